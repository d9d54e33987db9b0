"""Eltwise: SUM (coefficients), PROD (both gradient forms), MAX (Caffe's CPU tie rule), errors."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.config import settings
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer

RNG = np.random.default_rng(1)
SHAPE = (2, 3, 4)


def rand(n: int) -> list[np.ndarray]:
    return [RNG.uniform(-2, 2, size=SHAPE) for _ in range(n)]


def run_layer(proto: str, xs: list[np.ndarray], dy: np.ndarray, in_place: bool = False):
    """Forward and backward (all bottoms); returns (y, [dx_i])."""
    run = setup_layer(proto, xs, in_place=in_place, dtype=np.float64)
    y = run.forward()[0]
    run.top[0].diff[...] = dy
    run.layer.backward_layer(run.top, [True] * len(xs), run.bottom)
    return y, [b.diff.copy() for b in run.bottom]


def max_reference(xs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Caffe's CPU loop: bottoms 0/1 with ``a > b ? 0 : 1``, later ones only when strictly greater."""
    y = np.empty(SHAPE)
    idx = np.empty(SHAPE, dtype=int)
    for i in np.ndindex(SHAPE):
        a, b = xs[0][i], xs[1][i]
        y[i], idx[i] = (a, 0) if a > b else (b, 1)
        for k in range(2, len(xs)):
            if xs[k][i] > y[i]:
                y[i], idx[i] = xs[k][i], k
    return y, idx


def test_sum_default():
    xs = rand(3)
    dy = rand(1)[0]
    y, dxs = run_layer('type: "Eltwise"', xs, dy)
    np.testing.assert_allclose(y, xs[0] + xs[1] + xs[2], rtol=1e-12)
    for dx in dxs:
        np.testing.assert_array_equal(dx, dy)


def test_sum_coefficients():
    xs = rand(3)
    dy = rand(1)[0]
    coeffs = [1.0, -1.0, 0.5]
    proto = 'type: "Eltwise" eltwise_param { operation: SUM coeff: 1 coeff: -1 coeff: 0.5 }'
    y, dxs = run_layer(proto, xs, dy)
    want = np.zeros(SHAPE)
    for i in np.ndindex(SHAPE):
        want[i] = sum(c * x[i] for c, x in zip(coeffs, xs))
    np.testing.assert_allclose(y, want, rtol=1e-12)
    for c, dx in zip(coeffs, dxs):
        np.testing.assert_allclose(dx, c * dy, rtol=1e-12)


def test_prod_forward_and_backward():
    xs = rand(3)
    dy = rand(1)[0]
    for stable in ("true", "false"):
        proto = f'type: "Eltwise" eltwise_param {{ operation: PROD stable_prod_grad: {stable} }}'
        y, dxs = run_layer(proto, xs, dy)
        np.testing.assert_allclose(y, xs[0] * xs[1] * xs[2], rtol=1e-12)
        np.testing.assert_allclose(dxs[0], dy * xs[1] * xs[2], rtol=1e-9)
        np.testing.assert_allclose(dxs[1], dy * xs[0] * xs[2], rtol=1e-9)
        np.testing.assert_allclose(dxs[2], dy * xs[0] * xs[1], rtol=1e-9)


def test_prod_unstable_uses_division():
    # stable_prod_grad false: dx_i = dy * y / x_i, so a zero bottom gives NaN there (as in Caffe).
    xs = rand(2)
    xs[0][0, 0, 0] = 0.0
    with np.errstate(invalid="ignore"):
        _, dxs = run_layer('type: "Eltwise" eltwise_param { operation: PROD stable_prod_grad: false }',
                           xs, np.ones(SHAPE))
    assert np.isnan(dxs[0][0, 0, 0])
    _, dxs = run_layer('type: "Eltwise" eltwise_param { operation: PROD }', xs, np.ones(SHAPE))
    assert dxs[0][0, 0, 0] == xs[1][0, 0, 0]


def test_max_ties_follow_caffe_cpu():
    xs = [np.round(RNG.uniform(-2, 2, size=SHAPE)) for _ in range(4)]  # integers: many ties
    xs[1][0, 0, 0] = xs[0][0, 0, 0]  # tie between 0 and 1 -> 1
    xs[2][0, 0, 0] = xs[3][0, 0, 0] = xs[0][0, 0, 0] + 1  # tie between 2 and 3 -> 2
    dy = rand(1)[0]
    y, dxs = run_layer('type: "Eltwise" eltwise_param { operation: MAX }', xs, dy)
    want_y, want_idx = max_reference(xs)
    np.testing.assert_array_equal(y, want_y)
    assert want_idx[0, 0, 0] == 2
    for k, dx in enumerate(dxs):
        np.testing.assert_array_equal(dx, np.where(want_idx == k, dy, 0.0))
    two = [xs[0], xs[0].copy()]
    _, dxs = run_layer('type: "Eltwise" eltwise_param { operation: MAX }', two, dy)
    np.testing.assert_array_equal(dxs[0], 0.0)
    np.testing.assert_array_equal(dxs[1], dy)


GRADIENT_CASES = [
    'operation: SUM',
    'operation: SUM coeff: 2 coeff: -0.5 coeff: 0.25',
    'operation: PROD',
    'operation: PROD stable_prod_grad: false',
    'operation: MAX',
]


@pytest.mark.parametrize("param", GRADIENT_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_gradient(param, in_place):
    xs = rand(3)
    check_gradient(f'type: "Eltwise" eltwise_param {{ {param} }}', xs, in_place=in_place)


@pytest.mark.parametrize("param", GRADIENT_CASES)
def test_in_place_equals_out_of_place(param):
    xs = rand(3)
    dy = rand(1)[0]
    proto = f'type: "Eltwise" eltwise_param {{ {param} }}'
    y, dxs = run_layer(proto, xs, dy)
    y2, dxs2 = run_layer(proto, xs, dy, in_place=True)
    np.testing.assert_allclose(y2, y, rtol=1e-12)
    for a, b in zip(dxs, dxs2):
        np.testing.assert_allclose(b, a, rtol=1e-12)


@pytest.mark.parametrize("param", ['operation: SUM', 'operation: SUM coeff: 1 coeff: 1 coeff: -2',
                                   'operation: SUM coeff: -0.5 coeff: 2 coeff: 1'])
@pytest.mark.parametrize("in_place", [False, True])
def test_sum_over_the_batch_partitions(param, in_place):
    """The sum and its gradient split over the batch partitions, in place too (bottom 0's diff is dy itself:
    the other bottoms read it before bottom 0's coefficient is applied)."""
    xs, dy = rand(3), rand(1)[0]
    coeffs = [float(c) for c in param.split("coeff: ")[1:]] or [1.0] * 3
    with settings.override(partitions=2):
        y, dxs = run_layer(f'type: "Eltwise" eltwise_param {{ {param} }}', xs, dy, in_place=in_place)
    np.testing.assert_allclose(y, sum(c * x for c, x in zip(coeffs, xs)), rtol=1e-12)
    for c, dx in zip(coeffs, dxs):
        np.testing.assert_allclose(dx, c * dy, rtol=1e-12)


def test_split_sums_its_tops_gradients_over_the_batch_partitions():
    x, diffs = rand(1)[0], rand(3)
    with settings.override(partitions=2):
        run = setup_layer('type: "Split"', [x], num_tops=3, dtype=np.float64)
        run.forward()
        for t, d in zip(run.top, diffs):
            t.diff[...] = d
        run.layer.backward_layer(run.top, [True], run.bottom)
    np.testing.assert_allclose(run.bottom[0].diff, diffs[0] + diffs[1] + diffs[2], rtol=1e-12)


def test_float32():
    xs = [x.astype(np.float32) for x in rand(2)]
    run = setup_layer('type: "Eltwise" eltwise_param { coeff: 0.5 coeff: 2 }', xs, dtype=np.float32)
    y = run.forward()[0]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, 0.5 * xs[0] + 2 * xs[1], rtol=1e-6)


def test_errors():
    xs = rand(3)
    with pytest.raises(ParamError, match="eltwise_param.coeff"):
        setup_layer('type: "Eltwise" eltwise_param { coeff: 1 coeff: 2 }', xs)
    with pytest.raises(ParamError, match="eltwise_param.coeff"):
        setup_layer('type: "Eltwise" eltwise_param { operation: PROD coeff: 1 coeff: 2 coeff: 3 }', xs)
    with pytest.raises(ParamError, match="bottom"):
        setup_layer('type: "Eltwise"', xs[:1])
    with pytest.raises(CctError, match="2 3 4"):
        setup_layer('type: "Eltwise"', [xs[0], np.zeros((2, 3, 5))])


@pytest.mark.parametrize("layer_name,bottoms", [
    ("e_sum", ["relu", "leaky", "elu"]),
    ("e_prod", ["sigmoid_sigmoid_0_split_2", "tanh_tanh_0_split_1"]),
    ("e_max", ["prelu", "absval", "bnll"]),
])
def test_against_caffe(layer_name, bottoms):
    from tests.layers.test_neuron import check_against_caffe

    check_against_caffe(layer_name, bottoms)
