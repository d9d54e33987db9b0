"""Tests for the Caffe protobuf schema (proto/caffe.proto, cct/proto/caffe_pb2.py)."""

import ast
import os

import pytest
from google.protobuf import descriptor_pb2, text_format

from cct.proto import caffe_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO_FILE = os.path.join(PROTO_DIR, "caffe.proto")

FD = descriptor_pb2.FieldDescriptorProto


def _field(message, name):
    return message.DESCRIPTOR.fields_by_name[name]


def _file_proto(serialized):
    fdp = descriptor_pb2.FileDescriptorProto()
    fdp.ParseFromString(serialized)
    return fdp


# --------------------------------------------------------------------------
# (a) the checked-in module matches the .proto


def _serialized_from_source(path):
    """The FileDescriptorProto bytes protoc embedded in a generated _pb2 file.

    Read straight from the ``AddSerializedFile(b'...')`` literal, so the check
    does not depend on how the protobuf runtime re-serializes descriptors and
    never registers a second copy of caffe.proto in the default pool.
    """
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, bytes)
        ):
            found.append(node.args[0].value)
    assert len(found) == 1, "expected one AddSerializedFile(b'...') in " + path
    return found[0]


CHECKED_IN = os.path.join(ROOT, "cct", "proto", "caffe_pb2.py")


def test_generated_module_in_sync(tmp_path):
    protoc = pytest.importorskip(
        "grpc_tools.protoc",
        reason="grpc_tools not installed: cannot regenerate caffe_pb2 to compare",
    )
    status = protoc.main(
        [
            "grpc_tools.protoc",
            "-I" + PROTO_DIR,
            "--python_out=" + str(tmp_path),
            PROTO_FILE,
        ]
    )
    assert status == 0, "protoc failed on proto/caffe.proto"
    fresh_pb = _serialized_from_source(str(tmp_path / "caffe_pb2.py"))
    checked_in_pb = _serialized_from_source(CHECKED_IN)

    if fresh_pb != checked_in_pb:
        a = _file_proto(checked_in_pb)
        b = _file_proto(fresh_pb)
        drift = sorted({m.name for m in a.message_type} ^ {m.name for m in b.message_type}) or sorted(
            m.name for m in a.message_type for n in b.message_type if m.name == n.name and m != n
        )
        pytest.fail(
            "cct/proto/caffe_pb2.py is stale; run `python tools/gen_proto.py`"
            f" (messages that differ: {drift})"
        )

    # The imported module carries the same schema (compared semantically,
    # since the runtime may re-render default strings such as 1e-08).
    loaded = _file_proto(caffe_pb2.DESCRIPTOR.serialized_pb)
    declared = _file_proto(checked_in_pb)
    assert [m.name for m in loaded.message_type] == [m.name for m in declared.message_type]
    for lm, dm in zip(loaded.message_type, declared.message_type):
        assert [(f.name, f.number, f.label, f.type) for f in lm.field] == [
            (f.name, f.number, f.label, f.type) for f in dm.field
        ], lm.name


def test_descriptor_basics():
    fdp = _file_proto(caffe_pb2.DESCRIPTOR.serialized_pb)
    assert fdp.package == "caffe"
    assert fdp.syntax in ("", "proto2")
    assert caffe_pb2.DESCRIPTOR.name == "caffe.proto"


# --------------------------------------------------------------------------
# (b) binary-critical field numbers, labels, packing and defaults


@pytest.mark.parametrize(
    "message, name, number",
    [
        (caffe_pb2.LayerParameter, "convolution_param", 106),
        (caffe_pb2.LayerParameter, "inner_product_param", 117),
        (caffe_pb2.LayerParameter, "pooling_param", 121),
        (caffe_pb2.LayerParameter, "batch_norm_param", 139),
        (caffe_pb2.LayerParameter, "scale_param", 142),
        (caffe_pb2.LayerParameter, "input_param", 143),
        (caffe_pb2.LayerParameter, "recurrent_param", 146),
        (caffe_pb2.LayerParameter, "swish_param", 147),
        (caffe_pb2.LayerParameter, "clip_param", 148),
        (caffe_pb2.LayerParameter, "transform_param", 100),
        (caffe_pb2.LayerParameter, "loss_param", 101),
        (caffe_pb2.LayerParameter, "blobs", 7),
        (caffe_pb2.LayerParameter, "phase", 10),
        (caffe_pb2.LayerParameter, "propagate_down", 11),
        (caffe_pb2.NetParameter, "layer", 100),
        (caffe_pb2.NetParameter, "layers", 2),
        (caffe_pb2.NetParameter, "input_shape", 8),
        (caffe_pb2.BlobProto, "shape", 7),
        (caffe_pb2.BlobProto, "data", 5),
        (caffe_pb2.BlobProto, "diff", 6),
        (caffe_pb2.BlobProto, "double_data", 8),
        (caffe_pb2.BlobProto, "double_diff", 9),
        (caffe_pb2.Datum, "float_data", 6),
        (caffe_pb2.Datum, "encoded", 7),
        (caffe_pb2.SolverParameter, "layer_wise_reduce", 41),
        (caffe_pb2.SolverParameter, "weights", 42),
        (caffe_pb2.SolverParameter, "type", 40),
        (caffe_pb2.PoolingParameter, "round_mode", 13),
        (caffe_pb2.ConvolutionParameter, "dilation", 18),
        (caffe_pb2.V1LayerParameter, "bottom", 2),
        (caffe_pb2.V1LayerParameter, "top", 3),
        (caffe_pb2.V1LayerParameter, "name", 4),
        (caffe_pb2.V1LayerParameter, "type", 5),
        (caffe_pb2.V1LayerParameter, "blobs", 6),
        (caffe_pb2.V1LayerParameter, "blobs_lr", 7),
        (caffe_pb2.V1LayerParameter, "weight_decay", 8),
        (caffe_pb2.V1LayerParameter, "include", 32),
        (caffe_pb2.V1LayerParameter, "exclude", 33),
        (caffe_pb2.V1LayerParameter, "loss_weight", 35),
        (caffe_pb2.V1LayerParameter, "param", 1001),
        (caffe_pb2.V1LayerParameter, "blob_share_mode", 1002),
        (caffe_pb2.V1LayerParameter, "convolution_param", 10),
        (caffe_pb2.V1LayerParameter, "layer", 1),
        (caffe_pb2.V0LayerParameter, "hdf5_output_param", 1001),
    ],
)
def test_field_numbers(message, name, number):
    assert _field(message, name).number == number


# The schema exactly as protoc compiled it (not as the runtime re-renders it).
_FILE_PROTO = _file_proto(_serialized_from_source(CHECKED_IN))


def _decl(message, name):
    """The FieldDescriptorProto as declared in caffe.proto (label, options...)."""
    path = message.DESCRIPTOR.full_name.split(".")[1:]  # drop package
    msgs = _FILE_PROTO.message_type
    for part in path:
        (msg,) = [m for m in msgs if m.name == part]
        msgs = msg.nested_type
    (field,) = [f for f in msg.field if f.name == name]
    return field


def _is_packed(message, name):
    declared = _decl(message, name)
    runtime = _field(message, name).is_packed
    assert declared.options.packed == runtime
    return declared.label == FD.LABEL_REPEATED and declared.options.packed


def test_packing():
    for name in ("data", "diff", "double_data", "double_diff"):
        assert _is_packed(caffe_pb2.BlobProto, name), name
    assert _is_packed(caffe_pb2.BlobShape, "dim")
    # proto2 repeated scalars without [packed = true] stay unpacked on the wire.
    assert not _is_packed(caffe_pb2.Datum, "float_data")
    assert not _decl(caffe_pb2.Datum, "float_data").HasField("options")
    assert not _is_packed(caffe_pb2.TransformationParameter, "mean_value")
    assert not _is_packed(caffe_pb2.LayerParameter, "loss_weight")
    assert not _is_packed(caffe_pb2.NetParameter, "input_dim")
    # Exactly the five upstream [packed = true] fields, nothing else.
    packed = []

    def walk(msgs, prefix):
        for m in msgs:
            for f in m.field:
                if f.options.packed:
                    packed.append(prefix + m.name + "." + f.name)
            walk(m.nested_type, prefix + m.name + ".")

    walk(_FILE_PROTO.message_type, "")
    assert sorted(packed) == [
        "BlobProto.data",
        "BlobProto.diff",
        "BlobProto.double_data",
        "BlobProto.double_diff",
        "BlobShape.dim",
    ]


def test_packed_wire_bytes():
    blob = caffe_pb2.BlobProto(data=[1.0, 2.0])
    # field 5, wire type 2 (length-delimited) => tag 0x2a, then 8 bytes
    assert blob.SerializeToString() == b"\x2a\x08" + b"\x00\x00\x80\x3f\x00\x00\x00\x40"
    datum = caffe_pb2.Datum(float_data=[1.0, 2.0])
    # field 6, wire type 5 (fixed32) per element, unpacked => tag 0x35 each
    assert datum.SerializeToString() == b"\x35\x00\x00\x80\x3f\x35\x00\x00\x00\x40"


def test_labels():
    assert _decl(caffe_pb2.ClipParameter, "min").label == FD.LABEL_REQUIRED
    assert _decl(caffe_pb2.ClipParameter, "max").label == FD.LABEL_REQUIRED
    assert _field(caffe_pb2.ClipParameter, "max").is_required
    assert _decl(caffe_pb2.SolverParameter, "weights").label == FD.LABEL_REPEATED
    assert _decl(caffe_pb2.ConvolutionParameter, "kernel_size").label == FD.LABEL_REPEATED
    assert _decl(caffe_pb2.PoolingParameter, "kernel_size").label == FD.LABEL_OPTIONAL
    assert _decl(caffe_pb2.V1LayerParameter, "blob_share_mode").label == FD.LABEL_REPEATED
    # Only ClipParameter's bounds are required upstream.
    required = [
        m.name + "." + f.name
        for m in _FILE_PROTO.message_type
        for f in m.field
        if f.label == FD.LABEL_REQUIRED
    ]
    assert sorted(required) == ["ClipParameter.max", "ClipParameter.min"]


def test_declared_default_strings():
    # The textual defaults protoc records, as Caffe's C++ would see them.
    assert _decl(caffe_pb2.SolverParameter, "delta").default_value == "1e-08"
    assert _decl(caffe_pb2.SolverParameter, "random_seed").default_value == "-1"
    assert _decl(caffe_pb2.SolverParameter, "snapshot_format").default_value == "BINARYPROTO"
    assert _decl(caffe_pb2.PoolingParameter, "round_mode").default_value == "CEIL"
    assert _decl(caffe_pb2.NetState, "phase").default_value == "TEST"
    assert not _decl(caffe_pb2.NetStateRule, "phase").HasField("default_value")


def test_types():
    assert _field(caffe_pb2.BlobShape, "dim").type == FD.TYPE_INT64
    assert _field(caffe_pb2.BlobProto, "num").type == FD.TYPE_INT32
    assert _field(caffe_pb2.SolverParameter, "random_seed").type == FD.TYPE_INT64
    assert _field(caffe_pb2.SolverParameter, "max_iter").type == FD.TYPE_INT32
    assert _field(caffe_pb2.ConvolutionParameter, "pad").type == FD.TYPE_UINT32


def test_solver_defaults():
    s = caffe_pb2.SolverParameter()
    assert s.average_loss == 1
    assert s.iter_size == 1
    assert s.snapshot_format == caffe_pb2.SolverParameter.BINARYPROTO
    assert s.solver_mode == caffe_pb2.SolverParameter.GPU
    assert s.random_seed == -1
    assert s.type == "SGD"
    assert s.delta == pytest.approx(1e-8)
    assert s.momentum2 == pytest.approx(0.999)
    assert s.rms_decay == pytest.approx(0.99)
    assert s.regularization_type == "L2"
    assert s.clip_gradients == -1
    assert s.test_initialization is True
    assert s.snapshot_after_train is True
    assert s.layer_wise_reduce is True
    assert s.solver_type == caffe_pb2.SolverParameter.SGD


def test_layer_defaults():
    assert caffe_pb2.PoolingParameter().round_mode == caffe_pb2.PoolingParameter.CEIL
    assert caffe_pb2.PoolingParameter().stride == 1
    assert caffe_pb2.ConvolutionParameter().bias_term is True
    assert caffe_pb2.ConvolutionParameter().group == 1
    assert caffe_pb2.ConvolutionParameter().axis == 1
    assert caffe_pb2.InnerProductParameter().bias_term is True
    assert caffe_pb2.DataParameter().backend == caffe_pb2.DataParameter.LEVELDB
    assert caffe_pb2.DataParameter().prefetch == 4
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    assert caffe_pb2.FillerParameter().type == "constant"
    assert caffe_pb2.FillerParameter().std == 1
    assert caffe_pb2.FillerParameter().sparse == -1
    assert caffe_pb2.BatchNormParameter().moving_average_fraction == pytest.approx(0.999)
    assert caffe_pb2.BatchNormParameter().eps == pytest.approx(1e-5)
    assert caffe_pb2.LRNParameter().local_size == 5
    assert caffe_pb2.LRNParameter().beta == pytest.approx(0.75)
    assert caffe_pb2.ParamSpec().lr_mult == 1
    assert caffe_pb2.ParamSpec().decay_mult == 1
    assert caffe_pb2.EltwiseParameter().operation == caffe_pb2.EltwiseParameter.SUM
    assert caffe_pb2.ReshapeParameter().num_axes == -1
    assert caffe_pb2.FlattenParameter().end_axis == -1
    assert caffe_pb2.CropParameter().axis == 2
    assert caffe_pb2.MVNParameter().eps == pytest.approx(1e-9)
    assert caffe_pb2.SwishParameter().beta == 1
    assert caffe_pb2.ExpParameter().base == -1
    assert caffe_pb2.ReductionParameter().operation == caffe_pb2.ReductionParameter.SUM
    assert caffe_pb2.HingeLossParameter().norm == caffe_pb2.HingeLossParameter.L1
    assert caffe_pb2.WindowDataParameter().crop_mode == "warp"
    assert caffe_pb2.V0LayerParameter().biasterm is True


def test_enum_values():
    assert caffe_pb2.TRAIN == 0 and caffe_pb2.TEST == 1
    V1 = caffe_pb2.V1LayerParameter
    assert V1.CONVOLUTION == 4
    assert V1.DECONVOLUTION == 39
    assert V1.ABSVAL == 35
    assert V1.SOFTMAX_LOSS == 21
    assert V1.THRESHOLD == 31
    assert caffe_pb2.PoolingParameter.FLOOR == 1
    assert caffe_pb2.ReductionParameter.MEAN == 4
    assert caffe_pb2.FillerParameter.AVERAGE == 2


# --------------------------------------------------------------------------
# (c) text-format parsing of V2 and V1 nets


V2_NET = """
name: "tiny"
layer {
  name: "data"
  type: "Input"
  top: "data"
  input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } }
}
layer {
  name: "conv1"
  type: "Convolution"
  bottom: "data"
  top: "conv1"
  param { lr_mult: 1 decay_mult: 1 }
  param { lr_mult: 2 decay_mult: 0 }
  convolution_param {
    num_output: 4
    kernel_size: 3
    pad: 1
    stride: 1
    weight_filler { type: "xavier" }
    bias_filler { type: "constant" value: 0.1 }
  }
}
layer {
  name: "relu1"
  type: "ReLU"
  bottom: "conv1"
  top: "conv1"
}
layer {
  name: "pool1"
  type: "Pooling"
  bottom: "conv1"
  top: "pool1"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 round_mode: FLOOR }
}
layer {
  name: "loss"
  type: "SoftmaxWithLoss"
  bottom: "pool1"
  bottom: "label"
  top: "loss"
  include { phase: TRAIN }
  loss_param { ignore_label: 255 normalization: BATCH_SIZE }
}
"""


V1_NET = """
name: "legacy"
input: "data"
input_dim: 1
input_dim: 1
input_dim: 28
input_dim: 28
layers {
  name: "conv1"
  type: CONVOLUTION
  bottom: "data"
  top: "conv1"
  blobs_lr: 1
  blobs_lr: 2
  weight_decay: 1
  weight_decay: 0
  convolution_param {
    num_output: 20
    kernel_size: 5
    stride: 1
    weight_filler { type: "gaussian" std: 0.01 }
  }
}
layers {
  name: "relu1"
  type: RELU
  bottom: "conv1"
  top: "conv1"
}
layers {
  name: "pool1"
  type: POOLING
  bottom: "conv1"
  top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
  exclude { phase: TRAIN }
}
"""


def test_parse_v2_net():
    net = text_format.Parse(V2_NET, caffe_pb2.NetParameter())
    assert net.name == "tiny"
    assert [l.name for l in net.layer] == ["data", "conv1", "relu1", "pool1", "loss"]
    assert list(net.layer[0].input_param.shape[0].dim) == [1, 3, 8, 8]
    conv = net.layer[1]
    assert conv.type == "Convolution"
    assert list(conv.convolution_param.kernel_size) == [3]
    assert list(conv.convolution_param.pad) == [1]
    assert conv.convolution_param.num_output == 4
    assert conv.convolution_param.bias_term is True  # default
    assert conv.convolution_param.bias_filler.value == pytest.approx(0.1)
    assert [p.lr_mult for p in conv.param] == [1, 2]
    assert net.layer[3].pooling_param.pool == caffe_pb2.PoolingParameter.AVE
    assert net.layer[3].pooling_param.round_mode == caffe_pb2.PoolingParameter.FLOOR
    loss = net.layer[4]
    assert loss.include[0].phase == caffe_pb2.TRAIN
    assert loss.loss_param.normalization == caffe_pb2.LossParameter.BATCH_SIZE
    assert not net.layers

    # binary round-trip
    again = caffe_pb2.NetParameter.FromString(net.SerializeToString())
    assert again == net
    # text round-trip
    assert text_format.Parse(text_format.MessageToString(net), caffe_pb2.NetParameter()) == net


def test_parse_v1_net():
    net = text_format.Parse(V1_NET, caffe_pb2.NetParameter())
    assert net.name == "legacy"
    assert list(net.input) == ["data"]
    assert list(net.input_dim) == [1, 1, 28, 28]
    assert not net.layer
    assert len(net.layers) == 3
    conv = net.layers[0]
    assert conv.type == caffe_pb2.V1LayerParameter.CONVOLUTION
    assert list(conv.blobs_lr) == [1, 2]
    assert list(conv.weight_decay) == [1, 0]
    assert list(conv.convolution_param.kernel_size) == [5]
    assert conv.convolution_param.weight_filler.std == pytest.approx(0.01)
    assert net.layers[1].type == caffe_pb2.V1LayerParameter.RELU
    pool = net.layers[2]
    assert pool.type == caffe_pb2.V1LayerParameter.POOLING
    assert pool.exclude[0].phase == caffe_pb2.TRAIN

    again = caffe_pb2.NetParameter.FromString(net.SerializeToString())
    assert again == net


def test_parse_solver_text():
    solver = text_format.Parse(
        'net: "train_val.prototxt" base_lr: 0.01 lr_policy: "step" stepsize: 100 '
        'solver_mode: CPU weights: "a.caffemodel" weights: "b.caffemodel" '
        'snapshot_format: HDF5 type: "Adam"',
        caffe_pb2.SolverParameter(),
    )
    assert solver.solver_mode == caffe_pb2.SolverParameter.CPU
    assert list(solver.weights) == ["a.caffemodel", "b.caffemodel"]
    assert solver.snapshot_format == caffe_pb2.SolverParameter.HDF5
    assert solver.type == "Adam"
    assert solver.momentum2 == pytest.approx(0.999)
