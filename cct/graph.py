"""Net-definition transforms that run before any layer exists (pure functions on NetParameter).

* :func:`filter_net` — keep the layers whose include/exclude NetStateRules match the NetState
  (Caffe's ``Net::FilterNet`` / ``StateMeetsRule``).
* :func:`insert_splits` — give every blob consumed more than once its own Split layer, with Caffe's
  names ``<blob>_<layer>_<top index>_split`` / ``..._split_<k>`` (Caffe's ``InsertSplits``).
"""
from __future__ import annotations

from cct.errors import CctError
from cct.proto import caffe_pb2 as pb


class GraphError(CctError):
    """A wiring error attributable to one layer of the definition."""

    def __init__(self, layer: pb.LayerParameter, message: str):
        self.layer = layer
        self.message = message
        super().__init__(message)


def state_meets_rule(state: pb.NetState, rule: pb.NetStateRule) -> bool:
    """True iff phase, level bounds, required stages and forbidden stages all hold."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def layer_included(state: pb.NetState, layer: pb.LayerParameter) -> bool:
    """Include rules: included iff any matches.  Otherwise: excluded iff any exclude rule matches."""
    if layer.include and layer.exclude:
        raise GraphError(layer, f"layer '{layer.name}' specifies both include and exclude rules; use one kind")
    if layer.include:
        return any(state_meets_rule(state, r) for r in layer.include)
    return not any(state_meets_rule(state, r) for r in layer.exclude)


def filter_net(param: pb.NetParameter) -> pb.NetParameter:
    """A copy of ``param`` holding only the layers included in ``param.state``."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for layer in param.layer:
        if layer_included(param.state, layer):
            out.layer.add().CopyFrom(layer)
    return out


def split_layer_name(blob: str, layer: str, top_index: int) -> str:
    return f"{blob}_{layer}_{top_index}_split"


def split_blob_name(blob: str, layer: str, top_index: int, k: int) -> str:
    return f"{blob}_{layer}_{top_index}_split_{k}"


def insert_splits(param: pb.NetParameter) -> pb.NetParameter:
    """Insert Split layers where a top feeds several bottoms (or a bottom and an explicit loss)."""
    layers = param.layer
    producer: dict[str, tuple[int, int]] = {}  # blob name -> (layer, top index) most recently producing it
    bottom_src: dict[tuple[int, int], tuple[int, int]] = {}  # (layer, bottom idx) -> (layer, top idx)
    consumers: dict[tuple[int, int], int] = {}
    loss_weight: dict[tuple[int, int], float] = {}
    for i, layer in enumerate(layers):
        for j, name in enumerate(layer.bottom):
            if name not in producer:
                raise GraphError(layer, f"Unknown bottom blob '{name}' (layer '{layer.name}', bottom index {j})")
            src = producer[name]
            bottom_src[(i, j)] = src
            consumers[src] = consumers.get(src, 0) + 1
        for j, name in enumerate(layer.top):
            producer[name] = (i, j)
        for j, w in enumerate(layer.loss_weight):
            if w != 0 and j < len(layer.top):
                loss_weight[(i, j)] = w
                consumers[(i, j)] = consumers.get((i, j), 0) + 1

    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    next_k: dict[tuple[int, int], int] = {}
    for i, layer in enumerate(layers):
        new = out.layer.add()
        new.CopyFrom(layer)
        for j, name in enumerate(layer.bottom):
            src = bottom_src[(i, j)]
            if consumers[src] > 1:
                k = next_k.get(src, 1 if src in loss_weight else 0)
                next_k[src] = k + 1
                new.bottom[j] = split_blob_name(name, layers[src[0]].name, src[1], k)
        for j, name in enumerate(layer.top):
            n = consumers.get((i, j), 0)
            if n <= 1:
                continue
            split = pb.LayerParameter()
            split.name = split_layer_name(name, layer.name, j)
            split.type = "Split"
            split.bottom.append(name)
            for k in range(n):
                split.top.append(split_blob_name(name, layer.name, j, k))
            if (i, j) in loss_weight:
                split.loss_weight.append(loss_weight[(i, j)])
                split.loss_weight.extend([0.0] * (n - 1))
                del new.loss_weight[:]
            out.layer.add().CopyFrom(split)
    return out
