"""pycaffe's low-level Net members (``_caffe.cpp``): ``_inputs``/``_outputs`` blob indices, ``_bottom_ids``/
``_top_ids`` per layer, and ``_set_input_arrays`` with pycaffe's checks and messages."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.proto import caffe_pb2 as pb
from cct.pycaffe import InputArrayError

NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 4 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""
MEMORY = """
layer { name: "mem" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 2 channels: 3 height: 2 width: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
"""


def _net(text: str) -> cct.Net:
    return cct.Net(text_format.Parse(text, pb.NetParameter()), cct.TEST)


def test_indices_agree_with_the_named_views() -> None:
    net = _net(NET)
    names = list(net._blob_names)
    assert [names[i] for i in net._inputs] == net.inputs == ["data", "label"]
    assert [names[i] for i in net._outputs] == net.outputs == ["loss", "prob"]
    for i, layer in enumerate(net._layer_names):
        assert [names[b] for b in net._bottom_ids(i)] == net.bottom_names[layer]
        assert [names[t] for t in net._top_ids(i)] == net.top_names[layer]
    assert net._bottom_ids(0) == [] and len(net._top_ids(0)) == 2


def test_set_input_arrays_checks_like_pycaffe() -> None:
    net = _net(MEMORY)
    data = np.arange(24, dtype=np.float32).reshape(4, 3, 2, 1)
    labels = np.array([5, 6, 7, 8], np.float32).reshape(4, 1, 1, 1)
    net._set_input_arrays(data, labels)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[:2])
    np.testing.assert_array_equal(net.blobs["label"].data.ravel(), [5, 6])  # (2, 1, 1, 1), as Caffe
    bad = [
        (data.astype(np.float64), labels, "data array must be float32"),
        (np.asfortranarray(np.zeros((4, 3, 2, 2), np.float32))[..., :1], labels, "data array must be C contiguous"),
        (data.reshape(4, 6), labels, "data array must be 4-d"),
        (data.reshape(4, 2, 3, 1), labels, "data array has wrong number of channels"),
        (data.reshape(4, 3, 1, 2), labels, "data array has wrong height"),
        (data, labels.reshape(4, 1, 1), "labels array must be 4-d"),
        (data, labels[:2], "data and labels must have the same first dimension"),
        (data[:3], labels[:3], "first dimensions of input arrays must be a multiple of batch size"),
    ]
    for d, lab, message in bad:
        with pytest.raises(RuntimeError, match=message):
            net._set_input_arrays(d, lab)
    with pytest.raises(InputArrayError, match="first layer is a MemoryDataLayer"):
        _net(NET)._set_input_arrays(data, labels)
    net.set_input_arrays(data.astype(np.float64), np.array([1, 2, 3, 4]))  # the friendly form converts
    net.forward()
    np.testing.assert_array_equal(net.blobs["label"].data.ravel(), [1, 2])
