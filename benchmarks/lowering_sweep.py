"""CcT's Figure 8: time of each lowering as the input/output channel ratio d/o goes from 1/32 to 32.

Run:   python benchmarks/lowering_sweep.py [--n 27] [--k 5] [--batch 16] [--product 8192] [--repeat 5]
                                           [--torch-native]       (PyTorch column: pip install torch==2.13.0)
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets OpenBLAS use its own kernel choice,
       e.g. AVX-512, where the environment pins it; the script prints the values it ran with.)
Fixed input n×n, kernel k×k (pad k//2, stride 1), batch B and d·o = product; for each ratio d/o the median
seconds of forward + backward (data and weights) of lowering 1, 2, 3 (forced) and of ``auto`` (its pick —
cost model, or measured where the model sees a close call: ``cct.engines.choice`` — run as its own engine),
all measured alternately; auto's GFLOP/s as % of the sgemm peak measured at the start (3 passes of
2·o·d·k²·n²·B flops); PyTorch's ``conv2d`` forward + backward of the same layer (a worker process of its own,
:mod:`torch_conv`, with the same thread count and — where numpy's OpenBLAS runs AVX2 kernels — held to AVX2:
:mod:`torch_isa`) and auto's time over it; then whether auto's pick is within 5% of the fastest at each point
(judged by the forced time of the lowering it picked: the same code path, so the comparison is not at the
mercy of one noisy sample).  Partitions follow CCT_PARTITIONS (default auto).  Prints the load average: the
machine may be shared.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

# before numpy: importing cct sets OpenBLAS's worker spin (OPENBLAS_THREAD_TIMEOUT), as `cct train` runs
import cct  # noqa: E402,F401

# isort: split
import numpy as np  # noqa: E402
from torch_conv import TorchConv  # noqa: E402
from torch_isa import match_torch_isa  # noqa: E402

from cct.bench.bench import load_average  # noqa: E402
from cct.bench.flops import sgemm_peak  # noqa: E402
from cct.engines import ConvGeometry  # noqa: E402
from cct.engines.choice import SelectedEngine  # noqa: E402
from cct.engines.lowering import LoweringEngine  # noqa: E402
from cct.runtime.threads import thread_budget  # noqa: E402


def _step(eng: LoweringEngine, x, w, y, dy, dx, dw) -> float:
    t = time.perf_counter()
    eng.forward(x, w, None, y)
    eng.backward(x, dy, w, dx, dw)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=27)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--product", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--torch-native", action="store_true",
                    help="let PyTorch use its own instruction set even where numpy's OpenBLAS is held to AVX2")
    args = ap.parse_args()
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} "
          f"CCT_PARTITIONS={os.environ.get('CCT_PARTITIONS', 'auto')}")
    print(match_torch_isa(args.torch_native))
    torch_conv = TorchConv(thread_budget(), args.repeat)
    peak = sgemm_peak()
    print(f"n={args.n} k={args.k} batch={args.batch} d*o={args.product}; median of {args.repeat}, fwd+bwd ms; "
          f"sgemm peak (2048^3, {thread_budget()} threads) {peak / 1e9:.1f} GFLOP/s; "
          f"PyTorch {torch_conv.version or 'not installed: no PyTorch column'}")
    print(f"{'d/o':>7}{'d':>6}{'o':>6}{'type1':>9}{'type2':>9}{'type3':>9}{'auto':>9}{'%peak':>7}{'pytorch':>9}"
          f"{'auto/pt':>9}  auto pick  within 5%  why")
    rng = np.random.default_rng(0)
    all_ok = True
    for j in range(-5, 6):
        ratio = 2.0 ** j
        d = int(round((args.product * ratio) ** 0.5))
        o = args.product // d
        g = ConvGeometry(args.batch, d, o, 1, (args.n, args.n), (args.k, args.k), (1, 1), (args.k // 2,) * 2, (1, 1))
        x = rng.standard_normal((args.batch, d, args.n, args.n), dtype=np.float32)
        w = rng.standard_normal((o, d, args.k, args.k), dtype=np.float32)
        dy = rng.standard_normal((args.batch, o) + g.out_shape, dtype=np.float32)
        y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)
        engines = {}
        for name in (1, 2, 3, "auto"):
            eng = SelectedEngine("lowering", "benchmark", "auto") if name == "auto" else LoweringEngine(name)
            eng.configure(g, np.float32)
            _step(eng, x, w, y, dy, dx, dw)  # warm-up
            engines[name] = eng
        times: dict = {name: [] for name in engines}
        for _ in range(args.repeat):
            for name, eng in engines.items():
                times[name].append(_step(eng, x, w, y, dy, dx, dw))
        med = {name: statistics.median(v) for name, v in times.items()}
        fastest = min(med[s] for s in (1, 2, 3))
        # auto runs the very code path of the lowering it picked; judge the pick by that lowering's time
        ok = med[engines["auto"].strategy] <= 1.05 * fastest
        all_ok &= ok
        flops = 3 * 2.0 * o * d * args.k ** 2 * g.out_count * args.batch
        torch_ms = ratio_text = ""
        if torch_conv.version:
            _, torch_s = torch_conv.time(args.batch, d, o, 1, args.n, args.k, 1, args.k // 2)
            torch_ms, ratio_text = f"{torch_s * 1e3:9.1f}", f"{med['auto'] / torch_s:9.2f}"
        print(f"{'%g' % ratio:>7}{d:>6}{o:>6}" + "".join(f"{med[s] * 1e3:9.1f}" for s in (1, 2, 3, "auto"))
              + f"{100 * flops / med['auto'] / peak:6.0f}%{torch_ms:>9}{ratio_text:>9}"
              + f"  {engines['auto'].strategy:^9}  {'yes' if ok else 'NO':<9}  {engines['auto'].inner.reason}")
        del engines
    torch_conv.close()
    print(f"auto within 5% of the fastest lowering at every point: {'yes' if all_ok else 'no'}")
    print(load_average())


if __name__ == "__main__":
    main()
