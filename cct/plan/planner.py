"""A net's plan: the search's optimum next to image parallelism and OWT, per layer and in total, as the
``cct plan`` table and as the plan file (:mod:`cct.plan.planfile`).

Baselines, priced with the same cost functions:

* image parallelism — every layer ``{n = P}`` (``n`` as large as the layer allows);
* OWT (Krizhevsky's "one weird trick") — fully-connected layers model-parallel ``{c = P}``, every other
  layer image-parallel.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cct.plan.config import Config, image_parallel, model_parallel
from cct.plan.cost import CostModel, PlanCosts, plan_costs
from cct.plan.graph import LayerGraph
from cct.plan.search import ENUMERATION_LIMIT, SearchResult, search


@dataclass
class Strategy:
    """A global configuration with its Eq. 1 cost (ms per step) and bytes moved per step."""

    name: str
    assignment: dict[str, int]
    cost_ms: float
    moved_bytes: float


@dataclass
class NetPlan:
    graph: LayerGraph
    costs: PlanCosts
    result: SearchResult
    plan: Strategy
    baselines: list[Strategy]

    @property
    def workers(self) -> int:
        return self.costs.workers

    def config(self, node: str) -> Config:
        return self.costs.nodes[node].configs[self.plan.assignment[node]]

    def rows(self) -> list[dict]:
        """One row per node: name, type, output shape, degrees, workers, compute/update/xfer-in (ms)."""
        xfer = self.costs.xfer_in_ms(self.plan.assignment)
        out = []
        for name, node in self.graph.nodes.items():
            nc, i = self.costs.nodes[name], self.plan.assignment[name]
            c = nc.configs[i]
            shape = list(node.model.tops[0]) if node.model.tops else []
            out.append(dict(name=name, type=node.type, shape=shape, n=c.n, c=c.c, h=c.h, w=c.w, workers=c.workers,
                            compute_ms=float(nc.compute_ms[i]), update_ms=float(nc.update_ms[i]),
                            xfer_ms=xfer[name], fused=[m.lp.name for m in node.fused]))
        return out


def baseline_assignments(costs: PlanCosts) -> dict[str, dict[str, int]]:
    """Image parallelism and OWT as configuration indices per node."""
    image, owt = {}, {}
    for name, nc in costs.nodes.items():
        image[name] = nc.configs.index(image_parallel(nc.configs))
        fc = costs.graph.nodes[name].type == "InnerProduct"
        owt[name] = nc.configs.index(model_parallel(nc.configs)) if fc else image[name]
    return {"image parallelism": image, "OWT": owt}


def _strategy(name: str, costs: PlanCosts, assignment: Mapping[str, int], cost: float | None = None) -> Strategy:
    a = dict(assignment)
    total = costs.cost_graph().cost(a) if cost is None else cost
    return Strategy(name, a, total, costs.moved_bytes(a))


def plan_net(graph: LayerGraph, workers: int, model: CostModel, limit: int = ENUMERATION_LIMIT) -> NetPlan:
    """Price ``graph`` on ``workers`` workers, search the optimum, price the baselines."""
    costs = plan_costs(graph, workers, model)
    result = search(costs.cost_graph(), limit)
    plan = _strategy("plan", costs, result.assignment, result.cost)
    baselines = [_strategy(n, costs, a) for n, a in baseline_assignments(costs).items()]
    return NetPlan(graph, costs, result, plan, baselines)


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def format_text(p: NetPlan) -> str:
    """The ``cct plan`` table: one row per layer, then the totals and the search."""
    rows = p.rows()
    name_w = max([5] + [len(r["name"]) for r in rows])
    type_w = max([4] + [len(r["type"]) for r in rows])
    shape_w = max([5] + [len(_shape(r["shape"])) for r in rows])
    head = (f"{'layer':<{name_w}}  {'type':<{type_w}}  {'shape':<{shape_w}}  {'n':>3} {'c':>3} {'h':>3} {'w':>3}  "
            f"{'workers':>7}  {'compute ms':>11} {'update ms':>11} {'xfer ms':>11}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['name']:<{name_w}}  {r['type']:<{type_w}}  {_shape(r['shape']):<{shape_w}}  "
                     f"{r['n']:>3} {r['c']:>3} {r['h']:>3} {r['w']:>3}  {r['workers']:>7}  "
                     f"{r['compute_ms']:>11.3f} {r['update_ms']:>11.3f} {r['xfer_ms']:>11.3f}")
    m = p.costs.model
    lines.append("")
    lines.append(f"{p.graph.name or 'net'} on {p.workers} workers, batch {p.graph.batch}: {m.kind} costs, "
                 f"{m.gflops:g} GFLOP/s per worker, {m.bandwidth:g} GB/s, halos {m.halo}")
    for s in [p.plan] + p.baselines:
        ratio = "" if s is p.plan else f"  ({_ratio(s.cost_ms, p.plan.cost_ms)} the plan's time, " \
                                       f"{_ratio(s.moved_bytes, p.plan.moved_bytes)} its data)"
        lines.append(f"{s.name:<18} {s.cost_ms:12.3f} ms/step  {s.moved_bytes / 1e6:12.1f} MB/step{ratio}")
    r = p.result
    lines.append(f"search: {len(p.graph.nodes)} nodes -> {len(r.residue)} after {r.node_eliminations} node and "
                 f"{r.edge_eliminations} edge eliminations ({', '.join(r.residue)}); {r.enumerated} residue "
                 f"configurations enumerated; {r.seconds * 1e3:.3f} ms")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else ("1.00x" if a == 0 else "inf x")
