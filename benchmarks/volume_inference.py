"""Sliding-window inference throughput (ZNNi): the planned MPF path vs the naive per-window path and vs the
all-offsets pooling baseline, the planner's choice vs the best measured candidate, and the peak memory of a run
whose volume is 10x its budget.

Run:   python benchmarks/volume_inference.py [--net ctm_valid] [--output 48] [--budget 2GiB] [--rounds 3]
                                             [--memory] [--exactness] [--workers]

All on the same net and dense output (default: ``models/znn/deploy/ctm_valid.prototxt``, width 24, seeded
filler weights, a ``48³`` output from a ``73³`` random volume), timings in voxels of dense output per second:

* ``planned``: what ``cct infer`` runs — the planner's choice under ``--budget`` (patch size, batch, MPF,
  primitives), the forward runs of every tile of the volume, fragments recombined into the dense output;
* ``naive``: the plain net on field-of-view windows, ``B`` windows per forward run (``B`` = 1, 8, 32, each
  with the primitives the planner's cost model prefers for it), timed on 256 sampled output voxels; the
  best ``B`` is the baseline;
* ``all-offsets``: the plain net (pooling at offset 0 only) run on the patch shifted by every pooling offset —
  ``P³`` runs for a ``(P·J)³`` output, ZNNi's cuDNN baseline — with the planner's best batch and primitives
  for it (the same search restricted to plain pooling);
* ``planner``: the 5 best predicted candidates measured; the chosen one's measured throughput over the best;
* ``patch size``: the planned path on a quarter of the output per axis (one small patch, e.g. 12³ instead of
  48³): the larger patch's throughput over the smaller's (ZNNi: less work wasted on the borders).

Rounds interleave the paths (every round runs each once) and times are medians over rounds.  ``--memory``
runs ``cct.inference.infer`` in a fresh process on a 2-D volume 10x the size of its budget (a ``.npy``
file, memory-mapped) and on a 3-D one, and prints the tracemalloc peak and the RSS growth against the budget
and the planner's estimate.  ``--workers`` runs ``cct.inference.infer`` on a volume of 8 such outputs with one
worker (all cores) and with ``-devices cpu:1,cpu:1`` (two one-thread workers sharing the tiles, each with
half the budget), interleaved, and prints the ratio.  ``--exactness`` runs the full-size exactness checks
(every voxel of a 100³ output of ctm_valid against the plain net on each window; 2,000 sampled voxels of
n337_w8 at 140³): slower than the test suite's versions.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

import cct  # noqa: E402
from cct.inference import load_spec, measure_plan  # noqa: E402
from cct.inference.memory import parse_memory  # noqa: E402
from cct.inference.planner import candidates, plan_inference  # noqa: E402
from cct.inference.runner import InferenceNet, Weights  # noqa: E402
from cct.inference.tiling import Tiling, run_tiles  # noqa: E402
from cct.inference.volume_io import MemoryWriter, Volume  # noqa: E402
from cct.io.prototxt import read_net_param  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def weights_for(param, seed: int = 1) -> Weights:
    cct.set_random_seed(seed)
    from cct.config import settings

    settings.set("conv_engine", "lowering")
    net = cct.Net(param, cct.TEST)
    return Weights({name: [b.data.copy() for b in blobs] for name, blobs in net.params.items()})


def run_plan(spec, w: Weights, plan, volume: np.ndarray, out_shape) -> float:
    """Seconds to fill the whole dense output with ``plan`` (reading, runs, recombination, writing)."""
    sink = MemoryWriter((spec.out_channels,) + tuple(out_shape))
    vol = Volume(volume, True)
    t = time.perf_counter()
    run_tiles(spec, lambda k: InferenceNet(spec, w, plan.mpf, k, plan.run_input, plan.primitives), plan.mpf,
              plan.batch, Tiling(tuple(out_shape), plan.tile, plan.run_input), vol.read, sink.write)
    seconds = time.perf_counter() - t
    assert sink.counts.min() == 1 and sink.counts.max() == 1
    return seconds


def naive_seconds(spec, w: Weights, volume: np.ndarray, batch: int, positions, rates) -> float:
    """Seconds per output voxel of the plain net on ``batch`` field-of-view windows per run."""
    plain = (False,) * len(spec.pools)
    plans, _ = candidates(spec, (1,) * spec.num_spatial, 1 << 40, batches=(batch,), mpf_choices=[plain], rates=rates)
    net = InferenceNet(spec, w, plain, batch, spec.fov, plans[0].primitives)
    t = time.perf_counter()
    for b0 in range(0, len(positions), batch):
        x = net.input_buffer()
        for k, p in enumerate(positions[b0:b0 + batch]):
            x[k] = volume[(slice(None),) + tuple(slice(int(a), int(a) + f) for a, f in zip(p, spec.fov))]
        del x
        net.forward()
    runs = -(-len(positions) // batch)
    return (time.perf_counter() - t) / (runs * batch)


def throughput(args) -> None:
    from cct.engines.autotune import machine_rates

    param = read_net_param(ROOT / "models" / "znn" / "deploy" / f"{args.net}.prototxt")
    spec = load_spec(param)
    w = weights_for(param)
    rates = machine_rates(calibrate_if_missing=True)
    out_shape = (args.output,) * spec.num_spatial
    vol_shape = tuple(o + f - 1 for o, f in zip(out_shape, spec.fov))
    rng = np.random.default_rng(0)
    volume = rng.random((spec.in_channels,) + vol_shape, dtype=np.float32)
    budget = parse_memory(args.budget)
    voxels = int(np.prod(out_shape))
    print(f"net {spec.name} (FOV {spec.fov}), volume {vol_shape} -> output {out_shape}, budget {args.budget}, "
          f"{os.cpu_count()} cores")
    plan = plan_inference(spec, out_shape, budget, rates=rates, report=print)
    top, _ = candidates(spec, out_shape, budget, rates=rates)
    top = top[:5]
    plain = (False,) * len(spec.pools)
    offsets, _ = candidates(spec, out_shape, budget, mpf_choices=[plain], rates=rates)
    base = offsets[0]
    print(f"all-offsets baseline: input {base.run_input}, {base.shifts} shifts per tile, batch {base.batch}, "
          f"{base.runs} runs, {base.primitives}")
    small_out = tuple(max(1, o // 4) for o in out_shape)
    small = plan_inference(spec, small_out, budget, rates=rates, report=lambda line: None)
    small_vol = volume[(slice(None),) + tuple(slice(0, o + f - 1) for o, f in zip(small_out, spec.fov))]
    positions = rng.integers(0, args.output, (256, spec.num_spatial))
    for p in [plan, base, small] + top:  # warm-up: FFT plans, thread pools
        measure_plan(spec, w, p, repeat=1)
    rows: dict[str, list[float]] = {"planned": [], "all-offsets": [], "small": []}
    naive: dict[int, list[float]] = {b: [] for b in (1, 8, 32)}
    cand: list[list[float]] = [[] for _ in top]
    for r in range(args.rounds):
        rows["planned"].append(voxels / run_plan(spec, w, plan, volume, out_shape))
        rows["all-offsets"].append(voxels / run_plan(spec, w, base, volume, out_shape))
        rows["small"].append(int(np.prod(small_out)) / run_plan(spec, w, small, small_vol, small_out))
        for b in naive:
            naive[b].append(1.0 / naive_seconds(spec, w, volume, b, positions, rates))
        for i, p in enumerate(top):
            cand[i].append(p.voxels / (p.runs * measure_plan(spec, w, p, repeat=1)))
        print(f"round {r + 1}: planned {rows['planned'][-1]:,.0f} vox/s, all-offsets {rows['all-offsets'][-1]:,.0f}, "
              + ", ".join(f"naive B={b} {v[-1]:,.0f}" for b, v in naive.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    nmed = {b: statistics.median(v) for b, v in naive.items()}
    best_b = max(nmed, key=nmed.__getitem__)
    print(f"\nplanned path:        {med['planned']:>12,.0f} vox/s (predicted {plan.throughput:,.0f})")
    print(f"all-offsets baseline: {med['all-offsets']:>11,.0f} vox/s (predicted {base.throughput:,.0f})")
    for b, v in nmed.items():
        print(f"naive per-window B={b:<2}: {v:>10,.0f} vox/s")
    print(f"planned / naive (best batch {best_b}): {med['planned'] / nmed[best_b]:.1f}x   (goal >= 50)")
    print(f"planned / all-offsets:              {med['planned'] / med['all-offsets']:.1f}x   (goal >= 3)")
    print(f"planned on a {small_out} output (input {small.run_input}): {med['small']:,.0f} vox/s; "
          f"{out_shape} over it: {med['planned'] / med['small']:.1f}x")
    cm = [statistics.median(c) for c in cand]
    for p, m in zip(top, cm):
        print(f"candidate input {p.run_input} batch {p.batch}: predicted {p.throughput:,.0f}, measured {m:,.0f} vox/s")
    chosen = next(i for i, p in enumerate(top) if p.key() == plan.key())
    print(f"planner's choice / best measured of the 5 best predicted: {cm[chosen] / max(cm):.2f}   (goal >= 0.85)")


_MEMORY_CHILD = r"""
import json, os, sys, tracemalloc
import numpy as np
sys.path.insert(0, sys.argv[1])
from cct.inference import infer

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0

model, volume, budget = sys.argv[2], sys.argv[3], sys.argv[4]
small = np.random.default_rng(0).random((64,) * (2 if "2d" in model else 3), dtype=np.float32)
infer(model, None, small, sys.argv[5], memory_budget=budget, quiet=True, report=lambda line: None)  # warm-up
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
tracemalloc.start()
result = infer(model, None, volume, sys.argv[5], memory_budget=budget, quiet=True, report=lambda line: None)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
print(json.dumps({"tracemalloc": peak, "rss_growth": rss("VmHWM:") - before, "estimate": result.plan.memory,
                  "seconds": result.seconds, "tile": result.plan.tile, "tiles": result.plan.tiles}))
"""


def memory(args) -> None:
    """Each case in a fresh process: a volume 10x the budget, as a .npy file on disk."""
    from google.protobuf import text_format

    cases = [("ctm2d_valid", None, "16MiB", (6480, 6480)), ("ctm_valid", 4, "16MiB", (348, 348, 348))]
    with tempfile.TemporaryDirectory() as tmp:
        for net, width, budget, shape in cases:
            param = read_net_param(ROOT / "models" / "znn" / "deploy" / f"{net}.prototxt")
            if width is not None:
                for lp in [lp for lp in param.layer if lp.type == "Convolution"][:-1]:
                    lp.convolution_param.num_output = width
            model = os.path.join(tmp, f"{net}.prototxt")
            Path(model).write_text(text_format.MessageToString(param))
            path = os.path.join(tmp, f"{net}.npy")
            arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
            rng = np.random.default_rng(0)
            for i in range(shape[0]):
                arr[i] = rng.random(shape[1:], dtype=np.float32)
            arr.flush()
            del arr
            size = os.path.getsize(path)
            out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(ROOT), model, path, budget,
                                  os.path.join(tmp, "out.h5")], capture_output=True, text=True,
                                 env={**os.environ, "GLOG_minloglevel": "2"})
            if out.returncode:
                print(out.stderr[-2000:])
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            b = parse_memory(budget)
            print(f"{net}{'' if width is None else f' width {width}'}: volume {shape} ({size / 2**20:.0f} MiB = "
                  f"{size / b:.1f}x the budget {budget}), tile {r['tile']} x{r['tiles']}: tracemalloc peak "
                  f"{r['tracemalloc'] / 2**20:.1f} MiB ({r['tracemalloc'] / b:.2f} of the budget, "
                  f"{r['tracemalloc'] / r['estimate']:.2f} of the estimate {r['estimate'] / 2**20:.1f} MiB), RSS "
                  f"growth {r['rss_growth'] / 2**20:.1f} MiB ({r['rss_growth'] / b:.2f} of the budget), "
                  f"{r['seconds']:.1f} s", flush=True)


def workers(args) -> None:
    from cct.inference import infer

    param = read_net_param(ROOT / "models" / "znn" / "deploy" / f"{args.net}.prototxt")
    spec = load_spec(param)
    out = tuple(2 * args.output for _ in range(spec.num_spatial))
    volume = np.random.default_rng(3).random(tuple(o + f - 1 for o, f in zip(out, spec.fov)), dtype=np.float32)
    times: dict[str, list[float]] = {"1 worker": [], "cpu:1,cpu:1": []}
    for _ in range(args.rounds):
        for name, devices in (("1 worker", None), ("cpu:1,cpu:1", "cpu:1,cpu:1")):
            sink = MemoryWriter((spec.out_channels,) + out)
            r = infer(param, None, volume, sink, memory_budget=args.budget, quiet=True, devices=devices,
                      report=lambda line: None)
            times[name].append(r.voxels_per_second)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"workers on a {out} output: 1 worker {med['1 worker']:,.0f} vox/s, cpu:1,cpu:1 "
          f"{med['cpu:1,cpu:1']:,.0f} vox/s: {med['cpu:1,cpu:1'] / med['1 worker']:.2f}x")


def exactness(args) -> None:
    sys.path.insert(0, str(ROOT))
    from cct.compare.tolerance import compare_arrays
    from cct.inference import infer
    from tests.inference.helpers import deploy_param, save_weights, window_reference

    with tempfile.TemporaryDirectory() as tmp:
        for net, width, size, samples, budget in (("ctm_valid", 4, 100, None, "24MiB"),
                                                   ("n337_w8", 2, 140, 2000, "96MiB")):
            param = deploy_param(net, width)
            weights = save_weights(param, os.path.join(tmp, f"{net}.caffemodel"), seed=1)
            spec = load_spec(param)
            rng = np.random.default_rng(0)
            volume = rng.random((size,) * 3, dtype=np.float32)
            out = size - spec.fov[0] + 1
            sink = MemoryWriter((spec.out_channels, out, out, out))
            infer(param, weights, volume, sink, memory_budget=budget, quiet=True, engine="lowering",
                  report=lambda line: None)
            if samples is None:
                positions = np.stack(np.meshgrid(*(np.arange(out),) * 3, indexing="ij"), -1).reshape(-1, 3)
            else:
                positions = rng.integers(0, out, (samples, 3))
            t = time.perf_counter()
            naive = window_reference(param, weights, volume[None], positions, spec.fov, batch=64)
            ours = sink.array[(slice(None),) + tuple(positions.T)].T
            c = compare_arrays(ours, naive, rtol=1e-5)
            print(f"{net} {size}^3: {len(positions)} windows ({time.perf_counter() - t:.0f} s), written once: "
                  f"{sink.counts.min() == sink.counts.max() == 1}; {c.describe('MPF vs per-window', 'naive')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="ctm_valid")
    ap.add_argument("--output", type=int, default=48)
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="also the peak memory of runs 10x their budget")
    ap.add_argument("--exactness", action="store_true", help="also the full-size exactness checks")
    ap.add_argument("--workers", action="store_true", help="also one worker vs two one-thread workers")
    ap.add_argument("--skip-throughput", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.skip_throughput:
        throughput(args)
    if args.workers:
        workers(args)
    if args.memory:
        memory(args)
    if args.exactness:
        exactness(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
