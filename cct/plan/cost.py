"""DeePa's cost functions, precomputed for every configuration of every node and pair of configurations of
every edge of a :class:`~cct.plan.graph.LayerGraph` on ``P`` workers.

With ``G`` the GFLOP/s and ``B`` the GB/s between workers of :class:`CostModel`:

* ``compute(c)`` — forward + backward time of the largest part: ``flops(part) / G`` (``-cost analytic``,
  FLOPs from :mod:`cct.plan.layers`), or for convolutions and fully-connected layers (a 1x1 convolution) the
  engines' cost contract on the part's own geometry, the fastest variant of
  :func:`cct.engines.estimate_convolution` (``-cost measured``: this machine's calibrated rates where it has
  them, else the engines' defaults); the other layers by FLOPs as above;
* ``update(c)`` — parameter synchronisation: each of the ``r = n·h·w`` replicas of the layer's parameters
  sends its gradient to the parameter server and receives the new values, ``2·r·params·4 bytes / B``, and 0
  for a single replica (a channel split partitions the parameters, so it is not a replica);
* ``xfer(c_u, c_v)`` for an edge ``u → v`` — worker ``j`` of ``v`` (device ``j``) needs the box of ``u``'s
  output that its part reads (:meth:`~cct.plan.layers.LayerModel.input_box`); device ``j`` already holds
  part ``j`` of ``u``'s configuration, so the tensor moves ``Σ_j |need_j| − |need_j ∩ held_j|`` elements,
  forward (activations) and again backward (their gradients): ``2·elements·4 bytes / B``.  Equal
  configurations of layers that read a neighbourhood (3x3 convolutions split by rows) exchange their halos;
  ``halo="ignore"`` makes equal configurations free instead, the paper's rule.

Eq. 1 sums ``compute + update`` over nodes and ``xfer`` over edges (:meth:`PlanCosts.cost_graph`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from cct.errors import CctError
from cct.plan.config import Config, all_part_boxes, enumerate_configs, largest_part
from cct.plan.graph import GraphEdge, LayerGraph, LayerNode
from cct.plan.layers import as4
from cct.plan.search import CostEdge, CostGraph

DEFAULT_BANDWIDTH_GBS = 10.0  # GB/s between workers when none is given: a PCIe 3.0 x16-class link
ITEMSIZE = 4  # float32


def machine_gflops() -> float:
    """This machine's measured sgemm peak with all its cores (cached by :meth:`cct.device.Device.peak_gflops`)."""
    from cct.device import Device
    from cct.runtime.partition import cpu_cores

    return Device("cpu", 0, cpu_cores()).peak_gflops()[0]


@dataclass(frozen=True)
class CostModel:
    """How configurations are priced: each worker's ``gflops``, the ``bandwidth`` between workers (GB/s),
    ``kind`` ``analytic`` or ``measured`` and the ``halo`` rule (``exact`` or ``ignore``)."""

    gflops: float
    bandwidth: float = DEFAULT_BANDWIDTH_GBS
    kind: str = "analytic"
    halo: str = "exact"

    def __post_init__(self) -> None:
        if self.kind not in ("analytic", "measured"):
            raise CctError(f"-cost {self.kind}: the cost model is analytic or measured")
        if self.halo not in ("exact", "ignore"):
            raise CctError(f"-halo {self.halo}: halos are exact or ignore")
        if not self.gflops > 0:
            raise CctError(f"-gflops {self.gflops}: must be > 0")
        if not self.bandwidth > 0:
            raise CctError(f"-bandwidth {self.bandwidth}: must be > 0")

    def transfer_ms(self, nbytes: np.ndarray | float) -> np.ndarray | float:
        return nbytes / (self.bandwidth * 1e9) * 1e3

    def compute_ms(self, flops: float) -> float:
        return flops / (self.gflops * 1e9) * 1e3


@dataclass
class NodeCosts:
    """Per configuration of one node (same order as ``configs``)."""

    configs: list[Config]
    compute_ms: np.ndarray
    update_ms: np.ndarray
    update_bytes: np.ndarray


@dataclass
class EdgeCosts:
    """Per pair of configurations ``(c_u, c_v)`` of one edge."""

    edge: GraphEdge
    bytes: np.ndarray
    ms: np.ndarray


@dataclass
class PlanCosts:
    """Every cost function of a graph on ``workers`` workers."""

    graph: LayerGraph
    workers: int
    model: CostModel
    nodes: dict[str, NodeCosts]
    edges: list[EdgeCosts]
    _conv_memo: dict = field(default_factory=dict, repr=False)

    def cost_graph(self) -> CostGraph:
        """The search's input: ``compute + update`` per node configuration, ``xfer`` per edge."""
        return CostGraph({name: nc.compute_ms + nc.update_ms for name, nc in self.nodes.items()},
                         [CostEdge(ec.edge.src, ec.edge.dst, ec.ms) for ec in self.edges])

    def moved_bytes(self, assignment: Mapping[str, int]) -> float:
        """Bytes moved per step: parameter synchronisation plus tensors between layers."""
        total = sum(float(nc.update_bytes[assignment[name]]) for name, nc in self.nodes.items())
        return total + sum(float(ec.bytes[assignment[ec.edge.src], assignment[ec.edge.dst]]) for ec in self.edges)

    def xfer_in_ms(self, assignment: Mapping[str, int]) -> dict[str, float]:
        """Per node: the transfer time of the tensors it reads."""
        out = {name: 0.0 for name in self.nodes}
        for ec in self.edges:
            out[ec.edge.dst] += float(ec.ms[assignment[ec.edge.src], assignment[ec.edge.dst]])
        return out


def _measured_seconds(node: LayerNode, part: tuple[int, int, int, int], memo: dict) -> float | None:
    """The engines' estimate for a convolution-like part (fastest variant), or None."""
    geometry = node.model.conv_geometry(part)
    if geometry is None:
        return None
    if geometry not in memo:
        from cct.engines import estimate_convolution

        estimates = estimate_convolution(geometry, "float32")
        memo[geometry] = min(e.seconds for e in estimates.values()) if estimates else None
    return memo[geometry]


def node_costs(node: LayerNode, workers: int, model: CostModel, memo: dict | None = None) -> NodeCosts:
    """compute and update of every configuration of ``node``."""
    configs = enumerate_configs(workers, node.extent, node.splits)
    params = node.params()
    memo = {} if memo is None else memo
    compute, update = np.zeros(len(configs)), np.zeros(len(configs))
    for i, c in enumerate(configs):
        part = largest_part(c, node.extent)
        ms = model.compute_ms(node.flops(part))
        if model.kind == "measured":
            seconds = _measured_seconds(node, part, memo)
            if seconds is not None:
                ms += seconds * 1e3 - model.compute_ms(node.model.flops(part))
        compute[i] = ms
        update[i] = 2.0 * c.replicas * params * ITEMSIZE if c.replicas > 1 else 0.0
    return NodeCosts(configs, compute, model.transfer_ms(update), update)


def _volume(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Elements in boxes ``[lo, hi)`` (last axis: the 4 dimensions), as floats (a box may exceed 2³¹)."""
    length = np.maximum(hi - lo, 0).astype(np.float64)
    return length[..., 0] * length[..., 1] * length[..., 2] * length[..., 3]


def _overlap(held_lo: np.ndarray, held_hi: np.ndarray, need_lo: np.ndarray, need_hi: np.ndarray) -> np.ndarray:
    """``Σ_j |held[c_u, j] ∩ need[c_v, j]|`` for every pair, ``(|C_u|, |C_v|)`` (axis by axis, in int32)."""
    total = None
    for a in range(4):
        hl, hh = held_lo[:, None, :, a].astype(np.int32), held_hi[:, None, :, a].astype(np.int32)
        nl, nh = need_lo[None, :, :, a].astype(np.int32), need_hi[None, :, :, a].astype(np.int32)
        length = np.maximum(np.minimum(hh, nh) - np.maximum(hl, nl), 0).astype(np.float64)
        total = length if total is None else total * length
    return total.sum(axis=2)


def edge_bytes(edge: GraphEdge, src: LayerNode, src_configs: list[Config], dst: LayerNode,
               dst_configs: list[Config], workers: int, halo: str = "exact") -> np.ndarray:
    """Bytes moved over ``edge`` (forward and backward) for every pair of configurations, ``(|C_u|, |C_v|)``."""
    top = src.model.tops[edge.top]
    held_lo, held_hi, _ = all_part_boxes(src_configs, as4(top) if top else (1, 1, 1, 1), workers)
    lo, hi, valid = all_part_boxes(dst_configs, dst.extent, workers)
    need_lo, need_hi = dst.model.input_box(edge.bottom, lo, hi)
    need_lo, need_hi = np.where(valid[..., None], need_lo, 0), np.where(valid[..., None], need_hi, 0)
    need = _volume(need_lo, need_hi).sum(axis=1)  # (|C_v|,)
    moved = need[None, :] - _overlap(held_lo, held_hi, need_lo, need_hi)
    nbytes = 2.0 * ITEMSIZE * moved
    if halo == "ignore":
        same = np.array([[cu.degrees == cv.degrees for cv in dst_configs] for cu in src_configs])
        nbytes[same] = 0.0
    return nbytes


def plan_costs(graph: LayerGraph, workers: int, model: CostModel) -> PlanCosts:
    """Every cost function of ``graph`` on ``workers`` workers under ``model``."""
    if workers < 1:
        raise CctError(f"-workers {workers}: need at least one worker")
    memo: dict = {}
    nodes = {name: node_costs(node, workers, model, memo) for name, node in graph.nodes.items()}
    edges = []
    for e in graph.edges:
        nbytes = edge_bytes(e, graph.nodes[e.src], nodes[e.src].configs, graph.nodes[e.dst], nodes[e.dst].configs,
                            workers, model.halo)
        edges.append(EdgeCosts(e, nbytes, model.transfer_ms(nbytes)))
    return PlanCosts(graph, workers, model, nodes, edges, memo)
