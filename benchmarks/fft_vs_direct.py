"""FFT vs direct (lowering) 3-D convolution per layer, ZNN Table II style, and PyTorch CPU conv3d.

Run:   python benchmarks/fft_vs_direct.py [--size 30] [--batch 1] [--repeat 5] [--kernels 3,5,7,9]
                                          [--widths 8,16,24,32,40] [--headline-only] [--prune]
                                          [--cases 16:7,16:3]
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets OpenBLAS pick its own kernels where
       the environment pins them; the script prints the values it ran with.)

For each kernel ``k³`` and width ``f`` (``f → f`` channels) on a ``size³`` volume of ``batch`` images: the
median seconds of one training step of the layer — forward, then backward (data and weights) — for

* ``lowering``: the fastest of the CcT lowerings 1/2/3 that apply (each measured; one whose warm-up is 3x
  slower than the best so far is skipped), named in the ``best`` column;
* ``fft``: :class:`cct.engines.fft.FFTEngine` (pruned, memoized, layout chosen by its cost model: all axes
  transformed, or the first axis lifted); the input, weights and output gradient change before every step,
  as in training, so every transform is recomputed (the memo only serves the passes within a step); both
  layouts' times are shown in parentheses;
* ``auto``: what ``-conv_engine auto`` runs (:class:`cct.engines.choice.SelectedEngine`: the engine chosen
  at setup by the cost models and a short measurement, in a fresh cache directory; the setup time with a
  cold and a warm cache is printed at the end), with the engine it chose;
* ``torch``: ``torch.nn.functional.conv3d`` forward + autograd backward, if torch imports, with the same
  thread count;

auto's effective GFLOP/s — the direct convolution's 3 passes of ``2·f·f·k³·out³·batch`` flops over its time — as
% of the sgemm peak measured at the start (above 100% where the FFT does fewer multiplications than the direct
sums), and the ratios fft/lowering, auto/best (auto's median over the fastest of lowering's and both fft layouts'),
pick/best (the same, with auto's pick timed as its forced twin: the lowering type or fft layout it runs) and
fft/torch.  The cct engines run in interleaved rounds (each round runs
every engine in turn, timing it once it has settled: see :func:`interleaved`), so that all see the same
conditions on a shared machine;
times are medians over rounds and fft/lowering the median of the per-round ratios.  PyTorch runs in its
own block of rounds followed by a block of fft steps (its OpenMP threads keep spinning after each call and
would slow a numpy step run right after), and fft/torch is the ratio of those two medians.  The last lines
print the ZNN headline case (16 → 16, 7³ kernel, 30³ volume): the fft/lowering ratio (goal ≤ 0.35) and
fft/pytorch.  ``--prune`` adds the pruned vs unpruned transform timings (:mod:`cct.engines.fft_plan`).  All
numbers come from the same run.
"""
from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

# before numpy: importing cct sets OpenBLAS's worker spin (OPENBLAS_THREAD_TIMEOUT), as `cct train` runs
import cct  # noqa: E402,F401

# isort: split
import numpy as np  # noqa: E402

from cct.bench.flops import sgemm_peak  # noqa: E402
from cct.engines import ConvGeometry  # noqa: E402
from cct.engines.choice import SelectedEngine  # noqa: E402
from cct.engines.fft import FFTEngine  # noqa: E402
from cct.engines.fft_plan import fft_workers  # noqa: E402
from cct.engines.lowering import LoweringEngine, strategy_fallback  # noqa: E402


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _median(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up: buffers, plans
    return statistics.median(_timed(fn) for _ in range(repeat))


class Layer:
    """Arrays of one ``f → f``, ``k³`` convolution on ``size³`` (float32)."""

    def __init__(self, batch: int, width: int, k: int, size: int, seed: int = 0):
        self.g = ConvGeometry(batch, width, width, 1, (size,) * 3, (k,) * 3, (1, 1, 1), (0, 0, 0), (1, 1, 1))
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((batch, width, size, size, size), dtype=np.float32)
        self.w = rng.standard_normal((width, width, k, k, k), dtype=np.float32) * 0.05
        self.dy = rng.standard_normal((batch, width) + self.g.out_shape, dtype=np.float32)
        self.y = np.empty_like(self.dy)
        self.dx = np.empty_like(self.x)
        self.dw = np.zeros_like(self.w)

    def step(self, eng: Any) -> Callable[[], None]:
        def run() -> None:
            # as in training, every step sees a new input, new weights (a solver update) and a new output
            # gradient, so no transform memoized by an earlier step applies
            self.x[0, 0, 0, 0, 0] += 1e-3
            self.w[0, 0, 0, 0, 0] += 1e-3
            self.dy[0, 0, 0, 0, 0] += 1e-3
            eng.forward(self.x, self.w, None, self.y)
            eng.backward(self.x, self.dy, self.w, self.dx, self.dw)
        return run


def best_lowering(layer: Layer) -> tuple[LoweringEngine, str]:
    """The fastest applicable CcT lowering for this layer (each timed twice, best of two)."""
    best, choice = float("inf"), None
    for strategy in (2, 1, 3):
        if strategy_fallback(strategy, layer.g):
            continue
        eng = LoweringEngine(strategy)
        eng.configure(layer.g, np.float32)
        run = layer.step(eng)
        t = _timed(run)
        if t > 3 * best:  # clearly slower: skip its second run
            continue
        t = min(t, _timed(run))
        if t < best:
            best, choice = t, eng
    assert choice is not None
    return choice, f"type {choice.strategy}"


def torch_step(layer: Layer, torch: Any) -> Callable[[], None]:
    x = torch.from_numpy(layer.x).requires_grad_(True)
    w = torch.from_numpy(layer.w.copy()).requires_grad_(True)
    dy = torch.from_numpy(layer.dy)

    def run() -> None:
        x.grad = w.grad = None
        torch.nn.functional.conv3d(x, w).backward(dy)
    return run


SETTLE_S = 0.15  # OpenBLAS threads spin ~0.1 s after a large GEMM and take a core from whatever runs next


def interleaved(steps: dict[str, Callable[[], None]], repeat: int) -> dict[str, list[float]]:
    """``repeat`` rounds, each running every step in turn, so that all of them see the same machine
    conditions (this machine is shared); within a round a step runs untimed until ``SETTLE_S`` has passed
    and is then timed once, so that it is measured in its steady state and does not pay for the threads
    the step before it left spinning (an FFT step right after a lowering step measured 30 ms slower).
    Per-step lists of seconds."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    rng = random.Random(0)
    for _ in range(repeat):
        rng.shuffle(order)  # no step always follows the same one
        for name in order:
            run = steps[name]
            start = time.perf_counter()
            run()
            while time.perf_counter() - start < SETTLE_S:
                run()
            times[name].append(_timed(run))
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a``'s time / ``b``'s time in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def check_equal(layer: Layer) -> float:
    """Max |fft - lowering| / max |lowering| over y, dx, dw, both fft layouts (sanity: the engines agree)."""
    out = []
    for eng in (LoweringEngine(1), FFTEngine(lift=False), FFTEngine(lift=True)):
        eng.configure(layer.g, np.float32)
        y, dx, dw = np.empty_like(layer.y), np.empty_like(layer.dx), np.zeros_like(layer.dw)
        eng.forward(layer.x, layer.w, None, y)
        eng.backward(layer.x, layer.dy, layer.w, dx, dw)
        out.append((y, dx, dw))
    return max(float(np.abs(a - b).max() / np.abs(a).max()) for other in out[1:] for a, b in zip(out[0], other))


def prune_figures(size: int, k: int, width: int, repeat: int) -> None:
    from cct.engines.fft_plan import FFTPlan

    layer = Layer(1, width, k, size)
    eng = FFTEngine(lift=False)  # the 3-D transforms
    eng.configure(layer.g, np.float32)
    T = eng._plan().size
    workers = fft_workers()
    block = np.ascontiguousarray(np.moveaxis(layer.w, (0, 1), (3, 4)))
    spec = FFTPlan(T, True).forward(block, None, workers)
    taps = [slice(0, k)] * 3
    for pruned in (True, False):
        plan = FFTPlan(T, pruned)
        tf = _median(lambda plan=plan: plan.forward(block, None, workers), repeat)
        ti = _median(lambda plan=plan: plan.inverse(spec.copy(), taps, workers), repeat)
        print(f"  {'pruned  ' if pruned else 'unpruned'} {width * width} kernels {k}^3 in {'x'.join(map(str, T))}: "
              f"forward {tf * 1e3:7.1f} ms   inverse to {k}^3 {ti * 1e3:7.1f} ms (incl. a copy)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kernels", default="3,5,7,9")
    ap.add_argument("--widths", default="8,16,24,32,40")
    ap.add_argument("--headline-only", action="store_true", help="only the 16->16, 7^3 case")
    ap.add_argument("--prune", action="store_true", help="also time pruned vs unpruned transforms")
    ap.add_argument("--cases", default="", help="f:k pairs instead of the sweep, e.g. 16:7,16:3")
    args = ap.parse_args()
    os.environ["CCT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cct-bench-")  # auto measures afresh
    atexit.register(shutil.rmtree, os.environ["CCT_CACHE_DIR"], ignore_errors=True)
    try:
        import torch  # only here: the engine never needs it
        torch.set_num_threads(fft_workers())
    except ImportError:
        torch = None
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} "
          f"threads (BLAS/FFT{'/torch' if torch else ''}) {fft_workers()}; "
          f"torch {torch.__version__ if torch else 'not importable'}")
    peak = sgemm_peak()
    print(f"volume {args.size}^3, batch {args.batch}, float32, one step = forward + backward (data + weights), "
          f"medians of {args.repeat} interleaved rounds; sgemm peak (2048^3) {peak / 1e9:.1f} GFLOP/s")
    if args.prune:
        prune_figures(args.size, 7, 16, args.repeat)
    cases = [(16, 7)] if args.headline_only else [
        (f, k) for k in map(int, args.kernels.split(",")) for f in map(int, args.widths.split(","))]
    if args.cases:
        cases = [tuple(int(v) for v in pair.split(":")) for pair in args.cases.split(",")]
    if (16, 7) not in cases:
        cases.append((16, 7))
    print(f"{'f->f':>7}{'k':>4}{'lowering ms':>13}{'best':>8}{'fft ms':>9}{'layout':>8}{'auto ms':>9}{'auto':>9}"
          f"{'eff%peak':>9}{'torch ms':>10}{'fft/lowering':>14}{'auto/best':>11}{'pick/best':>11}{'fft/torch':>11}"
          f"{'fft MiB':>9}"
          f"  (full / lifted fft ms)")
    headline: dict[str, Any] = {}
    setups: list[str] = []
    misses = 0
    for f, k in cases:
        layer = Layer(args.batch, f, k, args.size)
        low, label = best_lowering(layer)
        setup = []
        for _ in range(2):  # cold cache (measures), then warm (reads the cache)
            auto_eng = SelectedEngine("auto")
            t0 = time.perf_counter()
            auto_eng.configure(layer.g, np.float32)
            setup.append(time.perf_counter() - t0)
        setups.append(f"{f}->{f} {k}^3: {setup[0] * 1e3:.0f} / {setup[1] * 1e3:.1f} ms [{auto_eng.describe()}]")
        engines = {"full": FFTEngine(lift=False), "lifted": FFTEngine(lift=True)}
        for eng in engines.values():
            eng.configure(layer.g, np.float32)
        auto = FFTEngine()  # the layout the engine picks by itself; timed as that layout
        auto.configure(layer.g, np.float32)
        chosen = "lifted" if auto.lifted else "full"
        steps = {"lowering": layer.step(low), "auto": layer.step(auto_eng)}
        steps.update({name: layer.step(eng) for name, eng in engines.items()})
        times = interleaved(steps, args.repeat)
        times["fft"] = times[chosen]
        if torch:  # its own rounds, each against an fft step: torch's OpenMP threads spin after each call and
            # would slow whatever numpy/BLAS step runs right after them
            times.update({"torch": [], "fft_t": []})
            pair = interleaved({"torch": torch_step(layer, torch)}, args.repeat)["torch"]
            times["torch"] = pair
            times["fft_t"] = interleaved({"fft": steps[chosen]}, args.repeat)["fft"]
        med = {name: statistics.median(t) for name, t in times.items()}
        med.setdefault("torch", float("nan"))
        r_low = ratio(times, "fft", "lowering")
        fastest = min(med["lowering"], med["full"], med["lifted"])
        r_auto = med["auto"] / fastest
        # auto's pick judged by the forced time of what it picked (the same code path: one noisy sample of
        # the auto instance does not decide); a lowering other than the fastest one by its own time
        inner = auto_eng.inner
        if inner.name == "fft":
            picked = med["lifted" if inner.lifted else "full"]
        elif f"type {inner.strategy}" == label:
            picked = med["lowering"]
        else:
            picked = med["auto"]
        r_pick = picked / fastest
        misses += r_pick > 1.05
        r_torch = statistics.median(times["fft_t"]) / med["torch"] if torch else float("nan")
        eng = engines[chosen]
        g = layer.g
        direct = 3 * 2.0 * g.out_channels * g.in_channels * k ** 3 * g.out_count * g.num
        print(f"{f:>3}->{f:<3}{k:>4}{med['lowering'] * 1e3:13.1f}{label:>8}{med['fft'] * 1e3:9.1f}"
              f"{'lifted' if eng.lifted else 'full':>8}{med['auto'] * 1e3:9.1f}{auto_eng.name:>9}"
              f"{100 * direct / med['auto'] / peak:8.0f}%{med['torch'] * 1e3:10.1f}{r_low:14.3f}{r_auto:11.3f}"
              f"{r_pick:11.3f}{r_torch:11.3f}"
              f"{eng.workspace_bytes() / 2**20:9.1f}  ({med['full'] * 1e3:.1f} / {med['lifted'] * 1e3:.1f})")
        if (f, k) == (16, 7):
            headline = {"med": med, "low": r_low, "torch": r_torch, "err": check_equal(layer),
                        "engine": eng.describe(), "lowering": label}
    h, m = headline, headline["med"]
    print(f"headline 16->16, 7^3 kernel, {args.size}^3 volume, batch {args.batch}: fwd+bwd medians "
          f"fft {m['fft'] * 1e3:.1f} ms [{h['engine']}], lowering {m['lowering'] * 1e3:.1f} ms "
          f"[{h['lowering']}], torch {m['torch'] * 1e3:.1f} ms; max rel. difference fft vs lowering "
          f"{h['err']:.1e}")
    print(f"fft/lowering = {h['low']:.3f}  (goal <= 0.35; median of per-round ratios)")
    print(f"fft/pytorch  = {h['torch']:.3f}")
    print(f"auto's pick within 5% of the fastest forced choice (lowering, fft full, fft lifted) at every layer: "
          f"{'yes' if not misses else f'no ({misses} of {len(cases)})'}")
    print("auto's setup time, cold / warm cache [its choice]:")
    for line in setups:
        print(f"  {line}")


if __name__ == "__main__":
    main()
