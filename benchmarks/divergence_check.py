"""What the per-iteration divergence check costs on CaffeNet: the check (one reduction per learnable gradient,
``cct.solvers.divergence.gradients_finite``) against the training iteration it guards (forward + backward of
``models/caffenet/train.prototxt``, batch 64, 61M parameters), both measured in the same run.

Run:   python benchmarks/divergence_check.py [--batch 64] [--iters 3] [--checks 20]
Prints the median iteration, the median check, and the check as a fraction of the iteration (goal: < 1%).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

import cct  # noqa: E402
from cct.solvers.divergence import gradients_finite  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "caffenet" / "train.prototxt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--checks", type=int, default=20)
    args = ap.parse_args()
    net = cct.Net(str(MODEL), cct.TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].reshape(args.batch, 3, 227, 227)
    net.blobs["label"].reshape(args.batch)
    net.reshape()
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape, dtype=np.float32)
    net.blobs["label"].data[...] = rng.integers(0, 1000, args.batch)
    params = sum(p.count for p in net.learnable_params)
    net.forward_backward()  # warm-up (engine choices, workspaces)
    iters = []
    for _ in range(args.iters):
        t = time.perf_counter()
        net.forward_backward()
        iters.append(time.perf_counter() - t)
    checks = []
    for _ in range(args.checks):
        t = time.perf_counter()
        assert gradients_finite(net)
        checks.append(time.perf_counter() - t)
    it, ck = statistics.median(iters), statistics.median(checks)
    print(f"CaffeNet batch {args.batch}, {params / 1e6:.1f}M parameters")
    print(f"iteration (forward + backward): median {it * 1e3:.0f} ms of {args.iters}")
    print(f"divergence check:               median {ck * 1e3:.2f} ms of {args.checks}")
    print(f"check / iteration:              {ck / it:.2%} (goal < 1%)")


if __name__ == "__main__":
    main()
