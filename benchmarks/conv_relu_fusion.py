"""A convolution and the in-place ReLU after it as one step: each CaffeNet convolution's forward with its output
rectified as the engine writes it, against the forward and then the ReLU's own pass (the baseline, as the layers
ran one by one), alternated in one process.

Run:   python benchmarks/conv_relu_fusion.py [--batch 64] [--rounds 7]
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets numpy's OpenBLAS pick its own kernels,
       e.g. AVX-512, where the environment pins them.)
Prints per convolution its engine, the medians of both ways in milliseconds and their ratio (rectified / forward
+ ReLU), then the sums.  The engines are the net's own choices (:mod:`cct.exec.fusion` runs the pair so in a
training or inference pass: ``Convolution.forward_rectified``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np  # noqa: E402

import cct  # noqa: E402
from cct.elementwise import rectify  # noqa: E402

CONVS = ("conv1", "conv2", "conv3", "conv4", "conv5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    net = cct.Net(str(ROOT / "models/caffenet/train.prototxt"), cct.TRAIN)
    net.blobs["data"].reshape(args.batch, 3, 227, 227)
    net.blobs["label"].reshape(args.batch)
    net.reshape()
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
    net.forward()  # every engine chosen and its buffers made
    names = list(net._layer_names)
    print(f"batch {args.batch}, medians of {args.rounds} alternated rounds; OPENBLAS_CORETYPE="
          f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    print(f"{'layer':<7}{'engine':<34}{'fwd + ReLU ms':>14}{'rectified ms':>14}{'ratio':>8}")
    totals = [0.0, 0.0]
    for name in CONVS:
        i = names.index(name)
        layer = net.layers[i]
        x = layer._bottom_view(net.bottom_vecs[i][0].data)
        y = layer._top_view(net.top_vecs[i][0].data)
        w, b, eng = layer.blobs[0].data, layer.blobs[1].data, layer.engine
        both, fused = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            eng.forward(x, w, b, y)
            rectify(y)
            both.append(time.perf_counter() - t)
            t = time.perf_counter()
            eng.forward_rectified(x, w, b, y)
            fused.append(time.perf_counter() - t)
        a, c = statistics.median(both) * 1e3, statistics.median(fused) * 1e3
        totals[0] += a
        totals[1] += c
        print(f"{name:<7}{eng.describe().split(' (')[0].split(';')[0]:<34}{a:14.1f}{c:14.1f}{c / a:8.3f}")
    print(f"{'all':<41}{totals[0]:14.1f}{totals[1]:14.1f}{totals[1] / totals[0]:8.3f}")
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
