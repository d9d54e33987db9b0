"""Reduction and ArgMax: forward against loop references, gradients, Caffe's tie order and shapes."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from tests.reference import assert_close, reference_dir

RNG = np.random.default_rng(7)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


# ---- Reduction --------------------------------------------------------------------------------------
OPS = {
    "SUM": lambda v: sum(v),
    "ASUM": lambda v: sum(abs(a) for a in v),
    "SUMSQ": lambda v: sum(a * a for a in v),
    "MEAN": lambda v: sum(v) / len(v),
}


def reduction_reference(x: np.ndarray, op: str, axis: int, coeff: float) -> np.ndarray:
    rows = x.reshape(int(np.prod(x.shape[:axis])), -1)
    out = np.array([coeff * OPS[op]([float(a) for a in row]) for row in rows])
    return out.reshape(x.shape[:axis])


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("axis, coeff", [(0, 1.0), (1, 1.0), (2, -0.5), (-1, 2.0), (-3, 1.5)])
def test_reduction_forward_and_gradient(op, axis, coeff):
    x = rand(2, 3, 4)
    text = f'type: "Reduction" reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}'
    run = setup_layer(text, [x], dtype=np.float64)
    (y,) = run.forward()
    canonical = axis % 3
    assert y.shape == x.shape[:canonical]
    np.testing.assert_allclose(y, reduction_reference(x, op, canonical, coeff), rtol=1e-12)
    check_gradient(text, [x])


def test_reduction_default_is_sum_to_scalar():
    x = rand(3, 2)
    (y,) = setup_layer('type: "Reduction"', [x], dtype=np.float64).forward()
    assert y.shape == ()
    np.testing.assert_allclose(y, x.sum())


def test_reduction_backward_formulas():
    x, td = rand(2, 5), rand(2)
    ones = np.ones_like(x)
    for op, want in (("SUM", 3 * td[:, None] * ones), ("MEAN", 3 / 5 * td[:, None] * ones),
                     ("ASUM", 3 * td[:, None] * np.sign(x)), ("SUMSQ", 6 * td[:, None] * x)):
        run = setup_layer(f'type: "Reduction" reduction_param {{ operation: {op} axis: 1 coeff: 3 }}', [x],
                          dtype=np.float64)
        run.forward()
        run.top[0].diff[...] = td
        run.bottom[0].diff[...] = np.nan
        run.layer.backward_layer(run.top, [True], run.bottom)
        np.testing.assert_allclose(run.bottom[0].diff, want)


def test_reduction_errors():
    with pytest.raises(ParamError, match="reduction_param.axis"):
        setup_layer('type: "Reduction" reduction_param { axis: 2 }', [rand(2, 3)])


def test_reduction_matches_caffe():
    ref = np.load(reference_dir("nets", "neuron_zoo") / "train.npz")
    text = 'type: "Reduction" loss_weight: 0.5 reduction_param { operation: SUM }'
    run = setup_layer(text, [ref["data/w"]])
    assert_close(run.forward()[0], ref["data/loss"], "loss")
    run.layer.backward_layer(run.top, [True], run.bottom)  # top diff holds the loss weight
    assert_close(run.bottom[0].diff, ref["diff/w"], "diff into w")


# ---- ArgMax -----------------------------------------------------------------------------------------
def ranked(values) -> list[tuple[float, int]]:
    """(value, index) pairs sorted descending: Caffe's std::greater on pairs."""
    return sorted(((float(v), j) for j, v in enumerate(values)), reverse=True)


@pytest.mark.parametrize("top_k, out_max_val", [(1, False), (3, False), (1, True), (4, True)])
def test_argmax_no_axis(top_k, out_max_val):
    x = np.round(rand(3, 2, 4) * 2) / 2  # plenty of ties
    text = f'type: "ArgMax" argmax_param {{ top_k: {top_k} out_max_val: {str(out_max_val).lower()} }}'
    (y,) = setup_layer(text, [x], dtype=np.float64).forward()
    assert y.shape == (3, 2 if out_max_val else 1, top_k)
    for n in range(3):
        best = ranked(x[n].ravel())[:top_k]
        np.testing.assert_array_equal(y[n, 0], [j for _, j in best])
        if out_max_val:
            np.testing.assert_array_equal(y[n, 1], [v for v, _ in best])


def test_argmax_shape_padding():
    assert setup_layer('type: "ArgMax"', [rand(4, 3)]).top[0].shape == (4, 1, 1)
    assert setup_layer('type: "ArgMax"', [rand(4, 3, 2, 2, 2)]).top[0].shape == (4, 1, 1, 1, 1)
    assert setup_layer('type: "ArgMax" argmax_param { top_k: 2 out_max_val: true }',
                       [rand(4, 3, 2)]).top[0].shape == (4, 2, 2)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("top_k, out_max_val", [(1, False), (2, False), (2, True)])
def test_argmax_axis(axis, top_k, out_max_val):
    x = np.round(rand(3, 4, 5) * 2) / 2
    text = (f'type: "ArgMax" argmax_param {{ axis: {axis} top_k: {top_k} '
            f'out_max_val: {str(out_max_val).lower()} }}')
    (y,) = setup_layer(text, [x], dtype=np.float64).forward()
    a = axis % 3
    shape = list(x.shape)
    shape[a] = top_k
    assert y.shape == tuple(shape)
    moved, got = np.moveaxis(x, a, -1), np.moveaxis(y, a, -1)
    for idx in np.ndindex(moved.shape[:-1]):
        best = ranked(moved[idx])[:top_k]
        want = [v for v, _ in best] if out_max_val else [j for _, j in best]
        np.testing.assert_array_equal(got[idx], want)


def test_argmax_ties_prefer_higher_index():
    x = np.array([[1.0, 3.0, 3.0, 0.0, 3.0]])
    (y,) = setup_layer('type: "ArgMax" argmax_param { top_k: 4 }', [x], dtype=np.float64).forward()
    np.testing.assert_array_equal(y.ravel(), [4, 2, 1, 0])


def test_argmax_errors_and_no_backward():
    with pytest.raises(ParamError, match="argmax_param.top_k"):
        setup_layer('type: "ArgMax" argmax_param { top_k: 0 }', [rand(2, 3)])
    with pytest.raises(ParamError, match="argmax_param.top_k"):
        setup_layer('type: "ArgMax" argmax_param { top_k: 7 }', [rand(2, 3, 2)])
    with pytest.raises(ParamError, match="argmax_param.top_k"):
        setup_layer('type: "ArgMax" argmax_param { top_k: 3 axis: 1 }', [rand(2, 2, 5)])
    with pytest.raises(ParamError, match="argmax_param.axis"):
        setup_layer('type: "ArgMax" argmax_param { axis: 3 }', [rand(2, 3, 2)])
    run = setup_layer('type: "ArgMax"', [rand(2, 3)])
    run.forward()
    with pytest.raises(CctError, match="back-propagate"):
        run.layer.backward_layer(run.top, [True], run.bottom)


def test_argmax_matches_caffe():
    ref = np.load(reference_dir("nets", "losses") / "test.npz")
    text = 'type: "ArgMax" argmax_param { top_k: 2 out_max_val: true }'
    (y,) = setup_layer(text, [ref["data/x"]]).forward()
    assert_close(y, ref["data/argmax"], "argmax")
