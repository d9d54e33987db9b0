"""Input and Parameter layers."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.blob import Blob
from cct.errors import ParamError
from cct.gradient_check import layer_param
from cct.layers.registry import create_layer


def make(text: str, num_tops: int):
    layer = create_layer(layer_param(text))
    top = [Blob() for _ in range(num_tops)]
    layer.setup_layer([], top)
    return layer, top


def test_input_shapes():
    _, top = make('type: "Input" input_param { shape { dim: 2 dim: 3 } }', 2)
    assert [t.shape for t in top] == [(2, 3), (2, 3)]
    _, top = make('type: "Input" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } }', 2)
    assert [t.shape for t in top] == [(2, 3), (2,)]
    layer, top = make('type: "Input"', 1)
    assert top[0].shape == ()


def test_input_leaves_tops_alone():
    layer, top = make('type: "Input" input_param { shape { dim: 2 dim: 3 } }', 1)
    top[0].reshape((4, 3))  # the user reshapes the input; forward keeps it
    top[0].data[...] = 7.0
    layer.forward_layer([], top)
    layer.backward_layer(top, [], [])
    assert top[0].shape == (4, 3)
    np.testing.assert_array_equal(top[0].data, 7.0)


def test_input_errors():
    with pytest.raises(ParamError, match="input_param.shape"):
        make('type: "Input" input_param { shape { dim: 1 } shape { dim: 2 } }', 3)
    with pytest.raises(ParamError, match="top"):
        make('type: "Input" input_param { shape { dim: 1 } }', 0)


def test_parameter_shares_data_and_diff():
    layer, top = make('type: "Parameter" parameter_param { shape { dim: 2 dim: 3 } }', 1)
    (blob,) = layer.blobs
    assert blob.shape == (2, 3) and top[0].shape == (2, 3)
    assert layer.param_propagate_down == [True]
    np.testing.assert_array_equal(blob.data, 0.0)  # no filler: zero-initialised
    blob.data[...] = np.arange(6).reshape(2, 3)
    layer.forward_layer([], top)
    np.testing.assert_array_equal(top[0].data, blob.data)
    top[0].diff[...] = 3.0
    layer.backward_layer(top, [], [])
    np.testing.assert_array_equal(blob.diff, 3.0)
    other = Blob((2, 3))  # the blob's memory swapped (weight sharing): the next forward follows it
    other.data[...] = 5.0
    blob.share_data(other)
    layer.forward_layer([], top)
    np.testing.assert_array_equal(top[0].data, 5.0)


def test_parameter_stored_blob():
    text = ('type: "Parameter" parameter_param { shape { dim: 2 } } '
            'blobs { shape { dim: 2 } data: [1.5, -2] }')
    layer, top = make(text, 1)
    layer.forward_layer([], top)
    np.testing.assert_array_equal(top[0].data, [1.5, -2.0])
    with pytest.raises(ParamError, match="parameter_param.shape"):
        make(text.replace("shape { dim: 2 } }", "shape { dim: 3 } }", 1), 1)
