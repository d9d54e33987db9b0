"""The layer graph DeePa plans over: one node per layer that computes something, one edge per tensor.

* In-place layers (one bottom, one top of the same name: ReLU, Dropout, BatchNorm, Scale …) are fused into
  the node that produced their blob: they run on the same parts, so they add their FLOPs and parameters to it.
* Split layers (inserted where a blob feeds several layers) are not nodes: each consumer gets its own edge
  from the producer, so a branching net stays a DAG (Inception's modules: one node fans out to the branches,
  a Concat node joins them).
* Every other layer is a node; an edge ``(u, v)`` is a blob produced by ``u`` and read as a bottom of ``v``
  (a label blob is an edge from the data layer to the loss).

Shapes come from Caffe's shape rules applied to the NetParameter (:mod:`cct.plan.layers`), which allocates
nothing and measures nothing; a net with a layer type that has no rule here (a Data layer reading a database,
a Python layer) is built as a :class:`cct.Net` instead and its blobs' shapes read back
(:func:`graph_from_net` does that for a net that is already built).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from cct import log
from cct.errors import CctError
from cct.graph import filter_net
from cct.plan.layers import LayerModel, Shape, as4, layer_model, model_class
from cct.proto import caffe_pb2 as pb


@dataclass
class LayerNode:
    """A layer and the in-place layers fused into it.  ``model`` prices its output parts."""

    name: str
    model: LayerModel
    bottoms: list[str]
    tops: list[str]
    fused: list[LayerModel] = field(default_factory=list)

    @property
    def type(self) -> str:
        return self.model.lp.type

    @property
    def layers(self) -> list[str]:
        """This layer's name, then the fused layers' in net order."""
        return [self.name] + [m.lp.name for m in self.fused]

    @property
    def extent(self) -> tuple[int, int, int, int]:
        return self.model.extent

    @property
    def splits(self) -> str:
        return self.model.splits

    def flops(self, part: Sequence[int]) -> float:
        """Forward + backward FLOPs of one output part, fused layers included."""
        return self.model.flops(part) + sum(m.flops(part) for m in self.fused)

    def params(self) -> int:
        return self.model.params() + sum(m.params() for m in self.fused)


@dataclass
class GraphEdge:
    """Blob ``blob``: top ``top`` of node ``src``, read as bottom ``bottom`` of node ``dst``."""

    src: str
    dst: str
    blob: str
    top: int
    bottom: int


@dataclass
class LayerGraph:
    name: str
    nodes: dict[str, LayerNode]
    edges: list[GraphEdge]
    batch: int


@dataclass
class _Record:
    lp: pb.LayerParameter
    bottoms: list[str]
    tops: list[str]
    bottom_shapes: list[Shape]
    top_shapes: list[Shape]


def _build(name: str, records: Sequence[_Record], source: str) -> LayerGraph:
    nodes: dict[str, LayerNode] = {}
    edges: list[GraphEdge] = []
    producer: dict[str, tuple[str, int]] = {}
    for r in records:
        lp = r.lp
        where = f"{source}: layer '{lp.name}' ({lp.type})"
        if lp.type == "Split":
            for t in r.tops:
                producer[t] = producer[r.bottoms[0]]
            continue
        try:
            model = layer_model(lp, r.bottom_shapes, r.top_shapes)
            for shape in r.bottom_shapes + r.top_shapes:
                as4(shape)
        except CctError as e:
            raise CctError(f"{where}: {e}") from None
        if len(r.bottoms) == 1 and r.tops == r.bottoms and r.bottoms[0] in producer:
            nodes[producer[r.bottoms[0]][0]].fused.append(model)
            continue
        if lp.name in nodes:
            raise CctError(f"{where}: a second layer named '{lp.name}' (the plan names layers, so names must be "
                           "unique)")
        nodes[lp.name] = LayerNode(lp.name, model, list(r.bottoms), list(r.tops))
        for k, b in enumerate(r.bottoms):
            src, top = producer[b]
            edges.append(GraphEdge(src, lp.name, b, top, k))
        for t, top_name in enumerate(r.tops):
            producer[top_name] = (lp.name, t)
    if not nodes:
        raise CctError(f"{source}: the net has no layers to plan")
    sources = [n.extent[0] for n in nodes.values() if not n.bottoms]
    return LayerGraph(name, nodes, edges, sources[0] if sources else next(iter(nodes.values())).extent[0])


def _set_batch(param: pb.NetParameter, batch: int, source: str) -> None:
    inputs = [lp for lp in param.layer if lp.type == "Input"]
    if not inputs:
        raise CctError(f"{source}: -batch {batch}: the net has no Input layer to resize (set the batch size in "
                       "its data layer)")
    for lp in inputs:
        for shape in lp.input_param.shape:
            if len(shape.dim):
                shape.dim[0] = batch


def _rule_records(param: pb.NetParameter, source: str) -> list[_Record] | None:
    """Records with shapes from the shape rules, or None when some layer type has none."""
    shapes: dict[str, Shape] = {}
    records = []
    for lp in param.layer:
        where = f"{source}: layer '{lp.name}' ({lp.type})"
        for j, b in enumerate(lp.bottom):
            if b not in shapes:
                raise CctError(f"{where}: unknown bottom blob '{b}' (bottom index {j})")
        bottoms = [shapes[b] for b in lp.bottom]
        try:
            tops = model_class(lp, len(bottoms)).top_shapes(lp, bottoms)
        except CctError as e:
            raise CctError(f"{where}: {e}") from None
        if tops is None or len(tops) != len(lp.top):
            log.info("plan: no shape rule for layer '%s' (%s); building the net for its shapes", lp.name, lp.type)
            return None
        for name, shape in zip(lp.top, tops):
            shapes[name] = tuple(int(d) for d in shape)
        records.append(_Record(lp, list(lp.bottom), list(lp.top), bottoms, list(tops)))
    return records


def layer_graph(net: str | os.PathLike[str] | pb.NetParameter, phase: int = pb.TEST, batch: int | None = None,
                level: int = 0, stages: Sequence[str] = ()) -> LayerGraph:
    """The layer graph of a net definition (a prototxt path or a NetParameter) in ``phase``/``level``/
    ``stages``, with the batch of its Input layers set to ``batch`` when given."""
    from cct.io.prototxt import read_net_param

    if isinstance(net, pb.NetParameter):
        param, source = pb.NetParameter(), "<NetParameter>"
        param.CopyFrom(net)
    else:
        source = os.fspath(net)
        param = read_net_param(source)
    param.state.phase = phase
    param.state.level = level
    param.state.stage.extend(stages)
    param = filter_net(param)
    if batch is not None:
        _set_batch(param, batch, source)
    records = _rule_records(param, source)
    if records is None:
        from cct.pycaffe import Net

        return graph_from_net(Net.from_param(param, source), source)
    return _build(param.name, records, source)


def graph_from_net(net, source: str = "<net>") -> LayerGraph:
    """The layer graph of a built :class:`cct.Net` (shapes read from its blobs)."""
    records = []
    bottoms, tops = net.bottom_vecs, net.top_vecs
    for i, layer in enumerate(net.layers):
        lp = layer.layer_param
        named = tops[i][:len(lp.top)]  # a loss layer's automatic top has no name and no consumer
        records.append(_Record(lp, list(lp.bottom), list(lp.top), [tuple(b.shape) for b in bottoms[i]],
                               [tuple(t.shape) for t in named]))
    return _build(net.name, records, source)
