"""Embed: lookup forward, accumulated row gradients, index range checks, parameter errors."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer

RNG = np.random.default_rng(3)
FILLERS = 'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 }'


def embed(extra: str = "", k: int = 6, n: int = 4) -> str:
    return f'type: "Embed" embed_param {{ input_dim: {k} num_output: {n} {FILLERS} {extra} }}'


def indices(shape, k: int = 6) -> np.ndarray:
    return RNG.integers(0, k, size=shape).astype(np.float64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 1, 3)])
def test_forward(bias, shape):
    x = indices(shape)
    run = setup_layer(embed(f"bias_term: {str(bias).lower()}"), [x], dtype=np.float64)
    w = run.layer.blobs[0].data
    assert w.shape == (6, 4)
    assert len(run.layer.blobs) == (2 if bias else 1)
    y = run.forward()[0]
    assert y.shape == shape + (4,)
    for i in np.ndindex(shape):
        want = w[int(x[i])] + (run.layer.blobs[1].data if bias else 0.0)
        np.testing.assert_array_equal(y[i], want)


def test_indices_truncate_toward_zero():
    # Caffe reads indices with static_cast<int>: 2.7 -> 2, -0.5 -> 0.
    run = setup_layer(embed(), [np.array([2.7, -0.5, 5.99])], dtype=np.float64)
    y = run.forward()[0]
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    np.testing.assert_array_equal(y, w[[2, 0, 5]] + b)


@pytest.mark.parametrize("bad", [6.0, -1.0, 100.0, float("nan")])
def test_index_out_of_range(bad):
    run = setup_layer(embed(), [np.array([1.0, 2.0])])
    run.inputs[0][...] = [1.0, bad]
    with pytest.raises(CctError, match=r"input index .* out of range \[0, 6\)"):
        run.forward()


def test_weight_gradient_accumulates_repeated_rows():
    x = np.array([[1.0, 3.0, 1.0], [1.0, 0.0, 3.0]])
    run = setup_layer(embed(), [x], dtype=np.float64)
    run.forward()
    dy = RNG.standard_normal((2, 3, 4))
    run.top[0].diff[...] = dy
    run.layer.backward_layer(run.top, [False], run.bottom)
    want = np.zeros((6, 4))
    for i in np.ndindex(x.shape):
        want[int(x[i])] += dy[i]
    np.testing.assert_allclose(run.layer.blobs[0].diff, want, rtol=1e-12)
    np.testing.assert_allclose(run.layer.blobs[1].diff, dy.sum((0, 1)), rtol=1e-12)
    run.layer.backward_layer(run.top, [False], run.bottom)  # parameter diffs accumulate
    np.testing.assert_allclose(run.layer.blobs[0].diff, 2 * want, rtol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_gradient(bias):
    check_gradient(embed(f"bias_term: {str(bias).lower()}"), [indices((3, 4))], check_bottoms=[])


def test_no_backprop_to_indices():
    run = setup_layer(embed(), [indices((3,))])
    run.forward()
    with pytest.raises(CctError, match="backpropagate"):
        run.layer.backward_layer(run.top, [True], run.bottom)


def test_stored_blobs():
    stored = ('type: "Embed" embed_param { input_dim: 3 num_output: 2 bias_term: false } '
              'blobs { shape { dim: 3 dim: 2 } data: [1, 2, 3, 4, 5, 6] }')
    run = setup_layer(stored, [np.array([2.0, 0.0])], dtype=np.float64)
    np.testing.assert_array_equal(run.forward()[0], [[5, 6], [1, 2]])
    with pytest.raises(ParamError, match=r"expected \(3 2\)"):
        setup_layer(stored.replace("dim: 3 dim: 2", "dim: 2 dim: 3"), [np.array([0.0])])


def test_param_errors():
    with pytest.raises(ParamError, match="embed_param.num_output"):
        setup_layer('type: "Embed" embed_param { input_dim: 3 }', [indices((2,))])
    with pytest.raises(ParamError, match="embed_param.input_dim"):
        setup_layer('type: "Embed" embed_param { num_output: 3 }', [indices((2,))])
