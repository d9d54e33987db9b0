"""Softmax: forward against a per-position reference, gradients, axis handling."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers.softmax  # noqa: F401  (registers the layer even if other layer modules are unfinished)
from cct.errors import ParamError
from cct.gradient_check import check_gradient, setup_layer


def ref_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    xm = np.moveaxis(x, axis, -1)
    out = np.empty_like(xm)
    for idx in np.ndindex(xm.shape[:-1]):
        v = xm[idx]
        e = np.exp(v - v.max())
        out[idx] = e / e.sum()
    return np.moveaxis(out, -1, axis)


def layer(axis: int | None = None) -> str:
    p = f"softmax_param {{ axis: {axis} }}" if axis is not None else ""
    return f'type: "Softmax" {p}'


@pytest.mark.parametrize("shape,axis", [((2, 5), None), ((2, 3, 4, 2), None), ((2, 3, 4, 2), 2),
                                        ((2, 3, 4), -1), ((4, 3), 0), ((2, 3, 4), -3)])
def test_forward_matches_reference(shape, axis):
    x = np.random.default_rng(0).standard_normal(shape) * 3
    run = setup_layer(layer(axis), [x], dtype=np.float64)
    (y,) = run.forward()
    np.testing.assert_allclose(y, ref_softmax(x, 1 if axis is None else axis), rtol=1e-12, atol=1e-15)


def test_large_values_are_stable_in_float32():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1000.0]], dtype=np.float32)
    run = setup_layer(layer(), [x], dtype=np.float32)
    (y,) = run.forward()
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ref_softmax(x.astype(np.float64), 1), rtol=1e-6)


def test_in_place_forward():
    x = np.random.default_rng(1).standard_normal((3, 4))
    run = setup_layer(layer(), [x], in_place=True, dtype=np.float64)
    (y,) = run.forward()
    np.testing.assert_allclose(y, ref_softmax(x, 1), rtol=1e-12)
    assert run.top[0] is run.bottom[0]


@pytest.mark.parametrize("shape,axis", [((2, 4), None), ((2, 3, 2, 2), None), ((2, 3, 4), 2),
                                        ((2, 3, 4), -2)])
def test_gradient(shape, axis):
    x = np.random.default_rng(2).standard_normal(shape)
    check_gradient(layer(axis), [x])


def test_gradient_in_place():
    check_gradient(layer(), [np.random.default_rng(3).standard_normal((2, 5, 2))], in_place=True)


def test_axis_out_of_range():
    with pytest.raises(ParamError, match="softmax_param.axis"):
        setup_layer(layer(3), [np.zeros((2, 3))], dtype=np.float64)


def test_matches_caffe_reference():
    """4-D Softmax of the reference net neuron_zoo, forward and backward, float32 as in Caffe."""
    from google.protobuf import text_format

    from cct.layers.registry import create_layer
    from cct.proto import caffe_pb2 as pb
    from tests.reference import assert_close, reference_dir

    folder = reference_dir("nets", "neuron_zoo")
    net = text_format.Parse((folder / "net.prototxt").read_text(), pb.NetParameter())
    consumers = [lp.name for lp in net.layer if "data" in lp.bottom]
    param = next(lp for lp in net.layer if lp.name == "softmax")
    ref = np.load(folder / "train.npz")
    run = setup_layer(create_layer(param), [ref["data/data"]], dtype=np.float32)
    assert_close(run.forward()[0], ref["data/softmax"], "softmax top")
    run.top[0].diff[...] = ref["diff/softmax"]
    run.layer.backward_layer(run.top, [True], run.bottom)
    split = f"diff/data_data_0_split_{consumers.index('softmax')}"
    assert_close(run.bottom[0].diff, ref[split], "softmax bottom diff")
