"""``cct <command> [flags]``: Caffe's ``caffe`` tool (``tools/caffe.cpp``) with its verbs, flags and log lines,
plus cct's own commands; one module per command (``cct.cli.<command>``: ``SUMMARY``, its own ``FLAGS`` and
``main(flags) -> exit status``).

Commands: ``train`` (-solver, -snapshot | -weights a,b, -gpu, -level, -stage, -sigint_effect,
-sighup_effect, -plan), ``test`` (-model -weights -iterations -level -stage -gpu), ``time`` (-model -phase
-iterations -level -stage -gpu -plan), ``device_query`` (-gpu, or -devices: each device's peak GFLOP/s), ``plan``
(-model -workers or -costs: DeePa's per-layer parallelism), plus
``convert_imageset`` and ``compute_image_mean`` (Caffe's separate tools, same arguments).  cct's own knobs
(``-conv_engine``, ``-lowering``, ``-partitions``, ``-devices``, ``-split``) apply to every command.  Flags
use gflags syntax: ``-flag=v``, ``-flag v``, ``--flag=v``; bool flags also ``-flag`` / ``-noflag``; as with
gflags, one set of flags serves every command (the union of the commands' flags).

Every user error (a missing or bad file, a bad flag, an unknown command) is one glog ``F`` line and a
non-zero exit status; an unexpected exception is one line too, with a hint to set ``CCT_TRACEBACK=1``.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from cct import log
from cct.cli import common
from cct.errors import CctError
from cct.flags import Flag, Flags, parse_flags, usage_text

# command name -> module (imported when the command runs or the flags are listed; keep their imports light)
COMMAND_MODULES = {
    "train": "cct.cli.train",
    "test": "cct.cli.test",
    "device_query": "cct.cli.device_query",
    "time": "cct.cli.time",
    "compare": "cct.cli.compare",
    "bench": "cct.cli.bench",
    "draw": "cct.cli.draw",
    "plan": "cct.cli.plan",
    "infer": "cct.cli.infer",
}


class _Lazy:
    """A command's ``main``, imported on first call."""

    def __init__(self, module: str):
        self.module = module

    def __call__(self, flags: Flags) -> int:
        return int(importlib.import_module(self.module).main(flags) or 0)

    @property
    def arguments(self) -> str:
        """The positional arguments the command takes after its name (``ARGUMENTS``; '' for Caffe's verbs)."""
        return getattr(importlib.import_module(self.module), "ARGUMENTS", "")


COMMANDS: dict[str, Callable[[Flags], int]] = {name: _Lazy(m) for name, m in COMMAND_MODULES.items()}


def _data_tool(name: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from cct.data import tools

        return int(getattr(tools, f"{name}_main")(argv) or 0)

    return run


TOOLS = {"convert_imageset": _data_tool("convert_imageset"),
         "compute_image_mean": _data_tool("compute_image_mean")}


def _merged(groups: list[list[Flag]]) -> list[Flag]:
    flags, seen = [], set()
    for group in groups:
        for f in group:
            if f.name not in seen:
                seen.add(f.name)
                flags.append(f)
    return flags


def all_flags() -> list[Flag]:
    """Caffe's flags and cct's knobs, then every command's own (the first definition of a name wins): what
    ``-help`` lists, and how a command given after its flags (``cct -solver s.prototxt train``) is found."""
    return _merged([common.FLAGS] + [importlib.import_module(m).FLAGS for m in COMMAND_MODULES.values()])


def command_flags(name: str) -> list[Flag]:
    """The flags of command ``name``: its own (which may share a name with another command's, with its own
    default), then Caffe's flags and cct's knobs."""
    module = COMMAND_MODULES.get(name)
    return _merged(([importlib.import_module(module).FLAGS] if module else []) + [common.FLAGS])


FLAGS = common.FLAGS  # Caffe's own flags and cct's knobs (what tools/caffe.cpp's users pass)


def usage(prog: str = "cct") -> str:
    lines = ["command line brew", "usage: caffe <command> <args>", "", "commands:"]
    for name, module in COMMAND_MODULES.items():
        m = importlib.import_module(module)
        arguments = getattr(m, "ARGUMENTS", "")
        lines.append(f"  {name:<15} {m.SUMMARY}" + (f" (cct {name} {arguments})" if arguments else ""))
    lines.append("  convert_imageset    convert a set of images to the leveldb/lmdb format (own flags)")
    lines.append("  compute_image_mean  compute the mean image of a leveldb/lmdb (own flags)")
    return usage_text(f"{prog}: " + "\n".join(lines), all_flags(), "Flags from tools/caffe.cpp and cct")


def _fatal(message: str) -> None:
    log.logger.critical("%s", " ".join(message.split("\n")).strip(), stacklevel=2)


def apply_settings(flags: Flags, command: str = "") -> None:
    """cct's knobs from the command line (every command; a command's own flag of the same name, such as
    ``cct plan -workers``, is the command's), then every setting checked: a bad flag or environment variable
    is one line before any work."""
    from cct.config import settings
    from cct.exec.device_split import device_setting

    module = COMMAND_MODULES.get(command)
    own = {f.name for f in importlib.import_module(module).FLAGS} if module else set()
    settings.apply_flags(flags, skip=own)
    settings.validate()
    device_setting()  # devices and split checked against each other


def run(argv: Sequence[str]) -> int:
    """Dispatch without the error boundary (exceptions propagate)."""
    argv = list(argv)
    if argv and argv[0] in TOOLS:
        return TOOLS[argv[0]](argv[1:])
    name = argv[0] if argv and argv[0] in COMMANDS else None
    if name is None:  # flags first, as gflags allows: find the command among the arguments
        name = next(iter(parse_flags(argv, all_flags())[1]), "")
    flags, positional = parse_flags(argv, command_flags(name))
    if flags.help:
        print(usage(), file=sys.stderr)
        return 0
    name = positional[0] if positional else ""
    command = COMMANDS.get(name)
    if not positional or (len(positional) > 1 and not getattr(command, "arguments", "")):
        print(usage(), file=sys.stderr)  # Caffe's verbs take exactly one positional argument
        return 1
    flags["args"] = positional[1:]
    if name in TOOLS:
        raise CctError(f"{name} takes its own arguments: put it first (cct {name} ...)")
    if command is None:
        raise CctError(f"Unknown action: {name} (available caffe actions: "
                       f"{', '.join(sorted(COMMANDS) + sorted(TOOLS))})")
    apply_settings(flags, name)
    import numpy as np

    # numpy's floating-point warnings are not Caffe's log: a diverging run is reported once by the solver
    with np.errstate(all="ignore"):
        return command(flags)


def _tracebacks() -> bool:
    from cct.config import settings

    try:
        return bool(settings.get("traceback"))
    except CctError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``cct`` console script: run a command; every failure becomes one line and a non-zero status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except CctError as e:
        _fatal(str(e))
        return 1
    except KeyboardInterrupt:
        _fatal("Interrupted.")
        return 130
    except MemoryError as e:
        _fatal(f"out of memory: {e}" if str(e) else "out of memory")
        return 1
    except Exception as e:  # noqa: BLE001 - the one place that turns any failure into one line
        if _tracebacks():
            import traceback

            traceback.print_exc()
            return 1
        _fatal(f"{type(e).__name__}: {e} (an internal error; set CCT_TRACEBACK=1 to see the traceback)")
        return 1


__all__ = ["COMMANDS", "FLAGS", "TOOLS", "main", "parse_flags", "run", "usage"]
