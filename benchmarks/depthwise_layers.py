"""MobileNet v1's depthwise layers (one input channel per group): cct's depthwise engine, its lowering engine and
PyTorch CPU, forward and forward + backward, layer by layer.

Run:   python benchmarks/depthwise_layers.py [--batch 16] [--repeat 3] [--no-lowering]   (PyTorch rows: pip install
       torch==2.13.0; ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets OpenBLAS use its own kernel
       choice, e.g. AVX-512, where the environment pins it.)
For each distinct depthwise geometry of ``models/mobilenet`` (3x3, pad 1; the 112x112 and 56x56 stride-2 ones
included; conv5_1..5_5 share one) at ``batch`` images: the median over ``repeat`` training steps (every step's
operands new) of the forward and of forward + backward (data and weights) with ``-conv_engine depthwise`` and —
unless ``--no-lowering`` — ``-conv_engine lowering`` (one GEMM of a row per group: what cct ran these layers with
before the depthwise engine), then the same layer in PyTorch (``conv2d`` with ``groups``, in its own worker
process with the same thread count), and the ratios depthwise/PyTorch and depthwise/lowering of the forward +
backward times, with their medians over the layers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

# before numpy: importing cct sets OpenBLAS's worker spin (OPENBLAS_THREAD_TIMEOUT), as `cct train` runs
import cct  # noqa: E402,F401

# isort: split
import numpy as np  # noqa: E402
from conv_layers import layer_operands, measure_steps  # noqa: E402
from torch_conv import TorchConv  # noqa: E402
from torch_isa import match_torch_isa  # noqa: E402

from cct.engines.choice import SelectedEngine  # noqa: E402
from cct.runtime.threads import thread_budget as blas_threads  # noqa: E402

# name, d, o, group, n, k, stride, pad (conv_layers' layout); the layers of models/mobilenet that differ
MOBILENET = [("conv2_1/dw", 32, 32, 32, 112, 3, 1, 1), ("conv2_2/dw", 64, 64, 64, 112, 3, 2, 1),
             ("conv3_1/dw", 128, 128, 128, 56, 3, 1, 1), ("conv3_2/dw", 128, 128, 128, 56, 3, 2, 1),
             ("conv4_1/dw", 256, 256, 256, 28, 3, 1, 1), ("conv4_2/dw", 256, 256, 256, 28, 3, 2, 1),
             ("conv5_x/dw", 512, 512, 512, 14, 3, 1, 1), ("conv5_6/dw", 512, 512, 512, 14, 3, 2, 1),
             ("conv6/dw", 1024, 1024, 1024, 7, 3, 1, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-lowering", action="store_true", help="skip the lowering engine's rows (slow)")
    ap.add_argument("--torch-native", action="store_true",
                    help="PyTorch on its own instruction set even where numpy's OpenBLAS runs AVX2 or older")
    args = ap.parse_args()
    print(match_torch_isa(args.torch_native))
    torch_conv = TorchConv(blas_threads(), args.repeat)
    print(f"batch {args.batch}; median of {args.repeat}; {blas_threads()} threads; PyTorch "
          f"{torch_conv.version or 'not installed: no PyTorch rows'}")
    print(f"{'layer':<12}{'engine':<12}{'fwd ms':>9}{'fwd+bwd ms':>12}{'/pytorch':>10}{'/lowering':>11}")
    rng = np.random.default_rng(0)
    vs_torch, vs_lowering = [], []
    for spec in MOBILENET:
        name, d, o, grp, n, k, s, p = spec
        g, _, x, w, dy = layer_operands(args.batch, spec, rng)
        y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)
        times = {}
        for choice in ("depthwise",) + (() if args.no_lowering else ("lowering",)):
            eng = SelectedEngine(choice, "benchmark", "auto")
            eng.configure(g, np.float32)
            eng.forward(x, w, None, y)
            eng.backward(x, dy, w, dx, dw)
            tf, tb = measure_steps(eng, (x, w, y, dy, dx, dw), args.repeat)
            times[choice] = (tf, tf + tb)
        if torch_conv.version:
            times["pytorch"] = torch_conv.time(args.batch, d, o, grp, n, k, s, p)
        ours = times["depthwise"][1]
        for engine, (tf, tfb) in times.items():
            cells = ["", ""]
            if engine == "depthwise" and "pytorch" in times:
                vs_torch.append(ours / times["pytorch"][1])
                cells[0] = f"{vs_torch[-1]:.2f}"
            if engine == "depthwise" and "lowering" in times:
                vs_lowering.append(ours / times["lowering"][1])
                cells[1] = f"{vs_lowering[-1]:.3f}"
            print(f"{name:<12}{engine:<12}{tf * 1e3:9.1f}{tfb * 1e3:12.1f}{cells[0]:>10}{cells[1]:>11}")
    torch_conv.close()
    if vs_torch:
        print(f"depthwise / pytorch (fwd+bwd), median over the layers: {statistics.median(vs_torch):.2f}")
    if vs_lowering:
        print(f"depthwise / lowering (fwd+bwd), median over the layers: {statistics.median(vs_lowering):.3f}")


if __name__ == "__main__":
    main()
