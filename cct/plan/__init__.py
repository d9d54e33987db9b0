"""DeePa's per-layer parallelism planner: for every layer, how to split it over ``P`` workers.

A **configuration** ``{n, c, h, w}`` gives a layer's degrees of parallelism over the images, channels, rows
and columns of its output; its ``n·c·h·w <= P`` workers each compute one disjoint part
(:mod:`cct.plan.config`).  Image parallelism is ``{n = P}`` everywhere; OWT is image parallelism for
convolutions and pooling and ``{c = P}`` (model parallelism) for fully-connected layers.  DeePa picks one
configuration per layer.

**Graph** (:mod:`cct.plan.graph`): one node per layer of the net (in-place layers fused into their
producer), one edge per blob from its producer to each consumer; Inception's branches keep the DAG.

**Cost model** (:mod:`cct.plan.cost`), per step of training, with ``G`` GFLOP/s per worker and ``B`` GB/s
between workers:

* ``v.compute(c)`` = forward + backward FLOPs of the largest part / ``G`` (or the engines' estimate for a
  convolution of the part's geometry, ``-cost measured``);
* ``v.update(c)``  = ``2·r·params·4 bytes / B`` for ``r = n·h·w > 1`` replicas of the parameters, else 0;
* ``e.xfer(c_u, c_v)`` = ``2·4 bytes·Σ_j |need_j \\ held_j| / B``: the part of ``u``'s output that worker ``j``
  of ``v`` reads, less what device ``j`` computed itself in ``u``'s configuration, forward and backward.

**Eq. 1**: ``Cost(g) = Σ_v [v.compute(g(v)) + v.update(g(v))] + Σ_(u,v) e.xfer(g(u), g(v))``.

**Search** (:mod:`cct.plan.search`): node elimination (Eq. 2) replaces a node with one in-edge ``(u, w)`` and
one out-edge ``(w, v)`` by an edge ``(u, v)`` with ``xfer'(a, b) = min_k [xfer₁(a, k) + w.compute(k) +
w.update(k) + xfer₂(k, b)]`` (keeping the argmin); edge elimination (Eq. 3) sums parallel edges.  When neither
applies the residue is enumerated, then the eliminations are undone in reverse.  The result is optimal
(DeePa's Theorems 1 and 2).  ``O(|V|·C³ + |E|·C² + C^R)`` for ``C`` configurations per node and ``R``
residue nodes: chains and Inception reduce to ``R = 2``.

Files (:mod:`cct.plan.files`): ``cct plan -costs GRAPH.json`` runs the search on a user's cost graph; the
plan file (``-format json -output plan.json``) gives every layer's degrees, read back by :func:`read_plan`.

    from cct.plan import CostModel, layer_graph, plan_net
    plan = plan_net(layer_graph("models/alexnet/deploy.prototxt", batch=512), 16, CostModel(gflops=2500,
                    bandwidth=4.5))
    plan.plan.cost_ms, [s.cost_ms for s in plan.baselines], plan.config("fc6")
"""
from cct.plan.config import Config, enumerate_configs
from cct.plan.cost import CostModel, PlanCosts, machine_gflops, plan_costs
from cct.plan.files import LayerPlan, Plan, read_cost_graph, read_plan
from cct.plan.graph import LayerGraph, graph_from_net, layer_graph
from cct.plan.planner import NetPlan, format_text, plan_net
from cct.plan.search import CostEdge, CostGraph, SearchResult, brute_force, search

__all__ = ["Config", "CostEdge", "CostGraph", "CostModel", "LayerGraph", "LayerPlan", "NetPlan", "Plan",
           "PlanCosts", "SearchResult", "brute_force", "enumerate_configs", "format_text", "graph_from_net",
           "layer_graph", "machine_gflops", "plan_costs", "plan_net", "read_cost_graph", "read_plan", "search"]
