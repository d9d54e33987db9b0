"""LRN against loop transcriptions of Caffe's formulas (both normalization regions)."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers.lrn  # noqa: F401  (registers the layer)
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from tests.helpers import BODIES, select_body


@pytest.fixture(autouse=True, params=BODIES)
def body(request, monkeypatch):
    """Every test here runs LRN's compiled kernels (where built and they apply) and its numpy body."""
    return select_body(request, monkeypatch)


def ref_lrn(x, size, alpha, beta, k, within):
    alpha, beta, k = (float(np.float32(v)) for v in (alpha, beta, k))  # proto floats are float32
    n_img, c, h, w = x.shape
    half = (size - 1) // 2
    y = np.zeros_like(x)
    for n, ch, i, j in np.ndindex(*x.shape):
        if within:  # k ignored; zero padding; divisor size²
            win = x[n, ch, max(i - half, 0):i + half + 1, max(j - half, 0):j + half + 1]
            scale = 1 + alpha / size ** 2 * (win ** 2).sum()
        else:
            win = x[n, max(ch - half, 0):ch + half + 1, i, j]
            scale = k + alpha / size * (win ** 2).sum()
        y[n, ch, i, j] = x[n, ch, i, j] * scale ** -beta
    return y


CASES = [
    ("local_size: 5", 5, 1.0, 0.75, 1.0, False),
    ("local_size: 3 alpha: 0.7 beta: 0.6 k: 2", 3, 0.7, 0.6, 2.0, False),
    ("local_size: 1 alpha: 2 beta: 1.5 k: 0.5", 1, 2.0, 1.5, 0.5, False),
    ("local_size: 3 alpha: 0.9 beta: 0.75 k: 5 norm_region: WITHIN_CHANNEL", 3, 0.9, 0.75, 5.0, True),
    ("local_size: 5 alpha: 2 beta: 0.5 norm_region: WITHIN_CHANNEL", 5, 2.0, 0.5, 1.0, True),
]


@pytest.mark.parametrize("params,size,alpha,beta,k,within", CASES)
def test_forward_and_gradient(params, size, alpha, beta, k, within):
    x = np.random.default_rng(0).standard_normal((2, 7, 4, 5))
    run = setup_layer(f'type: "LRN" lrn_param {{ {params} }}', [x], dtype=np.float64)
    (y,) = run.forward()
    np.testing.assert_allclose(y, ref_lrn(x, size, alpha, beta, k, within), rtol=1e-12, atol=1e-12)
    check_gradient(f'type: "LRN" lrn_param {{ {params} }}', [x])


def test_errors():
    with pytest.raises(ParamError, match="odd") as e:
        setup_layer('type: "LRN" lrn_param { local_size: 4 }', [np.zeros((1, 3, 2, 2))])
    assert e.value.field == "lrn_param.local_size"
    with pytest.raises(CctError, match="4 axes"):
        setup_layer('type: "LRN"', [np.zeros((1, 3, 2))])
    with pytest.raises(ParamError, match="in-place"):
        setup_layer('type: "LRN"', [np.zeros((1, 3, 2, 2))], in_place=True)


@pytest.mark.parametrize("params", [c[0] for c in CASES])
def test_chunks_of_images_give_the_whole_batch_result(monkeypatch, params):
    """Forward and backward run chunk by chunk of images (``CHUNK_BYTES``): chunks of 2 images with a shorter
    last one give bitwise the results of one chunk."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 7, 4, 5)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    out = []
    for chunk in (1 << 30, 2 * x[0].nbytes):
        monkeypatch.setattr(cct.layers.lrn, "CHUNK_BYTES", chunk)
        run = setup_layer(f'type: "LRN" lrn_param {{ {params} }}', [x])
        (y,) = run.forward()
        run.top[0].diff[...] = dy
        run.layer.backward(run.top, [True], run.bottom)
        out.append((y, run.bottom[0].diff.copy()))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shape", [(3, 96, 27, 27), (2, 7, 4, 5), (2, 3, 1, 1), (1, 1, 17, 19), (2, 5, 300, 1)])
@pytest.mark.parametrize("params", ["local_size: 5 alpha: 0.0001", "local_size: 3 alpha: 0.7 k: 2",
                                    "local_size: 9 alpha: 3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_lrn_is_bitwise_the_numpy_body(monkeypatch, shape, params, dtype, body):
    """The compiled LRN (across channels, beta 3/4) gives the numpy body's top, scale and gradient bit for
    bit: fewer channels than the window, one channel, planes shorter and longer than its tiles."""
    if body == "numpy":
        pytest.skip("compares the two bodies")
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    out = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setenv("CCT_NATIVE", "0")
        run = setup_layer(f'type: "LRN" lrn_param {{ {params} }}', [x], dtype=dtype)
        assert (run.layer._compiled(x) is not None) == compiled
        (y,) = run.forward()
        run.top[0].diff[...] = dy
        run.layer.backward(run.top, [True], run.bottom)
        out.append((y.copy(), run.layer._scale.copy(), run.bottom[0].diff.copy()))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_numpy_backward_after_a_compiled_forward(monkeypatch, body):
    """The compiled forward keeps the scale but not the factor; a numpy backward after it (the kernels turned
    off in between) computes the factor again and gives the same gradient."""
    if body == "numpy":
        pytest.skip("starts from the compiled forward")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 7, 4, 5)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    grads = []
    for switch in (False, True):
        run = setup_layer('type: "LRN" lrn_param { local_size: 5 alpha: 2 }', [x])
        run.forward()
        if switch:
            monkeypatch.setenv("CCT_NATIVE", "0")
        run.top[0].diff[...] = dy
        run.layer.backward(run.top, [True], run.bottom)
        grads.append(run.bottom[0].diff.copy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_a_device_array_is_normalized_in_one_chunk(monkeypatch):
    """A device array is walked whole (each chunk is a kernel launch per operation there): CaffeNet's norm1
    input, 64 images of 280 KB, in one chunk against the host's three images at a time."""
    import types

    x = np.empty((64, 96, 27, 27), np.float32)
    assert cct.layers.lrn._chunk_images(x) == 3
    monkeypatch.setattr(cct.layers.lrn, "get_array_module", lambda *a: types.ModuleType("device"))
    assert cct.layers.lrn._chunks(x) == [(0, 64)]
