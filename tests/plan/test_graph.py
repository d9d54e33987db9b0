"""The layer graph: shapes from Caffe's rules agree with a built Net, in-place layers fuse, branches stay a
DAG, nets without a shape rule are built, and mistakes are one-line errors."""
from __future__ import annotations

import os

import pytest

import cct
from cct.config import settings
from cct.errors import CctError
from cct.io.prototxt import parse_net_param, read_net_param
from cct.plan.graph import graph_from_net, layer_graph

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {m: os.path.join(REPO, "models", m, "deploy.prototxt")
          for m in ("alexnet", "vgg16", "inception_v3", "resnet50")}


@pytest.fixture
def no_autotune():
    """Building a net for its shapes needs no engine measurements (the fixture in conftest restores this)."""
    settings.set("autotune", False)


def structure(g):
    return ({name: (n.type, n.model.tops, n.model.bottoms, n.layers) for name, n in g.nodes.items()},
            [(e.src, e.dst, e.top, e.bottom) for e in g.edges])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_shape_rules_agree_with_a_built_net(model, no_autotune):
    param = read_net_param(MODELS[model])
    param.layer[0].input_param.shape[0].dim[0] = 2
    net = cct.Net(param, cct.TEST)
    ruled = layer_graph(param)
    built = graph_from_net(net)
    assert ruled.batch == built.batch == 2
    nodes, edges = structure(ruled)
    built_nodes, built_edges = structure(built)
    assert nodes == built_nodes
    # the built net reaches a branch through Split blobs: same producer, consumer and bottom index
    assert sorted(edges) == sorted(built_edges)
    for name, node in ruled.nodes.items():
        assert node.model.tops[0] == net.blobs[node.tops[0]].shape, name
        assert node.params() == sum(b.count for b in net.params.get(name, [])) + \
            sum(b.count for m in node.fused if m.lp.type == "Scale" for b in net.params[m.lp.name]), name


def test_alexnet_fuses_in_place_layers_into_their_producers():
    g = layer_graph(MODELS["alexnet"])
    assert list(g.nodes) == ["data", "conv1", "norm1", "pool1", "conv2", "norm2", "pool2", "conv3", "conv4",
                             "conv5", "pool5", "fc6", "fc7", "fc8", "prob"]
    assert g.nodes["conv1"].layers == ["conv1", "relu1"] and g.nodes["fc6"].layers == ["fc6", "relu6", "drop6"]
    assert [(e.src, e.dst) for e in g.edges] == list(zip(list(g.nodes), list(g.nodes)[1:]))
    assert g.nodes["fc6"].model.bottoms == [(10, 256, 6, 6)] and g.nodes["fc6"].extent == (10, 4096, 1, 1)
    assert g.nodes["conv2"].params() == 256 * 48 * 25 + 256  # two groups
    assert g.nodes["fc6"].params() == 9216 * 4096 + 4096


def test_inception_v3_is_a_dag_of_modules():
    g = layer_graph(MODELS["inception_v3"], batch=32)
    assert len(g.nodes) == 122 and g.batch == 32
    convs = [n for n in g.nodes.values() if n.type == "Convolution"]
    assert len(convs) == 94
    assert all(n.layers[1:] == [f"{n.name}/bn", f"{n.name}/scale", f"{n.name}/relu"] for n in convs)
    fan_in = {name: sum(e.dst == name for e in g.edges) for name in g.nodes}
    fan_out = {name: sum(e.src == name for e in g.edges) for name in g.nodes}
    assert fan_in["mixed_5b/output"] == 4 and fan_in["mixed_6a/output"] == 3 and fan_in["mixed_7b/output"] == 6
    assert fan_out["mixed_7b/3x3_reduce"] == 2 and fan_out["mixed_6e/output"] == 3  # into mixed_7a's branches
    assert g.nodes["mixed_7c/output"].extent == (32, 2048, 8, 8)
    assert g.nodes["classifier"].extent == (32, 1000, 1, 1)
    # the built net holds 23,869,094 values in parameter blobs; BatchNorm's statistics (mean, variance: one each
    # per channel, and a scale factor) are not learned, so they are not synchronised
    statistics = sum(2 * n.extent[1] + 1 for n in convs)
    assert sum(n.params() for n in g.nodes.values()) == 23869094 - statistics


def test_a_net_without_shape_rules_is_built_for_its_shapes(no_autotune):
    text = """
    name: "reshaping"
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 2 dim: 6 dim: 6 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 3 kernel_size: 3 } }
    layer { name: "flat" type: "Reshape" bottom: "conv" top: "flat" reshape_param { shape { dim: 0 dim: -1 } } }
    layer { name: "ip" type: "InnerProduct" bottom: "flat" top: "ip" inner_product_param { num_output: 5 } }
    """
    g = layer_graph(parse_net_param(text))
    assert list(g.nodes) == ["data", "conv", "flat", "ip"]
    assert g.nodes["flat"].model.tops == [(4, 48)] and g.nodes["flat"].splits == "n"
    assert g.nodes["ip"].params() == 48 * 5 + 5


def test_a_training_net_has_a_label_edge_from_the_data_layer_to_the_loss(no_autotune):
    g = layer_graph(os.path.join(REPO, "models", "digits", "lenet_train_test.prototxt"), cct.TRAIN)
    data = next(n for n in g.nodes.values() if n.type == "Data")
    loss = next(n for n in g.nodes.values() if n.type == "SoftmaxWithLoss")
    assert {(e.src, e.dst, e.blob) for e in g.edges if e.dst == loss.name} >= {(data.name, loss.name, "label")}
    assert loss.extent[0] == data.extent[0] and loss.splits == "n"


def test_batch_override_and_errors(tmp_path):
    assert layer_graph(MODELS["alexnet"], batch=512).nodes["conv1"].extent == (512, 96, 55, 55)
    bad = tmp_path / "bad.prototxt"
    bad.write_text('layer { name: "ip" type: "InnerProduct" bottom: "nowhere" top: "ip" '
                   'inner_product_param { num_output: 2 } }')
    with pytest.raises(CctError, match=r"bad.prototxt: layer 'ip' \(InnerProduct\): unknown bottom blob 'nowhere'"):
        layer_graph(bad)
    volume = tmp_path / "volume.prototxt"
    volume.write_text('layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 1 dim: 1 dim: 4 dim: 4 '
                      'dim: 4 } } }\nlayer { name: "r" type: "ReLU" bottom: "d" top: "r" }')
    with pytest.raises(CctError, match=r"volume.prototxt: layer 'd' \(Input\): .* \(1, 1, 4, 4, 4\) has 5 axes"):
        layer_graph(volume)
    twice = tmp_path / "twice.prototxt"
    twice.write_text('layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 1 dim: 2 } } }\n'
                     'layer { name: "d" type: "ReLU" bottom: "d" top: "e" }')
    with pytest.raises(CctError, match="a second layer named 'd'"):
        layer_graph(twice)
    with pytest.raises(CctError, match="-batch 8: the net has no Input layer"):
        layer_graph(os.path.join(REPO, "models", "digits", "lenet_train_test.prototxt"), cct.TRAIN, batch=8)
