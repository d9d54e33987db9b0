"""Upgrades of deprecated nets and solvers (cct.io.upgrade), as Caffe's upgrade_proto."""
from __future__ import annotations

import logging

import pytest
from google.protobuf import text_format

from cct.errors import CctError
from cct.io import upgrade as up
from cct.proto import caffe_pb2


def net(text: str) -> caffe_pb2.NetParameter:
    return text_format.Parse(text, caffe_pb2.NetParameter())


def solver(text: str) -> caffe_pb2.SolverParameter:
    return text_format.Parse(text, caffe_pb2.SolverParameter())


@pytest.fixture
def logs():
    """Messages logged by cct (its logger does not propagate, so attach a handler directly)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    lg = logging.getLogger("cct")
    old_level = lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    yield records
    lg.removeHandler(handler)
    lg.setLevel(old_level)


def messages(records, level=None):
    return [r.getMessage() for r in records if level is None or r.levelno == level]


# ------------------------------------------------------------------------------------------------
# V0 -> V1 -> V2
# ------------------------------------------------------------------------------------------------

V0_NET = """
name: "v0net"
input: "data"
input_dim: 2 input_dim: 3 input_dim: 16 input_dim: 16
force_backward: true
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 8 kernelsize: 5 stride: 2 group: 2 biasterm: false
                 weight_filler { type: "gaussian" std: 0.01 } bias_filler { type: "constant" value: 1 }
                 blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 }
         bottom: "pad1" top: "conv1" }
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "pad2" type: "padding" pad: 1 } bottom: "conv1" top: "pad2" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 3 stride: 2 } bottom: "pad2" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.5 beta: 0.25 k: 2 }
         bottom: "pool1" top: "norm1" }
layers { layer { name: "drop1" type: "dropout" dropout_ratio: 0.3 } bottom: "norm1" top: "norm1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 10 biasterm: true
                 weight_filler { type: "xavier" } } bottom: "norm1" top: "fc" }
layers { layer { name: "prob" type: "softmax" } bottom: "fc" top: "prob" }
"""

V0_NET_UPGRADED = """
name: "v0net"
force_backward: true
layer { name: "input" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 3 dim: 16 dim: 16 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 8 bias_term: false pad: 2 kernel_size: 5 group: 2 stride: 2
                            weight_filler { type: "gaussian" std: 0.01 }
                            bias_filler { type: "constant" value: 1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.25 k: 2 } }
layer { name: "drop1" type: "Dropout" bottom: "norm1" top: "norm1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "fc" type: "InnerProduct" bottom: "norm1" top: "fc"
        inner_product_param { num_output: 10 bias_term: true weight_filler { type: "xavier" } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def test_v0_net_with_padding_layers_upgrades_to_current(logs):
    n = net(V0_NET)
    assert up.net_needs_v0_to_v1_upgrade(n)
    assert up.upgrade_net_as_needed(n, "v0.prototxt")
    assert n == net(V0_NET_UPGRADED)
    info = messages(logs, logging.INFO)
    assert info[0] == ("Attempting to upgrade input file specified using deprecated V0LayerParameter: "
                       "v0.prototxt")
    assert info[1] == "Successfully upgraded file specified using deprecated V0LayerParameter"
    assert "Attempting to upgrade input file specified using deprecated V1LayerParameter: v0.prototxt" in info
    assert "Successfully upgraded file specified using deprecated V1LayerParameter" in info
    assert "Attempting to upgrade input file specified using deprecated input fields: v0.prototxt" in info
    assert any("will not support V0NetParameter" in m for m in messages(logs, logging.WARNING))


def test_v0_padding_folding_alone():
    n = net(V0_NET)
    up.upgrade_v0_padding_layers(n)
    assert [l.layer.name for l in n.layers] == ["conv1", "relu1", "pool1", "norm1", "drop1", "fc", "prob"]
    assert list(n.layers[0].bottom) == ["data"] and n.layers[0].layer.pad == 2
    assert list(n.layers[2].bottom) == ["conv1"] and n.layers[2].layer.pad == 1


def test_v0_data_layers_and_transform_fields():
    n = net("""
      layers { layer { name: "d" type: "data" source: "db" batchsize: 32 rand_skip: 5 scale: 0.5
                       meanfile: "mean.binaryproto" cropsize: 7 mirror: true } top: "data" top: "label" }
      layers { layer { name: "i" type: "images" source: "list.txt" batchsize: 4 shuffle_images: true
                       new_height: 10 new_width: 12 rand_skip: 1 } top: "img" top: "lab" }
      layers { layer { name: "w" type: "window_data" source: "win.txt" batchsize: 8 det_fg_threshold: 0.6
                       det_bg_threshold: 0.4 det_fg_fraction: 0.3 det_context_pad: 16
                       det_crop_mode: "square" }
               top: "win" top: "wl" }
      layers { layer { name: "h" type: "hdf5_data" source: "h5.txt" batchsize: 2 } top: "hd" }
      layers { layer { name: "c" type: "concat" concat_dim: 0 } bottom: "data" bottom: "img" top: "cat" }
      layers { layer { name: "ig" type: "infogain_loss" source: "H.binaryproto" }
               bottom: "cat" bottom: "label" }
      layers { layer { name: "o" type: "hdf5_output" hdf5_output_param { file_name: "out.h5" } }
               bottom: "cat" bottom: "label" }
    """)
    assert up.upgrade_v0_net(n)
    assert up.upgrade_v1_net(n)
    d, i, w, h, c, ig, o = n.layer
    assert d.type == "Data" and d.data_param.source == "db" and d.data_param.batch_size == 32
    assert d.data_param.rand_skip == 5
    assert d.transform_param == text_format.Parse(
        'scale: 0.5 mean_file: "mean.binaryproto" crop_size: 7 mirror: true',
        caffe_pb2.TransformationParameter())
    assert i.type == "ImageData" and i.image_data_param.shuffle and i.image_data_param.new_height == 10
    assert i.image_data_param.new_width == 12 and i.image_data_param.rand_skip == 1
    assert w.type == "WindowData" and w.window_data_param.crop_mode == "square"
    assert w.window_data_param.context_pad == 16
    assert abs(w.window_data_param.fg_threshold - 0.6) < 1e-7
    assert abs(w.window_data_param.fg_fraction - 0.3) < 1e-7
    assert h.type == "HDF5Data" and h.hdf5_data_param.batch_size == 2
    assert c.type == "Concat" and c.concat_param.HasField("concat_dim") and c.concat_param.concat_dim == 0
    assert ig.type == "InfogainLoss" and ig.infogain_loss_param.source == "H.binaryproto"
    assert o.type == "HDF5Output" and o.hdf5_output_param.file_name == "out.h5"


def test_v0_field_on_wrong_type_is_logged_and_dropped(logs):
    n = net('layers { layer { name: "r" type: "relu" num_output: 3 shuffle_images: true } '
            'bottom: "x" top: "x" } input: "x"')
    assert not up.upgrade_v0_net(n)
    errors = messages(logs, logging.ERROR)
    assert "Unknown parameter num_output for layer type relu" in errors
    assert "Unknown parameter shuffle for layer type relu" in errors
    assert not n.layers[0].HasField("convolution_param")


def test_v0_unknown_type_names_the_layer():
    n = net('layers { layer { name: "mystery" type: "warp_drive" } top: "x" }')
    with pytest.raises(CctError, match=r"f\.prototxt: layer 'mystery': unknown V0 layer type 'warp_drive'"):
        up.upgrade_net_as_needed(n, "f.prototxt")


def test_v0_padding_into_non_conv_is_an_error():
    n = net('input: "x" layers { layer { name: "p" type: "padding" pad: 1 } bottom: "x" top: "p" }'
            'layers { layer { name: "r" type: "relu" } bottom: "p" top: "r" }')
    with pytest.raises(CctError, match="layer 'r'.*padding.*relu"):
        up.upgrade_v0_net(n, "f")


def test_v0_unknown_bottom_is_an_error():
    n = net('layers { layer { name: "r" type: "relu" } bottom: "nowhere" top: "r" }')
    with pytest.raises(CctError, match="layer 'r': unknown bottom blob 'nowhere'"):
        up.upgrade_v0_net(n, "f")


def test_v0_type_table_is_caffes():
    assert len(up.V0_TYPE_TO_V1) == 24
    for v1_name in up.V0_TYPE_TO_V1.values():
        caffe_pb2.V1LayerParameter.LayerType.Value(v1_name)  # every target exists


# ------------------------------------------------------------------------------------------------
# V1 -> V2
# ------------------------------------------------------------------------------------------------

def test_v1_type_table_covers_every_enum():
    names = set(caffe_pb2.V1LayerParameter.LayerType.keys())
    assert names == set(up.V1_TYPE_TO_STRING)


@pytest.mark.parametrize("enum_name, type_string", sorted(up.V1_TYPE_TO_STRING.items()))
def test_v1_layer_type_enum_to_string(enum_name, type_string):
    n = net(f'layers {{ name: "l" type: {enum_name} }}')
    up.upgrade_v1_net(n)
    assert n.layer[0].type == type_string


def test_v1_layer_type_strings_spot_check():
    expected = {"SOFTMAX_LOSS": "SoftmaxWithLoss", "TANH": "TanH", "IM2COL": "Im2col", "BNLL": "BNLL",
                "HDF5_DATA": "HDF5Data", "ABSVAL": "AbsVal", "MVN": "MVN", "NONE": ""}
    for k, v in expected.items():
        assert up.V1_TYPE_TO_STRING[k] == v


V1_NET = """
name: "v1net"
input: "data"
input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }
layers {
  name: "conv1" type: CONVOLUTION bottom: "data" top: "conv1"
  blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  param: "shared_w" param: "shared_b" blob_share_mode: PERMISSIVE
  convolution_param { num_output: 4 kernel_size: 3 }
  include { phase: TRAIN }
}
layers { name: "conv2" type: CONVOLUTION bottom: "conv1" top: "conv2" param: "shared_w"
         blobs_lr: 3 convolution_param { num_output: 4 kernel_size: 3 } exclude { stage: "deploy" } }
layers { name: "pool" type: POOLING bottom: "conv2" top: "pool" pooling_param { pool: MAX kernel_size: 2 } }
layers { name: "ip" type: INNER_PRODUCT bottom: "pool" top: "ip" weight_decay: 0 weight_decay: 0.5
         inner_product_param { num_output: 5 } }
layers { name: "elt" type: ELTWISE bottom: "ip" bottom: "ip" top: "elt" eltwise_param { operation: MAX } }
layers { name: "loss" type: SOFTMAX_LOSS bottom: "elt" bottom: "label" top: "loss" loss_weight: 2
         loss_param { ignore_label: 3 } }
layers { name: "acc" type: ACCURACY bottom: "elt" bottom: "label" top: "acc" accuracy_param { top_k: 2 } }
"""

V1_NET_UPGRADED = """
name: "v1net"
layer { name: "input" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer {
  name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { name: "shared_w" share_mode: PERMISSIVE lr_mult: 1 decay_mult: 1 }
  param { name: "shared_b" lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 4 kernel_size: 3 }
  include { phase: TRAIN }
}
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2" param { name: "shared_w" lr_mult: 3 }
        convolution_param { num_output: 4 kernel_size: 3 } exclude { stage: "deploy" } }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool" pooling_param { pool: MAX kernel_size: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        param { decay_mult: 0 } param { decay_mult: 0.5 } inner_product_param { num_output: 5 } }
layer { name: "elt" type: "Eltwise" bottom: "ip" bottom: "ip" top: "elt" eltwise_param { operation: MAX } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "elt" bottom: "label" top: "loss" loss_weight: 2
        loss_param { ignore_label: 3 } }
layer { name: "acc" type: "Accuracy" bottom: "elt" bottom: "label" top: "acc" accuracy_param { top_k: 2 } }
"""


def test_v1_net_upgrade(logs):
    n = net(V1_NET)
    assert up.net_needs_v1_to_v2_upgrade(n) and not up.net_needs_v0_to_v1_upgrade(n)
    assert up.upgrade_net_as_needed(n, "v1.prototxt")
    assert n == net(V1_NET_UPGRADED)
    assert messages(logs, logging.INFO)[:2] == [
        "Attempting to upgrade input file specified using deprecated V1LayerParameter: v1.prototxt",
        "Successfully upgraded file specified using deprecated V1LayerParameter"]


def test_v1_every_sub_param_is_copied():
    v1 = caffe_pb2.V1LayerParameter(name="all", type=caffe_pb2.V1LayerParameter.CONVOLUTION)
    subs = [f.name for f in v1.DESCRIPTOR.fields if f.name.endswith("_param")]
    assert len(subs) == 30
    for s in subs:
        getattr(v1, s).SetInParent()
    v1.convolution_param.num_output = 7
    v1.transform_param.scale = 0.25
    layer, ok = up.upgrade_v1_layer(v1)
    assert ok
    for s in subs:
        assert layer.HasField(s), s
    assert layer.convolution_param.num_output == 7 and layer.transform_param.scale == 0.25


def test_v1_blobs_are_copied():
    n = net('layers { name: "ip" type: INNER_PRODUCT blobs { num: 1 channels: 1 height: 2 width: 3 '
            'data: 1 data: 2 data: 3 data: 4 data: 5 data: 6 } blobs { shape { dim: 2 } data: 7 data: 8 } }')
    up.upgrade_v1_net(n)
    b = n.layer[0].blobs
    assert len(b) == 2 and list(b[0].data) == [1, 2, 3, 4, 5, 6] and b[0].width == 3
    assert list(b[1].shape.dim) == [2]


def test_v1_and_v2_layers_together_is_an_error():
    n = net('layer { name: "a" type: "ReLU" } layers { name: "b" type: RELU }')
    with pytest.raises(CctError, match=r"mixed\.prototxt: .*both 'layer'.*'layers'"):
        up.upgrade_net_as_needed(n, "mixed.prototxt")


# ------------------------------------------------------------------------------------------------
# Data transformation fields
# ------------------------------------------------------------------------------------------------

def test_data_transformation_upgrade(logs):
    n = net("""
      layers { name: "d" type: DATA top: "data" top: "label"
               data_param { source: "db" batch_size: 4 scale: 0.00390625 mean_file: "m.binaryproto"
                            crop_size: 5 mirror: true } }
      layers { name: "i" type: IMAGE_DATA top: "i" top: "il" image_data_param { source: "l" mirror: false } }
      layers { name: "w" type: WINDOW_DATA top: "w" top: "wl" window_data_param { source: "w" crop_size: 9 } }
      layers { name: "m" type: MEMORY_DATA top: "m" top: "ml" memory_data_param { batch_size: 1 } }
    """)
    assert up.net_needs_data_upgrade(n)
    up.upgrade_net_as_needed(n, "d.prototxt")
    assert not up.net_needs_data_upgrade(n)
    d, i, w, _ = n.layer
    assert d.data_param == text_format.Parse('source: "db" batch_size: 4', caffe_pb2.DataParameter())
    assert d.transform_param == text_format.Parse(
        'scale: 0.00390625 mean_file: "m.binaryproto" crop_size: 5 mirror: true',
        caffe_pb2.TransformationParameter())
    assert i.transform_param.HasField("mirror") and not i.transform_param.mirror
    assert not i.image_data_param.HasField("mirror")
    assert w.transform_param.crop_size == 9 and not w.window_data_param.HasField("crop_size")
    info = messages(logs, logging.INFO)
    assert info[0] == ("Attempting to upgrade input file specified using deprecated transformation "
                       "parameters: d.prototxt")
    assert info[1] == "Successfully upgraded file specified using deprecated data transformation parameters."


def test_data_upgrade_not_needed_without_legacy_fields():
    n = net('layers { name: "d" type: DATA data_param { source: "db" } transform_param { scale: 2 } }')
    assert not up.net_needs_data_upgrade(n)


# ------------------------------------------------------------------------------------------------
# Input fields
# ------------------------------------------------------------------------------------------------

def test_input_dim_upgrade_two_inputs_and_position_zero():
    n = net('input: "data" input: "label" input_dim: 10 input_dim: 3 input_dim: 4 input_dim: 5 '
            'input_dim: 10 input_dim: 1 input_dim: 1 input_dim: 1 '
            'layer { name: "relu" type: "ReLU" bottom: "data" top: "r" } '
            'layer { name: "sig" type: "Sigmoid" bottom: "r" top: "s" }')
    assert up.net_needs_input_upgrade(n)
    up.upgrade_net_input(n)
    assert [l.name for l in n.layer] == ["input", "relu", "sig"]
    inp = n.layer[0]
    assert inp.type == "Input" and list(inp.top) == ["data", "label"]
    assert [list(s.dim) for s in inp.input_param.shape] == [[10, 3, 4, 5], [10, 1, 1, 1]]
    assert not n.input and not n.input_dim and not n.input_shape


def test_input_shape_upgrade():
    n = net('input: "a" input_shape { dim: 2 dim: 7 } input: "b" input_shape { dim: 2 } '
            'layer { name: "x" type: "Concat" bottom: "a" bottom: "b" top: "c" }')
    up.upgrade_net_input(n)
    assert n.layer[0] == text_format.Parse(
        'name: "input" type: "Input" top: "a" top: "b" '
        'input_param { shape { dim: 2 dim: 7 } shape { dim: 2 } }',
        caffe_pb2.LayerParameter())
    assert n.layer[1].name == "x"


def test_input_without_shape_is_dropped():
    n = net('input: "data" layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" }')
    up.upgrade_net_input(n)
    assert [l.name for l in n.layer] == ["ip"] and not n.input


def test_input_with_too_few_dims_is_an_error():
    n = net('input: "a" input: "b" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4')
    with pytest.raises(CctError, match="f.prototxt: 2 inputs need 8 input_dim values"):
        up.upgrade_net_input(n, "f.prototxt")
    n = net('input: "a" input: "b" input_shape { dim: 1 }')
    with pytest.raises(CctError, match="2 inputs but only 1 input_shape"):
        up.upgrade_net_input(n, "f.prototxt")


# ------------------------------------------------------------------------------------------------
# BatchNorm
# ------------------------------------------------------------------------------------------------

def test_batchnorm_upgrade(logs):
    n = net('layer { name: "bn" type: "BatchNorm" param { name: "m" lr_mult: 1 } param { lr_mult: 0 } '
            'param { lr_mult: 0 decay_mult: 3 } } '
            'layer { name: "bn2" type: "BatchNorm" param { lr_mult: 1 } } '
            'layer { name: "sc" type: "Scale" param { lr_mult: 1 } param { lr_mult: 1 } '
            'param { lr_mult: 1 } }')
    assert up.net_needs_batchnorm_upgrade(n)
    up.upgrade_net_as_needed(n, "bn.prototxt")
    bn, bn2, sc = n.layer
    assert [(p.name, p.lr_mult, p.decay_mult) for p in bn.param] == [("m", 0, 0), ("", 0, 0), ("", 0, 0)]
    assert bn2.param[0].lr_mult == 1
    assert [p.lr_mult for p in sc.param] == [1, 1, 1]
    assert messages(logs, logging.INFO) == [
        "Attempting to upgrade batch norm layers using deprecated params: bn.prototxt",
        "Successfully upgraded batch norm layers using deprecated params."]


def test_current_net_needs_nothing(logs):
    n = net('name: "ok" layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 } } }')
    before = caffe_pb2.NetParameter()
    before.CopyFrom(n)
    assert not up.net_needs_upgrade(n)
    assert up.upgrade_net_as_needed(n, "ok.prototxt")
    assert n == before and not logs


# ------------------------------------------------------------------------------------------------
# Solver
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("enum_name, expected", sorted(up.SOLVER_TYPE_TO_STRING.items()))
def test_solver_type_upgrade(enum_name, expected):
    s = solver(f"base_lr: 0.01 solver_type: {enum_name}")
    assert up.solver_needs_type_upgrade(s)
    assert up.upgrade_solver_as_needed(s, "solver.prototxt")
    assert s.type == expected and not s.HasField("solver_type")
    assert not up.solver_needs_type_upgrade(s)


def test_solver_type_table_covers_every_enum():
    assert set(caffe_pb2.SolverParameter.SolverType.keys()) == set(up.SOLVER_TYPE_TO_STRING)


def test_solver_upgrade_logs(logs):
    s = solver("solver_type: NESTEROV")
    up.upgrade_solver_as_needed(s, "s.prototxt")
    assert messages(logs, logging.INFO) == [
        "Attempting to upgrade input file specified using deprecated 'solver_type' field (enum)': s.prototxt",
        "Successfully upgraded file specified using deprecated 'solver_type' field (enum) to 'type' field "
        "(string)."]


def test_solver_with_both_type_fields_is_an_error():
    s = solver('solver_type: ADAM type: "Adam"')
    with pytest.raises(CctError, match=r"s\.prototxt: .*solver_type.*type.*both"):
        up.upgrade_solver_as_needed(s, "s.prototxt")


def test_solver_without_legacy_type_is_untouched():
    s = solver('type: "AdaDelta"')
    assert not up.solver_needs_type_upgrade(s)
    assert up.upgrade_solver_as_needed(s) and s.type == "AdaDelta"
