"""Splitting each batch across devices (CcT's hybrid execution): CaffeNet training iterations with the split vs
the best single device, and CcT's Figure 9 — iteration time vs the share p of the batch on the first device.

Run:   python benchmarks/device_split.py [--devices cpu:1,cpu:1] [--batch 16] [--iters 3] [--steps 8]
Prints: each device's peak GFLOP/s (sgemm probe, cached); the best-of-rounds seconds of one forward+backward of
CaffeNet (models/caffenet/train.prototxt at ``--batch``) for the plain executor (all cores, batch partitions),
each device alone and the split by peak FLOPS, as ratios to the best single device; then the sweep
p = 0, 1/steps, ..., 1 (p = 0 and 1 are the second and first device alone) and where the auto share lies
relative to the fastest p.  One net is built; only its executor changes, round-robin (see :func:`measure`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

import cct  # noqa: E402
from cct.bench.bench import load_average  # noqa: E402
from cct.device import parse_devices  # noqa: E402
from cct.device.query import cpu_model  # noqa: E402
from cct.exec.device_split import DeviceSetting, DeviceSplitRunner, batch_shares  # noqa: E402
from cct.exec.serial import SerialExecutor  # noqa: E402
from cct.runtime.partition import cpu_cores  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "caffenet" / "train.prototxt"


def one_iteration(net, executor) -> float:
    """Wall time of one forward + backward with ``executor``."""
    net.set_executor(executor)
    t = time.perf_counter()
    net.forward_prefilled()
    net.clear_param_diffs()
    net.backward_all()
    return time.perf_counter() - t


def measure(net, executors: dict, iters: int) -> dict:
    """Best of ``iters`` seconds per iteration for every executor, measured round-robin (one iteration of
    each per round, after a warm-up round that creates the clones and workspaces), so that load from other
    processes on a shared machine falls on all of them alike; the best time is the least disturbed one."""
    times: dict = {k: [] for k in executors}
    for r in range(iters + 1):
        for k, ex in executors.items():
            t = one_iteration(net, ex)
            if r:
                times[k].append(t)
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cpu:1,cpu:1")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    devices = parse_devices(args.devices)
    if len(devices) != 2:
        raise SystemExit("--devices: give two devices (the Figure 9 sweep moves the share between them)")
    print(f"machine: {cpu_model()}, {cpu_cores()} usable cores (shared with whatever else runs); "
          f"CaffeNet train, batch {args.batch}, best of {args.iters} forward+backward rounds")
    peaks = [d.peak_gflops() for d in devices]
    for d, (g, src) in zip(devices, peaks):
        print(f"  {d}: peak {g:.1f} GFLOP/s ({src})")
    b = args.batch
    net = cct.Net(str(MODEL), cct.TRAIN)
    net.blobs["data"].reshape(b, 3, 227, 227)
    net.blobs["label"].reshape(b)
    net.reshape()
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape).astype(np.float32)
    net.blobs["label"].data[...] = rng.integers(0, 1000, b)

    def split(fractions, devs=devices) -> SerialExecutor:
        return SerialExecutor(DeviceSplitRunner(DeviceSetting(tuple(devs), fractions, "--devices", "share")))

    configs: dict = {"plain": SerialExecutor(), "alone0": split(None, devices[:1]),
                     "alone1": split(None, devices[1:]), "auto": split(None)}
    auto_shares = batch_shares(b, devices, [g for g, _ in peaks], "auto")
    points = []
    for k in range(args.steps + 1):
        b1 = int(round(k / args.steps * b))
        key = "alone1" if b1 == 0 else "alone0" if b1 == b else f"p{b1}"
        if key not in configs:
            configs[key] = split((b1 / b, 1 - b1 / b))
        points.append((b1, key))
    print(f"{load_average()} before")
    times = measure(net, configs, args.iters)
    print(f"{load_average()} after")
    plain, alone, auto = times["plain"], [times["alone0"], times["alone1"]], times["auto"]
    best_single = min(alone)
    print("\nseconds per iteration, best of the rounds (ratio: best single device / this, >1 is faster)")
    print(f"  {'plain executor (all cores, batch partitions)':<46}{plain:8.3f} s   {best_single / plain:5.2f}x")
    for d, x in zip(devices, alone):
        print(f"  {d.name + ' alone':<46}{x:8.3f} s   {best_single / x:5.2f}x")
    label = f"split by peak FLOPS ({auto_shares[0]}/{auto_shares[1]})"
    print(f"  {label:<46}{auto:8.3f} s   {best_single / auto:5.2f}x")

    print(f"\nFigure 9: share p of each batch of {b} on {devices[0]} (the rest on {devices[1]})")
    sweep = [(b1 / b, b1, times[key]) for b1, key in points]
    best_p, _, best_t = min(sweep, key=lambda e: e[2])
    for p, b1, t in sweep:
        bar = "#" * max(1, int(round(30 * best_t / t)))
        print(f"  p={p:4.2f} ({b1:3d}/{b - b1:3d})  {t:8.3f} s  {t / best_t:5.2f}x best  {bar}")
    p_auto = auto_shares[0] / b
    print(f"\nauto share p={p_auto:.2f} ({auto_shares[0]}/{auto_shares[1]}): {auto:.3f} s; fastest measured "
          f"p={best_p:.2f}: {best_t:.3f} s; auto / fastest = {auto / best_t:.2f}x")


if __name__ == "__main__":
    main()
