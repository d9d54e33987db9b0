"""Per convolution layer of CaffeNet: GFLOP/s of each lowering, of auto and of PyTorch, and % of the sgemm peak.

Run:   python benchmarks/conv_layers.py [--batch 64] [--repeat 3]      (PyTorch rows: pip install torch==2.13.0)
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets OpenBLAS use its own kernel choice,
       e.g. AVX-512, where the environment pins it; the script prints the values it ran with.)
First measures the float32 sgemm peak (2048³ matmul, best of 5) at the current BLAS thread count; then for
conv1..conv5 of CaffeNet at ``batch`` images the median forward and forward+backward (data and weights; conv1
has no data gradient in a net but it is measured too) seconds of each applicable lowering, of the lowering auto
chooses and of the engine auto chooses (``engine auto``: the lowering, FFT or Winograd engine, as a net's layer
runs: the five layers configured in order in one net's measuring session, so with the fast autotune's budget on
a first run and the cached measurements after, and the net's budget of FFT spectra kept between the passes), as
GFLOP/s of the convolution's arithmetic
(2·o·d/g·k²·m²·B per pass: for the FFT and Winograd engines, which do less arithmetic, an effective rate) and %
of the sgemm peak, and the workspace bytes the engine needs (each measured with buffers of its own; in a net
all layers share one).  Every step's operands are new (as in training).
Partitions follow CCT_PARTITIONS (default auto).  Then the same layer in PyTorch CPU (``conv2d`` without bias,
forward and autograd backward of the data and the weights), run in a worker process of its own with the same
thread count right after cct's rows, and the ratio of engine auto's forward+backward time to PyTorch's; PyTorch
is held to the instruction set of numpy's OpenBLAS kernel where that is AVX2 or older (:mod:`torch_isa`;
``--torch-native`` lifts it).
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
from torch_conv import TorchConv, timed  # noqa: E402
from torch_isa import match_torch_isa  # noqa: E402

from cct.bench.flops import sgemm_peak  # noqa: E402
from cct.engines import ConvGeometry  # noqa: E402
from cct.engines.autotune import measuring_session  # noqa: E402
from cct.engines.choice import SelectedEngine  # noqa: E402
from cct.engines.lowering import LoweringEngine, Workspace, strategy_fallback  # noqa: E402
from cct.runtime.threads import thread_budget as blas_threads  # noqa: E402

# name, d, o, group, n, k, stride, pad
CAFFENET = [("conv1", 3, 96, 1, 227, 11, 4, 0), ("conv2", 96, 256, 2, 27, 5, 1, 2),
            ("conv3", 256, 384, 1, 13, 3, 1, 1), ("conv4", 384, 384, 2, 13, 3, 1, 1),
            ("conv5", 384, 256, 2, 13, 3, 1, 1)]


def layer_operands(batch: int, spec: tuple, rng: np.random.Generator) -> tuple:
    """The geometry of ``spec`` (an entry of ``CAFFENET``) at ``batch`` images, its forward flops and random
    ``x``, ``w`` (scaled 0.01) and ``dy``."""
    _, d, o, grp, n, k, s, p = spec
    g = ConvGeometry(batch, d, o, grp, (n, n), (k, k), (s, s), (p, p), (1, 1))
    flops = 2.0 * o * (d // grp) * k * k * g.out_count * batch
    x = rng.standard_normal((batch, d, n, n), dtype=np.float32)
    w = rng.standard_normal((o, d // grp, k, k), dtype=np.float32) * 0.01
    dy = rng.standard_normal((batch, o) + g.out_shape, dtype=np.float32)
    return g, flops, x, w, dy


def measure_steps(eng: LoweringEngine | SelectedEngine, arrays: tuple, repeat: int) -> tuple[float, float]:
    """Median forward and backward (data + weights) seconds over ``repeat`` training steps, each on operands no
    earlier step saw (one value of the input, the weights and the output gradient changed in place: an engine
    that keeps transforms between its passes — the FFT's spectra — redoes them as in training)."""
    x, w, y, dy, dx, dw = arrays
    forward, backward = [], []
    for step in range(repeat):
        for a in (x, w, dy):
            a.flat[0] += 0.01 * (step + 1)
        forward.append(timed(lambda: eng.forward(x, w, None, y)))
        backward.append(timed(lambda: eng.backward(x, dy, w, dx, dw)))
    return statistics.median(forward), statistics.median(backward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--torch-native", action="store_true",
                    help="let PyTorch use its own instruction set even where numpy's OpenBLAS is held to AVX2")
    args = ap.parse_args()
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} "
          f"CCT_PARTITIONS={os.environ.get('CCT_PARTITIONS', 'auto')}")
    print(match_torch_isa(args.torch_native))
    torch_conv = TorchConv(blas_threads(), args.repeat)
    torch_version = torch_conv.version
    peak = sgemm_peak()
    print(f"sgemm peak (2048^3, this run, {blas_threads()} threads): {peak / 1e9:.1f} GFLOP/s; batch {args.batch}; "
          f"median of {args.repeat}; PyTorch {torch_version or 'not installed: no PyTorch rows'}")
    print(f"{'layer':<7}{'lowering':<50}{'fwd ms':>8}{'GFLOP/s':>9}{'%peak':>7}{'fwd+bwd ms':>12}{'GFLOP/s':>9}"
          f"{'%peak':>7}{'workspace MiB':>15}")

    def row(name: str, label: str, tf: float, tb: float, flops: float, tail: str) -> None:
        print(f"{name:<7}{label:<50}{tf * 1e3:8.1f}{flops / tf / 1e9:9.1f}{100 * flops / tf / peak:6.0f}%"
              f"{(tf + tb) * 1e3:12.1f}{3 * flops / (tf + tb) / 1e9:9.1f}{100 * 3 * flops / (tf + tb) / peak:6.0f}%"
              f"{tail}")

    rng = np.random.default_rng(0)
    operands = [layer_operands(args.batch, spec, rng) for spec in CAFFENET]
    # engine auto as a net's layers choose it: the five configured in the net's order within one net's measuring
    # session — its measuring budget and its budget of FFT spectra kept between the passes shared (outside a net
    # an FFT layout keeping many spectra needs KEPT_FRACTION more speed: CaffeNet's conv2 ran lowering 2 here
    # where the net runs the FFT)
    net_engines = []
    with measuring_session():
        for g, *_ in operands:
            net_engines.append(SelectedEngine("auto", "benchmark", "auto"))
            net_engines[-1].configure(g, np.float32)
    for spec, (g, flops, x, w, dy), net_engine in zip(CAFFENET, operands, net_engines):
        name, d, o, grp, n, k, s, p = spec
        y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)
        for strategy in (1, 2, 3, "auto", "engine"):
            if strategy in (1, 2, 3) and strategy_fallback(strategy, g):
                continue
            # each its own buffers (the column is per lowering); auto is the lowering policy, engine the engine
            # choice (lowering, FFT or Winograd) a net's layer runs
            if strategy == "engine":
                eng = net_engine
            elif strategy == "auto":
                eng = SelectedEngine("lowering", "benchmark", "auto")
            else:
                eng = LoweringEngine(strategy, workspace=Workspace())
            eng.configure(g, np.float32)
            eng.forward(x, w, None, y)
            eng.backward(x, dy, w, dx, dw)
            tf, tb = measure_steps(eng, (x, w, y, dy, dx, dw), args.repeat)
            label = f"lowering {strategy}" if strategy in (1, 2, 3) else eng.describe()
            if strategy == "engine":
                label = "engine auto: " + label
            row(name, label[:49], tf, tb, flops, f"{eng.workspace_bytes() / 2**20:15.1f}")
            auto = tf + tb
        if torch_version:
            tf, tfb = torch_conv.time(args.batch, d, o, grp, n, k, s, p)
            row(name, "pytorch", tf, tfb - tf, flops, f"   cct engine auto / pytorch (fwd+bwd) {auto / tfb:.2f}")
    torch_conv.close()


if __name__ == "__main__":
    main()
