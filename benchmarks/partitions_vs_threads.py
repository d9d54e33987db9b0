"""Batch partitions of one BLAS thread each against one partition on all the BLAS threads, on CaffeNet's layers.

Run:   python benchmarks/partitions_vs_threads.py [--batch 64] [--repeat 5]
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets OpenBLAS use its own kernel choice,
       e.g. AVX-512, where the environment pins it.)
The question a many-core machine asks of CcT's batch partitions (:mod:`cct.runtime.partition`): does one GEMM
of the whole batch on OpenBLAS's own threads beat one single-thread GEMM per core on its share of the columns?
First the GEMMs alone — the forward products of conv2-conv5 (one group) over the whole batch's columns and
conv3's weight gradient (the batch in the inner dimension) — as one call on every core's thread and as
one-thread calls on ``cores`` column ranges at once, and one of those ranges alone on an otherwise idle machine
(``alone %``: what one core does by itself, against the all-core peak over ``cores``: above 100% where the
cores share their arithmetic units or clocks when all are busy).  Then each lowering of conv2-conv5 as the
engine runs it, forward and backward (data and weights), with the ``auto`` partitions against one partition
(``CCT_PARTITIONS=1``: every BLAS thread, the lowering itself on one core), and the ratio.  Medians of
``repeat`` runs, % of the sgemm peak (2048³, all threads) measured first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

# before numpy: importing cct sets OpenBLAS's worker spin (OPENBLAS_THREAD_TIMEOUT), as `cct train` runs
import cct  # noqa: E402,F401

# isort: split
import numpy as np  # noqa: E402
from conv_layers import CAFFENET, layer_operands  # noqa: E402

from cct.bench.bench import load_average  # noqa: E402
from cct.config import settings  # noqa: E402
from cct.engines.lowering import LoweringEngine, Workspace, strategy_fallback  # noqa: E402
from cct.runtime.threads import blas_threads, cpu_cores  # noqa: E402

LAYERS = CAFFENET[1:]  # conv2-conv5: conv1 has one lowering


def median_seconds(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_seconds(w, x, cores: int, pool: ThreadPoolExecutor, repeat: int) -> tuple[float, float, float]:
    """``w @ x`` as one call on all the threads, as one-thread calls on ``cores`` column ranges at once, and one
    such range alone."""
    y = np.empty((w.shape[0], x.shape[1]), np.float32)
    whole = median_seconds(lambda: np.matmul(w, x, out=y), repeat)
    parts = [np.ascontiguousarray(p) for p in np.array_split(x, cores, axis=1)]
    outs = [np.empty((w.shape[0], p.shape[1]), np.float32) for p in parts]
    with blas_threads(1):
        alone = median_seconds(lambda: np.matmul(w, parts[0], out=outs[0]), repeat)
        split = median_seconds(lambda: list(pool.map(lambda i: np.matmul(w, parts[i], out=outs[i]), range(cores))),
                               repeat)
    return whole, split, alone


def engine_seconds(eng: LoweringEngine, x, w, dy, repeat: int) -> tuple[float, float]:
    """Median forward and backward (data and weights) seconds of ``eng``."""
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)
    return (median_seconds(lambda: eng.forward(x, w, None, y), repeat),
            median_seconds(lambda: eng.backward(x, dy, w, dx, dw), repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    cores, rng = cpu_cores(), np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    peak = 2 * 2048 ** 3 / median_seconds(lambda: a @ a, args.repeat)
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} cores {cores}, batch {args.batch}, "
          f"sgemm peak {peak / 1e9:.0f} GFLOP/s (all threads), median of {args.repeat}")
    print(f"{'GEMM (rows x inner x cols)':<34}{'one call ms':>12}{'%peak':>7}{f'{cores} x 1 thread ms':>20}{'%peak':>7}"
          f"{'alone %':>9}{'one call / parts':>18}")
    pool = ThreadPoolExecutor(cores)
    cols = lambda n: n * n * args.batch  # noqa: E731 - output positions of the batch
    gemms = [(f"{name} forward", o // g, d // g * k * k, cols(n)) for name, d, o, g, n, k, _, _ in LAYERS]
    gemms.append(("conv3 weight gradient", 384, cols(13), 256 * 9))
    for label, m, k, n in gemms:
        flops = 2.0 * m * k * n
        whole, split, alone = gemm_seconds(rng.standard_normal((m, k), dtype=np.float32),
                                           rng.standard_normal((k, n), dtype=np.float32), cores, pool, args.repeat)
        print(f"{label + f' {m}x{k}x{n}':<34}{whole * 1e3:12.1f}{100 * flops / whole / peak:6.0f}%"
              f"{split * 1e3:20.1f}{100 * flops / split / peak:6.0f}%{100 * flops / alone / peak:8.0f}%"
              f"{whole / split:18.2f}")
    pool.shutdown()
    print(f"\n{'layer':<7}{'lowering':<10}{'partitions':>11}{'fwd ms':>9}{'%peak':>7}{'bwd ms':>9}{'%peak':>7}"
          f"{'one partition / auto (fwd+bwd)':>32}")
    for spec in LAYERS:
        name = spec[0]
        g, flops, x, w, dy = layer_operands(args.batch, spec, rng)
        for strategy in (1, 2, 3):
            if strategy_fallback(strategy, g):
                continue
            total = {}
            for forced in (None, 1):
                with settings.override(partitions=forced):
                    eng = LoweringEngine(strategy, workspace=Workspace())
                    eng.configure(g, np.float32)
                    tf, tb = engine_seconds(eng, x, w, dy, args.repeat)
                    used = eng.batch_partitions()
                total[forced] = tf + tb
                tail = f"{total[1] / total[None]:32.2f}" if forced == 1 else ""
                print(f"{name:<7}{strategy:<10}{used:>11}{tf * 1e3:9.1f}{100 * flops / tf / peak:6.0f}%"
                      f"{tb * 1e3:9.1f}{100 * 2 * flops / tb / peak:6.0f}%{tail}")
    print(load_average())


if __name__ == "__main__":
    main()
