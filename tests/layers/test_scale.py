"""Scale and Bias: forward against broadcast references for every axis/num_axes case, gradients with one
and two bottoms (with bias, in place), Caffe's overwrite-or-accumulate quirk, errors, Caffe's numbers."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.config import settings
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from cct.runtime import partition
from tests.helpers import BODIES, select_body
from tests.reference import assert_close, reference_dir

RNG = np.random.default_rng(11)
X_SHAPE = (2, 3, 4, 5)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


# (scale_param fields, canonical axis, operand shape, Caffe overwrites the learned diff)
CASES = [
    ("", 1, (3,), False),                                   # outer 2, inner 20
    ("axis: 0 num_axes: -1", 0, (2, 3, 4, 5), True),        # count(x) == count(s)
    ("axis: 1 num_axes: 2", 1, (3, 4), False),
    ("axis: -1", 3, (5,), False),                           # inner 1
    ("num_axes: 0", 0, (), False),                          # scalar: axis forced to 0
    ("axis: 0 num_axes: 1", 0, (2,), True),                 # outer 1, inner > 1, dim > 1
    ("axis: 0 num_axes: 2", 0, (2, 3), True),
    ("axis: 1 num_axes: -1", 1, (3, 4, 5), False),          # outer 2, inner 1
    ("axis: -2 num_axes: 1", 2, (4,), False),
]


def expand(p: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """``p`` reshaped to broadcast against an ``ndim``-D array from ``axis``."""
    return p.reshape((1,) * axis + p.shape + (1,) * (ndim - axis - p.ndim))


def reduce_to(a: np.ndarray, axis: int, shape: tuple) -> np.ndarray:
    """Sum ``a`` over every axis outside ``axis .. axis+len(shape)``."""
    keep = set(range(axis, axis + len(shape)))
    return a.sum(axis=tuple(i for i in range(a.ndim) if i not in keep)).reshape(shape)


# ---- Scale forward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, axis, shape, _", CASES)
def test_scale_forward_learned_and_bottom(fields, axis, shape, _):
    x = rand(*X_SHAPE)
    run = setup_layer(f'type: "Scale" scale_param {{ {fields} }}', [x], dtype=np.float64)
    (s_blob,) = run.layer.blobs
    assert s_blob.shape == shape
    np.testing.assert_array_equal(s_blob.data, 1)  # default filler: constant 1
    s = rand(*shape)
    s_blob.data[...] = s
    np.testing.assert_allclose(run.forward()[0], x * expand(s, axis, x.ndim))
    run2 = setup_layer(f'type: "Scale" scale_param {{ {fields} }}', [x, s], dtype=np.float64)
    assert run2.layer.blobs == []
    np.testing.assert_allclose(run2.forward()[0], x * expand(s, axis, x.ndim))
    run3 = setup_layer(f'type: "Scale" scale_param {{ {fields} }}', [x], in_place=True, dtype=np.float64)
    run3.layer.blobs[0].data[...] = s
    np.testing.assert_allclose(run3.forward()[0], x * expand(s, axis, x.ndim))


def test_scale_scalar_bottom_forces_axis_zero():
    x, s = rand(2, 3), np.array(2.5)
    run = setup_layer('type: "Scale" scale_param { axis: 1 }', [x, s], dtype=np.float64)
    np.testing.assert_allclose(run.forward()[0], 2.5 * x)


def test_scale_bias_term_blob_order_and_fillers():
    x = rand(2, 3, 4)
    text = ('type: "Scale" scale_param { bias_term: true filler { type: "constant" value: 2 } '
            'bias_filler { type: "constant" value: -1 } }')
    run = setup_layer(text, [x], dtype=np.float64)
    s, b = run.layer.blobs
    assert s.shape == b.shape == (3,)
    np.testing.assert_array_equal(s.data, 2)
    np.testing.assert_array_equal(b.data, -1)
    assert run.layer.param_propagate_down == [True, True]
    np.testing.assert_allclose(run.forward()[0], 2 * x - 1)
    # defaults: scale 1, bias 0; with a bottom scale the bias is the only blob, shaped like bottom 1
    run = setup_layer('type: "Scale" scale_param { bias_term: true axis: 0 }', [x, rand(2, 3)],
                      dtype=np.float64)
    (b,) = run.layer.blobs
    assert b.shape == (2, 3)
    np.testing.assert_array_equal(b.data, 0)


def test_scale_stored_blobs():
    x = rand(2, 3)
    stored = ('blobs { shape { dim: 3 } data: 1 data: 2 data: 3 } '
              'blobs { shape { dim: 3 } data: 10 data: 20 data: 30 } ')
    run = setup_layer(f'type: "Scale" {stored} scale_param {{ bias_term: true }}', [x], dtype=np.float64)
    np.testing.assert_allclose(run.forward()[0], x * [1, 2, 3] + [10, 20, 30])
    # only the scale stored: a fresh bias is appended
    run = setup_layer('type: "Scale" blobs { shape { dim: 3 } data: 1 data: 2 data: 3 } '
                      'scale_param { bias_term: true }', [x], dtype=np.float64)
    assert len(run.layer.blobs) == 2
    np.testing.assert_allclose(run.forward()[0], x * [1, 2, 3])
    with pytest.raises(CctError, match="does not match"):
        setup_layer('type: "Scale" blobs { shape { dim: 4 } data: 1 data: 2 data: 3 data: 4 }', [x])


# ---- Scale gradients --------------------------------------------------------------------------------
FILLERS = 'filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 }'


@pytest.mark.parametrize("fields, axis, shape, _", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_gradient_learned(fields, axis, shape, _, bias):
    text = f'type: "Scale" scale_param {{ {fields} bias_term: {str(bias).lower()} {FILLERS} }}'
    x = rand(2, 3, 2, 3)  # the learned operand takes its shape from x
    check_gradient(text, [x])
    check_gradient(text, [x], in_place=True)


@pytest.mark.parametrize("fields, axis, shape, _", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_gradient_two_bottoms(fields, axis, shape, _, bias):
    text = f'type: "Scale" scale_param {{ {fields} bias_term: {str(bias).lower()} {FILLERS} }}'
    x = rand(*X_SHAPE)
    check_gradient(text, [x, rand(*shape)])
    check_gradient(text, [x, rand(*shape)], in_place=True)


# ---- Caffe's overwrite-or-accumulate quirk ----------------------------------------------------------
@pytest.fixture(params=BODIES)
def body(request, monkeypatch):
    return select_body(request, monkeypatch)


# (partitions, block budget): whole batch; one row of one outer index per block, in 2 partitions (8 B * 20 > 16 B)
SPLITS = [(1, None), (2, 16)]


@pytest.mark.parametrize("parts, block", SPLITS)
@pytest.mark.parametrize("fields, axis, shape, overwrite", CASES)
def test_scale_learned_diff_overwrite_or_accumulate(fields, axis, shape, overwrite, body, parts, block, monkeypatch):
    """Forward, the learned diffs (overwritten or accumulated as Caffe does) and the data gradient, in place or
    not, in blocks and partitions (a per-channel scale runs the blocked passes), compiled or numpy."""
    if block is not None:
        monkeypatch.setattr(partition, "BLOCK_BYTES", block)
    x, td = rand(*X_SHAPE), rand(*X_SHAPE)
    for in_place in (False, True):
        with settings.override(partitions=parts):
            run = setup_layer(f'type: "Scale" scale_param {{ {fields} bias_term: true }}', [x], in_place=in_place,
                              dtype=np.float64)
            s, b = run.layer.blobs
            s.data[...] = rand(*shape)
            b.data[...] = rand(*shape)
            (y,) = run.forward()
            np.testing.assert_allclose(y, x * expand(s.data, axis, x.ndim) + expand(b.data, axis, x.ndim))
            s.diff[...] = 1.0
            b.diff[...] = 1.0
            run.top[0].diff[...] = td
            run.layer.backward_layer(run.top, [True], run.bottom)
        grad = reduce_to(td * x, axis, shape)
        np.testing.assert_allclose(s.diff, grad if overwrite else grad + 1.0)
        np.testing.assert_allclose(b.diff, reduce_to(td, axis, shape) + 1.0)  # the bias always accumulates
        np.testing.assert_allclose(run.bottom[0].diff, td * expand(s.data, axis, x.ndim))


@pytest.mark.parametrize("parts, block", SPLITS)
def test_scale_gradients_each_alone(body, parts, block, monkeypatch):
    """Only the diffs asked for are written: no bias diff with its lr frozen, no scale diff with the scale's,
    no data gradient where bottom 0 gets none (in place: its diff is the top's, left as it was)."""
    if block is not None:
        monkeypatch.setattr(partition, "BLOCK_BYTES", block)
    x, td = rand(*X_SHAPE), rand(*X_SHAPE)
    with settings.override(partitions=parts):
        for frozen in (0, 1):
            run = setup_layer('type: "Scale" scale_param { bias_term: true }', [x], in_place=True, dtype=np.float64)
            run.layer.param_propagate_down[frozen] = False
            run.forward()
            for blob in run.layer.blobs:
                blob.diff[...] = 7.0
            run.top[0].diff[...] = td
            run.layer.backward_layer(run.top, [False], run.bottom)
            np.testing.assert_array_equal(run.layer.blobs[frozen].diff, 7.0)
            kept = 1 - frozen
            want = reduce_to(td * x, 1, (3,)) if kept == 0 else reduce_to(td, 1, (3,))
            np.testing.assert_allclose(run.layer.blobs[kept].diff, want + 7.0)
            np.testing.assert_array_equal(run.bottom[0].diff, td)


@pytest.mark.parametrize("fields, axis, shape, _", CASES)
def test_scale_bottom_diff_is_overwritten(fields, axis, shape, _):
    x, s, td = rand(*X_SHAPE), rand(*shape), rand(*X_SHAPE)
    run = setup_layer(f'type: "Scale" scale_param {{ {fields} }}', [x, s], dtype=np.float64)
    run.forward()
    run.bottom[1].diff[...] = 100.0
    run.top[0].diff[...] = td
    run.layer.backward_layer(run.top, [False, True], run.bottom)
    np.testing.assert_allclose(run.bottom[1].diff, reduce_to(td * x, axis, shape))


def test_scale_product_left_in_bottom_diff():
    """Like Caffe, td*x is formed in bottom 0's diff even when bottom 0 gets no gradient."""
    x, td = rand(2, 3, 4), rand(2, 3, 4)
    run = setup_layer('type: "Scale"', [x], dtype=np.float64)
    run.forward()
    run.top[0].diff[...] = td
    run.layer.backward_layer(run.top, [False], run.bottom)
    np.testing.assert_allclose(run.bottom[0].diff, td * x)


# ---- Scale errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, field", [
    ("num_axes: -2", "scale_param.num_axes"),
    ("axis: 1 num_axes: 4", "scale_param.num_axes"),
    ("axis: 4", "scale_param.axis"),
    ("axis: -5", "scale_param.axis"),
])
def test_scale_param_errors(fields, field):
    with pytest.raises(ParamError, match=field):
        setup_layer(f'type: "Scale" scale_param {{ {fields} }}', [rand(*X_SHAPE)])


def test_scale_bottom_shape_mismatch():
    with pytest.raises(CctError, match="does not match"):
        setup_layer('type: "Scale"', [rand(2, 3, 4), rand(4)])
    with pytest.raises(CctError, match="does not match"):
        setup_layer('type: "Scale" scale_param { axis: 2 }', [rand(2, 3, 4), rand(4, 2)])


# ---- Bias -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, axis, shape, _", CASES)
def test_bias_forward(fields, axis, shape, _):
    x, b = rand(*X_SHAPE), rand(*shape)
    run = setup_layer(f'type: "Bias" bias_param {{ {fields} }}', [x], dtype=np.float64)
    assert run.layer.blobs[0].shape == shape
    np.testing.assert_array_equal(run.layer.blobs[0].data, 0)  # default filler: constant 0
    run.layer.blobs[0].data[...] = b
    np.testing.assert_allclose(run.forward()[0], x + expand(b, axis, x.ndim))
    run = setup_layer(f'type: "Bias" bias_param {{ {fields} }}', [x, b], in_place=True, dtype=np.float64)
    np.testing.assert_allclose(run.forward()[0], x + expand(b, axis, x.ndim))


@pytest.mark.parametrize("fields, axis, shape, _", CASES)
def test_bias_gradient(fields, axis, shape, _):
    text = f'type: "Bias" bias_param {{ {fields} filler {{ type: "gaussian" std: 1 }} }}'
    x = rand(*X_SHAPE)
    check_gradient(text, [x])
    check_gradient(text, [x], in_place=True)
    check_gradient(text, [x, rand(*shape)])


def test_bias_diff_accumulates_and_bottom_is_overwritten():
    x, td = rand(2, 3, 4), rand(2, 3, 4)
    run = setup_layer('type: "Bias"', [x], dtype=np.float64)
    run.forward()
    run.layer.blobs[0].diff[...] = 1.0
    run.top[0].diff[...] = td
    run.layer.backward_layer(run.top, [True], run.bottom)
    np.testing.assert_allclose(run.layer.blobs[0].diff, td.sum(axis=(0, 2)) + 1.0)
    np.testing.assert_allclose(run.bottom[0].diff, td)
    run = setup_layer('type: "Bias"', [x, rand(3)], dtype=np.float64)
    run.forward()
    run.bottom[1].diff[...] = 5.0
    run.top[0].diff[...] = td
    run.layer.backward_layer(run.top, [True, True], run.bottom)
    np.testing.assert_allclose(run.bottom[1].diff, td.sum(axis=(0, 2)))


def test_bias_errors():
    with pytest.raises(ParamError, match="bias_param.num_axes"):
        setup_layer('type: "Bias" bias_param { num_axes: -3 }', [rand(2, 3)])
    with pytest.raises(ParamError, match="bias_param.axis"):
        setup_layer('type: "Bias" bias_param { axis: 2 }', [rand(2, 3)])
    with pytest.raises(CctError, match="does not match"):
        setup_layer('type: "Bias"', [rand(2, 3), rand(2)])


# ---- against Caffe (nets/neuron_zoo: "scale" and "bias" read the split blobs 13 and 14 of "data") ------
@pytest.mark.parametrize("name, proto, split", [
    ("scale", 'type: "Scale" scale_param { bias_term: true }', 13),
    ("bias", 'type: "Bias"', 14),
])
def test_matches_caffe(name, proto, split):
    ref = np.load(reference_dir("nets", "neuron_zoo") / "train.npz")
    run = setup_layer(proto, [ref["data/data"]])
    for j, blob in enumerate(run.layer.blobs):
        blob.data[...] = ref[f"param/{name}/{j}"]
        blob.diff[...] = 0
    assert_close(run.forward()[0], ref[f"data/{name}"], f"{name} data")
    run.top[0].diff[...] = ref[f"diff/{name}"]
    run.layer.backward_layer(run.top, [True], run.bottom)
    assert_close(run.bottom[0].diff, ref[f"diff/data_data_0_split_{split}"], f"{name} bottom diff")
    for j, blob in enumerate(run.layer.blobs):
        assert_close(blob.diff, ref[f"param_diff/{name}/{j}"], f"{name} param diff {j}")
