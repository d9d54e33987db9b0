"""pycaffe's multi-process training (Caffe's ``python/train.py``): one process per device, joined by
``caffe.NCCL(solver, uid)`` — two processes of batch B train as one process of batch 2B, their weights
bitwise identical; a process that fails, or ends without a word, stops the other with one error at its next
exchange instead of a hang."""
from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
from google.protobuf import text_format

from cct.compare.tolerance import assert_close
from cct.proto import caffe_pb2 as pb
from tests.helpers import datum_lmdb

NET = """
layer { name: "data" type: "Data" top: "data" top: "label"
        data_param { source: "SOURCE" batch_size: BATCH backend: LMDB } transform_param { scale: 0.00390625 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
STEPS = 6


def _solver_file(folder, source: str, batch: int) -> str:
    p = pb.SolverParameter()
    text_format.Parse(NET.replace("SOURCE", source).replace("BATCH", str(batch)), p.net_param)
    p.type, p.base_lr, p.lr_policy, p.momentum, p.weight_decay = "SGD", 0.05, "fixed", 0.9, 0.01
    p.max_iter, p.random_seed, p.solver_mode, p.snapshot_after_train = STEPS, 3, pb.SolverParameter.CPU, False
    path = os.path.join(folder, f"solver_{batch}.prototxt")
    with open(path, "w") as f:
        f.write(text_format.MessageToString(p))
    return path


def _solve(solver_file: str, uid: bytes, rank: int, count: int, out: str, fail_at: int = -1,
           failure: str = "raise") -> None:
    """What ``python/train.py``'s ``solve`` does in each process; at iteration ``fail_at`` it fails in its own
    code (``failure``: raise an error, or end the process at once); the error that ends it is kept in
    ``out + ".err"``."""
    import cct as caffe

    caffe.init_log(stream=open(os.devnull, "w"))  # noqa: SIM115
    caffe.set_mode_cpu()
    caffe.set_solver_count(count)
    caffe.set_solver_rank(rank)
    caffe.set_multiprocess(True)
    solver = caffe.SGDSolver(solver_file)
    nccl = caffe.NCCL(solver, uid, timeout=20)
    nccl.bcast()
    solver.add_callback(nccl)
    if solver.param.layer_wise_reduce:
        solver.net.after_backward(nccl)
    if fail_at >= 0:
        def boom():
            if solver.iter == fail_at:
                if failure == "exit":
                    os._exit(3)  # no cleanup, as a killed process
                raise RuntimeError(f"injected failure of rank {rank}")
        solver.add_callback(lambda: None, boom)
    try:
        solver.step(solver.param.max_iter)
    except Exception as e:
        with open(out + ".err", "w") as f:
            f.write(str(e))
        raise
    finally:
        nccl.close()
    np.savez(out, *[np.array(p.data) for p in solver.net.learnable_params])


def _run_processes(solver_file: str, count: int, folder, fail_rank: int = -1, failure: str = "raise") -> list[int]:
    import cct

    ctx = multiprocessing.get_context("spawn")
    uid = cct.NCCL.new_uid()
    procs = [ctx.Process(target=_solve, args=(solver_file, uid, r, count, os.path.join(folder, f"rank{r}.npz"),
                                              3 if r == fail_rank else -1, failure)) for r in range(count)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return datum_lmdb(tmp_path_factory.mktemp("nccl") / "train_lmdb", 24, 6, 9)


def test_two_processes_train_as_one_of_the_doubled_batch(source, tmp_path):
    import cct

    assert cct.has_nccl()
    codes = _run_processes(_solver_file(tmp_path, source, 4), 2, tmp_path)
    assert codes == [0, 0]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    cct.init_log(stream=open(os.devnull, "w"))  # noqa: SIM115
    single = cct.SGDSolver(_solver_file(tmp_path, source, 8))
    single.step(STEPS)
    cct.init_log()
    for i, p in enumerate(single.net.learnable_params):
        a, b = ranks[0][f"arr_{i}"], ranks[1][f"arr_{i}"]
        assert np.array_equal(a, b), f"param {i}: the ranks differ"
        assert_close(a, np.array(p.data), f"param {i}", rtol=1e-5, reference="one process of batch 8")


@pytest.mark.parametrize("failure", ["raise", "exit"])
def test_a_failing_process_stops_the_other(failure, source, tmp_path):
    """Rank 1 fails in its own code (not in an exchange), by an error or by ending at once: rank 0, waiting for
    it at the gradient exchange, sees its process gone and stops with an error naming it — not at the end of
    its 20 s wait."""
    codes = _run_processes(_solver_file(tmp_path, source, 4), 2, tmp_path, fail_rank=1, failure=failure)
    assert codes[0] != 0 and codes[1] != 0  # both ended, none hangs
    error = (tmp_path / "rank0.npz.err").read_text()
    assert "solver rank 1 of 2 ended before the gradient exchange; stopping rank 0" in error, error


def test_a_rank_is_seen_gone_once_its_exchange_is_closed_and_a_rank_is_held_once():
    """The liveness test behind the above, in one process (each exchange holds its own lock file): a joined rank
    is alive while its exchange is open, gone once closed; a rank's lock held by one exchange refuses another."""
    from cct.distributed.processes import ProcessExchange, new_uid
    from cct.errors import CctError

    uid = new_uid()
    first = ProcessExchange(uid, 0, 2, 5, timeout=5)
    assert first._gone() is None  # rank 1 has not joined: not tested
    second = ProcessExchange(uid, 1, 2, 5, timeout=5)
    try:
        assert first._gone() is None and second._gone() is None
        with pytest.raises(CctError, match="solver rank 1 of this uid is already taken"):
            ProcessExchange(uid, 1, 2, 5, timeout=5)
    finally:
        second.close()
    assert first._gone() == 1
    with pytest.raises(CctError, match="solver rank 1 of 2 ended before the gradient exchange; stopping rank 0"):
        first.barrier("gradient exchange")
    first.close()
