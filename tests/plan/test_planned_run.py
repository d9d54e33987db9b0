"""Plans that run (:mod:`cct.exec.planned`): a planned run on CPU stand-in devices equals the single-device
run (every parameter after 10 solver steps within the comparison rule of :mod:`cct.compare.tolerance` at
1e-5), for hand-written plans mixing sample and channel splits and for a plan ``cct plan`` wrote; a plan that
cannot run is one line naming the plan file, the layer and the field; ``cct train -plan`` and ``cct time
-plan``."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cct import cli
from cct.compare.tolerance import assert_close
from cct.errors import CctError
from cct.exec.planned import PlannedRunner, planned_executor_factory
from cct.exec.serial import SerialExecutor
from cct.plan.files import read_plan
from cct.proto import caffe_pb2 as pb
from cct.solvers import create_solver
from tests.solvers.helpers import captured_log, messages

RTOL, ATOL = 1e-5, 1e-7
STEPS = 10

NET = """
name: "planned"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 6 dim: 3 dim: 8 dim: 8 } shape { dim: 6 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv2" top: "ip1"
  inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.1 }
                        bias_filler { type: "constant" value: 0.1 } } }
layer { name: "tanh1" type: "TanH" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 }
                        bias_filler { type: "constant" value: 0 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

TYPES = {"data": "DummyData", "conv1": "Convolution", "relu1": "ReLU", "pool1": "Pooling", "conv2": "Convolution",
         "relu2": "ReLU", "ip1": "InnerProduct", "tanh1": "TanH", "ip2": "InnerProduct",
         "loss": "SoftmaxWithLoss"}
FUSED = {"relu1": "conv1", "relu2": "conv2", "tanh1": "ip1"}

# sample splits, channel splits of a convolution and an InnerProduct, a fused ReLU after a channel split, an
# unsplit layer and a loss the plan splits over samples (it runs whole)
MIXED = {"data": (2, 1), "conv1": (2, 1), "pool1": (2, 1), "conv2": (1, 2), "ip1": (1, 2), "ip2": (2, 1),
         "loss": (2, 1)}


def plan_doc(configs: dict[str, tuple[int, int]], workers: int = 2) -> dict:
    """A plan file (the format ``cct plan -format json`` writes) with (n, c) per node."""
    layers = {}
    for name, kind in TYPES.items():
        node = FUSED.get(name, name)
        n, c = configs.get(node, (1, 1))
        layers[name] = {"n": n, "c": c, "h": 1, "w": 1, "workers": n * c, "type": kind, "node": node}
    return {"format": "cct-plan", "version": 1, "model": "net.prototxt", "net": "planned", "workers": workers,
            "batch": 6, "layers": layers}


def write(tmp_path, doc: dict, name: str = "plan.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def solver_param(net: str = NET) -> pb.SolverParameter:
    from google.protobuf import text_format

    p = pb.SolverParameter()
    text_format.Merge(net, p.net_param)
    p.base_lr, p.momentum, p.weight_decay, p.lr_policy = 0.1, 0.9, 0.001, "fixed"
    p.max_iter, p.display, p.random_seed = STEPS, 0, 1701
    return p


def trained(factory=None) -> dict[str, np.ndarray]:
    solver = create_solver(solver_param(), executor_factory=factory)
    solver.step(STEPS)
    return {f"{name}[{j}]": np.array(b.data) for name, layer in zip(solver.net._layer_names, solver.net.layers)
            for j, b in enumerate(layer.blobs)}


@pytest.fixture(scope="module")
def plain() -> dict[str, np.ndarray]:
    return trained()


def assert_same_as_plain(ours: dict, plain: dict) -> None:
    assert ours.keys() == plain.keys()
    for k in plain:
        assert_close(ours[k], plain[k], k, rtol=RTOL, atol=ATOL, reference="one device")


@pytest.mark.parametrize("configs, devices", [
    (MIXED, "cpu:1,cpu:1"),
    ({"data": (2, 1), "conv1": (1, 2), "pool1": (2, 1), "conv2": (2, 1), "ip1": (2, 1), "ip2": (1, 2)},
     "cpu:1,cpu:1"),
    ({"conv1": (2, 2), "pool1": (4, 1), "conv2": (1, 4), "ip1": (2, 2), "ip2": (3, 1)}, "cpu:1,cpu:1,cpu:1,cpu:1"),
], ids=["mixed", "mixed-2", "n-and-c-on-4"])
def test_planned_run_equals_one_device_after_10_steps(tmp_path, plain, configs, devices):
    path = write(tmp_path, plan_doc(configs, workers=len(devices.split(","))))
    with captured_log() as buf:
        ours = trained(planned_executor_factory(path, devices))
    assert_same_as_plain(ours, plain)
    log = "\n".join(messages(buf.getvalue()))
    assert f"plan {path} (planned, " in log
    split = {n for n, (a, b) in configs.items() if a * b > 1 and n not in ("data", "loss")}
    for name in split:
        assert f"plan: {name} n={configs[name][0]} c={configs[name][1]} on " in log


def test_the_parts_really_run_on_their_devices_in_separate_memory(tmp_path):
    path = write(tmp_path, plan_doc(MIXED))
    solver = create_solver(solver_param(), executor_factory=planned_executor_factory(path, "cpu:1,cpu:1"))
    runner = solver.net.executor.runner
    assert isinstance(runner, PlannedRunner)
    solver.step(1)
    names = solver.net._layer_names
    conv2 = runner._splits[names.index("conv2")]
    assert [(p.k, p.r0, p.r1, p.chans) for p in conv2.parts] == [(0, 0, 6, (0, 3)), (1, 0, 6, (3, 6))]
    assert [p.clone.blobs[0].shape for p in conv2.parts] == [(3, 5, 3, 3), (3, 5, 3, 3)]
    conv1 = runner._splits[names.index("conv1")]
    assert [(p.r0, p.r1, p.chans) for p in conv1.parts] == [(0, 3, None), (3, 6, None)]
    net_top = solver.net.blobs["conv1"].data
    for part in conv1.parts:
        assert not np.shares_memory(part.tops[0].data, net_top)
    assert names.index("loss") not in runner._splits and names.index("data") not in runner._splits


def test_a_plan_cct_plan_wrote_runs_and_equals_one_device(tmp_path, plain, capsys):
    net_file = tmp_path / "net.prototxt"
    net_file.write_text(NET)
    path = str(tmp_path / "plan.json")
    assert cli.main(["plan", "-model", str(net_file), "-workers", "2", "-gflops", "0.5", "-bandwidth", "0.05",
                     "-format", "json", "-output", path]) == 0
    capsys.readouterr()
    plan = read_plan(path)
    # the analytic costs on these figures pick sample splits up front and a channel split of conv2
    assert (plan.layers["conv1"].n, plan.layers["conv2"].c) == (2, 2)
    ours = trained(planned_executor_factory(path, "cpu:1,cpu:1"))
    assert_same_as_plain(ours, plain)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["layers"].__setitem__("fc9", dict(d["layers"]["ip2"])),
     'layer "fc9": not a layer of the net \'planned\''),
    (lambda d: d["layers"].pop("tanh1"), 'layer "tanh1": a layer of the net \'planned\''),
    (lambda d: d["layers"]["pool1"].update(n=1, c=2, workers=2),
     'layer "pool1": "c" is 2: a channel split runs for InnerProduct and Convolution layers only, not Pooling'),
    (lambda d: d["layers"]["ip1"].update(n=1, c=3, workers=3) or d.update(workers=4),
     'layer "ip1": "workers" is 3, more than the 2 device(s) of -devices cpu:1,cpu:1'),
    (lambda d: d["layers"]["conv1"].update(n=1, h=2, workers=2),
     'layer "conv1": "h" is 2: spatial splits do not run'),
    (lambda d: d["layers"]["ip2"].update(type="Convolution"),
     'layer "ip2": "type" is Convolution in the plan but the net\'s layer is a InnerProduct'),
])
def test_a_plan_that_cannot_run_is_one_line(tmp_path, edit, message):
    doc = plan_doc(MIXED)
    edit(doc)
    path = write(tmp_path, doc)
    with pytest.raises(CctError) as e:
        create_solver(solver_param(), executor_factory=planned_executor_factory(path, "cpu:1,cpu:1"))
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{path}: ") and message in text, text


def test_a_test_net_takes_the_entries_it_shares(tmp_path):
    """A TEST net runs the layers the plan does not list on device 0 (and ignores the others)."""
    from cct.pycaffe import TEST, Net

    net_file = tmp_path / "net.prototxt"
    net_file.write_text(NET.replace('layer { name: "loss"', 'layer { name: "acc" type: "Accuracy" bottom: "ip2" '
                                    'bottom: "label" top: "acc" }\nlayer { name: "loss"'))
    doc = plan_doc(MIXED)
    path = write(tmp_path, doc)
    runner = PlannedRunner(read_plan(path), [__import__("cct").device.Device("cpu", 0, 1)] * 2)
    net = Net(str(net_file), TEST, executor=SerialExecutor(runner))
    modes = dict(zip(net._layer_names, runner.modes))
    assert modes["acc"].workers == 1 and modes["acc"].why == "not in the plan"
    assert (modes["ip1"].n, modes["ip1"].c) == (1, 2)
    net.forward()


def _train_files(tmp_path, plan: dict) -> tuple[str, str]:
    net_file = tmp_path / "net.prototxt"
    net_file.write_text(NET)
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{net_file}"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 3\ndisplay: 1\n'
                           'random_seed: 5\n')
    return str(solver_file), write(tmp_path, plan)


def test_cli_train_and_time_with_a_plan(tmp_path):
    solver, plan = _train_files(tmp_path, plan_doc(MIXED))
    with captured_log() as buf:
        rc = cli.main(["train", "-solver", solver, "-plan", plan, "-devices", "cpu:1,cpu:1"])
    log = buf.getvalue()
    assert rc == 0, log
    assert f"plan {plan} (planned, 2 workers) on cpu:1,cpu:1: 4 layer(s) split over samples, 2 over channels" in log
    assert "Optimization Done." in log
    with captured_log() as buf:
        rc = cli.main(["time", "-model", str(tmp_path / "net.prototxt"), "-plan", plan, "-devices", "cpu:1,cpu:1",
                       "-iterations", "2"])
    assert rc == 0, buf.getvalue()
    assert "Average Forward-Backward" in buf.getvalue() and f"plan {plan}" in buf.getvalue()


@pytest.mark.parametrize("args, message", [
    (["-plan", "{plan}"], "-plan {plan} needs -devices"),
    (["-plan", "{plan}", "-devices", "cpu:1,cpu:1", "-split", "0.5,0.5"], "-split 0.5,0.5 and -plan {plan}"),
    (["-plan", "{missing}", "-devices", "cpu:1,cpu:1"], "{missing}: cannot read"),
])
def test_cli_plan_errors_are_one_line(tmp_path, args, message):
    solver, plan = _train_files(tmp_path, plan_doc(MIXED))
    missing = str(tmp_path / "nope.json")
    args = [a.format(plan=plan, missing=missing) for a in args]
    with captured_log() as buf:
        rc = cli.main(["train", "-solver", solver, *args])
    fatal = [m for m in messages(buf.getvalue(), "F")]
    assert rc == 1 and len(fatal) == 1 and message.format(plan=plan, missing=missing) in fatal[0], buf.getvalue()
