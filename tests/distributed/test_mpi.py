"""``mpiexec -n 2 cct train`` for real (skipped without mpiexec or mpi4py): two ranks of batch 64 train the digits
LeNet as one process of batch 128 (every overlap mode, FC replication, iter_size, snapshot/resume), the ranks
end bitwise identical, and a rank that fails, dies or hangs ends the whole job with one line, never a hang."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from cct.compare.tolerance import assert_close
from cct.io.weights import read_caffemodel, read_solverstate
from cct.proto import caffe_pb2 as pb
from cct.solvers import create_solver

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "models" / "digits"
MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                                reason="needs mpiexec and mpi4py (pip install 'cct[mpi]')")

SOLVER = """
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75
display: 2 max_iter: 10 random_seed: 1701 solver_mode: CPU snapshot_after_train: true
"""
FAULT = """layer { name: "fault" type: "Python" bottom: "label" include { phase: TRAIN }
        python_param { module: "tests.distributed.mpi_faults" layer: "Fault" param_str: "%s" } }"""


def net_text(batch: int, fault: str = "") -> str:
    text = (DIGITS / "lenet_train_test.prototxt").read_text()
    text = text.replace('source: "models/digits/digits_train_lmdb" batch_size: 64',
                        f'source: "{DIGITS}/digits_train_lmdb" batch_size: {batch}')
    text = text.replace('source: "models/digits/digits_test_lmdb"', f'source: "{DIGITS}/digits_test_lmdb"')
    assert f"batch_size: {batch}" in text
    return text + (FAULT % fault if fault else "")


def solver_param(tmp: Path, batch: int, name: str, fault: str = "", **fields) -> pb.SolverParameter:
    p = pb.SolverParameter()
    text_format.Parse(SOLVER, p)
    text_format.Parse(net_text(batch, fault), p.net_param)
    p.snapshot_prefix = str(tmp / name)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def write_solver(tmp: Path, batch: int, name: str, fault: str = "", **fields) -> Path:
    path = tmp / f"{name}.prototxt"
    path.write_text(text_format.MessageToString(solver_param(tmp, batch, name, fault, **fields)))
    return path


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_mpi_yield_when_idle="1", OPENBLAS_NUM_THREADS="1", CCT_PARTITIONS="1")
    return env


def mpirun(*args: str, n: int = 2, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [MPIEXEC, "--oversubscribe", "-n", str(n), sys.executable, "-m", "cct", "train", *args]
    return subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def model_weights(path: Path) -> list[np.ndarray]:
    net = read_caffemodel(str(path))
    return [np.array(b.data, dtype=np.float32) for layer in net.layer for b in layer.blobs]


def assert_same_weights(ours: list[np.ndarray], reference: list[np.ndarray]) -> None:
    assert len(ours) == len(reference)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert_close(a, b.reshape(-1), f"param {i}", rtol=1e-5, reference="one process of batch 128")


def ranks_identical(log: str) -> bool:
    lines = [line for line in log.splitlines() if "MPI final weights SHA-256 per rank" in line]
    return len(lines) == 1 and lines[0].endswith("(identical)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[np.ndarray]]:
    """One process of batch 128: 10 iterations; 5 iterations at iter_size 2; 5 + resume to 10."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    solver = create_solver(solver_param(tmp, 128, "plain"))
    solver.solve()
    out["plain"] = [np.array(p.data) for p in solver.net.learnable_params]
    solver = create_solver(solver_param(tmp, 128, "iter_size", iter_size=2, max_iter=5))
    solver.solve()
    out["iter_size"] = [np.array(p.data) for p in solver.net.learnable_params]
    create_solver(solver_param(tmp, 128, "first", max_iter=5)).solve()
    solver = create_solver(solver_param(tmp, 128, "resumed"))
    solver.solve(str(tmp / "first_iter_5.solverstate"))
    out["resumed"] = [np.array(p.data) for p in solver.net.learnable_params]
    finetune = solver_param(tmp, 128, "finetuned", max_iter=4)
    finetune.weights.append(str(tmp / "first_iter_5.caffemodel"))
    solver = create_solver(finetune)
    solver.solve()
    out["finetuned"] = [np.array(p.data) for p in solver.net.learnable_params]
    out["weights_file"] = str(tmp / "first_iter_5.caffemodel")
    return out


def final_model(tmp: Path, name: str, iteration: int = 10) -> list[np.ndarray]:
    return model_weights(tmp / f"{name}_iter_{iteration}.caffemodel")


# ---- two ranks of batch 64 = one process of batch 128 -------------------------------------------------------

@pytest.mark.parametrize("flags", [
    ("-overlap", "none"),
    ("-overlap", "layer"),
    ("-overlap", "lee", "-chunk_split", "pool1", "-replicate_fc", "0"),
    ("-overlap", "lee", "-chunk_split", "pool1", "-replicate_fc", "1"),
    ("-overlap", "lee", "-chunk_split", "pool1", "-replicate_fc", "2"),
], ids=["none", "layer", "lee-f0", "lee-f1", "lee-f2"])
def test_two_ranks_train_as_one_process_of_the_doubled_batch(tmp_path, reference, flags):
    solver = write_solver(tmp_path, 64, "mpi")
    run = mpirun("-solver", str(solver), *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_weights(final_model(tmp_path, "mpi"), reference["plain"])
    assert ranks_identical(run.stderr), run.stderr[-3000:]
    ratio_lines = [line for line in run.stderr.splitlines() if "overlap R" in line]
    assert len(ratio_lines) == 5  # every display interval (iterations 0, 2, 4, 6, 8), on rank 0 only
    assert "(Eq. 11)" in ratio_lines[0] and "MPI 2 ranks:" in ratio_lines[0]


def test_iter_size_2_with_replication_and_auto_split(tmp_path, reference):
    solver = write_solver(tmp_path, 64, "mpi", iter_size=2, max_iter=5)
    run = mpirun("-solver", str(solver), "-overlap", "lee", "-chunk_split", "auto", "-replicate_fc", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "MPI chunk split auto: after layer pool1" in run.stderr
    assert_same_weights(final_model(tmp_path, "mpi", 5), reference["iter_size"])
    assert ranks_identical(run.stderr)


def test_snapshot_then_resume_as_one_process(tmp_path, reference):
    first = write_solver(tmp_path, 64, "first", max_iter=5)
    run = mpirun("-solver", str(first), "-overlap", "lee", "-chunk_split", "2", "-replicate_fc", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = write_solver(tmp_path, 64, "resumed")
    run = mpirun("-solver", str(resumed), "-snapshot", str(tmp_path / "first_iter_5.solverstate"),
                 "-overlap", "lee", "-chunk_split", "2", "-replicate_fc", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Resuming from" in run.stderr
    assert_same_weights(final_model(tmp_path, "resumed"), reference["resumed"])
    assert ranks_identical(run.stderr)


@pytest.mark.parametrize("flags, replicated", [(("-overlap", "none"), 0), (("-overlap", "layer"), 0),
                                               (("-overlap", "lee", "-chunk_split", "pool1", "-replicate_fc", "1"), 1)],
                         ids=["none", "layer", "lee-f1"])
def test_communication_volume_is_eqs_9_and_10(tmp_path, flags, replicated):
    """Per iteration, the reductions move every learnable value once (Eqs. 9-10; plus the one float carrying
    rank 0's signal action) less the replicated layers', and each replicated InnerProduct gathers its input
    and its output error of the whole batch, (K_b + K_c) * N floats."""
    solver = write_solver(tmp_path, 64, "volume", max_iter=6)
    run = mpirun("-solver", str(solver), *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    net = create_solver(solver_param(tmp_path, 64, "count")).net
    params = sum(p.count for p in net.learnable_params)
    ip1 = next(layer for layer in net.layers if layer.name == "ip1")
    k_b, k_c = ip1.blobs[0].shape[1], ip1.blobs[0].shape[0]
    # the display lines count the communications finished since the last one (one may finish after a display
    # and count in the next); the total at the end counts every one posted
    total = [line for line in run.stderr.splitlines() if "MPI communication in all:" in line]
    assert len(total) == 1, run.stderr[-3000:]
    reduced, gathered, iterations = (int(x) for x in re.search(
        r"(\d+) floats reduced, (\d+) gathered \((\d+) iterations", total[0]).groups())
    assert iterations == 6
    if replicated:
        assert reduced == iterations * (params + 1 - sum(b.count for b in ip1.blobs))
        assert gathered == iterations * (k_b + k_c) * 128
    else:
        assert (reduced, gathered) == (iterations * (params + 1), 0)


def test_mpi_ranks_and_thread_replicas_agree(tmp_path):
    """The exchange seam's two implementations: 2 MPI ranks and 2 thread replicas (CPU stand-in devices) of
    batch 64 end within 1e-6 of each other (the same sums; only the order inside MPI's reduction may differ)."""
    from cct.device import Device
    from cct.distributed.replicas import DataParallel

    solver = write_solver(tmp_path, 64, "mpi", max_iter=4)
    run = mpirun("-solver", str(solver), "-overlap", "layer")
    assert run.returncode == 0, run.stderr[-3000:]
    dp = DataParallel(solver_param(tmp_path, 64, "threads", max_iter=4), [Device("cpu", 0, 1), Device("cpu", 1, 1)])
    dp.solve()
    threads = [np.array(p.data).reshape(-1) for p in dp.root.net.learnable_params]
    for i, (a, b) in enumerate(zip(final_model(tmp_path, "mpi", 4), threads)):
        assert_close(a, b, f"param {i}", rtol=1e-6, reference="two thread replicas")


def test_weights_are_read_by_rank_0_and_broadcast(tmp_path, reference):
    solver = write_solver(tmp_path, 64, "finetuned", max_iter=4)
    run = mpirun("-solver", str(solver), "-weights", reference["weights_file"], "-overlap", "layer")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("Finetuning from") == 1  # rank 0 only
    assert_same_weights(final_model(tmp_path, "finetuned", 4), reference["finetuned"])
    assert ranks_identical(run.stderr)


# ---- failures end the whole job ------------------------------------------------------------------------------

def test_a_rank_that_raises_ends_the_job_with_one_line(tmp_path):
    solver = write_solver(tmp_path, 16, "mpi", fault="1 3 raise")
    began = time.monotonic()
    run = mpirun("-solver", str(solver), timeout=60)
    assert time.monotonic() - began < 30
    assert run.returncode != 0
    # the ranks share one stderr, so a line may follow another process's unfinished one: find the glog F line
    lines = [line for line in run.stderr.splitlines() if re.search(r"F\d{4} [\d:.]+ +\d+ \S+\] rank 1 of 2:", line)]
    assert len(lines) == 1 and "injected failure at iteration 3" in lines[0], run.stderr[-3000:]


def test_kill_9_of_a_rank_ends_the_job_and_the_last_snapshot_is_intact(tmp_path):
    solver = write_solver(tmp_path, 16, "mpi", fault="1 5 kill", snapshot=2)
    began = time.monotonic()
    run = mpirun("-solver", str(solver), "-mpi_timeout", "20", timeout=60)
    assert time.monotonic() - began < 30
    assert run.returncode != 0
    # mpiexec kills rank 0 as soon as rank 1 dies, possibly while rank 0 writes the iteration-4 snapshot (rank 1
    # needs rank 0 only for the reductions, not for its snapshot to be on disk): the newest complete solver
    # state is iteration 4's or, if the kill came first, iteration 2's — whole, with its weights, never torn
    states = sorted(tmp_path.glob("mpi_iter_*.solverstate"), key=lambda p: int(p.stem.split("_")[-1]))
    assert states and states[-1].name in ("mpi_iter_4.solverstate", "mpi_iter_2.solverstate"), run.stderr[-3000:]
    state = read_solverstate(str(states[-1]))
    assert state.learned_net.endswith(f"mpi_iter_{state.iter}.caffemodel") and state.cct_resume_state
    assert len(model_weights(tmp_path / f"mpi_iter_{state.iter}.caffemodel")) == 8
    assert not (tmp_path / "mpi_iter_6.caffemodel").exists()


def test_a_stopped_rank_is_a_timeout_not_a_hang(tmp_path):
    solver = write_solver(tmp_path, 16, "mpi", fault="1 3 stop")
    began = time.monotonic()
    run = mpirun("-solver", str(solver), "-mpi_timeout", "3", timeout=60)
    assert time.monotonic() - began < 30
    assert run.returncode != 0
    assert "rank 0 of 2: no gradient exchange within 3 s at iteration 3" in run.stderr, run.stderr[-3000:]


def test_a_launcher_of_2_with_an_mpi_of_1_is_one_error(tmp_path):
    solver = write_solver(tmp_path, 16, "mpi")
    env = mpi_env()
    env["PMI_SIZE"] = "2"  # a launcher that is not the MPI library mpi4py talks to (singleton world)
    run = subprocess.run([sys.executable, "-m", "cct", "train", "-solver", str(solver)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "PMI_SIZE=2 but MPI reports a world of 1 process(es)" in run.stderr, run.stderr[-3000:]


def test_a_launcher_without_mpi4py_is_one_error(tmp_path):
    solver = write_solver(tmp_path, 16, "mpi")
    env = mpi_env()
    env["PMI_SIZE"] = "2"
    code = ("import sys; sys.modules['mpi4py'] = None; from cct.cli import main; "
            f"sys.exit(main(['train', '-solver', {str(solver)!r}]))")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("F")]
    assert len(errors) == 1 and "mpi4py cannot be imported" in errors[0] and "pip install 'cct[mpi]'" in errors[0]


def test_without_a_launcher_mpi4py_is_never_imported(tmp_path):
    solver = write_solver(tmp_path, 16, "mpi", max_iter=1)
    env = {k: v for k, v in mpi_env().items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")}
    code = ("import sys; from cct.cli import main; "
            f"code = main(['train', '-solver', {str(solver)!r}]); "
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'; sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
