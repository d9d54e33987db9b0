"""Fuzzed inputs through the command line: mutated solver and net prototxt, caffemodel, solverstate, mean
binaryproto and LMDB records.  Every run ends in time, with status 0 or with one F line naming a file —
never a traceback, never an "internal error".

The mutants are seeded (the same on every machine).  Each kind runs in one worker process (``python -m
tests.test_fuzz KIND SEED COUNT FOLDER``) under an address-space limit, so that a mutated ``num_output: 1e9`` is
a MemoryError (reported as one line) rather than a machine that swaps; a per-mutant alarm turns a hang into a
failure.  The workers of the kinds a session runs start together, as many at a time as the process has cores.
"""
from __future__ import annotations

import gc
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

KINDS = ["solver", "net", "caffemodel", "solverstate", "binaryproto", "lmdb"]
COUNT = 300          # mutants per kind
SEED = 20261124
PER_MUTANT_S = 20     # a mutant running longer is a hang
MEMORY_LIMIT = 3 << 30

NET = """name: "fuzz"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "train_lmdb" batch_size: 4 backend: LMDB }
        transform_param { mean_file: "mean.binaryproto" scale: 0.00390625 mirror: true crop_size: 6 } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
        data_param { source: "train_lmdb" batch_size: 4 backend: LMDB }
        transform_param { mean_file: "mean.binaryproto" scale: 0.00390625 crop_size: 6 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "relu" type: "ReLU" bottom: "pool" top: "pool" }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" include { phase: TEST } }
"""

SOLVER = """net: "net.prototxt"
test_iter: 1
test_interval: 2
base_lr: 0.01
momentum: 0.9
lr_policy: "step"
gamma: 0.5
stepsize: 2
display: 1
max_iter: 3
snapshot: 2
snapshot_prefix: "snap"
solver_mode: CPU
random_seed: 1
"""


# ---- the clean inputs -------------------------------------------------------------------------------

def make_inputs(folder: Path) -> None:
    """The clean files: an LMDB of 12 Datums 1x8x8, a mean, the net and solver, and a snapshot at 2."""
    from cct.cli import main
    from cct.data.datum import array_to_datum
    from cct.data.db import LmdbWriter
    from cct.io.weights import write_proto_binary
    from cct.proto import caffe_pb2 as pb

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    writer = LmdbWriter(str(folder / "train_lmdb"))
    for i in range(12):
        writer.put(b"%08d" % i, array_to_datum(rng.integers(0, 256, (8, 8, 1), dtype=np.uint8),
                                               int(rng.integers(3))).SerializeToString())
    writer.close()
    mean = pb.BlobProto(num=1, channels=1, height=8, width=8)
    mean.data.extend(rng.uniform(0, 255, 64).astype(np.float32).tolist())
    write_proto_binary(folder / "mean.binaryproto", mean)
    (folder / "net.prototxt").write_text(NET)
    (folder / "solver.prototxt").write_text(SOLVER)
    cwd = os.getcwd()
    try:
        os.chdir(folder)
        from cct import log

        log.init_log(stream=io.StringIO())
        if main(["train", "-solver", "solver.prototxt"]) != 0:
            raise RuntimeError("the clean inputs do not train")
    finally:
        os.chdir(cwd)


# ---- mutations --------------------------------------------------------------------------------------

NUMBERS = ["0", "-1", "1e9", "2147483648", "-2147483649", "nan", "inf", "1e-45", "3.5", "99999999999999999999"]


def mutate_text(text: str, rng: np.random.Generator) -> str:
    lines = text.splitlines()
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(7))
        i = int(rng.integers(len(lines))) if lines else 0
        if not lines:
            lines = ["}"]
        elif op == 0:  # replace a number
            nums = list(re.finditer(r"-?\d+(\.\d+)?(e-?\d+)?", lines[i]))
            if nums:
                m = nums[int(rng.integers(len(nums)))]
                lines[i] = lines[i][:m.start()] + NUMBERS[int(rng.integers(len(NUMBERS)))] + lines[i][m.end():]
        elif op == 1:  # drop a line
            del lines[i]
        elif op == 2:  # duplicate a line
            lines.insert(i, lines[i])
        elif op == 3:  # cut a line short
            lines[i] = lines[i][:int(rng.integers(len(lines[i]) + 1))]
        elif op == 4:  # replace a word by another of the file
            words = re.findall(r"[A-Za-z_]+", text)
            own = list(re.finditer(r"[A-Za-z_]+", lines[i]))
            if own and words:
                m = own[int(rng.integers(len(own)))]
                lines[i] = lines[i][:m.start()] + words[int(rng.integers(len(words)))] + lines[i][m.end():]
        elif op == 5:  # a random byte
            pos = int(rng.integers(len(lines[i]) + 1))
            lines[i] = lines[i][:pos] + chr(int(rng.integers(32, 127))) + lines[i][pos:]
        else:  # a quoted string changed
            strings = list(re.finditer(r'"[^"]*"', lines[i]))
            if strings:
                m = strings[int(rng.integers(len(strings)))]
                lines[i] = lines[i][:m.start()] + '"' + m.group()[1:-1][::-1] + 'x"' + lines[i][m.end():]
    return "\n".join(lines) + "\n"


def mutate_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 6))):
        op = int(rng.integers(5))
        i = int(rng.integers(len(b))) if b else 0
        if not b:
            b = bytearray(rng.integers(0, 256, 8, dtype=np.uint8).tobytes())
        elif op == 0:
            b[i] = int(rng.integers(256))
        elif op == 1:
            b[i] ^= 1 << int(rng.integers(8))
        elif op == 2:
            del b[i:i + int(rng.integers(1, 16))]
        elif op == 3:
            b[i:i] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        else:
            b = b[:i]
    return bytes(b)


def prepare(kind: str, clean: Path, work: Path, rng: np.random.Generator) -> tuple[list[str], str]:
    """Write one mutant of ``kind`` into ``work`` (a copy of the clean folder); the command line and the
    name of the mutated file."""
    if kind == "solver":
        (work / "solver.prototxt").write_text(mutate_text(SOLVER, rng))
        return ["train", "-solver", "solver.prototxt"], "solver.prototxt"
    if kind == "net":
        (work / "net.prototxt").write_text(mutate_text(NET, rng))
        return ["train", "-solver", "solver.prototxt"], "net.prototxt"
    if kind == "caffemodel":
        data = (clean / "snap_iter_2.caffemodel").read_bytes()
        (work / "w.caffemodel").write_bytes(mutate_bytes(data, rng))
        return ["train", "-solver", "solver.prototxt", "-weights", "w.caffemodel"], "w.caffemodel"
    if kind == "solverstate":
        data = (clean / "snap_iter_2.solverstate").read_bytes()
        (work / "s.solverstate").write_bytes(mutate_bytes(data, rng))
        return ["train", "-solver", "solver.prototxt", "-snapshot", "s.solverstate"], "s.solverstate"
    if kind == "binaryproto":
        data = (clean / "mean.binaryproto").read_bytes()
        (work / "mean.binaryproto").write_bytes(mutate_bytes(data, rng))
        return ["train", "-solver", "solver.prototxt"], "mean.binaryproto"
    if kind == "lmdb":
        import lmdb

        env = lmdb.open(str(work / "train_lmdb"), map_size=1 << 24)
        with env.begin(write=True) as txn:
            keys = [k for k, _ in txn.cursor()]
            for _ in range(int(rng.integers(1, 3))):
                key = keys[int(rng.integers(len(keys)))]
                txn.put(key, mutate_bytes(txn.get(key), rng))
        env.close()
        return ["train", "-solver", "solver.prototxt"], "train_lmdb"
    raise ValueError(kind)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def worker(kind: str, seed: int, count: int, folder: Path) -> list[dict]:
    """Run ``count`` mutants of ``kind``; one result per mutant."""
    from cct import log
    from cct.cli import main

    clean = folder / "clean"
    make_inputs(clean)
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    results = []
    signal.signal(signal.SIGALRM, _alarm)
    for index in range(count):
        work = folder / f"m{index}"
        shutil.copytree(clean, work)
        argv, name = prepare(kind, clean, work, rng)
        buf = io.StringIO()
        log.init_log(stream=buf)
        cwd = os.getcwd()
        os.chdir(work)
        start = time.perf_counter()
        signal.alarm(PER_MUTANT_S)
        try:
            rc, hang = main(argv), False
        except _Hang:
            rc, hang = -1, True
        except BaseException as e:  # noqa: BLE001 - what escaped the command line's error boundary
            rc, hang = -2, False
            buf.write(f"\nESCAPED {type(e).__name__}: {e}\n")
        finally:
            signal.alarm(0)
            os.chdir(cwd)
        text = buf.getvalue()
        results.append({"index": index, "rc": rc, "hang": hang, "seconds": time.perf_counter() - start,
                        "file": name, "fatal": [line for line in text.splitlines() if line.startswith("F")],
                        "traceback": "Traceback" in text or "ESCAPED" in text})
        gc.collect()  # end the mutant's prefetch threads (the folders stay: a new one must not reuse an inode
        #               of an LMDB still open in this process)
    return results


def _limit_memory() -> None:
    """This process's address space at most ``MEMORY_LIMIT`` (the worker's first step; Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _run_worker(kind: str, folder: Path) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tests.test_fuzz", kind, str(SEED), str(COUNT), str(folder)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=COUNT * PER_MUTANT_S)


@pytest.fixture(scope="module")
def fuzz_runs(request, tmp_path_factory):
    """The worker of every kind the session runs, as many at a time as this process has cores (each runs its
    mutants one after another on one BLAS thread): a future per kind."""
    test = test_fuzzed_inputs_fail_as_one_line_naming_the_file.__name__
    kinds = [item.callspec.params["kind"] for item in request.session.items
             if getattr(item, "originalname", None) == test and item.module.__name__ == __name__]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pool = ThreadPoolExecutor(max_workers=max(1, min(cores, len(kinds))))
    futures = {kind: pool.submit(_run_worker, kind, tmp_path_factory.mktemp(f"fuzz-{kind}")) for kind in kinds}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("kind", KINDS)
def test_fuzzed_inputs_fail_as_one_line_naming_the_file(kind, fuzz_runs, tmp_path):
    r = fuzz_runs[kind].result() if kind in fuzz_runs else _run_worker(kind, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == COUNT
    problems = []
    for res in results:
        where = f"{kind} mutant {res['index']}"
        if res["hang"]:
            problems.append(f"{where}: still running after {PER_MUTANT_S} s")
        elif res["traceback"] or res["rc"] not in (0, 1):
            problems.append(f"{where}: status {res['rc']}, traceback {res['traceback']}: {res['fatal']}")
        elif res["rc"] == 1:
            if len(res["fatal"]) != 1:
                problems.append(f"{where}: {len(res['fatal'])} F lines: {res['fatal']}")
            elif "internal error" in res["fatal"][0]:
                problems.append(f"{where}: {res['fatal'][0]}")
            elif not re.search(r"\.prototxt|\.caffemodel|\.solverstate|\.binaryproto|lmdb|snap", res["fatal"][0]):
                problems.append(f"{where}: the line names no file: {res['fatal'][0]}")
    assert not problems, "\n".join(problems[:20])
    failed = sum(res["rc"] == 1 for res in results)
    assert 0 < failed, f"no {kind} mutant failed: the mutations do not reach the parser"


if __name__ == "__main__":
    _limit_memory()
    kind, seed, count, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    print(json.dumps(worker(kind, seed, count, folder)))
