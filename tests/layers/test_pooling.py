"""Pooling against a loop transcription of Caffe's CPU semantics, including its quirks."""
from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import pytest

import cct.layers.pooling  # noqa: F401  (registers the layer)
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from cct.layers.pooling import Pooler, pooled_shape
from cct.proto import caffe_pb2 as pb
from tests.helpers import BODIES, at_vector_width, compiled_vector_widths, select_body

FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN = float(np.finfo(np.float32).tiny)


@pytest.fixture(autouse=True, params=BODIES)
def body(request, monkeypatch):
    """Every test here runs MAX pooling's compiled kernels (where built) and its numpy body."""
    return select_body(request, monkeypatch)


def ref_out_size(n, k, s, p, ceil=True, any_pad=None):
    o = (math.ceil if ceil else math.floor)((n + 2 * p - k) / s) + 1
    if (p if any_pad is None else any_pad) and (o - 1) * s >= n + p:
        o -= 1
    return o


def ref_pool(x, method, k, s, p, ceil=True):
    """Caffe's loops: MAX (init -FLT_MAX, strictly greater, mask h*W+w, -1 if none), AVE (pool_size with
    padding, clipped at H+pad; unguarded division), STOCHASTIC at TEST (Σx²/(FLT_MIN+Σx))."""
    (kh, kw), (sh, sw), (ph_, pw_) = k, s, p
    n_img, c, h, w = x.shape
    any_pad = ph_ > 0 or pw_ > 0
    oh = ref_out_size(h, kh, sh, ph_, ceil, any_pad)
    ow = ref_out_size(w, kw, sw, pw_, ceil, any_pad)
    y = np.zeros((n_img, c, oh, ow))
    mask = np.full((n_img, c, oh, ow), -1.0)
    for n in range(n_img):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i * sh - ph_, j * sw - pw_
                    if method == "MAX":
                        he, we = min(hs + kh, h), min(ws + kw, w)
                        hs, ws = max(hs, 0), max(ws, 0)
                        best = -FLT_MAX
                        for a in range(hs, he):
                            for b in range(ws, we):
                                if x[n, ch, a, b] > best:
                                    best, mask[n, ch, i, j] = x[n, ch, a, b], a * w + b
                        y[n, ch, i, j] = best
                    elif method == "AVE":
                        he, we = min(hs + kh, h + ph_), min(ws + kw, w + pw_)
                        size = (he - hs) * (we - ws)
                        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
                        total = sum(x[n, ch, a, b] for a in range(hs, he) for b in range(ws, we))
                        with np.errstate(invalid="ignore", divide="ignore"):
                            y[n, ch, i, j] = np.float64(total) / size
                    else:
                        he, we = min(hs + kh, h), min(ws + kw, w)
                        cells = x[n, ch, hs:he, ws:we]
                        y[n, ch, i, j] = (cells ** 2).sum() / (FLT_MIN + cells.sum())
    return y, mask


def _pool(params: str, x, num_tops=None, phase=pb.TRAIN):
    run = setup_layer(f'type: "Pooling" pooling_param {{ {params} }}', [x], num_tops, phase=phase,
                      dtype=np.float64)
    return run, run.forward()


# (params, shape, method, kernel, stride, pad, ceil)
CASES = [
    ("pool: MAX kernel_size: 3 stride: 2", (2, 2, 7, 7), "MAX", (3, 3), (2, 2), (0, 0), True),
    ("pool: MAX kernel_size: 3 stride: 2", (1, 2, 6, 8), "MAX", (3, 3), (2, 2), (0, 0), True),  # overhang
    ("pool: MAX kernel_size: 3 stride: 2 pad: 1", (2, 2, 6, 5), "MAX", (3, 3), (2, 2), (1, 1), True),
    # ceil with pad: the last window would start in the padding and is dropped
    ("pool: MAX kernel_size: 2 stride: 2 pad: 1", (1, 2, 3, 5), "MAX", (2, 2), (2, 2), (1, 1), True),
    ("pool: AVE kernel_size: 2 stride: 2 pad: 1", (1, 2, 3, 5), "AVE", (2, 2), (2, 2), (1, 1), True),
    ("pool: AVE kernel_size: 3 stride: 2", (2, 2, 6, 8), "AVE", (3, 3), (2, 2), (0, 0), True),
    ("pool: AVE kernel_size: 3 stride: 2 pad: 1", (2, 3, 7, 6), "AVE", (3, 3), (2, 2), (1, 1), True),
    ("pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0", (1, 2, 5, 7), "AVE",
     (3, 2), (1, 2), (1, 0), True),
    ("pool: MAX kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 1", (1, 2, 5, 6), "MAX",
     (2, 3), (2, 1), (0, 1), True),
    ("pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR", (1, 2, 6, 8), "MAX", (3, 3), (2, 2), (0, 0),
     False),
    ("pool: AVE kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR", (1, 2, 6, 7), "AVE", (3, 3), (2, 2),
     (1, 1), False),
    ("pool: STOCHASTIC kernel_size: 3 stride: 2", (2, 2, 6, 7), "STOCHASTIC", (3, 3), (2, 2), (0, 0), True),
]


@pytest.mark.parametrize("params,shape,method,k,s,p,ceil", CASES)
def test_forward_matches_caffe_loops(params, shape, method, k, s, p, ceil):
    x = np.abs(np.random.default_rng(0).standard_normal(shape)) + 0.05 if method == "STOCHASTIC" else \
        np.random.default_rng(0).standard_normal(shape)
    phase = pb.TEST if method == "STOCHASTIC" else pb.TRAIN
    _, (y,) = _pool(params, x, phase=phase)
    ref, _ = ref_pool(x, method, k, s, p, ceil)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("params,shape,method,k,s,p,ceil", CASES)
def test_gradient(params, shape, method, k, s, p, ceil):
    rng = np.random.default_rng(1)
    x = np.abs(rng.standard_normal(shape)) + 0.05 if method == "STOCHASTIC" else rng.standard_normal(shape)
    check_gradient(f'type: "Pooling" pooling_param {{ {params} }}', [x])
    if method == "STOCHASTIC":
        check_gradient(f'type: "Pooling" pooling_param {{ {params} }}', [x], phase=pb.TEST)


def test_output_sizes():
    assert pooled_shape((6, 8), (3, 3), (2, 2), (0, 0)) == (3, 4)            # ceil: partial last window
    assert pooled_shape((6, 8), (3, 3), (2, 2), (0, 0), ceil_mode=False) == (2, 3)
    assert pooled_shape((3, 5), (2, 2), (2, 2), (1, 1)) == (2, 3)            # ceil gives 3, 4; corrected
    assert pooled_shape((3, 5), (2, 2), (2, 2), (1, 0)) == (2, 3)            # correction hits every axis
    assert pooled_shape((4,), (1,), (2,), (0,)) == (3,)                      # no pad: empty window kept


def test_empty_window_quirk():
    """No padding and kernel < stride: the last window lies outside the image.  Caffe: MAX gives -FLT_MAX with
    mask -1, AVE divides an empty sum by its pool_size (0 -> NaN, negative -> -0)."""
    x = np.random.default_rng(2).standard_normal((1, 1, 4, 5))
    run, (y, mask) = _pool("pool: MAX kernel_size: 1 stride: 2", x, num_tops=2)
    ref, ref_mask = ref_pool(x, "MAX", (1, 1), (2, 2), (0, 0))
    assert y.shape == (1, 1, 3, 3) and y[0, 0, 2, 0] == -FLT_MAX and mask[0, 0, 2, 0] == -1
    np.testing.assert_array_equal(y, ref)
    np.testing.assert_array_equal(mask, ref_mask)
    run.top[0].diff[...] = 1.0
    run.layer.backward_layer(run.top, [True], run.bottom)  # the empty window's gradient is dropped
    assert run.bottom[0].diff.sum() == 6.0  # 9 windows, 3 of them empty
    _, (ya,) = _pool("pool: AVE kernel_size: 1 stride: 2", x)
    ref_a, _ = ref_pool(x, "AVE", (1, 1), (2, 2), (0, 0))
    assert np.isnan(ya[0, 0, 2, 0])
    np.testing.assert_array_equal(ya, ref_a)
    x2 = np.random.default_rng(3).standard_normal((1, 1, 5, 5))
    _, (yb,) = _pool("pool: AVE kernel_size: 1 stride: 3", x2)  # window at 6 > 5: pool_size negative
    np.testing.assert_array_equal(yb, ref_pool(x2, "AVE", (1, 1), (3, 3), (0, 0))[0])


def test_mask_top_and_ties():
    x = np.zeros((1, 2, 4, 4))
    x[0, 0] = [[1, 3, 3, 0], [3, 2, 0, 5], [0, 0, 0, 0], [4, 4, 4, 4]]
    x[0, 1] = 7.0  # every window tied
    run, (y, mask) = _pool("pool: MAX kernel_size: 2 stride: 2", x, num_tops=2)
    np.testing.assert_array_equal(y[0, 0], [[3, 5], [4, 4]])
    np.testing.assert_array_equal(mask[0, 0], [[1, 7], [12, 14]])  # first (lowest) index wins a tie
    np.testing.assert_array_equal(mask[0, 1], [[0, 2], [8, 10]])
    run.top[0].diff[...] = np.arange(8).reshape(1, 2, 2, 2)
    run.layer.backward_layer(run.top, [True], run.bottom)
    expect = np.zeros((1, 2, 4, 4))
    for c in range(2):
        for i in range(2):
            for j in range(2):
                m = int(mask[0, c, i, j])
                expect[0, c, m // 4, m % 4] += run.top[0].diff[0, c, i, j]
    np.testing.assert_array_equal(run.bottom[0].diff, expect)
    # overlapping windows sharing a maximum accumulate into it
    x3 = np.zeros((1, 1, 3, 3))
    x3[0, 0, 1, 1] = 9
    run3, _ = _pool("pool: MAX kernel_size: 2 stride: 1", x3)
    run3.top[0].diff[...] = 1
    run3.layer.backward_layer(run3.top, [True], run3.bottom)
    assert run3.bottom[0].diff[0, 0, 1, 1] == 4 and run3.bottom[0].diff.sum() == 4


def test_mask_top_gradient():
    x = np.random.default_rng(4).standard_normal((2, 2, 5, 6))
    check_gradient('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }', [x],
                   num_tops=2, top_indices=[0])


def test_global_pooling():
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5))
    _, (y,) = _pool("pool: AVE global_pooling: true", x)
    np.testing.assert_allclose(y, x.mean(axis=(2, 3), keepdims=True), rtol=1e-12)
    _, (ym,) = _pool("pool: MAX global_pooling: true", x)
    np.testing.assert_array_equal(ym, x.max(axis=(2, 3), keepdims=True))
    check_gradient('type: "Pooling" pooling_param { pool: AVE global_pooling: true }', [x])
    check_gradient('type: "Pooling" pooling_param { pool: MAX global_pooling: true }', [x])
    # the kernel follows the input on reshape
    run, _ = _pool("pool: MAX global_pooling: true", x)
    run.bottom[0].reshape((2, 3, 6, 2))
    run.layer.reshape(run.bottom, run.top)
    assert run.top[0].shape == (2, 3, 1, 1)


def test_stochastic_train_samples_proportionally():
    """TRAIN samples a cell with probability ∝ activation (Caffe runs this on GPU only)."""
    from cct.rng import set_random_seed

    set_random_seed(11)
    x = np.tile(np.array([[1.0, 2.0], [3.0, 4.0]]), (1, 4000, 1, 1))
    run, (y,) = _pool("pool: STOCHASTIC kernel_size: 2 stride: 2", x)
    freq = np.array([(y == v).mean() for v in (1, 2, 3, 4)])
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.03)
    run.top[0].diff[...] = 1
    run.layer.backward_layer(run.top, [True], run.bottom)
    d = run.bottom[0].diff
    assert (d.sum(axis=(2, 3)) == 1).all()                       # one cell per window
    np.testing.assert_array_equal((d * x).sum(axis=(2, 3)), y[:, :, 0, 0])  # the sampled one
    # a single positive cell is always chosen
    x1 = np.zeros((1, 1, 2, 2))
    x1[0, 0, 1, 0] = 2.5
    _, (y1,) = _pool("pool: STOCHASTIC kernel_size: 2 stride: 2", x1)
    assert y1[0, 0, 0, 0] == 2.5


def test_nd_pooler():
    """The Pooler is N-D, with a kernel, stride and pad per axis."""
    x = np.random.default_rng(6).standard_normal((1, 2, 4, 5, 3))
    y = np.zeros((1, 2) + pooled_shape((4, 5, 3), (2, 3, 2), (2, 2, 1), (0, 1, 0)))
    Pooler(pb.PoolingParameter.MAX, (4, 5, 3), (2, 3, 2), (2, 2, 1), (0, 1, 0)).forward(x, y)
    xp = np.pad(x, [(0, 0), (0, 0), (0, 0), (1, 1), (0, 0)], constant_values=-np.inf)
    for i, j, k in np.ndindex(*y.shape[2:]):
        win = xp[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 3, k:k + 2]
        np.testing.assert_array_equal(y[:, :, i, j, k], win.max(axis=(2, 3, 4)))


@pytest.mark.parametrize("params,field,match", [
    ("pool: MAX kernel_size: 2 kernel_h: 2 kernel_w: 2", "pooling_param.kernel_size", "not both"),
    ("pool: MAX kernel_h: 2", "pooling_param.kernel_size", "both kernel_h and kernel_w"),
    ("pool: MAX", "pooling_param.kernel_size", "required"),
    ("pool: MAX kernel_size: 0", "pooling_param.kernel_size", "cannot be zero"),
    ("pool: MAX kernel_size: 2 stride: 0", "pooling_param.stride", "> 0"),
    ("pool: MAX kernel_size: 2 pad: 2", "pooling_param.pad", "smaller than the kernel"),
    ("pool: STOCHASTIC kernel_size: 2 pad: 1", "pooling_param.pad", "only for average and max"),
    ("pool: MAX kernel_size: 2 pad: 1 pad_h: 1", "pooling_param.pad", "pad OR pad_h and pad_w"),
    ("pool: MAX kernel_size: 2 stride_h: 1", "pooling_param.stride", "stride OR stride_h and stride_w"),
    ("pool: MAX global_pooling: true kernel_size: 2", "pooling_param.global_pooling", "cannot specified"),
    ("pool: AVE global_pooling: true stride: 2", "pooling_param.global_pooling", "stride = 1"),
    ("pool: MAX kernel_size: 9", "pooling_param.kernel_size", "kernel larger than padded input"),
])
def test_param_errors(params, field, match):
    with pytest.raises(ParamError, match=match) as e:
        setup_layer(f'type: "Pooling" pooling_param {{ {params} }}', [np.zeros((1, 1, 5, 5))])
    assert e.value.field == field


def test_arity_and_shape_errors():
    with pytest.raises(ParamError, match="only for MAX"):
        setup_layer('type: "Pooling" pooling_param { pool: AVE kernel_size: 2 }', [np.zeros((1, 1, 4, 4))],
                    num_tops=2)
    with pytest.raises(CctError, match="4 axes"):
        setup_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }', [np.zeros((1, 4))])
    run = setup_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }', [np.zeros((1, 1, 4, 4))])
    run.bottom[0].reshape((1, 1, 4, 4, 4))
    with pytest.raises(CctError, match="4 axes"):
        run.layer.reshape(run.bottom, run.top)
    run = setup_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }', [np.zeros((1, 1, 4, 4, 4))])
    run.bottom[0].reshape((1, 1, 4, 4))
    with pytest.raises(CctError, match="keep its 5 axes"):
        run.layer.reshape(run.bottom, run.top)


# ---- N-D (3-D volumes): a cct extension, kernel/stride/pad for every spatial axis or per axis (*_nd) -------
def ref_pool_nd(x, method, k, s, p, ceil=True):
    """Caffe's MAX/AVE loops written for any number of spatial axes (same rules as :func:`ref_pool`); the
    mask is the flat index within the channel volume.  ``k``, ``s``, ``p``: one int for every axis or a tuple
    with one per axis."""
    nd = x.ndim - 2
    k, s, p = (tuple(v) if isinstance(v, tuple) else (v,) * nd for v in (k, s, p))
    out = tuple(ref_out_size(n, kk, ss, pp, ceil, any(p)) for n, kk, ss, pp in zip(x.shape[2:], k, s, p))
    y = np.zeros(x.shape[:2] + out)
    mask = np.full(y.shape, -1.0)
    for n, c in itertools.product(range(x.shape[0]), range(x.shape[1])):
        for o in itertools.product(*map(range, out)):
            start = [oi * si - pi for oi, si, pi in zip(o, s, p)]
            if method == "MAX":
                lo = [max(a, 0) for a in start]
                hi = [min(a + kk, dim) for a, kk, dim in zip(start, k, x.shape[2:])]
                best = -FLT_MAX
                for cell in itertools.product(*(range(a, b) for a, b in zip(lo, hi))):
                    if x[(n, c) + cell] > best:
                        best, mask[(n, c) + o] = x[(n, c) + cell], np.ravel_multi_index(cell, x.shape[2:])
                y[(n, c) + o] = best
            else:
                hi = [min(a + kk, dim + pp) for a, kk, dim, pp in zip(start, k, x.shape[2:], p)]
                size = math.prod(b - a for a, b in zip(start, hi))
                lo = [max(a, 0) for a in start]
                hi = [min(b, dim) for b, dim in zip(hi, x.shape[2:])]
                total = sum(x[(n, c) + cell] for cell in itertools.product(*(range(a, b) for a, b in zip(lo, hi))))
                y[(n, c) + o] = total / size
    return y, mask


# (params, shape, method, kernel, stride, pad)
ND_CASES = [
    ("pool: MAX kernel_size: 2 stride: 2", (2, 2, 4, 6, 5), "MAX", 2, 2, 0),        # ceil overhang on W
    ("pool: MAX kernel_size: 3 stride: 2 pad: 1", (1, 2, 5, 4, 6), "MAX", 3, 2, 1),
    ("pool: AVE kernel_size: 2 stride: 2", (2, 2, 4, 5, 4), "AVE", 2, 2, 0),
    ("pool: AVE kernel_size: 3 stride: 2 pad: 1", (1, 3, 5, 6, 4), "AVE", 3, 2, 1),
    ("pool: MAX kernel_size: 3 stride: 1", (1, 2, 7), "MAX", 3, 1, 0),              # 1-D
    ("pool: AVE kernel_size: 2 stride: 1 pad: 1", (1, 1, 3, 3, 2, 3), "AVE", 2, 1, 1),  # 4-D volume
    # per-axis sizes (kernel_nd / stride_nd / pad_nd), e.g. an anisotropic volume pooled 1x2x2
    ("pool: MAX kernel_nd: [1, 2, 2] stride_nd: [1, 2, 2]", (2, 2, 3, 5, 4), "MAX", (1, 2, 2), (1, 2, 2), 0),
    ("pool: AVE kernel_nd: [1, 2, 2] stride_nd: [1, 2, 2]", (2, 2, 3, 5, 4), "AVE", (1, 2, 2), (1, 2, 2), 0),
    ("pool: MAX kernel_nd: [3, 2, 2] stride_nd: [2, 1, 2] pad_nd: [1, 0, 1]", (1, 2, 5, 4, 5), "MAX",
     (3, 2, 2), (2, 1, 2), (1, 0, 1)),
    ("pool: AVE kernel_nd: [3, 2, 2] stride_nd: [2, 1, 2] pad_nd: [1, 0, 1]", (1, 2, 5, 4, 5), "AVE",
     (3, 2, 2), (2, 1, 2), (1, 0, 1)),
    ("pool: MAX kernel_nd: [3, 2] stride_nd: 2", (2, 2, 7, 6), "MAX", (3, 2), 2, 0),           # 2-D
    ("pool: AVE kernel_nd: [3, 2] stride_nd: 2 pad_nd: 1", (1, 2, 6, 5), "AVE", (3, 2), 2, 1),
    ("pool: MAX kernel_nd: 3 stride_nd: [1, 2] pad_nd: [1, 0]", (1, 2, 5, 6), "MAX", 3, (1, 2), (1, 0)),
]


@pytest.mark.parametrize("params,shape,method,k,s,p", ND_CASES)
def test_nd_forward_matches_caffe_loops(params, shape, method, k, s, p):
    x = np.random.default_rng(7).standard_normal(shape)
    tops = 2 if method == "MAX" else 1
    _, outs = _pool(params, x, num_tops=tops)
    ref, ref_mask = ref_pool_nd(x, method, k, s, p)
    np.testing.assert_allclose(outs[0], ref, rtol=1e-12, atol=1e-12)
    if method == "MAX":
        np.testing.assert_array_equal(outs[1], ref_mask)


@pytest.mark.parametrize("params,shape,method,k,s,p", ND_CASES)
def test_nd_gradient(params, shape, method, k, s, p):
    x = np.random.default_rng(8).standard_normal(shape)
    check_gradient(f'type: "Pooling" pooling_param {{ {params} }}', [x])
    if method == "MAX":
        check_gradient(f'type: "Pooling" pooling_param {{ {params} }}', [x], num_tops=2, top_indices=[0])


def test_nd_global_pooling_and_mask_backward():
    x = np.random.default_rng(9).standard_normal((2, 3, 3, 4, 5))
    _, (y,) = _pool("pool: AVE global_pooling: true", x)
    np.testing.assert_allclose(y, x.mean(axis=(2, 3, 4), keepdims=True), rtol=1e-12)
    run, (ym, mask) = _pool("pool: MAX global_pooling: true", x, num_tops=2)
    assert ym.shape == mask.shape == (2, 3, 1, 1, 1)
    np.testing.assert_array_equal(mask.reshape(6), x.reshape(6, -1).argmax(axis=1))
    run.top[0].diff[...] = 2.0
    run.layer.backward_layer(run.top, [True], run.bottom)
    d = run.bottom[0].diff.reshape(6, -1)
    assert (d.sum(axis=1) == 2.0).all() and (d.argmax(axis=1) == x.reshape(6, -1).argmax(axis=1)).all()
    check_gradient('type: "Pooling" pooling_param { pool: AVE global_pooling: true }', [x])


@pytest.mark.parametrize("params,field", [
    ("pool: MAX kernel_h: 2 kernel_w: 2", "pooling_param.kernel_h"),
    ("pool: MAX kernel_size: 2 stride_h: 1 stride_w: 1", "pooling_param.stride_h"),
    ("pool: AVE kernel_size: 2 pad_h: 1 pad_w: 1", "pooling_param.pad_h"),
])
def test_nd_rejects_2d_only_fields(params, field):
    with pytest.raises(ParamError, match="2-D pooling only") as e:
        setup_layer(f'type: "Pooling" pooling_param {{ {params} }}', [np.zeros((1, 1, 4, 4, 4))])
    assert e.value.field == field



def test_nd_per_axis_2d_equals_caffe_hw_fields():
    x = np.random.default_rng(10).standard_normal((2, 3, 7, 6))
    for pool in ("MAX", "AVE"):
        tops = 2 if pool == "MAX" else 1
        _, nd_outs = _pool(f"pool: {pool} kernel_nd: [3, 2] stride_nd: [2, 1] pad_nd: [1, 0]", x, num_tops=tops)
        _, hw_outs = _pool(f"pool: {pool} kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0", x,
                           num_tops=tops)
        for a, b in zip(nd_outs, hw_outs):
            np.testing.assert_array_equal(a, b)


def test_nd_single_value_applies_to_every_axis():
    x = np.random.default_rng(11).standard_normal((1, 2, 4, 5, 3))
    run, (y, mask) = _pool("pool: MAX kernel_nd: 2", x, num_tops=2)
    _, (ref, ref_mask) = _pool("pool: MAX kernel_size: 2", x, num_tops=2)
    assert run.layer.kernel == (2, 2, 2) and run.layer.stride == (1, 1, 1) and run.layer.pad == (0, 0, 0)
    np.testing.assert_array_equal(y, ref)
    np.testing.assert_array_equal(mask, ref_mask)


@pytest.mark.parametrize("params,shape,field,match", [
    ("pool: MAX kernel_nd: [2, 2, 2] kernel_size: 2", (1, 1, 4, 4, 4), "pooling_param.kernel_nd", "not both"),
    ("pool: MAX kernel_nd: [2, 2] kernel_h: 2 kernel_w: 2", (1, 1, 4, 4), "pooling_param.kernel_nd", "not both"),
    ("pool: MAX global_pooling: true kernel_nd: [2, 2, 2]", (1, 1, 4, 4, 4), "pooling_param.global_pooling",
     "cannot specified"),
    ("pool: MAX kernel_nd: [2, 2]", (1, 1, 4, 4, 4), "pooling_param.kernel_nd",
     r"2 values for 3 spatial axes, bottom 1 1 4 4 4"),
    ("pool: MAX kernel_nd: 2 stride_nd: [1, 1, 1, 1]", (1, 1, 4, 4, 4), "pooling_param.stride_nd",
     "4 values for 3 spatial axes"),
    ("pool: MAX kernel_nd: 2 pad_nd: [1, 1, 1]", (1, 1, 4, 4), "pooling_param.pad_nd", "3 values for 2 spatial axes"),
    ("pool: MAX kernel_nd: [2, 2, 2] stride_nd: [1, 2, 1] stride: 2", (1, 1, 4, 4, 4), "pooling_param.stride_nd",
     "not both"),
    ("pool: MAX kernel_nd: [3, 3] pad_nd: [1, 0] pad_h: 1 pad_w: 0", (1, 1, 5, 5), "pooling_param.pad_nd",
     "not both"),
    ("pool: MAX kernel_size: 3 pad_nd: 1 pad_h: 1", (1, 1, 5, 5, 5), "pooling_param.pad_nd", "not both"),
    ("pool: MAX kernel_nd: [2, 0, 2]", (1, 1, 4, 4, 4), "pooling_param.kernel_nd", "cannot be zero"),
    ("pool: MAX kernel_nd: 2 stride_nd: [1, 0, 1]", (1, 1, 4, 4, 4), "pooling_param.stride_nd", "> 0"),
    ("pool: MAX kernel_nd: [2, 3, 2] pad_nd: [0, 1, 2]", (1, 1, 4, 4, 4), "pooling_param.pad_nd",
     "smaller than the kernel"),
    ("pool: AVE global_pooling: true stride_nd: [1, 2, 1]", (1, 1, 4, 4, 4), "pooling_param.global_pooling",
     "stride = 1"),
])
def test_nd_per_axis_param_errors(params, shape, field, match):
    with pytest.raises(ParamError, match=match) as e:
        setup_layer(f'type: "Pooling" pooling_param {{ {params} }}', [np.zeros(shape)])
    assert e.value.field == field


def test_nd_2d_only_field_error_points_to_per_axis_fields():
    with pytest.raises(ParamError, match="kernel_size for every axis, or kernel_nd for per-axis sizes"):
        setup_layer('type: "Pooling" pooling_param { pool: MAX kernel_h: 2 kernel_w: 2 }', [np.zeros((1, 1, 4, 4, 4))])


def test_nd_per_axis_fields_text_round_trip():
    from google.protobuf import text_format

    lp = pb.LayerParameter(name="pool1", type="Pooling")
    lp.pooling_param.pool = pb.PoolingParameter.AVE
    lp.pooling_param.kernel_nd.extend([1, 2, 2])
    lp.pooling_param.stride_nd.extend([1, 2, 2])
    lp.pooling_param.pad_nd.append(0)
    text = text_format.MessageToString(lp)
    assert "kernel_nd: 1" in text and "pad_nd: 0" in text
    back = text_format.Parse(text, pb.LayerParameter())
    assert back == lp
    assert list(back.pooling_param.kernel_nd) == [1, 2, 2] and list(back.pooling_param.stride_nd) == [1, 2, 2]
    assert list(back.pooling_param.pad_nd) == [0] and not back.pooling_param.HasField("kernel_size")
    assert pb.LayerParameter.FromString(lp.SerializeToString()) == lp


@pytest.mark.parametrize("in_hw, kernel, stride, pad", [((9, 9), 3, 2, 0), ((7, 6), 3, 1, 1), ((8, 8), 2, 2, 0),
                                                        ((10, 7), 3, 2, 1)])
def test_max_backward_adds_in_caffes_order(in_hw, kernel, stride, pad):
    """Overlapping windows add their gradients into a shared cell in top order, in float32, from 0 — Caffe's
    CPU loop — bitwise; ties keep the first cell of the scan."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (2, 3) + in_hw).astype(np.float32)  # many ties
    pl = Pooler(pb.PoolingParameter.MAX, in_hw, (kernel,) * 2, (stride,) * 2, (pad,) * 2)
    y = np.empty((2, 3) + pl.out_shape, np.float32)
    dy = rng.standard_normal(y.shape).astype(np.float32) * np.float32(1e3)
    dx = np.full(x.shape, np.nan, np.float32)
    pl.forward(x, y)
    pl.backward(dy, dx, x)
    ref = np.zeros_like(x)
    h, w = in_hw
    for n, c, ph, pw in itertools.product(range(2), range(3), *(range(o) for o in pl.out_shape)):
        hs, ws = ph * stride - pad, pw * stride - pad
        he, we = min(hs + kernel, h), min(ws + kernel, w)
        hs, ws = max(hs, 0), max(ws, 0)
        best, arg = np.float32(-3.4028234663852886e38), None
        for i, j in itertools.product(range(hs, he), range(ws, we)):
            if x[n, c, i, j] > best:
                best, arg = x[n, c, i, j], (i, j)
        assert y[n, c, ph, pw] == best
        ref[n, c, arg[0], arg[1]] = np.float32(ref[n, c, arg[0], arg[1]] + dy[n, c, ph, pw])
    np.testing.assert_array_equal(dx.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("in_hw, kernel, stride, pad", [((9, 9), 3, 2, 0), ((10, 7), 3, 2, 1), ((8, 8), 2, 2, 0)])
def test_max_pooling_in_chunks_of_images_is_bitwise_the_whole_batch(monkeypatch, in_hw, kernel, stride, pad):
    """MAX pooling walks the batch in cache-sized chunks of images (the last one shorter): maxima, mask, and
    gradients (overwritten and accumulated) are bitwise those of one pass over the whole batch."""
    from cct.layers import pooling

    rng = np.random.default_rng(7)
    x = rng.integers(-9, -2, (7, 3) + in_hw).astype(np.float32)  # ties, all below zero
    dy_shape = (7, 3) + pooled_shape(in_hw, (kernel,) * 2, (stride,) * 2, (pad,) * 2)
    dy = rng.standard_normal(dy_shape).astype(np.float32)

    def run():
        pl = Pooler(pb.PoolingParameter.MAX, in_hw, (kernel,) * 2, (stride,) * 2, (pad,) * 2)
        y, mask = np.empty(dy_shape, np.float32), np.empty(dy_shape, np.float32)
        pl.forward(x, y, mask=mask)
        pl.forward(x, y)
        dx = np.full(x.shape, np.nan, np.float32)
        pl.backward(dy, dx, x)
        acc = np.ones_like(x)
        pl.backward(dy, acc, x, accumulate=True)
        return pl, (y, mask, dx, acc)

    whole_pl, whole = run()
    assert len(whole_pl._max_chunks(x)) == 1
    per_image = 3 * 4 * np.prod(whole_pl.phase_extent) * stride ** 2
    monkeypatch.setattr(pooling, "MAX_POOL_CHUNK_BYTES", int(per_image * 3))  # chunks of 3, 3, 1 images
    chunked_pl, chunked = run()
    assert chunked_pl._max_chunks(x) == [(0, 3), (3, 6), (6, 7)]
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)
    padded = np.full(x.shape[:2] + chunked_pl.padded_shape, -np.inf, np.float32)
    padded[:, :, pad:pad + in_hw[0], pad:pad + in_hw[1]] = x
    for i, j in itertools.product(*(range(o) for o in dy_shape[2:])):  # the maxima, window by window
        window = padded[:, :, i * stride:i * stride + kernel, j * stride:j * stride + kernel]
        np.testing.assert_array_equal(chunked[0][:, :, i, j], window.max(axis=(2, 3)))



def test_max_backward_routes_through_forwards_winners_when_the_bottom_changes_in_place():
    """Training keeps each window's winner from forward, as Caffe keeps its mask: an in-place layer on a Split
    sibling may change the shared bottom before backward.  After a TEST-phase forward (nothing kept) the
    winners are found again from the bottom, and a changed bottom is an error, not a silently wrong gradient."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 2, 9, 9)).astype(np.float32)
    pl = Pooler(pb.PoolingParameter.MAX, (9, 9), (3, 3), (2, 2), (0, 0))
    y = np.empty((3, 2) + pl.out_shape, np.float32)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    pl.forward(x, y)
    expected = np.empty_like(x)
    pl.backward(dy, expected, x)
    changed = np.maximum(x, 0)  # a ReLU in place on the shared bottom
    got = np.empty_like(x)
    pl.backward(dy, got)  # no bottom needed
    pl.backward(dy, got, changed)
    np.testing.assert_array_equal(got, expected)
    pl.forward(x, y, train=False)  # TEST phase: nothing kept
    pl.backward(dy, got, x)
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(CctError, match="needs its bottom data"):
        pl.backward(dy, got)
    with pytest.raises(CctError, match="the bottom changed since the TEST-phase forward"):
        pl.backward(dy, got, x * np.float32(2))


@pytest.mark.parametrize("in_shape, kernel, stride, pad, dilation", [
    ((11, 11), (3, 3), (2, 2), (0, 0), (1, 1)),   # CaffeNet's pools: a flat scan
    ((10, 7), (3, 3), (2, 2), (1, 1), (1, 1)),    # padding, ceil-mode overhang
    ((9, 8), (2, 3), (1, 3), (0, 1), (1, 1)),     # per-axis kernels and strides
    ((9, 9), (2, 2), (1, 1), (0, 0), (2, 3)),     # dilated windows (sparse max-filtering)
    ((5, 6, 7), (2, 3, 2), (2, 1, 2), (1, 0, 1), (1, 1, 1)),  # 3-D
])
def test_max_flat_scan_is_bitwise_the_strided_scan(in_shape, kernel, stride, pad, dilation):
    """MAX pooling scans each kernel offset as one contiguous run of the phase buffer where the padded phase
    planes are little larger than the output planes (``FLAT_SCAN_MAX_OVERHEAD``), reading past each output row
    into neighbouring cells that are dropped: maxima, winners (ties, NaN, -inf and -FLT_MAX cells), mask and
    gradients are bitwise those of the scan over strided views shaped like the output."""
    rng = np.random.default_rng(3)
    x = rng.integers(-4, 3, (3, 2) + in_shape).astype(np.float32)  # many ties
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, 9, replace=False)] = np.nan
    flat[rng.choice(flat.size, 9, replace=False)] = -np.inf
    flat[rng.choice(flat.size, 9, replace=False)] = np.float32(-3.4028234663852886e38)
    results = []
    for flat_scan in (False, True):
        pl = Pooler(pb.PoolingParameter.MAX, in_shape, kernel, stride, pad, dilation=dilation)
        pl.flat_scan = flat_scan
        y = np.empty((3, 2) + pl.out_shape, np.float32)
        mask = np.empty_like(y)
        dy = rng.standard_normal(y.shape).astype(np.float32) if not results else results[0][-1]
        pl.forward(x, y, mask=mask)
        dx = np.empty_like(x)
        pl.backward(dy, dx)
        pl.forward(x, y, train=False)  # winners found again in backward, by the same scan
        dx_test = np.empty_like(x)
        pl.backward(dy, dx_test, x)
        results.append((y.copy(), mask, dx, dx_test, pl._buffers["winners"].copy(), dy))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_max_flat_scan_only_where_the_phase_planes_are_little_larger_than_the_output():
    assert Pooler(pb.PoolingParameter.MAX, (55, 55), (3, 3), (2, 2), (0, 0)).flat_scan      # 28² vs 27²
    assert Pooler(pb.PoolingParameter.MAX, (13, 13), (3, 3), (2, 2), (0, 0)).flat_scan      # 7² vs 6²
    assert not Pooler(pb.PoolingParameter.MAX, (13, 13), (13, 13), (1, 1), (0, 0)).flat_scan  # global: 169 vs 1


@pytest.mark.parametrize("in_hw, kernel, pad, delta_codes, code_dtype", [
    ((11, 11), 3, 0, True, np.uint8),     # CaffeNet's pools: a code is the winning cell's offset in the window
    ((6, 7), 5, 0, True, np.uint8),       # 25 offsets: found in two groups of SCAN_GROUP
    ((5, 2), 3, 1, False, np.uint8),      # rows shorter than the window: offsets repeat, codes count offsets
    ((17, 17), 17, 0, False, np.uint16),  # 289 offsets, a window's offsets past a byte
])
def test_max_winner_codes_give_caffes_argmax_and_routing(in_hw, kernel, pad, delta_codes, code_dtype):
    """Whatever form the winner codes take, the mask top is Caffe's argmax (ties to the first cell, NaN and
    -FLT_MAX cells never win) and backward routes each window's gradient to that cell."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 2, (2, 3) + in_hw).astype(np.float64)  # many ties
    x.reshape(-1)[rng.choice(x.size, 5, replace=False)] = np.nan
    x.reshape(-1)[rng.choice(x.size, 5, replace=False)] = -FLT_MAX
    params = f"pool: MAX kernel_size: {kernel} stride: 1 pad: {pad}"
    run, (y, mask) = _pool(params, x, num_tops=2)
    pl = run.layer.pooler
    assert pl._delta_codes() == delta_codes and pl._code_dtype() == code_dtype
    _, ref_mask = ref_pool(x, "MAX", (kernel, kernel), (1, 1), (pad, pad))
    np.testing.assert_array_equal(mask, ref_mask)
    single, _ = _pool(params, x)
    dy = rng.standard_normal(y.shape)
    single.top[0].diff[...] = dy
    single.layer.backward_layer(single.top, [True], single.bottom)
    expect = np.zeros_like(x)
    w = in_hw[1]
    for idx in np.ndindex(*y.shape):
        m = int(ref_mask[idx])
        if m >= 0:
            expect[idx[0], idx[1], m // w, m % w] += dy[idx]
    np.testing.assert_array_equal(single.bottom[0].diff, expect)


@pytest.mark.parametrize("in_shape, kernel, stride, pad, dilation, ceil", [
    ((55, 55), (3, 3), (2, 2), (0, 0), (1, 1), True),    # CaffeNet's pool1
    ((13, 13), (3, 3), (2, 2), (0, 0), (1, 1), True),    # pool5
    ((8, 8), (2, 2), (2, 2), (0, 0), (1, 1), True),      # LeNet's: the scan's wide grid is the output grid
    ((4, 4), (2, 2), (2, 2), (0, 0), (1, 1), True),      # the same on planes of one vector
    ((10, 7), (3, 3), (2, 2), (1, 1), (1, 1), True),     # padding, ceil-mode overhang
    ((10, 7), (3, 3), (2, 2), (1, 1), (1, 1), False),    # FLOOR
    ((9, 8), (2, 3), (1, 3), (0, 1), (1, 1), True),      # per-axis kernels, stride 3
    ((9, 9), (2, 2), (1, 1), (0, 0), (2, 3), True),      # dilated windows (sparse max-filtering)
    ((40, 37), (5, 4), (3, 2), (2, 1), (1, 1), True),    # wide rows: several vectors per wide grid
    ((23,), (4,), (3,), (1,), (1,), True),               # 1-D
    ((5, 2), (3, 3), (1, 1), (1, 1), (1, 1), True),      # rows shorter than the window: offset codes
    ((8, 9, 10), (2, 2, 2), (2, 2, 2), (0, 0, 0), (1, 1, 1), True),    # 3-D, ZNN's 2x2x2 pooling
    ((5, 6, 7), (2, 3, 2), (2, 1, 2), (1, 0, 1), (1, 1, 1), True),     # 3-D, per-axis geometry, overhang
    ((9, 7, 8), (2, 2, 2), (1, 1, 1), (0, 0, 0), (2, 1, 3), True),     # 3-D max-filtering (dilated)
    ((4, 5, 3, 6), (2, 2, 1, 3), (1, 2, 1, 2), (0, 1, 0, 1), (1, 1, 1, 1), False),  # 4-D
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_max_pooling_is_bitwise_the_numpy_body(monkeypatch, in_shape, kernel, stride, pad, dilation, ceil,
                                                         dtype, body):
    """The compiled MAX pooling gives the numpy body's maxima, winners, mask and gradients bit for bit — ties,
    NaN, -inf and -FLT_MAX cells, padding, ceil-mode overhang, dilation, accumulation, the rectified routing
    of a fused ReLU, and the winners found again after a TEST-phase forward."""
    if body == "numpy":
        pytest.skip("compares the two bodies")
    _compare_bodies(monkeypatch, (3, 2), in_shape, kernel, stride, pad, dilation, ceil, dtype)


@pytest.mark.parametrize("lead, in_shape, kernel, stride, pad", [
    ((7, 9), (10, 10), (3, 3), (2, 2), (1, 1)),   # 63 planes of 100 cells: pooled 21 at a time (40 fit)
    ((64, 50), (4, 4), (2, 2), (2, 2), (0, 0)),   # LeNet's pool2: 200 at a time (256 fit)
    ((5, 1), (11,), (3,), (2,), (1,)),            # 1-D rows, 5 planes at a time
    ((2, 3), (11, 11), (3, 3), (2, 2), (0, 0)),   # 121 cells: one plane at a time
])
def test_compiled_max_pooling_of_small_planes_in_groups_is_bitwise_the_numpy_body(monkeypatch, lead, in_shape,
                                                                                    kernel, stride, pad, body):
    """Small planes, which the compiled kernels pool many at a time as one plane of an extra axis, give the numpy
    body's results bit for bit, whatever share of the planes a group holds."""
    if body == "numpy":
        pytest.skip("compares the two bodies")
    ones = (1,) * len(in_shape)
    _compare_bodies(monkeypatch, lead, in_shape, kernel, stride, pad, ones, True, np.float32)


def _compare_bodies(monkeypatch, lead, in_shape, kernel, stride, pad, dilation, ceil, dtype):
    rng = np.random.default_rng(5)
    x = rng.integers(-4, 3, lead + in_shape).astype(dtype)  # many ties
    flat = x.reshape(-1)
    for value in (np.nan, -np.inf, -FLT_MAX):
        flat[rng.choice(flat.size, 7, replace=False)] = value

    def run(pl, y, dy):
        mask = np.empty_like(y)
        pl.forward(x, y, mask=mask)
        winners = pl._buffers["winners"].copy()
        dx = np.empty_like(x)
        pl.backward(dy, dx)
        dx_sum = np.ones_like(x)
        pl.backward(dy, dx_sum, accumulate=True)
        dx_positive = np.empty_like(x)
        pl.backward(dy, dx_positive, positive=True)
        pl.forward(x, y, train=False)  # winners found again in backward
        dx_test = np.empty_like(x)
        pl.backward(dy, dx_test, x)
        return y.copy(), mask, winners, dx, dx_sum, dx_positive, dx_test
    _same_bits_in_both_bodies(monkeypatch, pb.PoolingParameter.MAX, x, lead, (in_shape, kernel, stride, pad, ceil),
                              dilation, run)


def _same_bits_in_both_bodies(monkeypatch, method, x, lead, window, dilation, run):
    """``run(pooler, y, dy)``'s arrays from the numpy body (``CCT_NATIVE=0``) and from the compiled kernels at
    every vector width this machine runs (their scans are built once per width), on the same ``x`` and ``dy``:
    the same bits."""
    results, dy = [], None
    for width in [None] + compiled_vector_widths():
        with monkeypatch.context() as env:
            if width is None:
                env.setenv("CCT_NATIVE", "0")
            pl = Pooler(method, *window, dilation=dilation)
            assert (pl._compiled(x) is None) == (width is None)
            y = np.empty(lead + pl.out_shape, x.dtype)
            if dy is None:
                dy = np.random.default_rng(7).standard_normal(y.shape).astype(x.dtype)
                dy.reshape(-1)[:2] = (-0.0, np.nan)
            with contextlib.nullcontext() if width is None else at_vector_width(width):
                results.append(run(pl, y, dy))
    assert len(results) > 1
    for compiled in results[1:]:
        for a, b in zip(results[0], compiled):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("lead, in_shape, kernel, stride, pad, dilation, ceil", [
    ((3, 2), (35, 35), (3, 3), (1, 1), (1, 1), (1, 1), True),        # Inception's branch pools
    ((3, 2), (13, 13), (3, 3), (2, 2), (0, 0), (1, 1), True),        # stride 2, ceil-mode overhang
    ((3, 2), (10, 7), (3, 3), (2, 2), (1, 1), (1, 1), True),         # padding and overhang
    ((3, 2), (9, 8), (2, 3), (1, 3), (0, 1), (1, 1), False),         # per-axis kernels, stride 3, FLOOR
    ((3, 2), (9, 9), (2, 2), (1, 1), (0, 0), (2, 3), True),          # dilated windows
    ((64, 50), (4, 4), (2, 2), (2, 2), (0, 0), (1, 1), True),        # small planes, pooled in groups
    ((3, 2), (23,), (4,), (3,), (1,), (1,), True),                   # 1-D
    ((3, 2), (5, 6, 7), (2, 3, 2), (2, 1, 2), (1, 0, 1), (1, 1, 1), True),   # 3-D
    ((5, 7), (8, 8), (8, 8), (1, 1), (0, 0), (1, 1), True),          # global: one window per plane
    ((5, 7), (17, 17), (17, 17), (1, 1), (0, 0), (1, 1), True),      # ... of more than 255 cells
    ((2, 3), (5, 5), (4, 4), (2, 2), (0, 0), (1, 1), False),         # one window, not the whole plane
    ((2, 3), (4, 5, 6), (4, 5, 6), (1, 1, 1), (0, 0, 0), (1, 1, 1), True),   # 3-D global
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_ave_pooling_is_bitwise_the_numpy_body(monkeypatch, lead, in_shape, kernel, stride, pad, dilation,
                                                        ceil, dtype, body):
    """The compiled AVE pooling gives the numpy body's averages and gradients bit for bit (the same additions in the
    same order, -0.0, NaN and infinities included): padding, overhang, dilation, small planes in groups, global
    pooling's one window per plane, accumulation."""
    if body == "numpy":
        pytest.skip("compares the two bodies")
    rng = np.random.default_rng(6)
    x = rng.standard_normal(lead + in_shape).astype(dtype)
    flat = x.reshape(-1)
    for value in (np.nan, np.inf, -0.0):
        flat[rng.choice(flat.size, 3, replace=False)] = value

    def run(pl, y, dy):
        pl.forward(x, y, train=False)
        dx = np.empty_like(x)
        pl.backward(dy, dx)
        dx_sum = x.copy()
        pl.backward(dy, dx_sum, accumulate=True)
        return y, dx, dx_sum
    _same_bits_in_both_bodies(monkeypatch, pb.PoolingParameter.AVE, x, lead, (in_shape, kernel, stride, pad, ceil),
                              dilation, run)


def test_a_device_array_is_pooled_in_one_chunk(monkeypatch):
    """A device array (an array module other than numpy) is walked whole, not in the host's cache-sized chunks
    (each a kernel launch per operation there): CaffeNet's pool1 input, 64 images of 1.2 MB, in one chunk against
    the host's one image at a time."""
    import types

    from cct.layers import pooling

    pl = Pooler(pb.PoolingParameter.MAX, (55, 55), (3, 3), (2, 2), (0, 0))
    x = np.empty((64, 96, 55, 55), np.float32)
    assert len(pl._max_chunks(x)) == 64
    monkeypatch.setattr(pooling, "get_array_module", lambda *a: types.ModuleType("device"))
    assert pl._max_chunks(x) == [(0, 64)]
