"""The layer contract's backward rule, for every layer type with a backward: a bottom's gradient is overwritten
where the layer propagates to it, whatever the buffer held before (a NaN-filled buffer gives the zero-filled
one's result).  Shared gradient memory (cct.exec.diff_memory) relies on it."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from cct.blob import Blob
from cct.layers.registry import _load_all, _registry, create_layer
from cct.proto import caffe_pb2 as pb

F = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'
X = (2, 3, 5, 4)

# type -> [(layer parameter text, bottom shapes, propagate_down, kind of each bottom's values)]; kinds: "x" normal,
# "pos" positive, "label" class indices < 3, "prob" probabilities over axis 1, "bit" 0/1, "index" batch indices
CASES: dict[str, list[tuple[str, list[tuple[int, ...]], list[bool], list[str]]]] = {
    "Convolution": [(f"convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 stride: 2 {F} }}", [X], [True], ["x"])],
    "Deconvolution": [(f"convolution_param {{ num_output: 2 kernel_size: 3 stride: 2 {F} }}", [X], [True], ["x"])],
    "Im2col": [("convolution_param { kernel_size: 2 }", [X], [True], ["x"])],
    "InnerProduct": [(f"inner_product_param {{ num_output: 4 {F} }}", [X], [True], ["x"])],
    "Pooling": [("pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }", [X], [True], ["x"]),
                ("pooling_param { pool: AVE kernel_size: 2 stride: 1 }", [X], [True], ["x"]),
                ("pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 }", [X], [True], ["pos"])],
    "SPP": [("spp_param { pyramid_height: 2 }", [X], [True], ["x"])],
    "ReLU": [("relu_param { negative_slope: 0.1 }", [X], [True], ["x"])],
    "PReLU": [("", [X], [True], ["x"])],
    "ELU": [("", [X], [True], ["x"])],
    "Sigmoid": [("", [X], [True], ["x"])],
    "TanH": [("", [X], [True], ["x"])],
    "AbsVal": [("", [X], [True], ["x"])],
    "BNLL": [("", [X], [True], ["x"])],
    "Power": [("power_param { power: 2 scale: 0.5 shift: 1 }", [X], [True], ["x"])],
    "Exp": [("exp_param { base: 2 }", [X], [True], ["x"])],
    "Log": [("", [X], [True], ["pos"])],
    "Clip": [("clip_param { min: -0.5 max: 0.5 }", [X], [True], ["x"])],
    "Swish": [("", [X], [True], ["x"])],
    "Dropout": [("", [X], [True], ["x"])],
    "LRN": [("lrn_param { local_size: 3 }", [X], [True], ["x"]),
            ("lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL }", [X], [True], ["x"])],
    "BatchNorm": [("", [X], [True], ["x"])],
    "MVN": [("", [X], [True], ["x"])],
    "Bias": [("", [X], [True], ["x"]), ("", [X, (3,)], [True, True], ["x", "x"])],
    "Scale": [(f"scale_param {{ bias_term: true {F.replace('weight_filler', 'filler')} }}", [X], [True], ["x"]),
              ("", [X, (3, 5)], [True, True], ["x", "x"])],
    "Softmax": [("", [X], [True], ["x"])],
    "Eltwise": [("eltwise_param { operation: SUM coeff: 2 coeff: -1 }", [X, X], [True, True], ["x", "x"]),
                ("eltwise_param { operation: PROD }", [X, X], [True, True], ["x", "x"]),
                ("eltwise_param { operation: MAX }", [X, X], [True, True], ["x", "x"])],
    "Concat": [("", [X, (2, 1, 5, 4)], [True, True], ["x", "x"])],
    "Slice": [("slice_param { slice_point: 1 }", [X], [True], ["x"])],
    "Split": [("", [X], [True], ["x"])],
    "Crop": [("crop_param { axis: 2 offset: 1 }", [X, (2, 3, 3, 2)], [True, False], ["x", "x"])],
    "Tile": [("tile_param { axis: 1 tiles: 2 }", [X], [True], ["x"])],
    "Silence": [("", [X], [True], ["x"])],
    "Filter": [("", [X, (2,)], [True, False], ["x", "bit"])],
    "BatchReindex": [("", [X, (3,)], [True, False], ["x", "index"])],
    "Reduction": [(f"reduction_param {{ operation: {op} axis: 1 }}", [X], [True], ["x"])
                  for op in ("SUM", "ASUM", "SUMSQ", "MEAN")],
    "SoftmaxWithLoss": [("", [(2, 3, 2), (2, 2)], [True, False], ["x", "label"])],
    "EuclideanLoss": [("", [X, X], [True, True], ["x", "x"])],
    "SigmoidCrossEntropyLoss": [("", [X, X], [True, False], ["x", "bit"])],
    "HingeLoss": [("", [(2, 3), (2,)], [True, False], ["x", "label"])],
    "MultinomialLogisticLoss": [("", [(2, 3), (2,)], [True, False], ["prob", "label"])],
    "InfogainLoss": [("", [(2, 3), (2,), (3, 3)], [True, False, False], ["prob", "label", "pos"])],
    "ContrastiveLoss": [("", [(2, 3, 1, 1), (2, 3, 1, 1), (2,)], [True, True, False], ["x", "x", "bit"])],
}
# no gradient for any bottom (indices, outputs without a backward, data sources, inference-only layers), user
# code, and the layers whose top's gradient is their bottom's (Flatten, Reshape: one buffer)
NO_BACKWARD = {"Embed", "ArgMax", "Accuracy", "Threshold", "MaxPoolingFragments", "Input", "Parameter", "Data",
               "DummyData", "HDF5Data", "HDF5Output", "ImageData", "MemoryData", "WindowData", "Python", "Flatten",
               "Reshape"}


def _values(rng, shape, kind):
    if kind == "pos":
        return rng.uniform(0.5, 2.0, shape)
    if kind == "label":
        return rng.integers(0, 3, shape)
    if kind == "bit":
        return rng.integers(0, 2, shape)
    if kind == "index":
        return rng.integers(0, X[0], shape)
    if kind == "prob":
        p = rng.uniform(0.1, 1.0, shape)
        return p / p.sum(axis=1, keepdims=True)
    return rng.standard_normal(shape)


def test_every_layer_type_is_covered():
    _load_all()
    built_in = {t for t, creator in _registry.items() if getattr(creator, "__module__", "").startswith("cct.")}
    assert built_in == set(CASES) | NO_BACKWARD


@pytest.mark.parametrize("kind, case", [(k, i) for k, cases in CASES.items() for i in range(len(cases))])
def test_backward_overwrites_the_bottoms_it_propagates_to(kind, case):
    text, shapes, down, kinds = CASES[kind][case]
    lp = pb.LayerParameter(name="l", type=kind, phase=pb.TRAIN)
    text_format.Parse(text, lp)
    rng = np.random.default_rng(2)
    bottom = [Blob(s) for s in shapes]
    for b, k in zip(bottom, kinds):
        b.data[...] = _values(rng, b.shape, k)
    layer = create_layer(lp)
    tops = layer.exact_num_top if layer.exact_num_top is not None else 2 if kind in ("Slice", "Split") else 1
    top = [Blob() for _ in range(tops)]
    layer.setup_layer(bottom, top)
    np.random.seed(0)  # Dropout's mask, STOCHASTIC pooling's draws: the same in both passes
    layer.forward_layer(bottom, top)
    for t in top:
        if not layer.loss(top.index(t)):
            t.diff[...] = rng.standard_normal(t.shape)
    results = []
    for fill in (np.nan, 0.0):
        for b, d in zip(bottom, down):
            if d:
                b.diff[...] = fill
        layer.backward_layer(top, down, bottom)
        results.append([b.diff.copy() for b, d in zip(bottom, down) if d])
    for got, want in zip(*results):
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(got, want)
