"""ZNN's task-graph executor on CTMCTMCTCT (width 24, dense max-filter net, 37^3 -> 12^3, batch 1).

Prints, measured in one run on this machine (forward + backward per iteration, median of ``--iters`` after
``--warmup``):

* the task graph with 1 worker on 1 thread (ZNN's serial baseline), 1 worker with all cores' BLAS/FFT threads,
  and 2 workers (half each), the speedups of 2 workers over both;
* the layer executor with 2 BLAS threads (the baseline the 2-worker run is compared with);
* the 2-worker task graph with priority, FIFO and LIFO queues;
* the Brent bound ``S_P >= S_inf / (1 + (S_inf - 1)/P)`` for widths 5-40 (direct convolution work model of
  ZNN Tables I/III: ``T_1`` the sum of all edge work, ``T_inf`` the layers' critical path), next to the
  speedup measured at the widths in ``--measure-widths``.

    python benchmarks/taskgraph.py [--iters 5] [--warmup 2] [--measure-widths 24]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import cct  # noqa: E402
from cct.exec.serial import SerialExecutor  # noqa: E402
from cct.exec.taskgraph import TaskGraphExecutor  # noqa: E402
from cct.io.prototxt import read_net_param  # noqa: E402
from cct.io.rewrite import to_max_filter  # noqa: E402
from cct.proto import caffe_pb2 as pb  # noqa: E402
from cct.runtime.threads import blas_threads  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def net_param(width: int, size: int = 37) -> pb.NetParameter:
    p = to_max_filter(read_net_param(os.path.join(ROOT, "models/znn/deploy/ctm_valid.prototxt")), 3)
    p.force_backward = True
    p.state.phase = pb.TRAIN
    for lp in p.layer:
        if lp.type == "Input":
            lp.input_param.shape[0].dim[:] = [1, 1, size, size, size]
        if lp.type == "Convolution" and lp.convolution_param.num_output != 2:
            lp.convolution_param.num_output = width
    return p


def time_net(param: pb.NetParameter, executor, iters: int, warmup: int, threads: int | None = None) -> float:
    import logging

    logging.getLogger("cct").setLevel(logging.WARNING)
    net = cct.Net.from_param(param, "bench", executor)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    top = net.blobs[net.outputs[0]]
    times = []
    for k in range(warmup + iters):
        t0 = time.perf_counter()
        if threads is None:
            net.forward()
            top.diff[...] = 1e-3
            net.backward()
        else:
            with blas_threads(threads):
                net.forward()
                top.diff[...] = 1e-3
                net.backward()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    if hasattr(executor, "close"):
        executor.close()
    return statistics.median(times)


def brent_table(widths: list[int], P: int = 2) -> list[tuple[int, float, float]]:
    """(width, S_inf, S_P bound) for the dense net, direct convolution (ZNN's cost model): T_1 = Σ_layers
    f·f'·n'^3·k^3 (+ filters), T_inf = Σ_layers n'^3·(k^3 + ⌈log2 f⌉) forward and backward, + max update."""
    shapes = [(1, None, 35, 27), (None, None, 30, 27), (None, None, 20, 27), (None, 2, 12, 27)]  # (f, f', n', k^3)
    out = []
    for w in widths:
        t1 = 0.0
        tinf = 0.0
        upd = 0.0
        for f, f2, n, k3 in shapes:
            f = w if f is None else f
            f2 = w if f2 is None else f2
            work = f * f2 * n ** 3 * k3
            t1 += 3 * work  # forward, backward, update
            tinf += 2 * n ** 3 * (k3 + math.ceil(math.log2(max(f, 2))))
            upd = max(upd, n ** 3 * k3)
        for n in (34, 28):  # max-filters 2^3: 6 n^3 log2 2 per pass, f maps
            t1 += 2 * w * 6 * n ** 3
            tinf += 2 * 6 * n ** 3
        tinf += upd
        s_inf = t1 / tinf
        out.append((w, s_inf, s_inf / (1 + (s_inf - 1) / P)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--width", type=int, default=24)
    ap.add_argument("--measure-widths", type=str, default="24")
    args = ap.parse_args(argv)
    param = net_param(args.width)
    print(f"CTMCTMCTCT width {args.width}, 37^3 -> 12^3 dense (max-filter twin), batch 1; {os.cpu_count()} CPUs; "
          f"median of {args.iters} forward+backward")
    layer2 = time_net(param, SerialExecutor(), args.iters, args.warmup, threads=2)
    t1 = time_net(param, TaskGraphExecutor(1), args.iters, args.warmup)
    single = TaskGraphExecutor(1)
    single.threads_per_worker = 1  # ZNN's baseline: one worker on one core
    t1s = time_net(param, single, args.iters, args.warmup)
    t2 = time_net(param, TaskGraphExecutor(2), args.iters, args.warmup)
    print(f"  layer executor, 2 BLAS threads : {layer2 * 1e3:8.1f} ms  (baseline)")
    print(f"  task graph, 1 worker, 1 thread : {t1s * 1e3:8.1f} ms  (ZNN's serial baseline)")
    print(f"  task graph, 1 worker, 2 threads: {t1 * 1e3:8.1f} ms")
    print(f"  task graph, 2 workers          : {t2 * 1e3:8.1f} ms  speedup vs 1 worker on 1 thread {t1s / t2:.2f}x, "
          f"vs 1 worker on 2 threads {t1 / t2:.2f}x, time / layer executor {t2 / layer2:.2f}x")
    for policy in ("priority", "fifo", "lifo"):
        t = time_net(param, TaskGraphExecutor(2, policy=policy), args.iters, args.warmup)
        print(f"  2 workers, {policy:<8} queue       : {t * 1e3:8.1f} ms  ({t2 / t:.2f}x of priority's speed)")
    measured = {}
    for w in [int(v) for v in args.measure_widths.split(",") if v]:
        pw = net_param(w)
        serial = TaskGraphExecutor(1)
        serial.threads_per_worker = 1
        a = time_net(pw, serial, args.iters, args.warmup)
        b = time_net(pw, TaskGraphExecutor(2), args.iters, args.warmup)
        measured[w] = a / b
    print("  Brent bound, P = 2 (direct-convolution work model) vs measured 2 workers over 1 worker on 1 thread:")
    print("    width   S_inf    S_2 bound   measured")
    for w, s_inf, s2 in brent_table([5, 10, 15, 20, 24, 30, 40]):
        m = f"{measured[w]:.2f}" if w in measured else "-"
        print(f"    {w:5d} {s_inf:8.1f} {s2:10.2f}   {m:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
