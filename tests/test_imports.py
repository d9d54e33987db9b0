"""The modules of cct import each other without cycles: every ``import`` counts, also those inside functions
(a late import hides a cycle from the interpreter, not from the design); imports only for type checkers
(``if TYPE_CHECKING:``) do not run and do not count."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cct"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """cct modules imported by ``path``: ``from cct.a import b`` depends on the module cct.a.b when there is
    one, else on cct.a (a package's own ``__init__`` runs before any of its modules anyway: that implicit
    import is Python's, not a dependency of the code)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    out = set()
    for m in found:
        while m and m not in modules:  # a name imported from a module: the module
            m = m.rpartition(".")[0]
        if m and m != name and m != "cct":
            out.add(m)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "proto" not in p.parts]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles_inside_cct():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_walker_sees_late_imports_and_skips_type_checking_ones():
    graph = import_graph()
    # executor_from_settings imports the device split inside the function
    assert "cct.exec.device_split" in graph["cct.exec"]
    # the executor contract names the net only for type checkers
    assert "cct.net" not in graph["cct.exec.base"]
    assert _cycles({"cct.a": {"cct.b"}, "cct.b": {"cct.c"}, "cct.c": {"cct.a"}, "cct.d": {"cct.a"}}) == \
        [["cct.a", "cct.b", "cct.c"]]


def test_mpi4py_is_imported_only_inside_the_mpi_functions():
    """mpi4py is loaded only when a launcher started the process: no module imports it at import time, and only
    cct.distributed.mpi and cct.distributed.mpi_train import it at all (inside functions)."""
    importers = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "mpi4py" for n in names):
                importers.add(_module_name(path))
                assert id(node) not in top_level, f"{_module_name(path)} imports mpi4py at import time"
    assert importers == {"cct.distributed.mpi", "cct.distributed.mpi_train"}
