"""cct.coord_map (pycaffe's caffe.coord_map): layer maps by formula, composition and inversion, and a crop()
whose offsets really align the blobs of a built net."""
from __future__ import annotations

import numpy as np
import pytest

import cct
from cct import layers as L
from cct import params as P
from cct.coord_map import (
    AxisMismatchException,
    UndefinedMapException,
    compose,
    coord_map,
    coord_map_from_to,
    crop,
    inverse,
)


def test_layer_maps_by_formula() -> None:
    n = cct.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 32, 32]))
    n.conv = L.Convolution(n.data, num_output=2, kernel_size=3, stride=2, pad=1, dilation=2)
    ax, a, b = coord_map(n.conv.fn)  # extent (3-1)·2+1 = 5: b = (1 - 2)/2
    assert ax == 1 and a == pytest.approx(0.5) and b == pytest.approx(-0.5)
    n.nested = L.Convolution(n.data, convolution_param=dict(num_output=2, kernel_size=[3, 5], stride=[1, 2]))
    ax, a, b = coord_map(n.nested.fn)
    np.testing.assert_allclose(a, [1, 0.5])
    np.testing.assert_allclose(b, [-1, -1])  # (0 - 1)/1 and (0 - 2)/2
    n.up = L.Deconvolution(n.data, convolution_param=dict(num_output=2, kernel_size=4, stride=2, pad=1))
    ax, a, b = coord_map(n.up.fn)
    assert (ax, float(a[0]), float(b[0])) == (1, 2.0, 0.5)
    assert coord_map(L.ReLU(n.data).fn) == (None, 1, 0)
    ax, a, b = coord_map(L.Crop(n.data, n.data, axis=2, offset=[3, 4]).fn)
    assert ax == 1 and a == 1 and list(b) == [-3, -4]
    with pytest.raises(UndefinedMapException):
        coord_map(L.InnerProduct(n.data, num_output=3).fn)
    with pytest.raises(AssertionError, match="legacy"):
        coord_map(L.Convolution(n.data, num_output=2, kernel_h=3, kernel_w=3).fn)


def test_compose_and_inverse_are_affine_algebra() -> None:
    m1 = (1, np.array([0.5]), np.array([-1.0]))
    m2 = (None, 2, 3)
    ax, a, b = compose(m1, m2)  # x -> 2x + 3 then y -> 0.5y - 1: 0.5(2x + 3) - 1 = x + 0.5
    assert ax == 1 and a[0] == 1 and b[0] == 0.5
    ax, a, b = compose(m1, inverse(m1))
    assert a[0] == 1 and b[0] == 0
    with pytest.raises(AxisMismatchException):
        compose((1, 1, 0), (2, 1, 0))


def _fcn(pad: int):
    n = cct.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 37, 37]))
    n.conv = L.Convolution(n.data, num_output=3, kernel_size=3, pad=pad, weight_filler=dict(type="gaussian"))
    n.relu = L.ReLU(n.conv, in_place=True)
    n.pool = L.Pooling(n.relu, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.up = L.Deconvolution(n.pool, convolution_param=dict(num_output=3, kernel_size=4, stride=2, bias_term=False))
    return n


@pytest.mark.parametrize("pad", [0, 5, 17])
def test_crop_aligns_the_upsampled_map_with_the_input(pad: int) -> None:
    n = _fcn(pad)
    ax, a, b = coord_map_from_to(n.up, n.data)
    assert ax == 1 and a[0] == 1 and b[0] == -pad  # each pad shifts the upsampled map by one
    n.score = crop(n.up, n.data)
    layer = n.to_proto().layer[-1]
    assert layer.type == "Crop" and layer.crop_param.axis == 2 and list(layer.crop_param.offset) == [pad]
    net = cct.Net(n.to_proto(), cct.TEST)
    assert net.blobs["score"].data.shape[2:] == net.blobs["data"].data.shape[2:]


def test_crop_refuses_what_cannot_be_aligned() -> None:
    n = _fcn(0)
    n.down = L.Pooling(n.data, pool=P.Pooling.MAX, kernel_size=3, stride=3)
    with pytest.raises(AssertionError, match="scale mismatch"):
        crop(n.down, n.data)
    n2 = cct.NetSpec()
    n2.data = L.Input(shape=dict(dim=[1, 1, 20, 20]))
    n2.small = L.Deconvolution(n2.data, convolution_param=dict(num_output=1, kernel_size=4, stride=1, pad=4))
    with pytest.raises(AssertionError, match="negative offset"):
        crop(n2.small, n2.data)
    n2.ip = L.InnerProduct(n2.data, num_output=4)
    with pytest.raises(RuntimeError, match="Could not compute map"):
        coord_map_from_to(n2.ip, n2.data)


def test_importable_as_pycaffe_submodule() -> None:
    import importlib

    module = importlib.import_module("cct.coord_map")
    assert {"coord_map_from_to", "crop", "PASS_THROUGH_LAYERS", "conv_params", "crop_params"} <= set(dir(module))
