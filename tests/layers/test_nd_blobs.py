"""The layers of 3-D (volumetric, ZNN-style) nets on 5-D blobs ``(N, C, D, H, W)``.

For each layer: the forward against an independent numpy formula written here, and a float64 gradient
check.  BatchNorm (batch and global statistics), Scale and Bias (learned operand and second bottom),
Crop (from axis 2 or 3, one or per-axis offsets), Concat (axis 1 and 2), Eltwise (SUM with coefficients,
PROD, MAX), ReLU, Sigmoid, Dropout in TEST, Softmax over axis 1, and SoftmaxWithLoss with a 4-D label
``(N, D, H, W)`` (a per-voxel segmentation loss with ignore_label).
"""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct import gradient_check
from cct.gradient_check import setup_layer
from cct.proto import caffe_pb2 as pb

SHAPE = (2, 3, 3, 4, 5)  # N, C, D, H, W


def check_gradient(*args, **kwargs) -> gradient_check.GradientReport:
    """``cct.gradient_check.check_gradient`` on a seeded random subset of 150 elements per blob (which
    spans every axis), to keep the file fast."""
    return gradient_check.check_gradient(*args, max_elements=150, **kwargs)


def f32(v: float) -> float:
    """A prototxt constant as the layer sees it (proto floats are float32)."""
    return float(np.float32(v))


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) * 1.5 + 0.3


def forward(text: str, bottoms, phase: int = pb.TRAIN, num_tops: int | None = None):
    run = setup_layer(text, bottoms, num_tops, phase=phase, dtype=np.float64)
    return run, run.forward()


def blobs_text(*arrays) -> str:
    out = ""
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        dims = " ".join(f"dim: {d}" for d in a.shape)
        data = " ".join(f"data: {v!r}" for v in a.ravel().tolist())
        out += f"blobs {{ shape {{ {dims} }} {data} }} "
    return out


# ---- BatchNorm -----------------------------------------------------------------------------------
def bn_reference(x: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float) -> np.ndarray:
    y = np.empty_like(x)
    for c in range(x.shape[1]):
        y[:, c] = (x[:, c] - mean[c]) / np.sqrt(var[c] + eps)
    return y


def test_batchnorm_batch_stats_forward_and_running_sums():
    x1, x2 = rand(*SHAPE), rand(*SHAPE, seed=1)
    run, (y,) = forward('type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 eps: 0.01 }', [x1])
    assert [b.shape for b in run.layer.blobs] == [(3,), (3,), (1,)]
    # statistics per channel over N, D, H and W (biased variance)
    m1 = np.array([x1[:, c].mean() for c in range(3)])
    v1 = np.array([((x1[:, c] - m1[c]) ** 2).mean() for c in range(3)])
    np.testing.assert_allclose(y, bn_reference(x1, m1, v1, f32(0.01)), rtol=1e-10, atol=1e-12)
    run.inputs[0] = x2
    run.forward()
    m2 = np.array([x2[:, c].mean() for c in range(3)])
    v2 = np.array([((x2[:, c] - m2[c]) ** 2).mean() for c in range(3)])
    m = 2 * 3 * 4 * 5  # values per channel (N·D·H·W): the unbiasing factor m/(m-1) counts every axis but C
    maf = f32(0.9)
    mean_sum, var_sum, s = (b.data for b in run.layer.blobs)
    np.testing.assert_allclose(s, [maf + 1])
    np.testing.assert_allclose(mean_sum, m2 + maf * m1)
    np.testing.assert_allclose(var_sum, m / (m - 1) * (v2 + maf * v1))


@pytest.mark.parametrize("phase, extra", [(pb.TEST, ""),
                                          (pb.TRAIN, "batch_norm_param { use_global_stats: true }")])
def test_batchnorm_global_stats_forward(phase, extra):
    x = rand(*SHAPE)
    mean_sum, var_sum, s = [1.0, -2.0, 0.5], [8.0, 0.5, 2.0], 2.0
    run, (y,) = forward(f'type: "BatchNorm" {blobs_text(mean_sum, var_sum, [s])} {extra}', [x], phase=phase)
    ref = bn_reference(x, np.array(mean_sum) / s, np.array(var_sum) / s, f32(1e-5))
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(run.layer.blobs[2].data, [2.0])  # no update with global statistics


@pytest.mark.parametrize("in_place", [False, True])
def test_batchnorm_gradient_batch_stats(in_place):
    check_gradient('type: "BatchNorm"', [rand(*SHAPE)], in_place=in_place, check_params=False)


@pytest.mark.parametrize("in_place", [False, True])
def test_batchnorm_gradient_global_stats(in_place):
    text = f'type: "BatchNorm" {blobs_text([1.0, -2.0, 0.5], [8.0, 0.5, 2.0], [2.0])}'
    check_gradient(text, [rand(*SHAPE)], phase=pb.TEST, in_place=in_place, check_params=False)


# ---- Scale and Bias ------------------------------------------------------------------------------
def broadcast(p: np.ndarray, axis: int = 1, ndim: int = 5) -> np.ndarray:
    """``p`` (covering axes ``axis .. axis + p.ndim``) with singleton axes so it broadcasts on x."""
    return p.reshape((1,) * axis + p.shape + (1,) * (ndim - axis - p.ndim))


FILLERS = 'filler { type: "gaussian" std: 1 } bias_filler { type: "uniform" min: -1 max: 1 }'
# (param body, operand shape): axis 1 over C, or over (C, D) with num_axes 2
LEARNED = [("axis: 1", (3,)), ("axis: 1 num_axes: 2", (3, 3)), ("axis: -4", (3,))]


@pytest.mark.parametrize("param, operand", LEARNED)
def test_scale_learned_forward_and_gradient(param, operand):
    x = rand(*SHAPE)
    text = f'type: "Scale" scale_param {{ {param} bias_term: true {FILLERS} }}'
    run, (y,) = forward(text, [x])
    s, b = (blob.data.copy() for blob in run.layer.blobs)
    assert s.shape == operand and b.shape == operand
    np.testing.assert_allclose(y, x * broadcast(s) + broadcast(b), rtol=1e-12)
    check_gradient(text, [x])


@pytest.mark.parametrize("operand", [(3,), (3, 3), (3, 3, 4, 5)])
def test_scale_second_bottom_forward_and_gradient(operand):
    x, s = rand(*SHAPE), rand(*operand, seed=1)
    (y,) = forward('type: "Scale" scale_param { axis: 1 }', [x, s])[1]
    np.testing.assert_allclose(y, x * broadcast(s), rtol=1e-12)
    check_gradient('type: "Scale" scale_param { axis: 1 }', [x, s])


@pytest.mark.parametrize("param, operand", LEARNED)
def test_bias_learned_forward_and_gradient(param, operand):
    x = rand(*SHAPE)
    text = f'type: "Bias" bias_param {{ {param} filler {{ type: "gaussian" std: 1 }} }}'
    run, (y,) = forward(text, [x])
    b = run.layer.blobs[0].data.copy()
    assert b.shape == operand
    np.testing.assert_allclose(y, x + broadcast(b), rtol=1e-12)
    check_gradient(text, [x])


@pytest.mark.parametrize("operand", [(3,), (3, 3), (3, 3, 4, 5)])
def test_bias_second_bottom_forward_and_gradient(operand):
    x, b = rand(*SHAPE), rand(*operand, seed=1)
    (y,) = forward('type: "Bias" bias_param { axis: 1 }', [x, b])[1]
    np.testing.assert_allclose(y, x + broadcast(b), rtol=1e-12)
    check_gradient('type: "Bias" bias_param { axis: 1 }', [x, b])


# ---- Crop ----------------------------------------------------------------------------------------
# (crop_param, reference shape, window start per axis of x (2, 3, 4, 5, 6))
CROPS = [
    ("axis: 2 offset: 1", (2, 3, 3, 4, 5), (0, 0, 1, 1, 1)),            # one offset for D, H and W
    ("axis: 2 offset: 1 offset: 0 offset: 1", (2, 3, 3, 4, 5), (0, 0, 1, 0, 1)),  # one per axis
    ("axis: 2", (2, 3, 3, 4, 5), (0, 0, 0, 0, 0)),                      # no offset: 0
    ("axis: -3 offset: 1", (1, 1, 3, 4, 5), (0, 0, 1, 1, 1)),           # only D, H, W of r count
    ("axis: 3 offset: 1 offset: 0", (9, 9, 9, 4, 5), (0, 0, 0, 1, 0)),  # H and W only; D kept
]


@pytest.mark.parametrize("param, ref_shape, start", CROPS)
def test_crop_forward_and_gradient(param, ref_shape, start):
    x, r = rand(2, 3, 4, 5, 6), rand(*ref_shape, seed=1)
    text = f'type: "Crop" crop_param {{ {param} }}'
    (y,) = forward(text, [x, r])[1]
    axis = int(param.split()[1]) % 5
    size = x.shape[:axis] + ref_shape[axis:]
    window = tuple(slice(o, o + n) for o, n in zip(start, size))
    np.testing.assert_array_equal(y, x[window])
    check_gradient(text, [x, r], check_bottoms=[0])


# ---- Concat --------------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [1, 2, -3])
def test_concat_forward_and_gradient(axis):
    shapes = [list(SHAPE) for _ in range(3)]
    for shape, n in zip(shapes, (3, 1, 2)):
        shape[axis] = n
    xs = [rand(*shape, seed=i) for i, shape in enumerate(shapes)]
    text = f'type: "Concat" concat_param {{ axis: {axis} }}'
    (y,) = forward(text, xs)[1]
    a = axis % 5
    pieces, offset = [], 0
    for x in xs:  # top slice by slice, indexed along the axis explicitly
        n = x.shape[a]
        index = (slice(None),) * a + (slice(offset, offset + n),)
        pieces.append((index, x))
        offset += n
    assert y.shape == tuple(SHAPE[:a]) + (6,) + tuple(SHAPE[a + 1:])
    for index, x in pieces:
        np.testing.assert_array_equal(y[index], x)
    check_gradient(text, xs)


# ---- Eltwise -------------------------------------------------------------------------------------
ELTWISE = [
    ("operation: SUM coeff: 1 coeff: -0.5 coeff: 2", lambda a, b, c: a - f32(0.5) * b + 2 * c),
    ("operation: SUM", lambda a, b, c: a + b + c),
    ("operation: PROD", lambda a, b, c: a * b * c),
    ("operation: PROD stable_prod_grad: false", lambda a, b, c: a * b * c),
    ("operation: MAX", lambda a, b, c: np.maximum(np.maximum(a, b), c)),
]


@pytest.mark.parametrize("param, ref", ELTWISE)
def test_eltwise_forward_and_gradient(param, ref):
    xs = [rand(*SHAPE, seed=i) for i in range(3)]
    text = f'type: "Eltwise" eltwise_param {{ {param} }}'
    (y,) = forward(text, xs)[1]
    np.testing.assert_allclose(y, ref(*xs), rtol=1e-12, atol=1e-12)
    check_gradient(text, xs)


# ---- neurons -------------------------------------------------------------------------------------
NEURONS = [
    ('type: "ReLU"', pb.TRAIN, lambda x: np.where(x > 0, x, 0.0)),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', pb.TRAIN, lambda x: np.where(x > 0, x, f32(0.1) * x)),
    ('type: "Sigmoid"', pb.TRAIN, lambda x: 1 / (1 + np.exp(-x))),
    ('type: "Dropout" dropout_param { dropout_ratio: 0.3 }', pb.TEST, lambda x: x),
]


@pytest.mark.parametrize("text, phase, ref", NEURONS)
@pytest.mark.parametrize("in_place", [False, True])
def test_neuron_forward_and_gradient(text, phase, ref, in_place):
    x = rand(*SHAPE)
    run = setup_layer(text, [x], in_place=in_place, phase=phase, dtype=np.float64)
    (y,) = run.forward()
    np.testing.assert_allclose(y, ref(x), rtol=1e-12, atol=1e-15)
    check_gradient(text, [x], phase=phase, in_place=in_place, kink=0.0, kink_range=0.01)  # ReLU's kink


# ---- Softmax and SoftmaxWithLoss -----------------------------------------------------------------
def softmax_channels(x: np.ndarray) -> np.ndarray:
    """Softmax over axis 1 of a 5-D array, voxel by voxel."""
    p = np.empty_like(x)
    n, _, d, h, w = x.shape
    for idx in np.ndindex(n, d, h, w):
        v = x[idx[0], :, idx[1], idx[2], idx[3]]
        e = np.exp(v - v.max())
        p[idx[0], :, idx[1], idx[2], idx[3]] = e / e.sum()
    return p


def test_softmax_axis1_forward_and_gradient():
    x = rand(*SHAPE)
    (y,) = forward('type: "Softmax"', [x])[1]
    np.testing.assert_allclose(y, softmax_channels(x), rtol=1e-12, atol=1e-15)
    check_gradient('type: "Softmax" softmax_param { axis: 1 }', [x])


def voxel_labels(ignore: int | None) -> np.ndarray:
    """Labels (N, D, H, W) in [0, C), about a quarter of them ``ignore``."""
    g = np.random.default_rng(3)
    n, c, d, h, w = SHAPE
    lab = g.integers(0, c, size=(n, d, h, w)).astype(np.float64)
    if ignore is not None:
        lab[g.random(lab.shape) < 0.25] = ignore
    return lab


@pytest.mark.parametrize("ignore", [None, 255])
@pytest.mark.parametrize("norm", ["VALID", "FULL", "BATCH_SIZE"])
def test_softmax_loss_per_voxel(ignore, norm):
    x, lab = rand(*SHAPE), voxel_labels(ignore)
    ignore_field = f"ignore_label: {ignore}" if ignore is not None else ""
    text = f'type: "SoftmaxWithLoss" loss_param {{ {ignore_field} normalization: {norm} }}'
    run, (loss, prob) = forward(text + " loss_weight: 1 loss_weight: 0", [x, lab], num_tops=2)
    p = softmax_channels(x)
    total, valid = 0.0, 0
    for n, d, h, w in np.ndindex(*lab.shape):
        if ignore is not None and lab[n, d, h, w] == ignore:
            continue
        total -= np.log(p[n, int(lab[n, d, h, w]), d, h, w])
        valid += 1
    normalizer = {"VALID": valid, "FULL": lab.size, "BATCH_SIZE": SHAPE[0]}[norm]
    assert loss.shape == ()
    np.testing.assert_allclose(loss, total / normalizer, rtol=1e-12)
    np.testing.assert_allclose(prob, p, rtol=1e-12, atol=1e-15)
    check_gradient(text, [x, lab], check_bottoms=[0])
