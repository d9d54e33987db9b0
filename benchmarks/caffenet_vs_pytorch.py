"""CaffeNet training iteration, batch 64, 2 threads: cct (as a net runs it, each lowering, auto) vs PyTorch CPU.

Run:   pip install torch==2.13.0          (the CPU wheel; torch is imported only by this script's worker)
       python benchmarks/caffenet_vs_pytorch.py [--batch 64] [--iters 5] [--threads 2] [--no-update]
       [--gpu N]   (Caffe's GPU mode, ``cct train -gpu N``, against PyTorch on cuda:N: needs cupy and a CUDA
                    build of torch; the ``net`` variant only; each iteration ends with the device synchronized,
                    % of peak is of a 4096³ cupy matmul, and the device memory column is what each framework's
                    memory pool holds; PyTorch's TF32 convolutions are turned off: float32 products on
                    both sides, as Caffe's)
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets numpy's OpenBLAS use its own kernel
       choice, e.g. AVX-512, where the environment pins it; the script prints the values it ran with.)
Each framework runs in its own worker process (so each one's peak RSS is its own); the parent alternates
them — for every iteration: cct net, lowering 1, 2, 3, auto, then PyTorch — so machine noise hits all alike.
``net`` is what ``cct train`` / ``cct time`` run: each convolution's engine as the layer chose it with the
default settings (``-conv_engine auto``: lowering, FFT or Winograd, measured per layer); ``1``, ``2``, ``3``
force a lowering and ``auto`` is ``-conv_engine lowering -lowering auto``.
Where numpy's OpenBLAS runs AVX2 kernels (``OPENBLAS_CORETYPE=Haswell``) PyTorch is held to AVX2 too
(:mod:`torch_isa`; ``--torch-native`` lifts it), so the ratio compares the frameworks, not vector widths.
Both build models/caffenet/train.prototxt's network (conv/ReLU/max-pool/LRN/InnerProduct/dropout/softmax
loss) with the same weights and the same input; an iteration is forward, backward and the SGD update (momentum
0.9, weight decay 5e-4: cct's SGD solver with the file's lr/decay multipliers, ``torch.optim.SGD``), or with
``--no-update`` forward and backward alone.  Prints per variant the median fwd+bwd milliseconds, the
ratio cct/pytorch, the share of the machine's sgemm peak it reaches (the GEMM arithmetic of the convolution and
InnerProduct layers: forward, then the data and weight gradients, conv1's data gradient excepted, over the
time of the whole iteration; the peak is a 2048³ float32 matmul on the same threads, measured in the cct
worker), and each worker's peak RSS; for cct also the bytes held in convolution workspaces (all
conv layers of all variants share the thread's workspace: it is sized by the largest layer × partitions).
``--variants net`` alone gives the peak RSS of exactly what ``cct time`` / ``cct train`` run (gradient memory
shared as they share it: ``CCT_SHARE_DIFFS=0`` keeps one gradient per blob).
The cct worker builds its engines before timing: ``net`` and ``auto`` measure close calls once per geometry
(cached in ``~/.cache/cct``; a cold cache adds some seconds there, never inside the timed iterations).
"""
from __future__ import annotations

import argparse
import atexit
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# OpenBLAS's workers sleep after each call, as in `cct train` (cct sets this when it is imported before numpy;
# the workers here, spawned with this module as their main, load numpy first; PyTorch's BLAS ignores it)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402
from torch_isa import match_torch_isa  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "caffenet" / "train.prototxt"
CONVS = ["conv1", "conv2", "conv3", "conv4", "conv5"]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _inputs(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, 3, 227, 227), dtype=np.float32),
            rng.integers(0, 1000, batch).astype(np.float32))


def _gpu_sgemm_peak(index: int) -> float:
    """FLOP/s of the best of five 4096³ float32 cupy matrix products on device ``index``."""
    import cupy

    n = 4096
    with cupy.cuda.Device(index):
        a = cupy.random.standard_normal((n, n), dtype=cupy.float32)
        c = cupy.empty_like(a)
        best = 0.0
        for _ in range(6):
            cupy.cuda.Device(index).synchronize()
            t = time.perf_counter()
            cupy.matmul(a, a, out=c)
            cupy.cuda.Device(index).synchronize()
            best = max(best, 2.0 * n ** 3 / (time.perf_counter() - t))
    return best


def cct_worker(conn, batch: int, threads: int, weights: str, variants: tuple[str, ...], update: bool,
               gpu: int | None = None) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("GLOG_minloglevel", "1")
    import cct
    from cct.bench.flops import count_net, sgemm_peak
    from cct.engines.choice import SelectedEngine
    from cct.engines.lowering import LoweringEngine, shared_workspace_bytes
    from cct.exec.diff_memory import share_as_the_command_line_does
    from cct.proto import caffe_pb2 as pb
    from cct.solvers.solver import create_solver

    synchronize = lambda: None  # noqa: E731
    if gpu is not None:  # Caffe's GPU mode: the nets built from here on run there
        import cupy

        cct.set_device(gpu)
        cct.set_mode_gpu()
        synchronize = cupy.cuda.Device(gpu).synchronize
    param = pb.SolverParameter(net=str(MODEL), base_lr=0.01, lr_policy="fixed", momentum=0.9, weight_decay=5e-4,
                               max_iter=1 << 30, snapshot_after_train=False)
    solver = create_solver(param)
    net = solver.net
    net.blobs["data"].reshape(batch, 3, 227, 227)
    net.blobs["label"].reshape(batch)
    net.reshape()
    share_as_the_command_line_does(net)  # gradient memory as cct train shares it (CCT_SHARE_DIFFS=0: not)
    x, label = _inputs(batch)
    net.blobs["data"].data[...] = x
    net.blobs["label"].data[...] = label
    np.savez(weights, **{f"{name}/{i}": b.data for name, blobs in net.params.items() for i, b in enumerate(blobs)})
    engines: dict = {}
    for name in CONVS:
        layer = net.layer_by_name(name)
        for variant in variants:
            if variant == "net":  # the layer's own engine, as the net chose it
                engines[(name, variant)] = layer.engine
                continue
            # auto: the engine choice a Convolution layer makes with -conv_engine lowering -lowering auto
            eng = SelectedEngine("lowering", "benchmark", "auto") if variant == "auto" else \
                LoweringEngine(int(variant), source="forced")
            eng.configure(layer.engine.geometry, np.float32)
            engines[(name, variant)] = eng
    # the GEMM arithmetic of one forward + backward (no data gradient below the first layer) and the sgemm rate
    flops, peak = count_net(net).products(), sgemm_peak() if gpu is None else _gpu_sgemm_peak(gpu)
    conn.send(("ready", ({v: [engines[(n, v)].describe() for n in CONVS] for v in variants}, flops, peak)))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            held = None if gpu is None else cupy.get_default_memory_pool().total_bytes() / 2**20
            conn.send(("rss", (_peak_rss_mib(), shared_workspace_bytes() / 2**20, held)))
            return
        variant = msg[1]
        for name in CONVS:
            net.layer_by_name(name).engine = engines[(name, variant)]
        t = time.perf_counter()
        net.forward()
        net.clear_param_diffs()
        net.backward()
        if update:
            solver.apply_update()
        synchronize()
        conn.send(("time", time.perf_counter() - t))


def torch_worker(conn, batch: int, threads: int, weights: str, variants: tuple[str, ...], update: bool,
                 gpu: int | None = None) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    if gpu is not None and not torch.cuda.is_available():
        conn.send(("error", f"torch {torch.__version__} has no CUDA device: --gpu compares against PyTorch on "
                            "cuda (install a CUDA build of torch)"))
        return
    if gpu is not None:  # float32 products on both sides, as Caffe's (cuDNN's default TF32 convolutions round
        # their operands to 10-bit mantissas; cupy's products are float32 unless CUPY_TF32=1)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cpu" if gpu is None else f"cuda:{gpu}")
    synchronize = (lambda: None) if gpu is None else (lambda: torch.cuda.synchronize(device))
    w = np.load(weights)

    def conv(name, cin, cout, k, stride=1, pad=0, groups=1):
        m = nn.Conv2d(cin, cout, k, stride, pad, groups=groups)
        m.weight.data = torch.from_numpy(w[f"{name}/0"].copy())
        m.bias.data = torch.from_numpy(w[f"{name}/1"].copy())
        return m

    def fc(name, cin, cout):
        m = nn.Linear(cin, cout)
        m.weight.data = torch.from_numpy(w[f"{name}/0"].copy())
        m.bias.data = torch.from_numpy(w[f"{name}/1"].copy())
        return m

    lrn = dict(size=5, alpha=1e-4, beta=0.75, k=1.0)
    model = nn.Sequential(
        conv("conv1", 3, 96, 11, 4), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.LocalResponseNorm(**lrn),
        conv("conv2", 96, 256, 5, 1, 2, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.LocalResponseNorm(**lrn),
        conv("conv3", 256, 384, 3, 1, 1), nn.ReLU(inplace=True),
        conv("conv4", 384, 384, 3, 1, 1, 2), nn.ReLU(inplace=True),
        conv("conv5", 384, 256, 3, 1, 1, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.Flatten(), fc("fc6", 9216, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        fc("fc7", 4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5), fc("fc8", 4096, 1000))
    model.train()
    model.to(device)
    x, label = _inputs(batch)
    xt, lt = torch.from_numpy(x).to(device), torch.from_numpy(label.astype(np.int64)).to(device)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    conn.send(("ready", torch.__version__))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            held = None if gpu is None else torch.cuda.max_memory_reserved(device) / 2**20
            conn.send(("rss", (_peak_rss_mib(), None, held)))
            return
        t = time.perf_counter()
        model.zero_grad(set_to_none=False)
        loss = loss_fn(model(xt), lt)
        loss.backward()
        if update:
            opt.step()
        synchronize()
        conn.send(("time", time.perf_counter() - t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="net,1,2,3,auto",
                    help="cct variants to run (comma separated: net, 1, 2, 3, auto); 'net' alone gives the peak "
                         "RSS of what cct train runs")
    ap.add_argument("--no-update", action="store_true", help="time forward + backward only (no SGD update)")
    ap.add_argument("--torch-native", action="store_true",
                    help="let PyTorch use its own instruction set even where numpy's OpenBLAS is held to AVX2")
    ap.add_argument("--gpu", type=int, default=None,
                    help="Caffe's GPU mode on this device against PyTorch on cuda (the 'net' variant only)")
    args = ap.parse_args()
    if args.gpu is not None and args.variants.replace(" ", "") != "net":
        ap.error("--gpu runs the 'net' variant only (--variants net): the forced lowerings are the CPU's choices")
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} threads={args.threads} "
          f"batch={args.batch} update={'none' if args.no_update else 'SGD'} "
          f"CCT_PARTITIONS={os.environ.get('CCT_PARTITIONS', 'auto')}"
          + ("" if args.gpu is None else f" GPU mode on device {args.gpu} (PyTorch on cuda:{args.gpu})"))
    from cct import native
    from cct.runtime.threads import blas_worker_spin

    print(f"cct kernels: {native.describe()}; OpenBLAS workers: {blas_worker_spin()}")
    print(match_torch_isa(args.torch_native))
    # both workers see exactly `threads` BLAS/OpenMP threads
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    ctx = mp.get_context("spawn")
    scratch = tempfile.mkdtemp(prefix="cct-bench-")  # the shared weights (~240 MB), removed on exit
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    weights = os.path.join(scratch, "caffenet.npz")
    chosen = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    workers = {}
    for name, target in (("cct", cct_worker), ("pytorch", torch_worker)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, args.batch, args.threads, weights, chosen, not args.no_update,
                                                args.gpu), daemon=True)
        proc.start()
        kind, info = parent.recv()
        if kind == "error":
            sys.exit(f"{name}: {info}")
        workers[name] = (proc, parent)
        if name == "cct":
            info, flops, sgemm_peak = info
            where = f"2048^3, {args.threads} threads" if args.gpu is None else f"4096^3, device {args.gpu}"
            print(f"GEMM arithmetic per iteration {flops / 1e9:.1f} GFLOP; sgemm peak ({where}) "
                  f"{sgemm_peak / 1e9:.1f} GFLOP/s: the iteration cannot take less than "
                  f"{flops / sgemm_peak * 1e3:.1f} ms")
            for v, desc in info.items():
                print(f"cct {v:>4}: " + "; ".join(f"{c} {d}" for c, d in zip(CONVS, desc)))
        else:
            print(f"pytorch {info}")
    variants = [("cct", v) for v in chosen] + [("pytorch", "")]
    times: dict = {v: [] for v in variants}
    for it in range(args.iters + 1):
        for who, variant in variants:
            conn = workers[who][1]
            conn.send(("run", variant))
            _, t = conn.recv()
            if it > 0:  # the first round is a warm-up (workspaces, allocator)
                times[(who, variant)].append(t)
    rss = {}
    for name, (proc, conn) in workers.items():
        conn.send(("stop",))
        rss[name] = conn.recv()[1]
        proc.join()
    base = statistics.median(times[("pytorch", "")])
    device = "" if args.gpu is None else f"{'device MiB':>12}"
    print(f"{'variant':<20}{'median ms':>10}{'min ms':>9}{'cct/pytorch':>13}{'% of peak':>11}{'peak RSS MiB':>14}"
          f"{'conv workspace MiB':>20}{device}")
    for who, variant in variants:
        med = statistics.median(times[(who, variant)])
        label = "pytorch" if who != "cct" else "cct net" if variant == "net" else f"cct lowering {variant}"
        peak, ws, held = rss[who]
        print(f"{label:<20}{med * 1e3:10.1f}{min(times[(who, variant)]) * 1e3:9.1f}{med / base:13.2f}"
              f"{100 * flops / med / sgemm_peak:10.0f}%"
              f"{peak:14.0f}{'' if ws is None else f'{ws:.0f}':>20}{'' if held is None else f'{held:12.0f}'}")
    sys.path.insert(0, str(ROOT))  # only now: the PyTorch worker must not load cct
    from cct.bench.bench import load_average
    print(f"(median of {args.iters} alternated iterations after one warm-up; one cct worker ran all {len(chosen)} "
          f"variant(s): its peak RSS and shared workspace cover them all; {load_average()})")


if __name__ == "__main__":
    main()
