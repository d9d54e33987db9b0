"""CaffeNet forward + backward, batch 64: cct vs real Caffe 1.0 (a CPU build), layer by layer, same command.

Run:   python benchmarks/caffenet_vs_caffe.py --caffe PATH/TO/caffe [--model models/caffenet/train.prototxt]
                                              [--iters 5] [--rounds 3] [--threads 2]
       (``--caffe`` defaults to $CAFFE_BIN, then ``caffe`` on the PATH; ``env -u OPENBLAS_CORETYPE -u
       OPENBLAS_L2_SIZE python ...`` lets both OpenBLAS libraries pick their own kernels, e.g. AVX-512, where
       the environment pins them; the script prints the kernel each one runs.)
Both tools run the same command line, ``time -model MODEL -iterations ITERS`` (Caffe's ``caffe time``, cct's
``cct time``), with ``OPENBLAS_NUM_THREADS`` = ``OMP_NUM_THREADS`` = ``--threads``, alternately, ``--rounds``
times each, so the machine's noise hits both alike.  The script reads their logs with one parser — the
"Iteration: i forward-backward time" and "<layer> forward/backward: X ms." lines are the same in both — and
prints the engine cct runs each convolution with, then per layer the median (over rounds) of each tool's average
forward and backward milliseconds, their ratio cct/Caffe and a ``*`` where cct is slower (a max pooling whose
backward cct runs with the in-place ReLU's below it, or a BatchNorm whose forward it runs with the in-place
Scale's (and ReLU's) above it, as training does — ``cct time`` says so and reads 0 on the other layers' lines — is
compared with Caffe's lines together); then the median
forward-backward iteration of each (all iterations of all rounds) and the ratio.  Both leave ``Input`` blobs at
zero, as ``caffe time`` does (Caffe's branchy max-pooling loop runs its best case on such ties; cct's is
branch-free).
A CPU build of Caffe links its own BLAS (a system OpenBLAS, say): the kernels can differ from numpy's, which the
header shows (Caffe's from ``OPENBLAS_VERBOSE=2``, cct's from threadpoolctl).  Caffe 1.0 builds on a current
Debian with its Makefile (``CPU_ONLY := 1``, ``USE_OPENCV := 0``, ``BLAS := open``, the HDF5 serial include and
library directories) once ``CodedInputStream::SetTotalBytesLimit`` is called with the one argument newer
protobuf releases take; ``make tools`` needs Debian's libboost-system-dev, libboost-thread-dev,
libboost-filesystem-dev, libgflags-dev, libgoogle-glog-dev, libprotobuf-dev, protobuf-compiler, libhdf5-dev,
libleveldb-dev, libsnappy-dev, liblmdb-dev and libopenblas-dev (about 10 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "caffenet" / "train.prototxt"
ITERATION = re.compile(r"Iteration: \d+ forward-backward time: ([0-9.]+) ms")
LAYER = re.compile(r"\]\s+(\S+)\s+(forward|backward): ([0-9.]+) ms")
CORE = re.compile(r"Core: (\S+)")
ENGINE = re.compile(r"Convolution layer (\S+): (.*?) \[d/o")
FUSED = re.compile(r"\]\s+(\S+)\t(forward|backward) includes (\S+)'s (?:forward|backward)")


def parse_time_log(text: str) -> tuple[list[float], dict[str, dict[str, float]]]:
    """(per-iteration forward-backward ms, {layer: {"forward": ms, "backward": ms}}) from a ``time`` log."""
    iterations = [float(m) for m in ITERATION.findall(text)]
    layers: dict[str, dict[str, float]] = {}
    for name, direction, ms in LAYER.findall(text):
        layers.setdefault(name, {})[direction] = float(ms)
    return iterations, layers


# the environment this script was started with, before importing cct sets OPENBLAS_THREAD_TIMEOUT in this
# process: each tool runs from it as it would be run by hand (`cct time` sets the variable itself; Caffe's
# OpenBLAS workers keep their default spin unless the caller set one)
CALLER_ENV = dict(os.environ)


def run_time(command: list[str], threads: int, extra_env: dict[str, str] | None = None) -> str:
    env = dict(CALLER_ENV, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               GLOG_logtostderr="1", **(extra_env or {}))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{log[-2000:]}")
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caffe", default=os.environ.get("CAFFE_BIN") or shutil.which("caffe"),
                    help="the caffe binary of a CPU build of Caffe 1.0 (default: $CAFFE_BIN, then PATH)")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--iters", type=int, default=5, help="iterations per run (each tool's -iterations)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tool, alternated")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not args.caffe or not Path(args.caffe).exists():
        sys.exit("no Caffe binary: pass --caffe PATH (the `caffe` tool of a CPU build of Caffe 1.0) or set CAFFE_BIN")

    sys.path.insert(0, str(ROOT))
    from cct.device.query import machine_key

    time_args = ["time", "-model", args.model, "-iterations", str(args.iters)]
    cct_cmd = [sys.executable, "-m", "cct"] + time_args
    caffe_cmd = [args.caffe] + time_args
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} threads={args.threads} "
          f"model={Path(args.model).name} iterations={args.iters} rounds={args.rounds}")
    from cct import native

    print(f"cct kernels: {native.describe()}")
    probe = subprocess.run([args.caffe, "--version"], env=dict(CALLER_ENV, OPENBLAS_VERBOSE="2"),
                           capture_output=True, text=True)
    text = probe.stdout + probe.stderr
    cores = CORE.findall(text)
    version = next((line.strip() for line in text.splitlines() if "version" in line), "version not reported")
    print(f"caffe: {args.caffe} ({version}; OpenBLAS core {cores[0] if cores else 'not reported'})")
    print(f"cct:   {machine_key()}")

    runs: dict[str, list[tuple[list[float], dict[str, dict[str, float]]]]] = {"caffe": [], "cct": []}
    warm = run_time(cct_cmd[:-1] + ["1"], args.threads)  # engine measurements cached before the timed runs
    for layer, engine in ENGINE.findall(warm):
        print(f"cct {layer}: {engine}")
    for r in range(args.rounds):
        for name, cmd in (("caffe", caffe_cmd), ("cct", cct_cmd)):
            runs[name].append(parse_time_log(run_time(cmd, args.threads)))
            iters = runs[name][-1][0]
            print(f"  round {r + 1} {name:5s}: median {statistics.median(iters):.0f} ms over {len(iters)} iterations",
                  flush=True)

    def layer_median(name: str, layer: str, direction: str) -> float | None:
        values = [layers[layer][direction] for _, layers in runs[name] if direction in layers.get(layer, {})]
        return statistics.median(values) if values else None

    order = list(runs["caffe"][0][1])
    # per direction: the layer whose line includes others' (a pooling the ReLU's backward, a BatchNorm the Scale's
    # and the ReLU's forwards) -> those layers, and back
    fused: dict[str, dict[str, list[str]]] = {"forward": {}, "backward": {}}
    for layer, direction, other in FUSED.findall(warm):
        fused[direction].setdefault(layer, []).append(other)
    inside = {d: {other: layer for layer, others in pairs.items() for other in others} for d, pairs in fused.items()}
    print(f"\n{'layer':10s} {'caffe fwd':>10s} {'cct fwd':>9s} {'ratio':>6s}   {'caffe bwd':>10s} {'cct bwd':>9s} "
          f"{'ratio':>6s}")
    slower = []
    for layer in order:
        cells = []
        for direction in ("forward", "backward"):
            a, b = layer_median("caffe", layer, direction), layer_median("cct", layer, direction)
            if layer in inside[direction]:
                cells.append(f"{'in ' + inside[direction][layer]:>27s} ")
                continue
            if layer in fused[direction] and a is not None:
                others = [layer_median("caffe", other, direction) for other in fused[direction][layer]]
                a = None if None in others else a + sum(others)  # Caffe's lines against cct's one step
            if a is None or b is None:
                cells.append(f"{'-':>10s} {'-':>9s} {'':>6s} ")
                continue
            mark = "*" if b > a and b - a > 0.05 else " "
            if mark == "*":
                slower.append(f"{layer} {direction}")
            ratio = f"{b / a:6.2f}" if a > 0 else f"{'-':>6s}"
            cells.append(f"{a:10.2f} {b:9.2f} {ratio}{mark}")
        print(f"{layer:10s} " + "  ".join(cells))
    caffe_ms = statistics.median([t for iters, _ in runs["caffe"] for t in iters])
    cct_ms = statistics.median([t for iters, _ in runs["cct"] for t in iters])
    print(f"\nforward-backward per iteration (median): caffe {caffe_ms:.0f} ms, cct {cct_ms:.0f} ms, "
          f"cct/caffe {cct_ms / caffe_ms:.2f}")
    print("layers where cct is slower (*): " + (", ".join(slower) if slower else "none"))


if __name__ == "__main__":
    main()
