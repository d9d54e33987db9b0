"""cct.draw (pycaffe's caffe.draw) and ``cct draw``: the graph Caffe draws (labels, colours, edges, phases), DOT
text with no extra installed, pydot's graph equal to ours, images through Graphviz, and one line when
Graphviz is missing."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format

from cct import cli, draw
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb
from tests.solvers.helpers import captured_log, messages

NET = """name: "drawn"
layer { name: "data" type: "Data" top: "data" top: "label" data_param { source: "x" batch_size: 64 }
        include { phase: TRAIN } }
layer { name: "tdata" type: "Data" top: "data" top: "label" data_param { source: "y" batch_size: 100 }
        include { phase: TEST } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 20 kernel_size: 5 stride: 2 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip1" bottom: "label" top: "acc" exclude { phase: TRAIN } }
"""


@pytest.fixture
def net() -> pb.NetParameter:
    return text_format.Parse(NET, pb.NetParameter())


def test_the_graph_caffe_draws(net) -> None:
    g = draw.net_graph(net, "LR")
    labels = {key: name for key, (name, _) in g.nodes.items()}
    assert labels["conv1_Convolution"] == r'"conv1\n(Convolution)\nkernel size: 5\nstride: 2\npad: 1"'
    assert labels["pool1_Pooling"] == r'"pool1\n(Pooling AVE)\nkernel size: 2\nstride: 2\npad: 0"'
    styles = {key: attrs for key, (_, attrs) in g.nodes.items()}
    assert styles["conv1_Convolution"]["fillcolor"] == "#FF5050" and styles["pool1_Pooling"]["fillcolor"] == "#FF9900"
    assert styles["ip1_InnerProduct"]["fillcolor"] == "#CC33FF"
    assert styles["loss_SoftmaxWithLoss"]["fillcolor"] == "#6495ED"
    assert styles["relu1_ReLU"] == draw.NEURON_LAYER_STYLE  # in place
    assert styles["pool1_blob"] == draw.BLOB_STYLE and styles["loss_blob"] == {}  # read vs only written
    edges = {(s, d): label for s, d, label in g.edges}
    assert edges[("data_Data", "data_blob")] == "Batch 64" and edges[("conv1_Convolution", "conv1_blob")] == "20"
    assert edges[("ip1_InnerProduct", "ip1_blob")] == "10" and edges[("pool1_blob", "ip1_InnerProduct")] == '""'
    assert {"data_Data", "tdata_Data", "acc_Accuracy"} <= set(g.nodes)  # phase None: every layer


def test_phases_orientation_and_lr_mult(net) -> None:
    train = draw.net_graph(net, "LR", phase=pb.TRAIN)
    test = draw.net_graph(net, "LR", phase=pb.TEST)
    assert "data_Data" in train.nodes and "tdata_Data" not in train.nodes and "acc_Accuracy" not in train.nodes
    assert "tdata_Data" in test.nodes and "data_Data" not in test.nodes and "acc_Accuracy" in test.nodes
    tb = draw.get_layer_label(net.layer[2], "TB", display_lrm=True)
    assert tb == '"conv1 (Convolution) kernel size: 5 stride: 2 pad: 1 lr mult: 1.0, 2.0"'
    assert draw.get_layer_lr_mult(net.layer[5]) == (1.0, 1.0)
    with pytest.raises(ValueError):
        draw.get_layer_lr_mult(net.layer[3])
    assert not draw.net_graph(net, "LR", label_edges=False).edges[0][2].strip('"')


def test_dot_text_without_pydot_or_graphviz(net, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pydot", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    text = draw.draw_net(net, "LR", ext="dot").decode()
    assert text.startswith('digraph "drawn" {\nrankdir=LR;\n') and text.endswith("}\n")
    assert r'"conv1\n(Convolution)\nkernel size: 5\nstride: 2\npad: 1" [shape="record", fillcolor="#FF5050"' in text
    assert r'"data" -> "conv1\n(Convolution)' in text and '[label="Batch 64"]' in text
    draw.draw_net_to_file(net, str(tmp_path / "n.gv"))
    assert (tmp_path / "n.gv").read_text() == text
    with pytest.raises(CctError, match=r"drawing a \.png needs Graphviz's dot program"):
        draw.draw_net(net, "LR", ext="png")
    with pytest.raises(CctError, match=r"pip install 'cct\[draw\]'"):
        draw.get_pydot_graph(net, "LR")


def test_pydot_graph_equals_ours(net) -> None:
    pydot = pytest.importorskip("pydot")
    ours = pydot.graph_from_dot_data(draw.net_to_dot(net, "TB", display_lrm=True))[0]
    theirs = draw.get_pydot_graph(net, "TB", display_lrm=True)

    def content(g):
        nodes = {n.get_name().strip('"'): {k: v.strip('"') for k, v in n.get_attributes().items()}
                 for n in g.get_nodes() if n.get_name() not in ("node", "edge", "graph")}
        edges = sorted((e.get_source().strip('"'), e.get_destination().strip('"'), e.get("label").strip('"'))
                       for e in g.get_edges())
        return nodes, edges

    assert content(ours) == content(theirs)
    assert len(content(ours)[1]) == 18  # 2 per Data layer, conv1, relu1, pool1, ip1; 3 for loss and acc


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot program is not installed")
@pytest.mark.parametrize("ext, magic", [("png", b"\x89PNG"), ("svg", b"<?xml"), ("pdf", b"%PDF")])
def test_images_through_graphviz(net, tmp_path, ext, magic, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pydot", None)  # the dot program directly
    assert draw.draw_net(net, "LR", ext=ext).startswith(magic)


def test_cct_draw_command(tmp_path, capsys) -> None:
    model = Path(__file__).resolve().parents[1] / "models" / "caffenet" / "deploy.prototxt"
    out = tmp_path / "caffenet.dot"
    with captured_log() as buf:
        assert cli.main(["draw", str(model), str(out), "-rankdir", "TB", "-phase", "TEST"]) == 0
    assert "Drawing net to" in buf.getvalue()
    text = out.read_text()
    assert "rankdir=TB;" in text and '"conv1 (Convolution) kernel size: 11 stride: 4 pad: 0"' in text
    for args, message in ((["draw", str(model)], "draw needs a net and an output file"),
                          (["draw", str(model), str(tmp_path / "noext")], "has no extension"),
                          (["draw", str(model), str(out), "-rankdir", "XY"], "-rankdir XY"),
                          (["draw", str(model), str(out), "-phase", "VAL"], "-phase VAL: must be TRAIN, TEST or ALL"),
                          (["draw", str(tmp_path / "none.prototxt"), str(out)], "none.prototxt")):
        with captured_log() as buf:
            assert cli.main(args) == 1
        fatal = messages(buf.getvalue(), "F")
        assert len(fatal) == 1 and message in fatal[0], (args, buf.getvalue())


def test_draw_net_tool(tmp_path, capsys) -> None:
    import importlib.util

    tool = Path(__file__).resolve().parents[1] / "tools" / "draw_net.py"
    spec = importlib.util.spec_from_file_location("cct_tools_draw_net", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = Path(__file__).resolve().parents[1] / "models" / "googlenet" / "deploy.prototxt"
    out = tmp_path / "g.raw"
    assert module.main([str(model), str(out), "--phase", "TEST"]) == 0
    text = out.read_text()
    assert '"inception_3a/output\\n(Concat)"' in text
    assert sum("(Convolution)" in ln and "->" not in ln for ln in text.splitlines()) == 57  # node lines
    assert module.main([str(tmp_path / "absent.prototxt"), str(out)]) == 1
    assert "absent.prototxt" in capsys.readouterr().err
