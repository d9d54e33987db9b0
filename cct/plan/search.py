"""DeePa's search for the global configuration that minimises Eq. 1, by node and edge elimination.

The input is a :class:`CostGraph`: a DAG whose node ``v`` has a cost per configuration ``v.cost[i] =
compute(i) + update(i)`` and whose edges ``e = (u, v)`` (parallel edges allowed) have a transfer table
``e.xfer[i, j]`` for ``u`` in configuration ``i`` and ``v`` in ``j``.  The cost of a global configuration
``g`` is Eq. 1::

    Cost(g) = Σ_v v.cost[g(v)] + Σ_{e=(u,v)} e.xfer[g(u), g(v)]

**Edge elimination** (Eq. 3): two edges ``u → v`` become one with ``xfer = xfer₁ + xfer₂`` (Cost unchanged
for every ``g``, Theorem 2).  Here parallel edges are merged as they appear.

**Node elimination** (Eq. 2): a node ``w`` with one in-edge ``(u, w)`` and one out-edge ``(w, v)`` is
replaced by an edge ``(u, v)`` with ``xfer'[a, b] = min_k (xfer₁[a, k] + w.cost[k] + xfer₂[k, b])``; the
minimising ``k`` is kept for every ``(a, b)`` (Theorem 1: the optimum of the smaller graph extends to an
optimum of the larger one).  When a graph has several sources (sinks), a virtual source (sink) with one
configuration and zero-cost edges to (from) them is added first so that a DAG with one entry and one exit
reduces: a series-parallel one, such as a chain or an Inception net, ends with 2 nodes.

**Enumeration**: the residue (whatever neither rule removes) is enumerated densely, a cost tensor with one
axis per remaining node, when it has at most ``limit`` (10⁷) global configurations, else an error naming its
nodes.  The eliminations are then undone in reverse order, each eliminated node taking its stored argmin
for its neighbours' configurations.  Ties keep the first configuration in each node's order.

Complexity, with ``C`` configurations per node: ``O(C³)`` per node elimination, ``O(C²)`` per edge
elimination, ``O(C^R)`` for a residue of ``R`` nodes; so ``O(|V|·C³ + |E|·C² + C^R)`` in all.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cct.errors import CctError

ENUMERATION_LIMIT = 10 ** 7


@dataclass
class CostEdge:
    """A tensor from ``src`` to ``dst``: ``xfer[i, j]`` (ms) with ``src`` in its configuration ``i`` and ``dst``
    in ``j``."""

    src: str
    dst: str
    xfer: np.ndarray


@dataclass
class CostGraph:
    """Eq. 1's ingredients: ``costs[v][i]`` = compute + update of node ``v`` in its configuration ``i`` (ms),
    and the edges.  Node order (insertion order of ``costs``) is the order ties are broken in."""

    costs: dict[str, np.ndarray]
    edges: list[CostEdge] = field(default_factory=list)

    def check(self, source: str = "cost graph") -> None:
        """One-line :class:`CctError` for a node without configurations, an edge to an unknown node or with a
        table of the wrong shape, or a cycle (naming its nodes)."""
        for name, cost in self.costs.items():
            if len(cost) == 0:
                raise CctError(f"{source}: node '{name}' has no configurations")
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in self.costs:
                    raise CctError(f"{source}: edge {e.src} -> {e.dst}: unknown node '{end}'")
            want = (len(self.costs[e.src]), len(self.costs[e.dst]))
            if e.xfer.shape != want:
                raise CctError(f"{source}: edge {e.src} -> {e.dst}: xfer table is {e.xfer.shape}, needs {want}")
        cycle = find_cycle(list(self.costs), [(e.src, e.dst) for e in self.edges])
        if cycle:
            raise CctError(f"{source}: not a DAG: cycle {' -> '.join(cycle)}")

    def cost(self, assignment: Mapping[str, int]) -> float:
        """Eq. 1 for ``assignment`` (node → configuration index)."""
        total = sum(float(c[assignment[v]]) for v, c in self.costs.items())
        return total + sum(float(e.xfer[assignment[e.src], assignment[e.dst]]) for e in self.edges)


def find_cycle(nodes: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[str]:
    """A cycle ``[a, b, ..., a]`` among ``edges``, or ``[]`` for a DAG (iterative depth-first search)."""
    succ: dict[str, list[str]] = {v: [] for v in nodes}
    for u, v in edges:
        succ[u].append(v)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in nodes:
        if root in state:
            continue
        path, stack = [root], [iter(succ[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(succ[nxt]))
    return []


@dataclass
class SearchResult:
    """The optimum: ``assignment`` (node → configuration index) and its Eq. 1 ``cost``; ``seconds`` spent
    eliminating, enumerating and undoing; the ``residue`` nodes that were enumerated (virtual source/sink
    included) and how many global configurations that was; the elimination counts."""

    assignment: dict[str, int]
    cost: float
    seconds: float
    residue: list[str]
    enumerated: int
    node_eliminations: int
    edge_eliminations: int


_SOURCE, _SINK = -1, -2  # ids of the virtual source and sink


class _Reducer:
    """The graph under elimination: node ids, at most one (merged) edge per ordered pair."""

    def __init__(self, graph: CostGraph):
        self.names = list(graph.costs)
        ids = {name: i for i, name in enumerate(self.names)}
        self.cost: dict[int, np.ndarray] = {i: np.asarray(graph.costs[n], dtype=np.float64)
                                            for i, n in enumerate(self.names)}
        self.succ: dict[int, dict[int, np.ndarray]] = {i: {} for i in self.cost}
        self.pred: dict[int, dict[int, None]] = {i: {} for i in self.cost}
        self.edge_eliminations = 0
        self.records: list[tuple[int, int, int, np.ndarray]] = []  # (w, u, v, argmin over w's configs)
        for e in graph.edges:
            self.add_edge(ids[e.src], ids[e.dst], np.asarray(e.xfer, dtype=np.float64))
        for virtual, ends in ((_SOURCE, [i for i in self.cost if not self.pred[i]]),
                              (_SINK, [i for i in self.cost if not self.succ[i]])):
            if len(ends) > 1:
                self.cost[virtual] = np.zeros(1)
                self.succ[virtual], self.pred[virtual] = {}, {}
                for i in ends:
                    if virtual == _SOURCE:
                        self.add_edge(_SOURCE, i, np.zeros((1, len(self.cost[i]))))
                    else:
                        self.add_edge(i, _SINK, np.zeros((len(self.cost[i]), 1)))

    def name(self, i: int) -> str:
        return {_SOURCE: "(virtual source)", _SINK: "(virtual sink)"}.get(i) or self.names[i]

    def add_edge(self, u: int, v: int, xfer: np.ndarray) -> None:
        """Insert ``u → v``; an existing ``u → v`` absorbs it (edge elimination, Eq. 3)."""
        if v in self.succ[u]:
            self.succ[u][v] = self.succ[u][v] + xfer
            self.edge_eliminations += 1
        else:
            self.succ[u][v] = xfer
            self.pred[v][u] = None

    def eliminable(self, w: int) -> bool:
        return w in self.cost and len(self.pred[w]) == 1 and len(self.succ[w]) == 1

    def eliminate(self, w: int) -> tuple[int, int]:
        """Node elimination (Eq. 2) of ``w``; returns its neighbours ``(u, v)``."""
        (u,), (v,) = self.pred[w], self.succ[w]
        e1, e2 = self.succ[u].pop(w), self.succ[w][v]
        del self.pred[v][w]
        total = e1[:, :, None] + self.cost[w][None, :, None] + e2[None, :, :]  # (u, w, v)
        arg = np.argmin(total, axis=1)
        best = np.take_along_axis(total, arg[:, None, :], axis=1)[:, 0, :]
        self.records.append((w, u, v, arg))
        for table in (self.cost, self.succ, self.pred):
            del table[w]
        self.add_edge(u, v, best)
        return u, v

    def reduce(self) -> None:
        work = deque(self.cost)
        while work:
            w = work.popleft()
            if self.eliminable(w):
                work.extend(self.eliminate(w))

    def enumerate(self, limit: int) -> tuple[dict[int, int], float, int]:
        """Dense enumeration of the residue: (assignment, cost, number of global configurations)."""
        order = [i for i in self.cost if i >= 0] + [i for i in (_SOURCE, _SINK) if i in self.cost]
        sizes = [len(self.cost[i]) for i in order]
        count = int(np.prod(sizes, dtype=np.float64))
        if count > limit:
            raise CctError(f"the graph does not reduce: {len(order)} nodes remain after elimination "
                           f"({' x '.join(map(str, sizes))} = {count:.3g} global configurations > {limit:.0g}): "
                           f"{', '.join(self.name(i) for i in order)}")
        axis = {i: k for k, i in enumerate(order)}
        total = np.zeros(sizes)
        for i in order:
            shape = [1] * len(order)
            shape[axis[i]] = sizes[axis[i]]
            total = total + self.cost[i].reshape(shape)
        for u in order:
            for v, xfer in self.succ[u].items():
                a, b = axis[u], axis[v]
                shape = [1] * len(order)
                shape[a], shape[b] = sizes[a], sizes[b]
                table = xfer if a < b else xfer.T
                total = total + table.reshape(shape)
        flat = int(np.argmin(total))
        picks = np.unravel_index(flat, total.shape)
        return {i: int(k) for i, k in zip(order, picks)}, float(total.flat[flat]), count

    def undo(self, assignment: dict[int, int]) -> None:
        for w, u, v, arg in reversed(self.records):
            assignment[w] = int(arg[assignment[u], assignment[v]])


def search(graph: CostGraph, limit: int = ENUMERATION_LIMIT) -> SearchResult:
    """The optimal global configuration of ``graph`` (checked first; see the module docstring)."""
    graph.check()
    t = time.perf_counter()
    r = _Reducer(graph)
    r.reduce()
    residue = [r.name(i) for i in r.cost]
    picks, cost, count = r.enumerate(limit)
    r.undo(picks)
    seconds = time.perf_counter() - t
    assignment = {name: picks[i] for i, name in enumerate(r.names)}
    return SearchResult(assignment, cost, seconds, residue, count, len(r.records), r.edge_eliminations)


def brute_force(graph: CostGraph, limit: int = ENUMERATION_LIMIT) -> tuple[dict[str, int], float]:
    """Eq. 1 minimised over every global configuration (no elimination): the reference for tests."""
    graph.check()
    names = list(graph.costs)
    sizes = [len(graph.costs[v]) for v in names]
    count = int(np.prod(sizes, dtype=np.float64))
    if count > limit:
        raise CctError(f"brute force over {count:.3g} global configurations exceeds {limit:.0g}")
    grid = np.indices(sizes).reshape(len(names), -1)  # every assignment, one per column
    pos = {v: k for k, v in enumerate(names)}
    total = np.zeros(grid.shape[1])
    for v, c in graph.costs.items():
        total += np.asarray(c, dtype=np.float64)[grid[pos[v]]]
    for e in graph.edges:
        total += np.asarray(e.xfer, dtype=np.float64)[grid[pos[e.src]], grid[pos[e.dst]]]
    best = int(np.argmin(total))
    return {v: int(grid[pos[v], best]) for v in names}, float(total[best])
