"""Floating-point operations of a net's passes, counted layer by layer from the built net's shapes.

The unit is one multiply or one add (a multiply-add is 2 FLOPs, as GEMM peaks are quoted).  Per layer, for
the whole batch:

* **Convolution**: forward ``2·(C_in/g)·Πk`` per output element (the lowered GEMM), plus one add per output
  for the bias; backward ``2·(C_in/g)·Πk`` per output element for the weight gradient when the weights
  learn, the same again for the data gradient when the bottom needs one, one add per output for the bias
  gradient.  **Deconvolution** is the same with input and output exchanged; **InnerProduct** is
  ``2·K`` per output element each way (K the inner dimension).
* **Pooling**: one operation per window element per output (MAX compares, AVE adds; stochastic the same),
  backward one per output for MAX and one per window element for AVE; **LRN**: ``2·local_size + 3`` per
  element forward (square, add over the window; scale, power, multiply) and twice that backward.
* Element-wise layers (ReLU, Sigmoid, TanH, Dropout, Eltwise, Scale, BatchNorm, Softmax, losses ...): a small
  fixed count per element (:data:`PER_ELEMENT`), forward and backward when a bottom needs a gradient.
* Data movement (Input, Data, Split, Concat, Slice, Reshape, Flatten, Crop ...): nothing.

A backward is counted as Caffe's ``time`` loop runs it: every layer's backward is called, and a layer works
where its bottoms need gradients (``bottom_need_backward``) and its parameters learn
(``param_propagate_down``) — so a deploy net without a loss computes weight gradients but no data gradients.
Convolution, deconvolution and inner products are nearly all of a ConvNet's arithmetic (over 99% for
CaffeNet); the rest is counted so that nothing computed is left out, and types the table does not know are
listed as uncounted.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

# FLOPs per element of the (first) bottom: (forward, backward)
PER_ELEMENT: dict[str, tuple[float, float]] = {
    "ReLU": (1, 1), "PReLU": (2, 4), "ELU": (3, 3), "Sigmoid": (4, 2), "TanH": (4, 2), "AbsVal": (1, 1),
    "BNLL": (4, 4), "Power": (3, 4), "Exp": (2, 2), "Log": (2, 2), "Threshold": (1, 0), "Clip": (2, 1),
    "Swish": (6, 6), "Dropout": (1, 1), "Bias": (1, 1), "Scale": (2, 3), "BatchNorm": (5, 8), "MVN": (6, 10),
    "Softmax": (4, 4), "SoftmaxWithLoss": (5, 2), "EuclideanLoss": (3, 1), "SigmoidCrossEntropyLoss": (6, 2),
    "HingeLoss": (3, 1), "ContrastiveLoss": (4, 3), "MultinomialLogisticLoss": (1, 1), "InfogainLoss": (3, 3),
    "Accuracy": (1, 0), "ArgMax": (1, 0), "Reduction": (2, 1), "Embed": (0, 1),
}
NO_ARITHMETIC = frozenset({
    "Input", "Data", "ImageData", "MemoryData", "DummyData", "HDF5Data", "HDF5Output", "WindowData", "Python",
    "Split", "Concat", "Slice", "Reshape", "Flatten", "Crop", "Tile", "Silence", "Parameter", "Im2col",
})


@dataclass
class LayerFlops:
    name: str
    type: str
    forward: float
    backward: float


@dataclass
class NetFlops:
    """FLOPs of one forward and one backward of the whole batch, per layer and in total."""

    batch: int
    layers: list[LayerFlops] = field(default_factory=list)
    uncounted: list[str] = field(default_factory=list)  # "name (Type)" of layers of unknown types

    @property
    def forward(self) -> float:
        return sum(layer.forward for layer in self.layers)

    @property
    def backward(self) -> float:
        return sum(layer.backward for layer in self.layers)

    def products(self) -> float:
        """FLOPs of the convolutions, deconvolutions and inner products, forward and backward: the GEMM work a
        training iteration cannot do faster than the machine's sgemm rate (:func:`sgemm_peak`)."""
        return sum(layer.forward + layer.backward for layer in self.layers
                   if layer.type in ("Convolution", "Deconvolution", "InnerProduct"))

    def per_image(self, train: bool) -> float:
        """FLOPs per image of a forward (TEST) or forward + backward (TRAIN) pass."""
        return (self.forward + (self.backward if train else 0.0)) / self.batch


def _count(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


Counter = Callable[..., "tuple[float, float]"]


def _conv(layer, bottom, top, down, learn) -> tuple[float, float]:
    """Convolution: every output element is a dot product of length (C_in/g)·Πk with the weights."""
    fwd = bwd = 0.0
    w = layer.blobs[0]
    per_output = 2.0 * _count(w.shape[1:])
    bias = len(layer.blobs) > 1
    for i, t in enumerate(top):
        outputs = float(t.count)
        fwd += outputs * per_output + (outputs if bias else 0.0)
        if learn[0]:
            bwd += outputs * per_output
        if bias and learn[1]:
            bwd += outputs
        if down[i]:
            bwd += outputs * per_output
    return fwd, bwd


def _deconv(layer, bottom, top, down, learn) -> tuple[float, float]:
    """Deconvolution: the convolution's transpose — each *input* element spreads (C_out/g)·Πk products."""
    fwd = bwd = 0.0
    w = layer.blobs[0]
    per_input = 2.0 * _count(w.shape[1:])
    bias = len(layer.blobs) > 1
    for i, (b, t) in enumerate(zip(bottom, top)):
        inputs, outputs = float(b.count), float(t.count)
        fwd += inputs * per_input + (outputs if bias else 0.0)
        if learn[0]:
            bwd += inputs * per_input
        if bias and learn[1]:
            bwd += outputs
        if down[i]:
            bwd += inputs * per_input
    return fwd, bwd


def _inner_product(layer, bottom, top, down, learn) -> tuple[float, float]:
    w = layer.blobs[0]
    outputs = float(top[0].count)
    num_output = int(layer.layer_param.inner_product_param.num_output) or 1
    per_output = 2.0 * w.count / num_output
    bias = len(layer.blobs) > 1
    fwd = outputs * per_output + (outputs if bias else 0.0)
    bwd = (outputs * per_output if learn[0] else 0.0) + (outputs if bias and learn[1] else 0.0)
    bwd += outputs * per_output if down[0] else 0.0
    return fwd, bwd


def _pooling(layer, bottom, top, down, learn) -> tuple[float, float]:
    p = layer.layer_param.pooling_param
    spatial = bottom[0].shape[2:]
    if p.global_pooling:
        window = _count(spatial)
    elif p.kernel_size or p.kernel_h:
        window = (p.kernel_h * p.kernel_w) if p.kernel_h else int(p.kernel_size) ** len(spatial)
    else:
        window = 1
    outputs = float(top[0].count)
    average = p.pool == p.AVE
    return outputs * window, (outputs * (window if average else 1) if down[0] else 0.0)


def _lrn(layer, bottom, top, down, learn) -> tuple[float, float]:
    n = int(layer.layer_param.lrn_param.local_size)
    per = 2.0 * n + 3.0
    elements = float(bottom[0].count)
    return elements * per, (2.0 * elements * per if down[0] else 0.0)


def _eltwise(layer, bottom, top, down, learn) -> tuple[float, float]:
    elements = float(top[0].count)
    fwd = elements * max(1, len(bottom) - 1) * (2 if layer.layer_param.eltwise_param.coeff else 1)
    return fwd, sum(elements for d in down if d)


def _per_element(costs: tuple[float, float]) -> Counter:
    def count(layer, bottom, top, down, learn) -> tuple[float, float]:
        elements = float(bottom[0].count) if bottom else float(top[0].count)
        learns = any(learn) and len(layer.blobs) > 0
        return costs[0] * elements, (costs[1] * elements if (any(down) or learns) else 0.0)

    return count


COUNTERS: dict[str, Counter] = {
    "Convolution": _conv, "Deconvolution": _deconv, "InnerProduct": _inner_product, "Pooling": _pooling,
    "LRN": _lrn, "Eltwise": _eltwise,
    **{t: _per_element(c) for t, c in PER_ELEMENT.items()},
}


def count_net(net) -> NetFlops:
    """FLOPs of ``net`` (a built :class:`cct.Net`) at its current shapes; ``batch`` is its first input's (or
    first blob's) leading dimension."""
    first = net.blobs[net.inputs[0]] if net.inputs else next(iter(net.blobs.values()))
    batch = int(first.shape[0]) if len(first.shape) else 1
    result = NetFlops(batch)
    for i, (name, layer) in enumerate(zip(net._layer_names, net.layers)):
        kind = layer.type
        down = list(net.bottom_need_backward[i])
        learn = [bool(layer.param_propagate_down[j]) if j < len(layer.param_propagate_down) else True
                 for j in range(len(layer.blobs))] + [False, False]
        counter = COUNTERS.get(kind)
        if counter is None:
            if kind not in NO_ARITHMETIC:
                result.uncounted.append(f"{name} ({kind})")
            fwd = bwd = 0.0
        else:
            fwd, bwd = counter(layer, net.bottom_vecs[i], net.top_vecs[i], down, learn)
        result.layers.append(LayerFlops(name, kind, float(fwd), float(bwd)))
    return result


def sgemm_peak(size: int = 2048, rounds: int = 5) -> float:
    """FLOP/s of the best of at least ``rounds`` float32 ``size``³ matrix products with the BLAS threads the
    caller runs (:func:`cct.device.device.sgemm_gflops`, measured now, not cached): the peak the benchmarks quote
    their shares of."""
    from cct.device.device import sgemm_gflops

    return 1e9 * sgemm_gflops(size, min_reps=rounds)
