"""net_spec: Python-built nets → NetParameter (routing of kwargs, names, order) → a buildable Net."""
from __future__ import annotations

import importlib

import pytest

import cct
from cct import net_spec
from cct.io.prototxt import parse_net_param
from cct.net_spec import NetSpec, to_proto
from cct.net_spec import layers as L
from cct.net_spec import params as P
from cct.proto import caffe_pb2


def lenet(batch_size: int) -> caffe_pb2.NetParameter:
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[batch_size, 1, 28, 28]))
    n.label = L.Input(shape=dict(dim=[batch_size]))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    return n.to_proto()


def anon_lenet(batch_size: int) -> caffe_pb2.NetParameter:
    data = L.Input(shape=dict(dim=[batch_size, 1, 28, 28]))
    label = L.Input(shape=dict(dim=[batch_size]))
    conv1 = L.Convolution(data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    pool1 = L.Pooling(conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    conv2 = L.Convolution(pool1, kernel_size=5, num_output=50, weight_filler=dict(type="xavier"))
    pool2 = L.Pooling(conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    ip1 = L.InnerProduct(pool2, num_output=500, weight_filler=dict(type="xavier"))
    relu1 = L.ReLU(ip1, in_place=True)
    ip2 = L.InnerProduct(relu1, num_output=10, weight_filler=dict(type="xavier"))
    return L.SoftmaxWithLoss(ip2, label).to_proto()


def load_net(tmp_path, proto: caffe_pb2.NetParameter, phase=cct.TEST) -> cct.Net:
    path = tmp_path / "net.prototxt"
    path.write_text(str(proto))
    return cct.Net(str(path), phase)


def test_lenet_names_order_and_params():
    proto = lenet(50)
    assert [layer.name for layer in proto.layer] == [
        "data", "label", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]
    relu = proto.layer[7]
    assert relu.type == "ReLU" and list(relu.bottom) == list(relu.top) == ["ip1"]
    conv = proto.layer[2]
    assert list(conv.convolution_param.kernel_size) == [5]  # scalar → repeated field
    assert conv.convolution_param.num_output == 20
    assert conv.convolution_param.weight_filler.type == "xavier"
    assert proto.layer[3].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert list(proto.layer[0].input_param.shape[0].dim) == [50, 1, 28, 28]
    assert list(proto.layer[9].bottom) == ["ip2", "label"]


def test_lenet_builds(tmp_path):
    net = load_net(tmp_path, lenet(5))
    assert len(net.layers) == 10
    assert net.blobs["pool2"].data.shape == (5, 50, 4, 4)
    assert net.inputs == ["data", "label"]
    assert net.outputs == ["loss"]
    assert [k for k in net.params] == ["conv1", "conv2", "ip1", "ip2"]


def test_anonymous_names(tmp_path):
    proto = anon_lenet(5)
    assert [layer.name for layer in proto.layer] == [
        "Input1", "Convolution1", "Pooling1", "Convolution2", "Pooling2", "InnerProduct1", "ReLU1",
        "InnerProduct2", "Input2", "SoftmaxWithLoss1"]
    relu = proto.layer[6]
    assert list(relu.bottom) == list(relu.top) == ["InnerProduct1"]
    assert list(proto.layer[-1].top) == ["SoftmaxWithLoss1"]
    assert len(load_net(tmp_path, proto).layers) == 10


def test_kwarg_routing():
    data = L.Input(shape=[dict(dim=[2, 3]), dict(dim=[2])], ntop=2)
    assert isinstance(data, tuple) and len(data) == 2
    ip = L.InnerProduct(data[0], num_output=4, param=[dict(lr_mult=1), dict(lr_mult=2, decay_mult=0)],
                        bias_filler=dict(type="constant", value=0.5), loss_weight=0.5,
                        include=dict(phase=cct.TRAIN), propagate_down=[True])
    deconv = L.Deconvolution(ip, convolution_param=dict(num_output=2, kernel_size=[1, 1], bias_term=False))
    loss = L.SoftmaxWithLoss(deconv, data[1], loss_param=dict(ignore_label=-1), loss_weight=2)
    proto = to_proto(loss)
    ip_p, dec_p, loss_p = proto.layer[1], proto.layer[2], proto.layer[3]
    assert [p.lr_mult for p in ip_p.param] == [1, 2] and ip_p.param[1].decay_mult == 0
    assert ip_p.inner_product_param.bias_filler.value == 0.5
    assert list(ip_p.loss_weight) == [0.5] and list(ip_p.propagate_down) == [True]
    assert ip_p.include[0].phase == caffe_pb2.TRAIN
    assert list(dec_p.convolution_param.kernel_size) == [1, 1]
    assert dec_p.convolution_param.bias_term is False
    assert loss_p.loss_param.ignore_label == -1 and list(loss_p.loss_weight) == [2]
    assert list(proto.layer[0].top) == ["Input1", "Input2"]


def test_unknown_kwarg_is_an_attribute_error():
    data = L.Input(shape=dict(dim=[1]))
    with pytest.raises(AttributeError, match="num_output"):
        to_proto(L.Deconvolution(data, num_output=3))  # Deconvolution has no DeconvolutionParameter
    with pytest.raises(cct.errors.CctError):
        to_proto(L.ReLU(data, not_a_field=1))


def test_enum_by_name_and_params_module():
    assert P.Pooling.AVE == caffe_pb2.PoolingParameter.AVE
    assert P.Eltwise.SUM == caffe_pb2.EltwiseParameter.SUM
    assert P.Data.LMDB == caffe_pb2.DataParameter.LMDB
    data = L.Input(shape=dict(dim=[1, 1, 4, 4]))
    proto = to_proto(L.Pooling(data, pool="AVE", kernel_size=2))
    assert proto.layer[1].pooling_param.pool == caffe_pb2.PoolingParameter.AVE


def test_param_name_dict():
    names = net_spec.param_name_dict()
    assert names["Convolution"] == "convolution"
    assert names["InnerProduct"] == "inner_product"
    assert names["ReLU"] == "relu" and names["LRN"] == "lrn" and names["HDF5Data"] == "hdf5_data"
    assert "Deconvolution" not in names and "SoftmaxWithLoss" not in names


def test_zero_tops_and_type_error(tmp_path):
    n = NetSpec()
    n.data, n.data2 = L.Input(shape=[dict(dim=[3]), dict(dim=[3])], ntop=2)
    n.silence_data = L.Silence(n.data, ntop=0)
    n.silence_data2 = L.Silence(n.data2, ntop=0)
    assert isinstance(n.silence_data, net_spec.Function)
    proto = n.to_proto()
    assert [layer.name for layer in proto.layer] == ["data", "silence_data", "silence_data2"]
    assert len(proto.layer[1].top) == 0
    net = load_net(tmp_path, proto)
    assert net.forward() == {}
    pair = L.Input(shape=[dict(dim=[1]), dict(dim=[1])], ntop=2)
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence(pair, ntop=0)
    L.Silence(*pair, ntop=0)


def test_netspec_item_access_update_and_parse_back():
    n = NetSpec()
    n["data"] = L.Input(shape=dict(dim=[2, 3]))
    n.ip = L.InnerProduct(n["data"], num_output=5)
    assert n.keys() == ["data", "ip"] and n.vals()[1] is n.ip and "ip" in n
    n.update("ip", dict(num_output=7, bias_term=False))
    with pytest.raises(AttributeError):
        _ = n.missing
    proto = n.to_proto()
    assert proto.layer[1].inner_product_param.num_output == 7
    assert parse_net_param(str(proto)) == proto  # the text form parses back to the same message


def test_two_names_for_one_function_use_first_top(tmp_path):
    n = NetSpec()
    n.a, n.b = L.Input(shape=[dict(dim=[1, 2]), dict(dim=[1, 2])], ntop=2)
    n.s = L.Eltwise(n.a, n.b, operation=P.Eltwise.PROD)
    proto = n.to_proto()
    assert proto.layer[0].name == "a" and list(proto.layer[0].top) == ["a", "b"]
    net = load_net(tmp_path, proto)
    assert net.forward(a=[[1.0, 2.0]], b=[[3.0, 4.0]])["s"].tolist() == [[3.0, 8.0]]


def test_layer_package_serves_net_spec_types():
    """``caffe.layers`` is the ``cct.layers`` package: capitalised names are NetSpec layer types, and the
    package's own modules stay what they are."""
    import cct

    assert cct.layers is importlib.import_module("cct.layers")
    assert cct.layers.registry is importlib.import_module("cct.layers.registry")
    with pytest.raises(AttributeError):
        _ = cct.layers.nonexistent_module
    assert isinstance(cct.layers.Convolution(cct.layers.Input(shape=dict(dim=[1]))), net_spec.Top)
