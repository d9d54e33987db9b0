"""Per-layer profile of one CaffeNet training iteration (forward + backward + SGD update) with cct's solver.

Run:   python benchmarks/caffenet_profile.py [--batch 64] [--iters 3] [--lowering auto] [--partitions auto]
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets numpy's OpenBLAS pick its own kernels,
       e.g. AVX-512, where the environment pins them; the script prints what it ran with.)
Prints: one line per layer with its median forward and backward milliseconds, its share of the iteration and what
engine it runs (``describe_layer_engine``) — the executor's fused pairs (:mod:`cct.exec.fusion`: a convolution and
the in-place ReLU after it, forward, timed on the convolution; a max pooling and the in-place ReLU below it,
backward, timed on the pooling) as one step, as a training iteration runs them; then the time of the solver's update
(SGD, momentum 0.9, weight decay 5e-4: what ``cct train`` runs after each backward), the share of the layers other
than Convolution and InnerProduct, each convolution's backward/forward ratio, the iteration total, the bytes held
in the convolution workspace (shared by all conv layers: ``shared_workspace_bytes``) and the peak RSS.
The ``others ms`` column is the CPU time, during the layer's forward and backward, of the threads Python did
not start (OpenBLAS's workers, scipy.fft's; Linux only): the batch partitions run their BLAS calls on one thread
each, so on a partitioned layer it should be about 0 — where it is not, a multi-threaded BLAS call woke
OpenBLAS's workers, which then share the partitions' cores (how that was found on a 16-core machine).  An
InnerProduct's products may run as one call on OpenBLAS's threads where that was measured faster (their work
shows in this column).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

# before numpy: importing cct sets OpenBLAS's worker spin (OPENBLAS_THREAD_TIMEOUT), as `cct train` runs
import cct  # noqa: E402,F401

# isort: split
import numpy as np  # noqa: E402

from cct import native  # noqa: E402
from cct.bench.bench import load_average  # noqa: E402
from cct.config import settings  # noqa: E402
from cct.engines.choice import describe_layer_engine  # noqa: E402
from cct.engines.lowering import shared_workspace_bytes  # noqa: E402
from cct.exec.diff_memory import share_as_the_command_line_does  # noqa: E402
from cct.proto import caffe_pb2 as pb  # noqa: E402
from cct.runtime.threads import blas_worker_spin  # noqa: E402
from cct.solvers.solver import create_solver  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "caffenet" / "train.prototxt"


def other_threads_cpu_seconds() -> float:
    """CPU seconds so far of this process's threads that Python did not start (0 where /proc has no
    per-thread schedstat)."""
    ours = {t.native_id for t in threading.enumerate()}
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            if int(tid) not in ours:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
    except OSError:
        return 0.0
    return total * 1e-9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--lowering", default=None)
    ap.add_argument("--partitions", default=None)
    args = ap.parse_args()
    settings.set("lowering", args.lowering, "--lowering")
    settings.set("partitions", args.partitions, "--partitions")
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} batch={args.batch}")
    print(f"cct kernels: {native.describe()}; OpenBLAS workers: {blas_worker_spin()}")
    # a tiny rate: the weights stay what they were drawn, iteration after iteration
    solver = create_solver(pb.SolverParameter(net=str(MODEL), base_lr=1e-6, lr_policy="fixed", momentum=0.9,
                                              weight_decay=5e-4, max_iter=1 << 30, snapshot_after_train=False))
    net = solver.net
    net.blobs["data"].reshape(args.batch, 3, 227, 227)
    net.blobs["label"].reshape(args.batch)
    net.reshape()
    share_as_the_command_line_does(net)  # gradient memory as cct train shares it
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape).astype(np.float32)
    net.blobs["label"].data[...] = rng.integers(0, 1000, args.batch)
    n = len(net.layers)
    fwd = [[] for _ in range(n)]
    bwd = [[] for _ in range(n)]
    others = [[] for _ in range(n)]
    upd, total = [], []
    # the executor's fused steps run as one, timed as their first layer's forward (a convolution and the ReLU
    # after it) or their pooling's backward (and the ReLU below it): what a training iteration runs
    pairs = net.executor.fused_backward_pairs() if hasattr(net.executor, "fused_backward_pairs") else {}
    fused_forward: dict[int, int] = {}  # a layer whose forward a fused step runs -> the step's first layer
    for it in range(args.iters + 1):
        t0 = time.perf_counter()
        cpu = [0.0] * n
        i = 0
        while i < n:
            c, t = other_threads_cpu_seconds(), time.perf_counter()
            following, _ = net.executor.forward_step(net, i, 0, n - 1)
            fwd[i].append(time.perf_counter() - t)
            cpu[i] += other_threads_cpu_seconds() - c
            for j in range(i + 1, following):
                fwd[j].append(0.0)
                fused_forward[j] = i
            i = following
        net.clear_param_diffs()
        i = n - 1
        while i >= 0:
            last = pairs.get(i, i)
            c, t = other_threads_cpu_seconds(), time.perf_counter()
            net.backward_from_to(i, last)
            bwd[i].append(time.perf_counter() - t)
            cpu[i] += other_threads_cpu_seconds() - c
            for j in range(last, i):
                bwd[j].append(0.0)
            i = last - 1
        t = time.perf_counter()
        solver.apply_update()
        upd.append(time.perf_counter() - t)
        total.append(time.perf_counter() - t0)
        for i in range(n):
            others[i].append(cpu[i])
        if it == 0:  # warm-up: buffers are allocated
            for lst in fwd + bwd + others + [upd, total]:
                lst.clear()
    tot = statistics.median(total)
    print(f"{'layer':<10}{'type':<18}{'fwd ms':>9}{'bwd ms':>9}{'share':>8}{'others ms':>10}  engine")
    fused_into = {r: [f"backward in {net.layers[p].name}"] for p, r in pairs.items()}
    for j, i in fused_forward.items():
        fused_into.setdefault(j, []).insert(0, f"forward in {net.layers[i].name}")
    for i, layer in enumerate(net.layers):
        f, b = statistics.median(fwd[i]) * 1e3, statistics.median(bwd[i]) * 1e3
        o = statistics.median(others[i]) * 1e3
        note = f"fused: {', '.join(fused_into[i])}" if i in fused_into else describe_layer_engine(layer)
        print(f"{layer.name:<10}{layer.type:<18}{f:9.1f}{b:9.1f}{(f + b) / tot / 10:7.1f}%{o:10.1f}  {note}")
    print(f"CPU time of threads Python did not start (OpenBLAS's, scipy.fft's workers), all layers: "
          f"{sum(statistics.median(o) for o in others) * 1e3:.1f} ms an iteration")
    print(f"update (SGD solver): {statistics.median(upd) * 1e3:.1f} ms")
    other = sum(statistics.median(fwd[i]) + statistics.median(bwd[i]) for i, layer in enumerate(net.layers)
                if layer.type not in ("Convolution", "InnerProduct"))
    print(f"layers other than Convolution and InnerProduct: {other * 1e3:.1f} ms, {other / tot * 100:.1f}% of the "
          f"iteration")
    ratios = [f"{layer.name} {statistics.median(bwd[i]) / statistics.median(fwd[i]):.2f}"
              for i, layer in enumerate(net.layers) if layer.type == "Convolution"]
    print(f"backward/forward per convolution: {', '.join(ratios)}")
    print(f"iteration (fwd+bwd+update), median of {args.iters}: {tot * 1e3:.0f} ms")
    print(f"conv workspace (shared by all conv layers): {shared_workspace_bytes() / 2**20:.1f} MiB; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    print(load_average())


if __name__ == "__main__":
    main()
