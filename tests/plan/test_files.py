"""Cost-graph files and plan files: what they hold, and one-line errors naming the file and the entry."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cct.errors import CctError
from cct.io.prototxt import parse_net_param
from cct.plan.cost import CostModel
from cct.plan.files import plan_document, read_cost_graph, read_plan, search_document, write_json
from cct.plan.graph import layer_graph
from cct.plan.planner import plan_net
from cct.plan.search import search

GRAPH = {
    "nodes": {"in": {"a": 0.0}, "x": {"p": 3.0, "q": 1.0}, "y": {"p": 1.0, "q": 2.5}, "out": {"a": 0.5, "b": 0.25}},
    "edges": [{"from": "in", "to": "x", "xfer": {"a|p": 1.0}},
              {"from": "in", "to": "y"},
              {"from": "x", "to": "out", "xfer": {"q|a": 4.0, "q|b": 0.5}},
              {"from": "y", "to": "out", "xfer": {"p|b": 0.75}},
              {"from": "y", "to": "out", "xfer": {"p|b": 0.25}}],
}


def write(tmp_path, doc, name="graph.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_a_cost_graph_file_reads_into_tables_with_missing_pairs_zero(tmp_path):
    graph, labels = read_cost_graph(write(tmp_path, GRAPH))
    assert labels == {"in": ["a"], "x": ["p", "q"], "y": ["p", "q"], "out": ["a", "b"]}
    assert np.array_equal(graph.costs["x"], [3.0, 1.0])
    assert [(e.src, e.dst) for e in graph.edges] == [("in", "x"), ("in", "y"), ("x", "out"), ("y", "out"),
                                                      ("y", "out")]
    assert np.array_equal(graph.edges[0].xfer, [[1.0, 0.0]]) and not graph.edges[1].xfer.any()
    assert np.array_equal(graph.edges[2].xfer, [[0.0, 0.0], [4.0, 0.5]])
    doc = search_document(search(graph), labels)
    # x=q (1), y=p (1), out=b (0.25), parallel y->out edges 0.75 + 0.25, x->out q|b 0.5
    assert doc["assignment"] == {"in": "a", "x": "q", "y": "p", "out": "b"}
    assert doc["cost"] == pytest.approx(1.0 + 1.0 + 0.25 + 1.0 + 0.5) and doc["search_ms"] >= 0


@pytest.mark.parametrize("doc,message", [
    ("{\n  \"nodes\": {,\n}", r"graph.json: line 2 column 13: invalid JSON \(Expecting property name"),
    ([1, 2], "graph.json: expected an object with \"nodes\" and \"edges\", got list"),
    ({"nodes": {"a": {"x": 1}}, "edge": []}, "graph.json: unknown key \"edge\""),
    ({"nodes": {}}, "graph.json: \"nodes\" is empty"),
    ({"nodes": {"a": {}}}, "graph.json: node \"a\": has no configurations"),
    ({"nodes": {"a": {"x|y": 1}}}, "graph.json: node \"a\": configuration name \"x|y\" must be non-empty"),
    ({"nodes": {"a": {"x": "1"}}}, "graph.json: node \"a\" configuration \"x\": expected a finite number, got \"1\""),
    ('{"nodes": {"a": {"x": NaN}}}', "graph.json: node \"a\" configuration \"x\": expected a finite number, got NaN"),
    ({"nodes": {"a": {"x": 1}}, "edges": [{"from": "a", "to": "b"}]}, "graph.json: edge 0: \"to\": unknown node \"b\""),
    ({"nodes": {"a": {"x": 1}, "b": {"y": 1}}, "edges": [{"from": "a", "to": "b", "xfer": {"y|x": 1}}]},
     r"graph.json: edge 0 \(a -> b\): xfer key \"y\|x\" is not CONFIG_OF_a\|CONFIG_OF_b \(a: x; b: y\)"),
    ({"nodes": {"a": {"x": 1}, "b": {"y": 1}}, "edges": [{"from": "a", "to": "b", "cost": 1}]},
     "graph.json: edge 0: unknown key \"cost\""),
    ({"nodes": {"a": {"x": 1}, "b": {"y": 1}}, "edges": [{"from": "a", "to": "b"}, {"from": "b", "to": "a"}]},
     "graph.json: not a DAG: cycle a -> b -> a"),
])
def test_bad_cost_graphs_are_one_line_errors(tmp_path, doc, message):
    with pytest.raises(CctError, match=message) as e:
        read_cost_graph(write(tmp_path, doc))
    assert "\n" not in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(CctError, match="nothere.json: cannot read: No such file"):
        read_cost_graph(tmp_path / "nothere.json")


NET = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 8 kernel_size: 3 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 64 } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


@pytest.fixture
def plan_file(tmp_path):
    p = plan_net(layer_graph(parse_net_param(NET)), 4, CostModel(gflops=10.0, bandwidth=1.0))
    path = str(tmp_path / "plan.json")
    write_json(path, plan_document(p, "tiny.prototxt"))
    return p, path


def test_plan_files_round_trip(plan_file):
    p, path = plan_file
    plan = read_plan(path)
    assert plan.workers == 4 and plan.model == "tiny.prototxt"
    assert list(plan.layers) == ["data", "conv", "relu", "ip", "prob"]
    for name in p.graph.nodes:
        c = p.config(name)
        assert (plan.layers[name].n, plan.layers[name].c, plan.layers[name].h, plan.layers[name].w) == c.degrees
        assert plan.layers[name].workers == c.workers and plan.layers[name].node == name
    relu = plan.layers["relu"]
    assert relu.node == "conv" and (relu.n, relu.c, relu.h, relu.w) == p.config("conv").degrees
    doc = plan.document
    assert doc["totals"]["plan"]["cost_ms"] == pytest.approx(p.plan.cost_ms)
    assert doc["layers"]["conv"]["shape"] == [8, 8, 6, 6] and "compute_ms" not in doc["layers"]["relu"]
    assert doc["search"]["residue"] == ["data", "prob"]


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(format="other"), "not a cct plan file"),
    (lambda d: d.update(version=2), "plan file version 2; this cct reads version 1"),
    (lambda d: d.update(workers=0), "\"workers\": expected a positive integer, got 0"),
    (lambda d: d["layers"]["conv"].update(h=3), "layer \"conv\": n\\*c\\*h\\*w = .* but \"workers\" is"),
    (lambda d: d["layers"]["ip"].update(n=8, c=1, workers=8), "layer \"ip\": 8 workers exceed the plan's 4"),
    (lambda d: d["layers"]["relu"].pop("w"), "layer \"relu\": \"w\": expected a positive integer, got null"),
    (lambda d: d["layers"]["relu"].update(node="gone"), "layer \"relu\": \"node\" \"gone\" is not a layer"),
])
def test_bad_plan_files_are_one_line_errors(plan_file, edit, message):
    _, path = plan_file
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    write_json(path, doc)
    with pytest.raises(CctError, match=os.path.basename(path) + ": .*" + message):
        read_plan(path)
