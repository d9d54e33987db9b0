"""Per-iteration overhead on a small net: the embedded digits LeNet, cct's solver vs the same net in PyTorch CPU.

Run:   pip install torch==2.13.0          (the CPU wheel; torch is imported only by this script's worker)
       python benchmarks/small_net_overhead.py [--iters 300] [--block 25] [--threads 2]
       (from anywhere; ``env -u OPENBLAS_CORETYPE python ...`` lets numpy's OpenBLAS pick its own kernels.)
cct runs ``models/digits/solver.prototxt`` as ``cct train`` does — the Data layer reading the LMDB (its batches,
cheap, made in the training thread: :mod:`cct.data.prefetch`), forward, backward, the SGD update (momentum 0.9,
weight decay 5e-4, ``inv`` learning rate) — without test passes or snapshots.  PyTorch runs the same shapes
(1x8x8 digits, batch 64: conv 3x3 pad 1 → 20,
max-pool 2, conv 3x3 pad 1 → 50, max-pool 2, fc 500, ReLU, fc 10, softmax loss) with ``torch.optim.SGD``
(momentum 0.9, weight decay 5e-4) on batches sliced from the same training records held in memory (scaled by
1/256 like the Data layer's transform), so its data step is a slice, not a database read.
Each framework runs in its own worker process; the parent alternates blocks of ``--block`` iterations
(cct, PyTorch, cct, ...), each after a pause that lets the other's worker threads stop spinning, so machine
noise hits both alike, and prints the median milliseconds per iteration,
iterations per second, the ratio cct/PyTorch and the share of the sgemm peak (a 2048³ float32 matmul on the
same threads, in the cct worker) that the net's GEMM arithmetic reaches in that time (convolutions and
InnerProducts, forward and both gradients, the first layer's data gradient excepted — the same count for
both).
On a machine whose other cores are busy, ``--threads 1`` is the fair setting: PyTorch's OpenMP barriers with
two threads then wait for a time slice on every layer (measured on a loaded 2-core AMD EPYC: 39 ms/iteration
with 2 threads, 3.4 ms with 1), and cct runs its small GEMMs on one thread anyway.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SOLVER = "models/digits/solver.prototxt"
TRAIN_DB = "models/digits/digits_train_lmdb"
BATCH = 64
# pause before each block: OpenBLAS and OpenMP worker threads spin for ~0.1-0.2 s after their last parallel
# call, and a block (~50 ms) inside that window would share its cores with them
SETTLE_S = 0.3


def cct_worker(conn, threads: int) -> None:
    os.chdir(ROOT)  # the solver's paths are relative to the repository root
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("GLOG_minloglevel", "1")
    from cct.bench.flops import count_net, sgemm_peak
    from cct.exec.diff_memory import share_as_the_command_line_does
    from cct.solvers.solver import create_solver, read_solver_file

    p = read_solver_file(SOLVER)
    p.test_interval = 1 << 30  # no test passes inside the timed blocks (test nets are still built)
    p.snapshot = 0
    p.max_iter = 1 << 30
    solver = create_solver(p)
    share_as_the_command_line_does(solver.net)  # as cct train runs it
    solver.step(20)  # warm-up: workspaces, the prefetch queue
    flops, peak = count_net(solver.net).products(), sgemm_peak()
    conn.send(("ready", (flops, peak)))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        t = time.perf_counter()
        solver.step(msg[1])
        conn.send(("time", (time.perf_counter() - t) / msg[1]))


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """The training records as (N, 1, 8, 8) float32 scaled by 1/256, and their labels."""
    sys.path.insert(0, str(ROOT))
    from cct.data.datum import raw_view
    from cct.data.db import iterate_records

    images, labels = [], []
    for _, value in iterate_records(str(ROOT / TRAIN_DB), "lmdb"):
        im, label = raw_view(value)
        images.append(np.array(im, dtype=np.float32))
        labels.append(label)
    return np.stack(images) * np.float32(0.00390625), np.array(labels, dtype=np.int64)


def torch_worker(conn, threads: int) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    torch.manual_seed(1701)
    x_all, y_all = _digits()
    xt, yt = torch.from_numpy(x_all), torch.from_numpy(y_all)
    model = nn.Sequential(
        nn.Conv2d(1, 20, 3, padding=1), nn.MaxPool2d(2, 2), nn.Conv2d(20, 50, 3, padding=1), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(50 * 2 * 2, 500), nn.ReLU(inplace=True), nn.Linear(500, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    pos = 0

    def step() -> None:
        nonlocal pos
        if pos + BATCH > len(xt):
            pos = 0
        x, y = xt[pos:pos + BATCH], yt[pos:pos + BATCH]
        pos += BATCH
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(20):
        step()
    conn.send(("ready", torch.__version__))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        t = time.perf_counter()
        for _ in range(msg[1]):
            step()
        conn.send(("time", (time.perf_counter() - t) / msg[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300, help="timed iterations per framework")
    ap.add_argument("--block", type=int, default=25, help="iterations per alternated block")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} threads={args.threads} "
          f"batch={BATCH} CCT_PARTITIONS={os.environ.get('CCT_PARTITIONS', 'auto')}")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    ctx = mp.get_context("spawn")
    workers = {}
    for name, target in (("cct", cct_worker), ("pytorch", torch_worker)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, args.threads), daemon=True)
        proc.start()
        _, info = parent.recv()
        workers[name] = (proc, parent)
        if name == "cct":
            flops, peak = info
            print(f"GEMM arithmetic per iteration {flops / 1e6:.1f} MFLOP; sgemm peak (2048^3, {args.threads} "
                  f"thread(s)) {peak / 1e9:.1f} GFLOP/s")
        else:
            print(f"pytorch {info}")
    times: dict[str, list[float]] = {name: [] for name in workers}
    for _ in range(max(1, args.iters // args.block)):
        for name, (_, conn) in workers.items():
            time.sleep(SETTLE_S)  # the other worker's BLAS/OpenMP threads stop spinning before this block
            conn.send(("run", args.block))
            times[name].append(conn.recv()[1])
    for proc, conn in workers.values():
        conn.send(("stop",))
        proc.join()
    base = statistics.median(times["pytorch"])
    print(f"{'':<10}{'ms/iter':>9}{'iter/s':>9}{'cct/pytorch':>13}{'% of peak':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<10}{med * 1e3:9.2f}{1 / med:9.0f}{med / base:13.2f}{100 * flops / med / peak:10.1f}%")
    sys.path.insert(0, str(ROOT))  # only now: the PyTorch worker must not load cct
    from cct.bench.bench import load_average
    print(f"(median of {len(times['cct'])} alternated blocks of {args.block} iterations; {load_average()})")


if __name__ == "__main__":
    main()
