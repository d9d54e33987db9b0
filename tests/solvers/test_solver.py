"""The solver loop: net construction and states, display/smoothing, tests, snapshots and restore,
callbacks, requested actions, atomic snapshots and the pycaffe members."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
from google.protobuf import text_format

from cct import solvers
from cct.errors import CctError
from cct.io.weights import read_caffemodel, read_solverstate
from cct.proto import caffe_pb2 as pb
from cct.solvers import SolverAction
from tests.solvers.helpers import TINY_NET, captured_log, feed, feed_solver, messages, tiny_solver_param

TYPES = {
    "SGD": dict(momentum=0.9), "Nesterov": dict(momentum=0.9), "AdaGrad": dict(),
    "RMSProp": dict(rms_decay=0.9), "AdaDelta": dict(momentum=0.9, base_lr=1.0),
    "Adam": dict(momentum=0.9, momentum2=0.999, base_lr=0.01),
}


def _solver(**fields):
    with captured_log():
        s = solvers.create_solver(tiny_solver_param(**fields))
    feed_solver(s)
    return s


def _weights(solver):
    return [p.data.copy() for p in solver.net.learnable_params]


# ---- construction ----------------------------------------------------------------------------------

def test_train_net_must_be_given_exactly_once(tmp_path):
    p = tiny_solver_param()
    p.ClearField("net_param")
    with captured_log(), pytest.raises(CctError, match="must specify a train net"):
        solvers.SGDSolver(p)
    p = tiny_solver_param()
    text_format.Parse(TINY_NET, p.train_net_param)
    with captured_log(), pytest.raises(CctError, match="must not contain more than one"):
        solvers.SGDSolver(p)


def test_test_nets_order_states_and_checks(tmp_path):
    net = pb.NetParameter()
    text_format.Parse(TINY_NET, net)
    p = tiny_solver_param(test_iter=[1, 1, 1], test_interval=5)
    p.test_net_param.add().CopyFrom(net)
    p.test_state.add(stage=["a"])
    p.test_state.add(level=3)
    p.test_state.add()
    with captured_log() as buf:
        s = solvers.SGDSolver(p)
    assert len(s.test_nets) == 3  # one test_net_param + two copies of the generic net_param
    assert [m for m in messages(buf.getvalue()) if m.startswith("Creating test net")] == [
        "Creating test net (#0) specified by test_net_param", "Creating test net (#1) specified by net_param",
        "Creating test net (#2) specified by net_param"]
    assert "acc" in s.test_nets[0]._layer_names and "acc" not in s.net._layer_names
    with captured_log(), pytest.raises(CctError, match="test_state must be unspecified or specified once"):
        solvers.SGDSolver(tiny_solver_param(test_iter=[1], test_interval=1, test_state=[pb.NetState()] * 2))
    with captured_log(), pytest.raises(CctError, match="test_interval > 0"):
        solvers.SGDSolver(tiny_solver_param(test_iter=[1]))
    p = tiny_solver_param(test_iter=[1], test_interval=1)
    p.ClearField("net_param")
    text_format.Parse(TINY_NET, p.train_net_param)
    with captured_log(), pytest.raises(CctError, match="test_iter must be specified for each test network"):
        solvers.SGDSolver(p)


def test_train_state_merges_over_the_file_state():
    p = tiny_solver_param()
    p.net_param.state.stage.append("from_file")
    p.net_param.state.level = 2
    p.train_state.stage.append("from_solver")
    p.train_state.level = 5
    p.net_param.layer.add(name="only_b", type="Silence", bottom=["ip2"]).include.add(stage=["from_solver"])
    p.net_param.layer.add(name="not_c", type="Silence", bottom=["ip2"]).include.add(max_level=4)
    with captured_log():
        s = solvers.SGDSolver(p)
    assert "only_b" in s.net._layer_names and "not_c" not in s.net._layer_names


def test_random_seed_makes_initial_weights_reproducible():
    a, b, c = _solver(random_seed=3), _solver(random_seed=3), _solver(random_seed=4)
    for x, y in zip(_weights(a), _weights(b)):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, z) for x, z in zip(_weights(a), _weights(c)))


def test_average_loss_must_be_positive():
    with captured_log(), pytest.raises(CctError, match="average_loss"):
        solvers.SGDSolver(tiny_solver_param(average_loss=0))


# ---- the loop ----------------------------------------------------------------------------------

def test_display_smoothing_tests_and_final_lines():
    s = _solver(momentum=0.9, display=2, average_loss=3, test_iter=[2], test_interval=3,
                test_compute_loss=True, max_iter=6)
    raw = []
    s.add_callback(None, lambda: raw.append(float(s.net.blobs["loss"].data)))
    with captured_log() as buf:
        s.solve()
    msgs = messages(buf.getvalue())
    shown = [m for m in msgs if m.startswith("Iteration ") and "iter/s" in m]
    assert [m.split()[1] for m in shown] == ["0", "2", "4"]
    for m in shown:
        it = int(m.split()[1])
        window = raw[max(0, it - 2):it + 1]
        assert float(m.rsplit("= ", 1)[1]) == pytest.approx(np.mean(window), rel=1e-5)
    assert sum(m.startswith("Iteration ") and m.endswith("Testing net (#0)") for m in msgs) == 3  # 0, 3, 6
    assert sum(m.startswith("Test loss: ") for m in msgs) == 3
    assert "    Test net output #0: acc = " in "\n".join(msgs)
    assert msgs[-1] == "Optimization Done."
    assert msgs[-6].startswith("Iteration 6, loss = ")  # the extra forward pass, then the final test
    assert msgs[-5] == "Iteration 6, Testing net (#0)"
    assert "    Train net output #0: loss = " in "\n".join(msgs)
    assert any(m.startswith("Iteration 2, lr = 0.1") for m in msgs)


def test_display_rate_agrees_with_its_lapse_on_fast_iterations():
    """A tiny net runs an iteration in well under a millisecond: the rate is iterations / lapse, and the lapse
    is never printed as 0 s next to a finite rate (Caffe's whole-millisecond timer would print
    "(1 iter/s, 0s/1 iters)")."""
    s = _solver(display=1, max_iter=5)
    with captured_log() as buf:
        s.solve()
    shown = [re.search(r"\(([-\d.e+]+) iter/s, ([-\d.e+]+)s/(\d+) iters\)", m)
             for m in messages(buf.getvalue()) if "iter/s" in m]
    assert len(shown) == 5
    for m in shown[1:]:  # iteration 0's line has no interval before it
        rate, lapse, n = float(m.group(1)), float(m.group(2)), int(m.group(3))
        assert lapse > 0 and rate == pytest.approx(n / lapse, rel=1e-3)


def test_no_initial_test_when_disabled():
    s = _solver(test_iter=[1], test_interval=2, test_initialization=False, max_iter=2)
    with captured_log() as buf:
        s.step(2)
    assert not any("Testing net" in m for m in messages(buf.getvalue()))


def test_callbacks_run_in_caffes_order():
    s = _solver(max_iter=2)
    events = []

    class Recorder:
        def on_start(self):
            events.append(("start", s.iter, float(np.abs(s.net.learnable_params[0].diff).sum())))

        def on_gradients_ready(self):
            events.append(("ready", s.iter, float(np.abs(s.net.learnable_params[0].diff).sum())))

    s.add_callback(Recorder())
    with captured_log():
        s.step(2)
    assert [e[:2] for e in events] == [("start", 0), ("ready", 0), ("start", 1), ("ready", 1)]
    assert events[0][2] == 0 and events[1][2] > 0  # diffs cleared before, gradients present after


def test_apply_update_increments_iter_and_share_weights():
    s = _solver()
    with captured_log():
        s.net.clear_param_diffs()
        s.net.forward_backward()
        before = _weights(s)
        s.apply_update()
    assert s.iter == 1 and s.max_iter == 10
    assert not np.array_equal(before[0], s.net.learnable_params[0].data)
    from cct.pycaffe import TEST, Net

    with captured_log():
        other = Net(s.net.to_proto(), TEST)
    s.share_weights(other)
    assert other.params["ip1"][0].data is not None
    np.testing.assert_array_equal(other.params["ip1"][0].data, s.net.params["ip1"][0].data)
    s.net.params["ip1"][0].data[...] += 1
    np.testing.assert_array_equal(other.params["ip1"][0].data, s.net.params["ip1"][0].data)


def test_debug_info_logs_net_statistics_on_display_iterations():
    s = _solver(display=1, debug_info=True, max_iter=1)
    with captured_log() as buf:
        s.step(1)
    assert any("[Backward] All net params" in m for m in messages(buf.getvalue()))


# ---- actions and snapshots -----------------------------------------------------------------------

def test_stop_request_snapshots_and_stops(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = _solver(snapshot_prefix="snap", snapshot_after_train=True, max_iter=10)
    requests = iter([SolverAction.NONE, SolverAction.SNAPSHOT, SolverAction.STOP])
    s.set_action_function(lambda: next(requests, SolverAction.NONE))
    with captured_log() as buf:
        s.solve()
    msgs = messages(buf.getvalue())
    assert s.iter == 3 and msgs[-1] == "Optimization stopped early."
    assert sorted(os.listdir(tmp_path)) == ["snap_iter_2.caffemodel", "snap_iter_2.solverstate",
                                            "snap_iter_3.caffemodel", "snap_iter_3.solverstate"]


@pytest.mark.parametrize("kind", list(TYPES))
def test_resume_equals_straight_run(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fields = dict(type=kind, **TYPES[kind], max_iter=8, snapshot=4, snapshot_prefix="snap",
                  lr_policy="multistep", stepvalue=[2, 5], gamma=0.5, weight_decay=0.01)
    straight = _solver(**fields)
    with captured_log():
        straight.solve()
    assert read_solverstate("snap_iter_4.solverstate").current_step == 1
    resumed = _solver(**fields)
    with captured_log() as buf:
        resumed.solve("snap_iter_4.solverstate")
    msgs = messages(buf.getvalue())
    assert "Restoring previous solver status from snap_iter_4.solverstate" in msgs
    assert "SGDSolver: restoring history" in msgs
    assert resumed.iter == 8 and resumed.current_step == straight.current_step == 2
    for a, b in zip(_weights(straight), _weights(resumed)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(straight.history, resumed.history):
        np.testing.assert_array_equal(a.data, b.data)


def test_snapshot_contents_and_snapshot_diff(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = _solver(type="Adam", momentum=0.9, snapshot_prefix="out/snap", snapshot_diff=True, max_iter=2)
    os.mkdir("out")
    with captured_log() as buf:
        s.step(2)
        s.snapshot()
    assert "Snapshotting to binary proto file out/snap_iter_2.caffemodel" in messages(buf.getvalue())
    assert "Snapshotting solver state to binary proto file out/snap_iter_2.solverstate" in messages(buf.getvalue())
    state = read_solverstate("out/snap_iter_2.solverstate")
    assert state.iter == 2 and state.learned_net == "out/snap_iter_2.caffemodel"
    assert len(state.history) == 2 * len(s.net.learnable_params)
    assert [tuple(h.shape.dim) for h in state.history] == [p.shape for p in s.net.learnable_params] * 2
    model = read_caffemodel("out/snap_iter_2.caffemodel")
    ip1 = next(layer for layer in model.layer if layer.name == "ip1")
    np.testing.assert_array_equal(np.array(ip1.blobs[0].diff, dtype=np.float32),
                                  s.net.params["ip1"][0].diff.ravel())


def test_hdf5_snapshot_roundtrip(tmp_path, monkeypatch):
    pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    fields = dict(type="AdaDelta", momentum=0.9, base_lr=1.0, snapshot_prefix="h",
                  snapshot_format=pb.SolverParameter.HDF5, snapshot=2, max_iter=4)
    straight = _solver(**fields)
    with captured_log() as buf:
        straight.solve()
    assert "Snapshotting to HDF5 file h_iter_2.caffemodel.h5" in messages(buf.getvalue())
    assert "Snapshotting solver state to HDF5 file h_iter_2.solverstate.h5" in messages(buf.getvalue())
    resumed = _solver(**fields)
    with captured_log():
        resumed.solve("h_iter_2.solverstate.h5")
    for a, b in zip(_weights(straight), _weights(resumed)):
        np.testing.assert_array_equal(a, b)


def test_history_length_must_match(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sgd = _solver(snapshot_prefix="s", max_iter=1)
    with captured_log():
        sgd.step(1)
        sgd.snapshot()
    adam = _solver(type="Adam", snapshot_prefix="s")
    with captured_log(), pytest.raises(CctError, match="Incorrect length of history blobs"):
        adam.restore("s_iter_1.solverstate")


def test_snapshot_prefix_rules_from_a_solver_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = tiny_solver_param(snapshot=1)
    (tmp_path / "my_solver.prototxt").write_text(text_format.MessageToString(p))
    with captured_log():
        s = solvers.SGDSolver("my_solver.prototxt")
    assert s.param.snapshot_prefix == "my_solver"  # unset: the solver file's path minus its extension
    os.mkdir("snaps")
    p.snapshot_prefix = "snaps"
    (tmp_path / "my_solver.prototxt").write_text(text_format.MessageToString(p))
    with captured_log() as buf:
        s = solvers.SGDSolver("my_solver.prototxt")
    assert s.param.snapshot_prefix == os.path.join("snaps", "my_solver")
    assert "snapshot_prefix is a directory and is set to snaps/my_solver" in messages(buf.getvalue())
    with captured_log(), pytest.raises(CctError, match="Cannot write to snapshot prefix 'nowhere/x'"):
        solvers.SGDSolver(tiny_solver_param(snapshot=1, snapshot_prefix="nowhere/x"))
    with captured_log(), pytest.raises(CctError, match="snapshot is specified but snapshot_prefix is not"):
        solvers.SGDSolver(tiny_solver_param(snapshot=1))


def test_a_kill_during_a_snapshot_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = _solver(momentum=0.9, snapshot_prefix="snap", max_iter=2)
    with captured_log():
        s.step(2)
        s.snapshot()
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with captured_log():
        s.step(1)
    s.iter = 2  # snapshot again under the same names, and die half-way through writing
    real_fdopen = os.fdopen

    def dying_fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        real_write = f.write

        def write(data):
            real_write(data[: len(data) // 2])
            raise KeyboardInterrupt  # as if killed mid-write

        f.write = write
        return f

    monkeypatch.setattr(os, "fdopen", dying_fdopen)
    with captured_log(), pytest.raises(KeyboardInterrupt):
        s.snapshot()
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    after = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    assert after == before  # same files, same bytes, no temporary left behind


def test_pycaffe_members(tmp_path, monkeypatch):
    s = _solver(test_iter=[1], test_interval=5)
    assert s.iter == 0 and len(s.test_nets) == 1 and s.net.name == "Tiny"
    assert s.param.max_iter == 10 and s.param.display == 0 and s.param.layer_wise_reduce
    with captured_log():
        s.step(1)
    assert s.iter == 1
    feed(s.net)
