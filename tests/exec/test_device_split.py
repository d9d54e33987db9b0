"""The device split equals the plain single-device run: every blob, diff and parameter gradient of Caffe's
reference nets (both phases), random draws (fillers, Dropout), shared and accumulated gradients, a batch
that changes size — on two one-thread CPU devices, and on a stand-in device that does not hold host memory
(so every share is staged in and out through mirrors and a copy of the weights, exactly as a GPU share is).

"Equal" is normwise: ``max |split - plain| <= 1e-5 * max |plain|`` per blob.  Per-share GEMMs round
differently from whole-batch ones (OpenBLAS blocks by the matrix sizes), and an element that is the
difference of large terms (BatchNorm with global statistics divides by sqrt(eps) on the reference weights)
can then differ by 1e-5 of its own size while the blob agrees to 1e-7 of its scale.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import cct
from cct.device import Device
from cct.exec import device_split as devices
from cct.exec.device_split import DeviceSplitRunner
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.runtime import partition
from tests.reference import REFERENCE, reference_dir
from tests.solvers import test_reference_cases as solver_cases

NETS = sorted(p.name for p in (REFERENCE / "nets").iterdir()) if (REFERENCE / "nets").exists() else []
TOL = 1e-5


def assert_close(ours: Any, plain: Any, what: str) -> None:
    """``max |ours - plain| <= 1e-5 * max(max |plain|, 1e-2)`` (normwise, see the module docstring)."""
    ours, plain = np.asarray(ours, dtype=np.float64), np.asarray(plain, dtype=np.float64)
    assert ours.shape == plain.shape, f"{what}: shape {ours.shape} != {plain.shape}"
    if not plain.size:
        return
    err = float(np.max(np.abs(ours - plain)))
    scale = max(float(np.max(np.abs(plain))), 1e-2)
    assert err <= TOL * scale, f"{what}: max difference {err:.3g} > {TOL:g} x {scale:.4g}"


@dataclass(frozen=True)
class Elsewhere(Device):
    """A CPU device that claims not to hold host memory: the executor mirrors its shares (the GPU path)."""

    def holds(self, a: Any) -> bool:
        return False


CPU1 = Device("cpu", 0, 1)
SETTINGS = {
    "cpu:1,cpu:1 auto": ("cpu:1,cpu:1", "auto"),
    "cpu:1,cpu:1 0.6,0.4": ("cpu:1,cpu:1", "0.6,0.4"),
    "cpu:1,elsewhere 0.5,0.5": ([CPU1, Elsewhere("cpu", 0, 1)], "0.5,0.5"),
    "elsewhere alone": ([Elsewhere("cpu", 0, 1)], "auto"),
}


def _snapshot(net) -> dict[str, np.ndarray]:
    out = {}
    for name, b in net.blobs.items():
        out[f"data/{name}"] = b.data.copy()
        out[f"diff/{name}"] = b.diff.copy()
    for name, ps in net.params.items():
        for j, p in enumerate(ps):
            out[f"param/{name}/{j}"] = p.data.copy()
            out[f"param_diff/{name}/{j}"] = p.diff.copy()
    return out


def _run_reference(name: str, phase: int):
    folder = reference_dir("nets", name)
    ref = np.load(folder / ("train.npz" if phase == cct.TRAIN else "test.npz"))
    net = cct.Net(str(folder / "net.prototxt"), phase, weights=str(folder / "weights.caffemodel"))
    net.forward(**{k[len("input/"):]: ref[k] for k in ref.files if k.startswith("input/")})
    if phase == cct.TRAIN:
        net.clear_param_diffs()
        net.backward()
    return net


def _assert_same(ours: dict, plain: dict, what: str) -> None:
    assert ours.keys() == plain.keys()
    for k in plain:
        assert_close(ours[k], plain[k], f"{what} {k}")


def _split_layers(net) -> list[str]:
    ex = net.executor.runner
    assert isinstance(ex, DeviceSplitRunner)
    return [net._layer_names[i] for i, s in ex._split_at_forward.items() if s is not None]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("phase", [cct.TRAIN, cct.TEST], ids=["TRAIN", "TEST"])
@pytest.mark.parametrize("name", NETS)
def test_reference_nets_split_equal_plain(name, phase, setting, tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(devices, "SPLIT_MIN_WEIGHT_REUSE", 0)  # split every separable layer, however small
    plain = _snapshot(_run_reference(name, phase))
    cct.set_devices(*SETTINGS[setting])
    net = _run_reference(name, phase)
    _assert_same(_snapshot(net), plain, f"{name} {setting}")
    split = _split_layers(net)
    expected = [n for n, layer in zip(net._layer_names, net.layers) if layer.type in ("Convolution", "ReLU")]
    assert set(expected) <= set(split), f"not split: {set(expected) - set(split)}"


def test_weight_heavy_layers_run_whole_on_cpu_devices(tmp_path):
    """An InnerProduct uses each weight once per item: below SPLIT_MIN_WEIGHT_REUSE items per share it runs on
    the whole batch with all the CPU devices' threads (and says so once); a convolution with many output
    positions per weight still splits.  The same with a device that does not hold host memory (still a CPU)."""
    from tests.solvers.helpers import captured_log

    path = tmp_path / "net.prototxt"
    path.write_text('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 8 dim: 2 dim: 9 dim: 9 } } }\n'
                    'layer { name: "conv" type: "Convolution" bottom: "x" top: "c" '
                    'convolution_param { num_output: 3 kernel_size: 2 } }\n'
                    'layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y" '
                    'inner_product_param { num_output: 4 } }\n')
    cct.set_devices("cpu:1,cpu:1", split="0.5,0.5")
    net = cct.Net(str(path), cct.TEST)
    with captured_log() as log:
        net.forward()
        net.forward()
    assert _split_layers(net) == ["conv"]  # conv: 4 items x 64 positions per weight >= 64
    assert log.getvalue().count("ip runs on the whole batch of 8: its shares would use each weight 4 times") == 1
    cct.set_devices([CPU1, Elsewhere("cpu", 0, 1)], split="0.5,0.5")
    net = cct.Net(str(path), cct.TEST)
    net.forward()
    assert set(_split_layers(net)) == {"conv"}


RANDOM_NET = """
name: "random"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 6 dim: 2 dim: 7 dim: 7 } shape { dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "uniform" } } }
layer { name: "conv2" type: "Convolution" bottom: "data" top: "conv2"
        param { name: "shared_w" } param { name: "shared_b" }
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "conv3" type: "Convolution" bottom: "data" top: "conv3"
        param { name: "shared_w" } param { name: "shared_b" }
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "sum" type: "Eltwise" bottom: "conv" bottom: "conv2" bottom: "conv3" top: "sum" }
layer { name: "prelu" type: "PReLU" bottom: "sum" top: "sum" }
layer { name: "drop" type: "Dropout" bottom: "sum" top: "sum" dropout_param { dropout_ratio: 0.3 } }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
        pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 3
        weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _random_run(tmp_path, batch: int = 6) -> dict[str, np.ndarray]:
    """Fillers, Dropout and STOCHASTIC pooling draw from the global stream; two passes accumulate gradients
    (shared weights included); then the batch changes size."""
    path = tmp_path / "random.prototxt"
    path.write_text(RANDOM_NET)
    cct.set_random_seed(7)
    net = cct.Net(str(path), cct.TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 3, 6)
    net.clear_param_diffs()
    for _ in range(2):
        net.forward()
        net.backward()
    out = {f"first/{k}": v for k, v in _snapshot(net).items()}
    net.blobs["data"].reshape(batch, 2, 7, 7)
    net.blobs["label"].reshape(batch)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 3, batch)
    net.forward()
    net.backward()
    out.update({f"second/{k}": v for k, v in _snapshot(net).items()})
    return out


@pytest.mark.parametrize("setting", ["cpu:1,cpu:1 0.6,0.4", "cpu:1,elsewhere 0.5,0.5", "elsewhere alone"])
def test_random_draws_shared_and_accumulated_gradients_and_a_new_batch_size(setting, tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "SPLIT_MIN_WEIGHT_REUSE", 0)  # the InnerProduct too
    plain = _random_run(tmp_path, batch=5)
    cct.set_devices(*SETTINGS[setting])
    _assert_same(_random_run(tmp_path, batch=5), plain, setting)


@pytest.mark.parametrize("setting", ["cpu:1,elsewhere 0.5,0.5", "elsewhere alone"])
def test_weights_changed_between_passes_reach_every_device(setting, tmp_path):
    """A test net's layers get the train net's weight memory swapped in (share_trained_layers_with), and a
    mirrored device's copy must be refreshed after an update: both before the next forward."""
    def run():
        path = tmp_path / "random.prototxt"
        path.write_text(RANDOM_NET.replace('layer { name: "drop"', '# layer { name: "drop"'))
        cct.set_random_seed(3)
        nets = [cct.Net(str(path), cct.TEST) for _ in range(2)]
        rng = np.random.default_rng(1)
        for net in nets:
            net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
        outs = [nets[0].forward()["loss"].copy()]
        nets[0].share_trained_layers_with(nets[1])
        outs.append(nets[0].forward()["loss"].copy())
        for p in nets[1].params["ip"]:
            p.data[...] *= 1.5  # an update in place
        outs.append(nets[0].forward()["loss"].copy())
        return outs

    plain = run()
    assert not np.allclose(plain[0], plain[1]) and not np.allclose(plain[1], plain[2])
    cct.set_devices(*SETTINGS[setting])
    for a, b in zip(run(), plain):
        assert_close(a, b, "loss")


# ---- the shares really run at the same time, each on its rows, as one partition ----------------------
_seen: list[tuple[int, tuple[int, ...], bool]] = []
_barrier = threading.Barrier(2, timeout=20)


@register("TestSplitBarrier")
class _BarrierLayer(Layer):
    """y = 2x; every forward waits until two instances are inside it (fails unless the shares overlap)."""

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = True

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        _barrier.wait()
        _seen.append((threading.get_ident(), bottom[0].shape, partition.in_partition()))
        top[0].data[...] = 2 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 2 * top[0].diff


def test_shares_run_concurrently_on_their_rows(tmp_path):
    path = tmp_path / "barrier.prototxt"
    path.write_text('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 5 dim: 3 } } }\n'
                    'layer { name: "b" type: "TestSplitBarrier" bottom: "x" top: "y" }\n')
    cct.set_devices("cpu:1,cpu:1", split="0.6,0.4")
    net = cct.Net(str(path), cct.TEST)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    _seen.clear()
    out = net.forward(x=x)["y"]
    np.testing.assert_array_equal(out, 2 * x)
    assert sorted(s[1] for s in _seen) == [(2, 3), (3, 3)]
    assert len({s[0] for s in _seen}) == 2 and all(s[2] for s in _seen)


def test_gpu_mode_runs_the_layers_on_its_device(monkeypatch):
    """Caffe's GPU mode (set_mode_gpu, -gpu N) without a device setting: every batch-separable layer runs on
    that device (here a stand-in that does not hold host memory), with the plain run's numbers."""
    from cct import mode

    name = "lenet" if "lenet" in NETS else (NETS[0] if NETS else None)
    if name is None:
        pytest.skip("no reference nets")
    plain = _snapshot(_run_reference(name, cct.TRAIN))
    asked = []

    def stand_in(device_id: int) -> Device:
        asked.append(device_id)
        return Elsewhere("cpu", 0, 1)

    monkeypatch.setattr(devices, "gpu_mode_device", stand_in)
    monkeypatch.setitem(mode._state, "mode", mode.GPU)
    monkeypatch.setitem(mode._state, "device", 3)
    net = _run_reference(name, cct.TRAIN)
    assert asked == [3] and isinstance(net.executor.runner, DeviceSplitRunner)
    assert "conv1" in _split_layers(net)
    _assert_same(_snapshot(net), plain, f"{name} GPU mode")
    monkeypatch.setitem(mode._state, "mode", mode.CPU)
    assert not isinstance(_run_reference(name, cct.TRAIN).executor.runner, DeviceSplitRunner)


@pytest.mark.parametrize("devices, warned", [("cpu:2,cpu:2", True), ("cpu:1,cpu:1", False)])
def test_cpu_devices_of_several_blas_threads_are_told_their_products_take_turns(devices, warned, tmp_path):
    from tests.solvers.helpers import captured_log

    path = tmp_path / "net.prototxt"
    path.write_text('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 2 dim: 5 dim: 5 } } }\n'
                    'layer { name: "conv" type: "Convolution" bottom: "x" top: "c" '
                    'convolution_param { num_output: 3 kernel_size: 2 } }\n')
    cct.set_devices(devices, split="0.5,0.5")
    with captured_log() as log:
        cct.Net(str(path), cct.TEST).forward()
    assert ("OpenBLAS runs one multi-threaded matrix product at a time" in log.getvalue()) == warned


# ---- one device that does not hold the net's memory (GPU mode) keeps its copies between layers ---------------
def test_gpu_mode_has_its_nets_choose_their_engines_for_its_device():
    """One device alone (GPU mode) names its array module, for which the nets built for it configure their
    engines; a split over several devices names none (each device's copy of a layer chooses for itself)."""
    from cct.exec.serial import SerialExecutor

    alone = Elsewhere("cpu", 0, 1)
    assert SerialExecutor(DeviceSplitRunner(devices.make_setting([alone], "auto", ("d", "s")))) \
        .layer_array_module() is alone.xp
    assert DeviceSplitRunner(devices.make_setting([CPU1, alone], "0.5,0.5", ("d", "s"))).layer_array_module() is None
    assert SerialExecutor().layer_array_module() is None


def _copies(monkeypatch) -> list[tuple[Any, str]]:
    """Records every copy between the host and the stand-in device: (the host buffer, "data in", "diff in" or
    "back")."""
    seen: list[tuple[Any, str]] = []
    bring_in, copy_back = devices._Copies.bring_in, devices._CopyBack.__call__

    def counted_in(copies, p, what, dev):
        known = copies._when.get(dev)
        bring_in(copies, p, what, dev)
        if copies._when.get(dev) is not known:
            seen.append((p.buffer(what), f"{what} in"))

    def counted_back(back):
        seen.append((back.buf, "back"))
        copy_back(back)

    monkeypatch.setattr(devices._Copies, "bring_in", counted_in)
    monkeypatch.setattr(devices._CopyBack, "__call__", counted_back)
    return seen


def test_gpu_mode_keeps_each_blob_on_its_device_between_layers(tmp_path, monkeypatch):
    """A blob one device layer writes and the next reads stays on the device: what crosses in a training step
    is what the host's layers touch (Dropout's blob, both ways, data and gradient; the loss layer's input and
    its gradient); the weights, their gradients and the solver's history stay there until the host reads them
    — with the plain run's numbers.  (A host layer's read counts as a write: a blob's arrays are mutable views,
    as pycaffe's are.)"""
    monkeypatch.setattr(devices, "SPLIT_MIN_WEIGHT_REUSE", 0)  # the InnerProduct too (the stand-in is a CPU)
    path = tmp_path / "net.prototxt"
    path.write_text(RANDOM_NET.replace("STOCHASTIC", "MAX"))  # (a stochastic pooling draws on the host)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{path}" base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 100 '
                      f'display: 0 random_seed: 5\n')

    def train(steps: int) -> Any:
        cct.set_random_seed(5)
        s = cct.get_solver(str(solver))
        rng = np.random.default_rng(2)
        s.net.blobs["data"].data[...] = rng.standard_normal(s.net.blobs["data"].shape)
        s.net.blobs["label"].data[...] = rng.integers(0, 3, 6)
        s.step(steps)
        return s

    plain = _snapshot(train(3).net)
    cct.set_devices(*SETTINGS["elsewhere alone"])
    s = train(2)
    seen = _copies(monkeypatch)
    s.step(1)
    net = s.net
    assert sorted(n for n in net._layer_names if n not in _split_layers(net)) == ["data", "drop", "loss"]
    names = {}
    for name, b in net.blobs.items():
        names[id(b.buffer("data"))], names[id(b.buffer("diff"))] = name, name
    for p in net.learnable_params:
        names[id(p.buffer("data"))], names[id(p.buffer("diff"))] = "param", "param diff"
    for h in s.history:
        names[id(h.buffer("data"))] = "history"
    copied = sorted((names[id(buf)], how) for buf, how in seen)
    assert copied == sorted([("sum", "back"), ("sum", "data in"),  # Dropout, in place, forward
                             ("ip", "back"),  # the loss layer's input
                             ("ip", "diff in"), ("ip", "data in"),  # its gradient; the input it touched
                             ("sum", "back"), ("sum", "diff in")])  # Dropout's backward
    # (the input data never changed; weights, gradients and history stay on the device: the gradients cleared
    # there, the divergence check reads them there, the update runs there)
    seen.clear()
    snapshot = _snapshot(net)  # reading them on the host brings them back, once each
    history = [h.data.copy() for h in s.history]
    back = sorted(names[id(buf)] for buf, how in seen if how == "back" and names[id(buf)] in ("param", "param diff",
                                                                                               "history"))
    n = len(net.learnable_params)
    assert back == ["history"] * n + ["param"] * n + ["param diff"] * n
    _assert_same(snapshot, plain, "3 steps")
    assert any(h.any() for h in history)


def test_gpu_mode_sees_what_a_script_writes_between_passes(tmp_path, monkeypatch):
    """pycaffe code that reads a blob after a pass gets the device's values, and what it writes into a blob
    between two partial passes is what the next layers on the device read."""
    monkeypatch.setattr(devices, "SPLIT_MIN_WEIGHT_REUSE", 0)
    path = tmp_path / "net.prototxt"
    path.write_text(RANDOM_NET.replace("STOCHASTIC", "MAX").replace('layer { name: "drop"', '# layer { name: "drop"'))

    def run() -> list[np.ndarray]:
        cct.set_random_seed(4)
        net = cct.Net(str(path), cct.TRAIN)
        net.blobs["data"].data[...] = np.random.default_rng(3).standard_normal(net.blobs["data"].shape)
        net.forward()
        seen = [net.blobs["sum"].data.copy(), net.blobs["ip"].data.copy()]
        net.blobs["sum"].data[...] *= -2  # between passes, on the host
        net.forward(start="pool")
        seen.append(net.blobs["ip"].data.copy())
        net.backward()
        seen.append(net.blobs["sum"].diff.copy())
        net.blobs["pool"].diff[...] *= 3
        net.backward(start="pool")
        seen.append(net.blobs["sum"].diff.copy())
        return seen

    plain = run()
    assert not np.allclose(plain[1], plain[2]) and not np.allclose(plain[3], plain[4])
    cct.set_devices(*SETTINGS["elsewhere alone"])
    for k, (ours, theirs) in enumerate(zip(run(), plain)):
        assert_close(ours, theirs, f"read {k}")


SOLVER_CASES = {
    "SGD, iter_size 2, L1": 'type: "SGD" momentum: 0.9 iter_size: 2 weight_decay: 0.01 regularization_type: "L1"',
    "Nesterov, clipped": 'type: "Nesterov" momentum: 0.9 clip_gradients: 0.05 weight_decay: 0.001',
    "AdaGrad": 'type: "AdaGrad" weight_decay: 0.001',
    "RMSProp": 'type: "RMSProp" rms_decay: 0.9 momentum: 0.0',
    "AdaDelta": 'type: "AdaDelta" momentum: 0.95 delta: 1e-6 base_lr: 1.0',
    "Adam": 'type: "Adam" momentum: 0.9 momentum2: 0.999 delta: 1e-8',
}


@pytest.mark.parametrize("case", list(SOLVER_CASES))
def test_gpu_mode_updates_on_its_device_as_the_host_does(case, tmp_path, monkeypatch):
    """Every update rule (two history sets for AdaDelta and Adam), iter_size's accumulation, L1 decay and
    gradient clipping (which reads every gradient on the host) give the plain run's weights and history in
    GPU mode, where the update runs on the device's copies; a snapshot taken there and resumed in a fresh
    solver goes on as the uninterrupted run."""
    monkeypatch.setattr(devices, "SPLIT_MIN_WEIGHT_REUSE", 0)
    path = tmp_path / "net.prototxt"
    path.write_text(RANDOM_NET.replace("STOCHASTIC", "MAX"))
    fields = SOLVER_CASES[case]
    lr = "" if "base_lr" in fields else "base_lr: 0.01 "
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{path}" {lr}{fields} lr_policy: "fixed" max_iter: 100 display: 0 random_seed: 5 '
                      f'snapshot_prefix: "{tmp_path}/snap"\n')

    def train(steps: int, resume: str | None = None) -> dict:
        cct.set_random_seed(5)
        s = cct.get_solver(str(solver))
        rng = np.random.default_rng(2)
        s.net.blobs["data"].data[...] = rng.standard_normal(s.net.blobs["data"].shape)
        s.net.blobs["label"].data[...] = rng.integers(0, 3, 6)
        if resume:
            s.restore(resume)
        s.step(steps)
        if resume is None and steps == 2:
            s.snapshot()
        out = _snapshot(s.net)
        out.update({f"history/{k}": h.data.copy() for k, h in enumerate(s.history)})
        return out

    plain = train(4)
    cct.set_devices(*SETTINGS["elsewhere alone"])
    _assert_same(train(4), plain, f"{case}, 4 steps")
    train(2)
    state = next(tmp_path.glob("snap_iter_2.solverstate*"))
    _assert_same(train(2, resume=str(state)), plain, f"{case}, 2 steps resumed after 2")


def test_gpu_mode_checks_the_gradients_for_divergence_on_its_device(tmp_path, monkeypatch):
    """The per-iteration check of every gradient reads the device's copies, where the backward pass left them,
    and leaves them there: a non-finite value in a copy is seen although the host's copy is stale and finite."""
    from cct.solvers.divergence import gradients_finite

    monkeypatch.setattr(devices, "SPLIT_MIN_WEIGHT_REUSE", 0)
    path = tmp_path / "net.prototxt"
    path.write_text(RANDOM_NET.replace("STOCHASTIC", "MAX").replace('layer { name: "drop"', '# layer { name: "drop"'))
    cct.set_devices(*SETTINGS["elsewhere alone"])
    net = cct.Net(str(path), cct.TRAIN)
    net.blobs["data"].data[...] = np.random.default_rng(2).standard_normal(net.blobs["data"].shape)
    net.clear_param_diffs()
    net.forward()
    net.backward()
    assert gradients_finite(net)
    weight = net.params["conv"][0]
    copy = net.executor.runner._copies.newest(weight, "diff")
    assert copy is not None  # the gradient's newest values are on the device
    copy.array[3] = np.nan
    assert not gradients_finite(net)
    assert weight.buffer("diff").pending is not None  # the check brought nothing back
    assert np.isnan(weight.diff.reshape(-1)[3])  # a host read does


@pytest.mark.parametrize("case", solver_cases.CASES)
def test_gpu_mode_training_on_a_stand_in_reproduces_caffe(case, tmp_path, monkeypatch):
    """``cct train`` on Caffe's reference solver cases with every batch on one device that does not hold host
    memory, as GPU mode runs (blobs, weights, gradients and history kept there, the update run there): Caffe's
    log lines and iteration-12 snapshot (the same check the GPU runs)."""
    monkeypatch.setattr(devices, "SPLIT_MIN_WEIGHT_REUSE", 0)
    kept = []
    bring_in = devices._Copies.bring_in
    monkeypatch.setattr(devices._Copies, "bring_in", lambda self, *a: (kept.append(a), bring_in(self, *a))[1])
    cct.set_devices(*SETTINGS["elsewhere alone"])
    solver_cases.check_train_reproduces_caffe(case, tmp_path, monkeypatch)
    assert kept  # (the stand-in device ran the layers)
