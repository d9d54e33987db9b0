"""Caffe's data parallelism (``cct.distributed.replicas``) on one-thread CPU devices standing in for GPUs:
N replicas of batch B train as one solver of batch N·B over the same records, only the root tests,
displays and snapshots, the replicas stay identical, and a failure anywhere is one error, not a hang."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from google.protobuf import text_format

from cct import cli, mode
from cct.cli import train as train_command
from cct.compare.tolerance import assert_close as assert_arrays_close
from cct.device import Device, backend, cupy_available
from cct.distributed import replicas as data_parallel
from cct.distributed.replicas import DataParallel
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb
from cct.solvers import SolverAction, create_solver
from tests.helpers import datum_lmdb
from tests.solvers.helpers import captured_log, key_lines, messages, set_fields, split_numbers

CPU1 = Device("cpu", 0, 1)
RECORDS = 32

IP_NET = """
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "SOURCE" batch_size: BATCH backend: LMDB } transform_param { scale: 0.00390625 } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
        data_param { source: "SOURCE" batch_size: 8 backend: LMDB } transform_param { scale: 0.00390625 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" include { phase: TEST } }
"""

CONV_NET = """
layer { name: "data" type: "Data" top: "data" top: "label"
        data_param { source: "SOURCE" batch_size: BATCH backend: LMDB } transform_param { scale: 0.00390625 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """An LMDB of 32 Datums of 1x4x4 with labels 0..2."""
    return datum_lmdb(tmp_path_factory.mktemp("dp") / "train_lmdb", RECORDS, 4, 5)


@pytest.fixture(autouse=True)
def _mode_restored():
    saved = dict(mode._state)
    yield
    mode._state.update(saved)


def solver_param(source: str, batch: int, net: str = IP_NET, **fields) -> pb.SolverParameter:
    p = pb.SolverParameter()
    text_format.Parse(net.replace("SOURCE", source).replace("BATCH", str(batch)), p.net_param)
    p.base_lr = 0.05
    p.lr_policy = "fixed"
    p.max_iter = 12
    p.random_seed = 11
    p.momentum = 0.9
    p.weight_decay = 0.01
    p.snapshot_after_train = False
    return set_fields(p, **fields)


def weights(solver) -> list[np.ndarray]:
    return [np.array(p.data) for p in solver.net.learnable_params]


def assert_close(ours: list[np.ndarray], theirs: list[np.ndarray], rtol: float = 1e-5) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_arrays_close(a, b, f"param {i}", rtol=rtol, reference="one solver")


def assert_replicas_identical(dp: DataParallel) -> None:
    root = weights(dp.root)
    for s in dp.solvers[1:]:
        assert s.iter == dp.root.iter
        for a, b in zip(weights(s), root):
            assert np.array_equal(a, b)


# ---- N replicas of batch B = one solver of batch N·B ---------------------------------------------------

@pytest.mark.parametrize("net, fields", [
    (IP_NET, {"type": "SGD"}),
    (IP_NET, {"type": "Adam", "momentum2": 0.999, "base_lr": 0.01}),
    (CONV_NET, {"type": "SGD"}),
    (CONV_NET, {"type": "Adam", "momentum2": 0.999, "base_lr": 0.01}),
    (CONV_NET, {"type": "Nesterov", "iter_size": 2, "clip_gradients": 0.05}),
], ids=["ip-sgd", "ip-adam", "conv-sgd", "conv-adam", "conv-nesterov-iter_size-clip"])
@pytest.mark.parametrize("n", [2, 4])
def test_replicas_train_as_one_solver_of_the_whole_batch(source, net, fields, n):
    batch = 8 // n  # rank r takes records r, r+n, ...: the replicas' batches together are the single batch
    single = create_solver(solver_param(source, 8, net, **fields))
    single.solve()
    dp = DataParallel(solver_param(source, batch, net, **fields), [CPU1] * n)
    dp.solve()
    assert dp.root.iter == single.iter == 12
    assert_close(weights(dp.root), weights(single))
    assert_replicas_identical(dp)
    # the clipping case really clips (otherwise it checks nothing)
    if fields.get("clip_gradients"):
        with captured_log() as buf:
            create_solver(solver_param(source, 8, net, **fields)).step(1)
        assert "Gradient clipping: scaling down gradients" in buf.getvalue()


@pytest.mark.parametrize("how", ["resume", "weights"])
def test_start_from_a_snapshot_or_weights_as_one_solver(source, tmp_path, how):
    first = create_solver(solver_param(source, 8, max_iter=4, snapshot=4, snapshot_prefix=str(tmp_path / "s")))
    first.solve()
    state, model = tmp_path / "s_iter_4.solverstate", str(tmp_path / "s_iter_4.caffemodel")
    extra = {"max_iter": 9} if how == "resume" else {"max_iter": 5, "random_seed": 99}
    single_param, dp_param = solver_param(source, 8, **extra), solver_param(source, 4, **extra)
    if how == "weights":
        single_param.weights.append(model)
        dp_param.weights.append(model)
    single = create_solver(single_param)
    dp = DataParallel(dp_param, [CPU1, CPU1])
    assert dp.solvers[1].param.weights == []  # the broadcast gives it the root's
    if how == "resume":
        single.solve(str(state))
        dp.solve(str(state))
    else:
        single.solve()
        dp.solve()
    assert dp.root.iter == single.iter
    assert_close(weights(dp.root), weights(single))
    assert_replicas_identical(dp)


# ---- only the root tests, displays and snapshots -----------------------------------------------------

def _spy_snapshots(dp: DataParallel) -> list[int]:
    calls: list[int] = []
    for s in dp.solvers[1:]:
        s.snapshot = lambda s=s: calls.append(s.iter)
    return calls


def test_only_the_root_tests_displays_and_snapshots(source, tmp_path):
    fields = {"display": 2, "test_iter": [2], "test_interval": 3, "snapshot": 4,
              "snapshot_after_train": True, "max_iter": 10}
    with captured_log() as buf:
        single = create_solver(solver_param(source, 8, snapshot_prefix=str(tmp_path / "one"), **fields))
        single.solve()
    single_lines = key_lines(buf.getvalue().replace(str(tmp_path / "one"), str(tmp_path / "dp")))
    with captured_log() as buf:
        dp = DataParallel(solver_param(source, 4, snapshot_prefix=str(tmp_path / "dp"), **fields), [CPU1, CPU1])
        worker_snapshots = _spy_snapshots(dp)
        dp.solve()
    text = buf.getvalue()
    assert len(dp.root.test_nets) == 1 and dp.solvers[1].test_nets == []
    assert not dp.solvers[1].is_root and dp.root.is_root
    # the same progress lines as one solver (one set: the other replica is silent), its own numbers
    lines = key_lines(text)
    assert [split_numbers(x)[0] for x in lines] == [split_numbers(x)[0] for x in single_lines]
    assert sum(m.startswith("Iteration 4, Testing net (#0)") for m in messages(text)) == 0
    assert sum(m.startswith("Iteration 6, Testing net (#0)") for m in messages(text)) == 1
    assert sum(m.startswith("Initializing solver from parameters") for m in messages(text)) == 1
    assert messages(text).count("Creating Layer ip") == 2  # the root's train + test net
    assert worker_snapshots == []
    written = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("dp_"))
    assert written == ["dp_iter_10.caffemodel", "dp_iter_10.solverstate", "dp_iter_4.caffemodel",
                       "dp_iter_4.solverstate", "dp_iter_8.caffemodel", "dp_iter_8.solverstate"]
    assert_replicas_identical(dp)


def test_signals_act_on_all_replicas_through_the_root(source, tmp_path):
    dp = DataParallel(solver_param(source, 4, snapshot_prefix=str(tmp_path / "dp"), snapshot_after_train=True),
                      [CPU1, CPU1, CPU1])
    asked: list[int] = []

    def action() -> SolverAction:
        asked.append(dp.root.iter)
        return {3: SolverAction.SNAPSHOT, 5: SolverAction.STOP}.get(dp.root.iter, SolverAction.NONE)

    dp.root.set_action_function(action)
    worker_snapshots = _spy_snapshots(dp)
    with captured_log() as buf:
        dp.solve()
    assert asked == [1, 2, 3, 4, 5]
    assert "Optimization stopped early." in messages(buf.getvalue())
    assert all(s.iter == 5 for s in dp.solvers)
    assert worker_snapshots == []
    written = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("dp_"))
    assert written == ["dp_iter_3.caffemodel", "dp_iter_3.solverstate", "dp_iter_5.caffemodel", "dp_iter_5.solverstate"]
    assert_replicas_identical(dp)


# ---- failures: one error, no hang ----------------------------------------------------------------------

def _solve_in_thread(dp: DataParallel, seconds: float = 30.0) -> BaseException | None:
    result: list[BaseException | None] = [None]

    def body() -> None:
        try:
            dp.solve()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            result[0] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "data-parallel training hung after a failure"
    assert not [t for t in threading.enumerate() if t.name.startswith("cct-solver-rank-")]
    return result[0]


def _fail_forward(solver, at_call: int, error: BaseException, sleep: float = 0.0) -> None:
    layer = solver.net.layer_by_name("loss")
    original = layer.forward
    calls = [0]

    def forward(bottom, top):
        calls[0] += 1
        if calls[0] == at_call:
            if sleep:
                threading.Event().wait(sleep)
            else:
                raise error
        original(bottom, top)

    layer.forward = forward


@pytest.mark.parametrize("rank, error, expected", [
    (1, RuntimeError("boom"), "solver rank 1 of 3 (cpu:1): RuntimeError: boom"),
    (2, CctError("layer 'loss': bad label"), "solver rank 2 of 3 (cpu:1): <net_param>: layer 'loss': bad label "
                                             "(the net's data comes from SOURCE)"),
    (0, ValueError("root\nbroke"), "solver rank 0 of 3 (cpu:1): ValueError: root broke"),
])
def test_a_failing_replica_stops_all_with_one_error(source, rank, error, expected):
    dp = DataParallel(solver_param(source, 4, display=1), [CPU1, CPU1, CPU1])
    _fail_forward(dp.solvers[rank], 3, error)
    with captured_log():
        raised = _solve_in_thread(dp)
    assert isinstance(raised, CctError) and str(raised) == expected.replace("SOURCE", source)
    assert all(s.iter <= 3 for s in dp.solvers)


def test_a_replica_that_does_not_arrive_times_out(source):
    dp = DataParallel(solver_param(source, 4), [CPU1, CPU1], timeout=0.3)
    _fail_forward(dp.solvers[1], 2, RuntimeError("unused"), sleep=1.0)
    with captured_log():
        raised = _solve_in_thread(dp)
    assert isinstance(raised, CctError)
    assert "waited more than 0.3 s for the other replicas at the gradient exchange" in str(raised)


# ---- the command line ----------------------------------------------------------------------------------

def _write_solver(tmp_path, source: str, **fields) -> None:
    p = solver_param(source, 4, display=4, snapshot=6, snapshot_prefix="snap", snapshot_after_train=True,
                     **fields)
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(p))


def _run(*args: str) -> tuple[int, str]:
    with captured_log() as buf:
        rc = cli.main(list(args))
    return rc, buf.getvalue()


@pytest.mark.skipif(cupy_available, reason="checks the message without cupy")
def test_cli_several_gpus_without_cupy_is_one_line(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_solver(tmp_path, source)
    rc, out = _run("train", "-solver", "solver.prototxt", "-gpu", "0,1")
    fatal = messages(out, "F")
    assert rc == 1 and len(fatal) == 1 and "GPU mode needs cupy" in fatal[0] and "Traceback" not in out


def test_cli_several_gpus_trains_data_parallel(source, tmp_path, monkeypatch):
    """``cct train -gpu 0,1`` with the GPUs replaced by CPU stand-ins (no CUDA here)."""
    built: list[DataParallel] = []

    class OnCpus(DataParallel):
        def __init__(self, param, devices, **kw):
            assert [str(d) for d in devices] == ["gpu:0", "gpu:1"]
            super().__init__(param, [CPU1] * len(devices), **kw)
            built.append(self)

    monkeypatch.setattr(train_command, "parse_gpus", lambda value: [0, 1] if value else [])
    monkeypatch.setattr(backend, "gpu_name", lambda g: "Stand-in")
    monkeypatch.setattr(mode, "set_mode_gpu", lambda: None)
    monkeypatch.setattr(data_parallel, "DataParallel", OnCpus)
    monkeypatch.chdir(tmp_path)
    _write_solver(tmp_path, source)
    rc, out = _run("train", "-solver", "solver.prototxt", "-gpu", "0,1")
    msgs = messages(out)
    assert rc == 0, out
    assert msgs.count("Using GPUs 0, 1") == 1 and "GPU 1: Stand-in" in msgs
    assert msgs.index("Starting Optimization") < msgs.index("Solving ")
    assert msgs[-1] == "Optimization Done." and "Snapshotting to binary proto file snap_iter_12.caffemodel" in msgs
    assert [m for m in msgs if m.startswith("Iteration") and "loss" in m][-1].startswith("Iteration 12, loss")
    assert_replicas_identical(built[0])

    # resume both replicas from the iteration-6 snapshot, to iteration 8
    _write_solver(tmp_path, source, max_iter=8)
    rc, out = _run("train", "-solver", "solver.prototxt", "-gpu", "0,1", "-snapshot", "snap_iter_6.solverstate")
    msgs = messages(out)
    assert rc == 0, out
    assert "Resuming from snap_iter_6.solverstate" in msgs
    assert all(s.iter == 8 for s in built[1].solvers)
    assert_replicas_identical(built[1])


def test_solving_again_goes_on_from_where_it_stopped(source):
    single = create_solver(solver_param(source, 8, max_iter=10))
    single.solve()
    dp = DataParallel(solver_param(source, 4, max_iter=6), [CPU1, CPU1])
    dp.solve()
    dp.root.param.max_iter = 10  # the root's settings are the replicas' too
    dp.solve()
    assert all(s.iter == 10 for s in dp.solvers)
    assert_close(weights(dp.root), weights(single))
    assert_replicas_identical(dp)


def test_a_replica_trains_only_through_data_parallel(source):
    dp = DataParallel(solver_param(source, 4), [CPU1, CPU1])
    for rank in (0, 1):
        with pytest.raises(CctError, match=f"solver rank {rank} of 2 is a data-parallel replica"):
            dp.solvers[rank].step(1)
    dp.solvers[1].iter = 3
    with pytest.raises(CctError, match="the replicas are at iterations 0, 3"):
        dp.solve()


def test_concurrent_replicas_never_run_blas_with_more_threads_than_they_were_given(source, monkeypatch):
    """Replicas on cpu:1 and cpu:2 compute at the same time in two threads, each asking for its device's BLAS
    threads around every layer: the process-wide count seen inside any layer never exceeds what that replica
    was given, and it is back where it was after training (one owner keeps the books: cct.runtime.threads).
    Two cores whatever the machine has: a replica's whole-batch layers run on at most the machine's cores."""
    from cct.exec import device_split
    from cct.layers.inner_product import InnerProductLayer
    from cct.runtime.threads import BUDGET

    monkeypatch.setattr(device_split, "cpu_cores", lambda: 2)

    seen: list[tuple[int | None, int]] = []
    real = InnerProductLayer.forward

    def forward(self, bottom, top):
        for _ in range(3):  # while the other replica's thread runs (sleeping lets it)
            seen.append((BUDGET.thread_budget(), BUDGET.process_count()))
            time.sleep(0.0005)
        return real(self, bottom, top)

    monkeypatch.setattr(InnerProductLayer, "forward", forward)
    before = BUDGET.process_count()
    dp = DataParallel(solver_param(source, 4, max_iter=20), [Device("cpu", 0, 1), Device("cpu", 0, 2)])
    dp.solve()
    assert len(seen) >= 40
    assert all(own is not None and count <= own for own, count in seen), seen
    assert {own for own, _ in seen} == {1, 2}
    assert BUDGET.process_count() == before
