"""``cct plan``: the table, the plan file, ``-costs`` graphs, and one-line errors."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from cct import cli
from cct.plan.files import read_plan
from tests.plan.test_tables import TABLE2, TABLE3
from tests.solvers.helpers import captured_log, messages

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALEXNET = os.path.join(REPO, "models", "alexnet", "deploy.prototxt")
K80 = ["-gflops", "2500", "-bandwidth", "4.5"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, log)"""
    with captured_log() as buf:
        rc = cli.main(list(args))
    return rc, capsys.readouterr().out, buf.getvalue()


def table_graph(tmp_path, table, name: str) -> str:
    """A table as a cost graph: producer {n=16} -> layer -> consumer."""
    labels = [str(r[0]) for r in table]
    xfer = {f"{{n=16}}|{lab}": r[2] for lab, r in zip(labels, table)}
    doc = {"nodes": {"producer": {"{n=16}": 0}, name: {lab: r[3] + r[4] for lab, r in zip(labels, table)},
                     "consumer": {"any": 0}},
           "edges": [{"from": "producer", "to": name, "xfer": xfer}, {"from": name, "to": "consumer"}]}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_plan_prints_one_row_per_layer_and_the_totals(capsys):
    rc, out, log = run(capsys, "plan", "-model", ALEXNET, "-workers", "16", "-batch", "512", *K80)
    assert rc == 0, log
    lines = out.splitlines()
    assert lines[0].split() == ["layer", "type", "shape", "n", "c", "h", "w", "workers", "compute", "ms", "update",
                                "ms", "xfer", "ms"]
    rows = {r.split()[0]: r.split() for r in lines[1:16]}
    assert list(rows) == ["data", "conv1", "norm1", "pool1", "conv2", "norm2", "pool2", "conv3", "conv4", "conv5",
                          "pool5", "fc6", "fc7", "fc8", "prob"]
    assert rows["conv1"][1:8] == ["Convolution", "512x96x55x55", "16", "1", "1", "1", "16"]
    assert rows["fc6"][1:3] == ["InnerProduct", "512x4096"] and rows["fc6"][3] == "1" and rows["fc6"][4] in "24"
    totals = {line.split(" ms/step")[0].rsplit(None, 1)[0]: float(line.split(" ms/step")[0].rsplit(None, 1)[1])
              for line in lines if "ms/step" in line}
    assert set(totals) == {"plan", "image parallelism", "OWT"}
    assert totals["plan"] <= totals["OWT"] <= totals["image parallelism"]
    assert lines[-1].startswith("search: 15 nodes -> 2 after 13 node and 0 edge eliminations")


def test_json_output_is_the_plan_file(capsys, tmp_path):
    path = str(tmp_path / "plan.json")
    rc, out, log = run(capsys, "plan", "-model", ALEXNET, "-workers", "4", "-batch", "64", *K80, "-format", "json",
                       "-output", path)
    assert rc == 0, log
    doc = json.loads(out)
    with open(path) as f:
        assert json.load(f) == doc
    plan = read_plan(path)
    assert plan.workers == 4 and len(plan.layers) == 24  # every layer of the prototxt, fused ones included
    assert plan.layers["drop6"].node == "fc6" and plan.layers["drop6"].c == plan.layers["fc6"].c
    assert doc["batch"] == 64 and doc["cost_model"] == {"cost": "analytic", "gflops": 2500.0, "bandwidth_gbs": 4.5,
                                                         "halo": "exact"}
    assert f"plan: wrote {path}" in messages(log)


@pytest.mark.parametrize("table,name,pick,total", [(TABLE2, "fc6", "{n=1, c=2, h=1, w=1}", 27.0),
                                                   (TABLE3, "conv5", "{n=1, c=1, h=2, w=2}", 127.5)])
def test_costs_graphs_reproduce_tables_2_and_3(capsys, tmp_path, table, name, pick, total):
    rc, out, log = run(capsys, "plan", "-costs", table_graph(tmp_path, table, name), "-format", "json")
    assert rc == 0, log
    doc = json.loads(out)
    assert set(doc) == {"assignment", "cost", "search_ms"}
    assert doc["assignment"] == {"producer": "{n=16}", name: pick, "consumer": "any"}
    assert doc["cost"] == pytest.approx(total, rel=1e-9)
    rc, out, _ = run(capsys, "plan", "-costs", table_graph(tmp_path, table, name))
    assert rc == 0 and re.search(rf"^{name} +{re.escape(pick)}$", out, re.M)
    assert out.splitlines()[-1].startswith(f"cost {total:g} ms; 3 nodes -> 2 after elimination")


def test_default_gflops_is_this_machines_peak(capsys):
    rc, out, log = run(capsys, "plan", "-model", ALEXNET, "-workers", "2", "-cost", "measured")
    assert rc == 0, log
    assert any(m.startswith("plan: ") and "GFLOP/s per worker (this machine's sgemm peak" in m for m in messages(log))
    assert "measured costs" in out


@pytest.mark.parametrize("args,message", [
    (["-workers", "4"], "cct plan needs -model NET and -workers P, or -costs GRAPH.json"),
    (["-model", ALEXNET], "-workers 0: cct plan -model needs -workers P with P >= 1"),
    (["-model", ALEXNET, "-workers", "2", "-format", "xml"], "-format xml: the output format is text or json"),
    (["-model", ALEXNET, "-workers", "2", "-cost", "fast"], "-cost fast: the cost model is analytic or measured"),
    (["-model", ALEXNET, "-workers", "2", "-gflops", "-3"], "-gflops -3.0: must be > 0"),
    (["-model", "missing.prototxt", "-workers", "2", *K80], "missing.prototxt"),
    (["-costs", "missing.json"], "missing.json: cannot read"),
])
def test_mistakes_are_one_fatal_line(capsys, args, message):
    rc, out, log = run(capsys, "plan", *args)
    assert rc == 1 and out == ""
    fatal = messages(log, "F")
    assert len(fatal) == 1 and message in fatal[0], log
    assert "Traceback" not in log


def test_a_graph_too_large_to_enumerate_names_the_file_and_its_nodes(capsys, tmp_path):
    names = [f"k{i}" for i in range(8)]  # a complete DAG: nothing to eliminate, 8^8 > 10^7 configurations
    doc = {"nodes": {v: {str(c): 0 for c in range(8)} for v in names},
           "edges": [{"from": u, "to": v} for i, u in enumerate(names) for v in names[i + 1:]]}
    path = tmp_path / "dense.json"
    path.write_text(json.dumps(doc))
    rc, out, log = run(capsys, "plan", "-costs", str(path))
    assert rc == 1 and out == ""
    (fatal,) = messages(log, "F")
    assert fatal.startswith(f"{path}: the graph does not reduce: 8 nodes remain") and fatal.endswith(
        ": k0, k1, k2, k3, k4, k5, k6, k7")


def test_the_command_line_program(tmp_path):
    graph = table_graph(tmp_path, TABLE2, "fc6")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ok = subprocess.run([sys.executable, "-m", "cct", "plan", "-costs", graph, "-format", "json"], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["assignment"]["fc6"] == "{n=1, c=2, h=1, w=1}"
    cyclic = tmp_path / "cyclic.json"
    cyclic.write_text(json.dumps({"nodes": {"a": {"x": 1}, "b": {"y": 1}},
                                  "edges": [{"from": "a", "to": "b"}, {"from": "b", "to": "a"}]}))
    bad = subprocess.run([sys.executable, "-m", "cct", "plan", "-costs", str(cyclic)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.startswith("F")][0].endswith(
        "cyclic.json: not a DAG: cycle a -> b -> a")
