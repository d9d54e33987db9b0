"""Net construction semantics (Caffe's Net::Init): wiring, backward analysis, loss weights, sharing, errors."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb

MLP = """
name: "mlp"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def make(text: str, phase: int = cct.TRAIN) -> cct.Net:
    return cct.Net(text_format.Parse(text, pb.NetParameter()), phase)


def feed(net: cct.Net, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    if "label" in net.blobs:
        net.blobs["label"].data[...] = rng.integers(0, 3, net.blobs["label"].shape)


def test_blobs_outputs_and_splits() -> None:
    net = make(MLP)
    assert list(net.blobs) == ["data", "label", "label_data_1_split_0", "label_data_1_split_1", "ip1", "ip2",
                               "ip2_ip2_0_split_0", "ip2_ip2_0_split_1", "accuracy", "loss"]
    assert net.inputs == ["data", "label"]
    assert net.outputs == ["accuracy", "loss"]  # sorted by name
    assert list(net.params) == ["ip1", "ip2"]
    assert [layer.type for layer in net.layers][:2] == ["Input", "Split"]
    assert net.blob_loss_weights["loss"] == 1.0 and net.blob_loss_weights["accuracy"] == 0.0


def test_backward_analysis() -> None:
    net = make(MLP)
    need = dict(zip(net._layer_names, net.layer_need_backward))
    assert need == {"data": False, "label_data_1_split": False, "ip1": True, "relu1": True, "ip2": True,
                    "ip2_ip2_0_split": True, "accuracy": False, "loss": True}
    loss_layer = net._layer_names.index("loss")
    assert net.bottom_need_backward[loss_layer] == [True, False]


def test_forward_backward_loss_and_input_grad_with_force_backward() -> None:
    # (no Accuracy: it has no gradient, and force_backward would ask it for one, which Caffe aborts on)
    net = make("force_backward: true\n" + MLP.replace('top: "accuracy"', 'top: "accuracy" include { phase: TEST }'))
    feed(net)
    loss = net.forward_backward()
    assert loss == pytest.approx(float(net.blobs["loss"].data), rel=1e-6)
    assert np.abs(net.blobs["data"].diff).sum() > 0  # force_backward reaches the input
    assert np.all(net.blobs["label"].diff == 0)  # but never the labels


def test_no_input_grad_without_force_backward() -> None:
    net = make(MLP)
    feed(net)
    net.forward_backward()
    assert np.all(net.blobs["data"].diff == 0)
    assert np.abs(net.params["ip1"][0].diff).sum() > 0


def test_propagate_down_false_stops_gradient() -> None:
    net = make(MLP.replace('bottom: "ip1" top: "ip2"', 'bottom: "ip1" top: "ip2" propagate_down: false'))
    feed(net)
    net.forward_backward()
    assert np.all(net.params["ip1"][0].diff == 0)
    assert np.abs(net.params["ip2"][0].diff).sum() > 0


def test_lr_mult_zero_below_stops_backward() -> None:
    net = make(MLP.replace('top: "ip1"\n', 'top: "ip1" param { lr_mult: 0 } param { lr_mult: 0 }\n', 1))
    need = dict(zip(net._layer_names, net.layer_need_backward))
    assert need["ip1"] is False and need["relu1"] is False and need["ip2"] is True


def test_automatic_top_of_loss_layer() -> None:
    net = make("""
      layer { name: "d" type: "Input" top: "x" top: "y"
              input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 3 } } }
      layer { name: "e" type: "EuclideanLoss" bottom: "x" bottom: "y" }
    """)
    assert "(automatic)" in net.blobs
    assert net.outputs == []
    net.blobs["x"].data[...] = 1.0
    assert net.forward_prefilled() == pytest.approx(1.5)  # sum of 6 squares / (2 * N), N = 2


def test_loss_weight_on_any_layer() -> None:
    net = make("""
      layer { name: "d" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "r" type: "ReLU" bottom: "x" top: "y" loss_weight: 0.5 }
    """)
    net.blobs["x"].data[...] = [[1, -1, 2], [3, 0, -4]]
    assert net.forward_prefilled() == pytest.approx(0.5 * 6)


def test_parameter_sharing() -> None:
    text = """
      layer { name: "d" type: "Input" top: "a" top: "b" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "ip_a" type: "InnerProduct" bottom: "a" top: "fa" param { name: "w" } param { name: "bias" }
              inner_product_param { num_output: 2 weight_filler { type: "gaussian" } } }
      layer { name: "ip_b" type: "InnerProduct" bottom: "b" top: "fb" param { name: "w" } param { name: "bias" }
              inner_product_param { num_output: 2 } }
      layer { name: "loss" type: "EuclideanLoss" bottom: "fa" bottom: "fb" }
    """
    net = make(text)
    wa, wb = net.params["ip_a"][0], net.params["ip_b"][0]
    assert len(net.learnable_params) == 2
    np.testing.assert_array_equal(wa.data, wb.data)
    wa.data[0, 0] = 42.0
    assert wb.data[0, 0] == 42.0
    rng = np.random.default_rng(1)
    net.blobs["a"].data[...] = rng.standard_normal((2, 3))
    net.blobs["b"].data[...] = rng.standard_normal((2, 3))
    net.clear_param_diffs()
    net.forward_backward()
    # the one shared diff accumulates both layers' gradients: dW = g'a - g'b with g = (fa - fb) / N
    fa, fb = net.blobs["fa"].data, net.blobs["fb"].data
    a, b = net.blobs["a"].data, net.blobs["b"].data
    g = (fa - fb) / 2.0
    expected = g.T @ a - g.T @ b
    np.testing.assert_allclose(wa.diff, expected, rtol=1e-4, atol=1e-5)


def test_sharing_shape_mismatch_is_an_error() -> None:
    text = """
      layer { name: "d" type: "Input" top: "a" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "ip_a" type: "InnerProduct" bottom: "a" top: "fa" param { name: "w" }
              inner_product_param { num_output: 2 bias_term: false } }
      layer { name: "ip_b" type: "InnerProduct" bottom: "a" top: "fb" param { name: "w" }
              inner_product_param { num_output: 4 bias_term: false } }
    """
    with pytest.raises(CctError, match="Cannot share param 'w'.*shape mismatch"):
        make(text)


def test_multiple_sources_error() -> None:
    with pytest.raises(CctError, match="Top blob 'x' produced by multiple sources"):
        make("""
          layer { name: "d" type: "Input" top: "x" input_param { shape { dim: 2 } } }
          layer { name: "e" type: "AbsVal" bottom: "x" top: "y" }
          layer { name: "f" type: "AbsVal" bottom: "y" top: "x" }
        """)


def test_unknown_type_lists_known_types() -> None:
    with pytest.raises(CctError, match=r"layer 'b' \(Bogus\): type: Unknown layer type: Bogus \(known types: .*ReLU"):
        make('layer { name: "b" type: "Bogus" }')


def test_errors_name_file_and_line(tmp_path) -> None:
    path = tmp_path / "bad.prototxt"
    path.write_text('name: "n"\nlayer { name: "d" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
                    'layer {\n  name: "r"\n  type: "ReLU"\n  bottom: "nope"\n  top: "y"\n}\n')
    with pytest.raises(CctError) as e:
        cct.Net(str(path), cct.TEST)
    msg = str(e.value)
    assert msg.startswith(f"{path}:4: layer 'r' (ReLU):") and "Unknown bottom blob 'nope'" in msg
    assert "\n" not in msg


def test_phase_filtering_and_stages(tmp_path) -> None:
    path = tmp_path / "n.prototxt"
    path.write_text(MLP.replace('top: "accuracy"', 'top: "accuracy" include { phase: TEST stage: "eval" }'))
    assert "accuracy" not in cct.Net(str(path), cct.TEST).blobs
    assert "accuracy" in cct.Net(str(path), cct.TEST, stages=["eval"]).blobs
    assert "accuracy" not in cct.Net(str(path), cct.TRAIN, stages=["eval"]).blobs


def test_reshape_propagates_new_batch() -> None:
    net = make(MLP, cct.TEST)
    net.blobs["data"].reshape(7, 3)
    net.blobs["label"].reshape(7)
    net.reshape()
    assert net.blobs["ip2"].shape == (7, 3)
    feed(net)
    out = net.forward()
    assert set(out) == {"accuracy", "loss"}


def test_to_proto_records_layers_and_blobs() -> None:
    net = make(MLP)
    p = net.to_proto()
    assert [layer.name for layer in p.layer] == net._layer_names
    loss = [layer for layer in p.layer if layer.name == "loss"][0]
    assert list(loss.loss_weight) == [1.0]  # added at setup, as Caffe records it
    ip1 = [layer for layer in p.layer if layer.name == "ip1"][0]
    assert list(ip1.blobs[0].shape.dim) == [5, 3] and ip1.phase == cct.TRAIN


def test_update_subtracts_diff_from_owners() -> None:
    net = make(MLP)
    w = net.params["ip1"][0]
    before = w.data.copy()
    w.diff[...] = 0.25
    net.update()
    np.testing.assert_allclose(w.data, before - 0.25)


def test_reshape_errors_name_the_layer(tmp_path) -> None:
    model = tmp_path / "net.prototxt"
    model.write_text('layer { name: "d" type: "Input" top: "x" '
                     'input_param { shape { dim: 1 dim: 2 dim: 8 dim: 8 } } }\n'
                     'layer { name: "conv" type: "Convolution" bottom: "x" top: "y" '
                     'convolution_param { num_output: 3 kernel_size: 5 } }\n')
    net = cct.Net(str(model), cct.TEST)
    net.blobs["x"].reshape(1, 2, 3, 3)
    with pytest.raises(CctError, match=r"^layer 'conv' \(Convolution\): convolution_param.kernel_size: kernel larger"):
        net.reshape()
