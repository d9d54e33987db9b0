"""SPP against per-level loop pooling, flattened and concatenated."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cct.layers.spp  # noqa: F401  (registers the layer)
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from cct.layers.spp import spp_level_window
from tests.layers.test_pooling import ref_pool


def ref_spp(x, height, method):
    h, w = x.shape[2:]
    outs = []
    for level in range(height):
        bins = 2 ** level
        kh, kw = math.ceil(h / bins), math.ceil(w / bins)
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        outs.append(ref_pool(x, method, (kh, kw), (kh, kw), (ph, pw))[0])
    if height == 1:
        return outs[0]
    return np.concatenate([o.reshape(x.shape[0], -1) for o in outs], axis=1)


@pytest.mark.parametrize("height,method,shape", [
    (3, "MAX", (2, 3, 8, 9)), (2, "AVE", (2, 2, 7, 5)), (1, "MAX", (2, 3, 5, 6)), (3, "AVE", (1, 2, 13, 6)),
])
def test_forward_and_gradient(height, method, shape):
    x = np.random.default_rng(0).standard_normal(shape)
    text = f'type: "SPP" spp_param {{ pyramid_height: {height} pool: {method} }}'
    run = setup_layer(text, [x], dtype=np.float64)
    (y,) = run.forward()
    ref = ref_spp(x, height, method)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    check_gradient(text, [x])


def test_levels_and_reshape():
    assert spp_level_window(0, 7, 5) == ((7, 5), (7, 5), (0, 0))
    assert spp_level_window(2, 7, 5) == ((2, 2), (2, 2), (1, 2))  # ceil(7/4)=2, pad (8-7+1)//2; (8-5+1)//2
    run = setup_layer('type: "SPP" spp_param { pyramid_height: 2 }', [np.zeros((2, 3, 6, 6))])
    assert run.top[0].shape == (2, 3 * (1 + 4))
    run.bottom[0].reshape((2, 3, 9, 4))
    run.layer.reshape(run.bottom, run.top)
    assert run.top[0].shape == (2, 15)


def test_stochastic_without_padding():
    x = np.abs(np.random.default_rng(1).standard_normal((1, 2, 4, 8))) + 0.1
    run = setup_layer('type: "SPP" spp_param { pyramid_height: 2 pool: STOCHASTIC }', [x])
    (y,) = run.forward()
    assert y.shape == (1, 2 * (1 + 4))


def test_errors():
    with pytest.raises(ParamError, match="> 0") as e:
        setup_layer('type: "SPP" spp_param { }', [np.zeros((1, 1, 4, 4))])
    assert e.value.field == "spp_param.pyramid_height"
    with pytest.raises(ParamError, match="only for average and max"):  # 5 rows in 2 bins need padding
        setup_layer('type: "SPP" spp_param { pyramid_height: 2 pool: STOCHASTIC }', [np.zeros((1, 1, 5, 4))])
    with pytest.raises(ParamError, match="smaller than the kernel"):  # 3 rows in 4 bins
        setup_layer('type: "SPP" spp_param { pyramid_height: 3 }', [np.zeros((1, 1, 3, 8))])
    with pytest.raises(CctError, match="4 axes"):
        setup_layer('type: "SPP" spp_param { pyramid_height: 2 }', [np.zeros((1, 4, 4))])
