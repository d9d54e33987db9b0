"""Any Caffe net's forward + backward (what ``cct time`` times): cct vs PyTorch CPU, the same net built in each.

Run:   pip install torch==2.13.0          (the CPU wheel; torch is imported only by this script's worker)
       python benchmarks/net_vs_pytorch.py --model models/resnet50/deploy.prototxt [--batch 32] [--iters 5]
       [--threads 2] [--phase TRAIN|TEST] [--batch-statistics] [--forward-only] [--torch-native]
       (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`` lets numpy's OpenBLAS use its own kernel
       choice, e.g. AVX-512, where the environment pins it; the script prints the values it ran with.)
The cct worker builds the net (``--batch`` replacing the inputs' first dimension, ``force_backward`` on, so that
a deploy net's backward runs every layer's as ``cct time`` does; ``--batch-statistics``: every BatchNorm with
the batch's statistics, as training a deploy net's layout would run) and sends the PyTorch worker a plain
description of it — each layer's type, blobs and parameters, every shape resolved — from which that worker
builds the same computation with torch.nn.functional (convolutions, inner products, ReLU, MAX/AVE pooling with
Caffe's rounding, LRN, BatchNorm with batch or stored statistics, per-channel Scale, Eltwise, Concat, Dropout,
Softmax, SoftmaxWithLoss, Split, Flatten, Reshape; anything else stops the script naming the layer).  An
iteration is: the parameter gradients cleared, forward, backward from the outputs (a loss, or every output with
a gradient of ones); with ``--forward-only`` (inference: add ``--phase TEST``) the forward alone, PyTorch's
without autograd.  Workers run in their own processes (each one's peak RSS is its own), alternated iteration
by iteration; where numpy's OpenBLAS runs AVX2 kernels PyTorch is held to AVX2 too (:mod:`torch_isa`).  Prints
the median milliseconds of each, the ratio cct/pytorch and each worker's peak RSS (cct's gradient memory shared as
``cct time`` shares it; ``CCT_SHARE_DIFFS=0``: one gradient per blob, as Caffe).
The models to try: models/resnet50, googlenet, inception_v3, vgg16, mobilenet, alexnet (deploy nets),
caffenet/train.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# OpenBLAS's workers sleep after each call, as in `cct train` (cct sets this when it is imported before numpy)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402
from caffenet_vs_pytorch import _peak_rss_mib  # noqa: E402
from torch_isa import match_torch_isa  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _plan(net) -> tuple[list[dict], dict[str, list[int]], list[str]]:
    """The net as plain data for the PyTorch worker: one entry per layer (type, bottoms, tops, parameters with
    every shape resolved), the input blobs' shapes and the outputs.  Unsupported layers raise ValueError."""
    from cct.proto import caffe_pb2 as pb

    shapes = {name: list(blob.shape) for name, blob in net.blobs.items()}
    out, inputs = [], {}
    for layer in net.layers:
        p, kind = layer.layer_param, layer.type
        e = dict(type=kind, name=p.name, bottoms=list(p.bottom), tops=list(p.top))
        if kind == "Input":
            inputs.update({t: shapes[t] for t in p.top})
            continue
        if kind == "Convolution":
            g = layer.engine.geometry
            if g.num_spatial_axes != 2:
                raise ValueError(f"layer '{p.name}' (Convolution): {g.num_spatial_axes}-D; this script builds 2-D only")
            e.update(cin=g.in_channels, cout=g.out_channels, kernel=list(g.kernel), stride=list(g.stride),
                     pad=list(g.pad), dilation=list(g.dilation), group=g.group,
                     bias=bool(p.convolution_param.bias_term))
        elif kind == "InnerProduct":
            q = p.inner_product_param
            axis = q.axis % len(shapes[p.bottom[0]])
            if q.transpose:
                raise ValueError(f"layer '{p.name}' (InnerProduct): transpose is not built here")
            e.update(axis=axis, cin=int(np.prod(shapes[p.bottom[0]][axis:])), cout=q.num_output, bias=bool(q.bias_term))
        elif kind == "ReLU":
            e.update(slope=float(p.relu_param.negative_slope))
        elif kind == "Pooling":
            q = p.pooling_param
            if q.pool not in (pb.PoolingParameter.MAX, pb.PoolingParameter.AVE):
                raise ValueError(f"layer '{p.name}' (Pooling): only MAX and AVE are built here")
            e.update(method="max" if q.pool == pb.PoolingParameter.MAX else "ave", glob=bool(q.global_pooling),
                     kernel=list(layer.pooler.kernel), stride=list(layer.pooler.stride), pad=list(layer.pooler.pad))
        elif kind == "LRN":
            q = p.lrn_param
            if q.norm_region != pb.LRNParameter.ACROSS_CHANNELS:
                raise ValueError(f"layer '{p.name}' (LRN): only ACROSS_CHANNELS is built here")
            e.update(size=q.local_size, alpha=q.alpha, beta=q.beta, k=q.k)
        elif kind == "BatchNorm":
            e.update(channels=layer.channels, eps=layer.eps, maf=layer.maf, stored=bool(layer.use_global_stats))
        elif kind == "Scale":
            outer, dim, inner = layer.geometry
            if len(p.bottom) != 1 or dim != shapes[p.bottom[0]][1] or outer != shapes[p.bottom[0]][0]:
                raise ValueError(f"layer '{p.name}' (Scale): only a learned per-channel scale is built here")
            e.update(channels=dim, bias=layer.bias_index is not None)
        elif kind == "Eltwise":
            e.update(op=pb.EltwiseParameter.EltwiseOp.Name(layer.op), coeffs=list(layer.coeffs))
        elif kind == "Concat":
            e.update(axis=p.concat_param.axis % len(shapes[p.bottom[0]]))
        elif kind == "Dropout":
            e.update(ratio=float(p.dropout_param.dropout_ratio), train=p.phase == pb.TRAIN)
        elif kind in ("Softmax", "SoftmaxWithLoss"):
            e.update(axis=p.softmax_param.axis % len(shapes[p.bottom[0]]))
        elif kind in ("Flatten", "Reshape"):
            e.update(shape=shapes[p.top[0]])
        elif kind != "Split":
            raise ValueError(f"layer '{p.name}' ({kind}) has no PyTorch counterpart in this script")
        out.append(e)
    return out, inputs, list(net.outputs)


def cct_worker(conn, model: str, batch: int | None, phase: str, batch_statistics: bool, forward_only: bool) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("GLOG_minloglevel", "1")
    from google.protobuf import text_format

    import cct
    from cct.exec.diff_memory import share_as_the_command_line_does
    from cct.io.prototxt import read_net_param

    param = read_net_param(model)
    param.force_backward = True
    for layer in param.layer:
        if layer.type == "Input" and batch:
            for shape in layer.input_param.shape:
                shape.dim[0] = batch
        if layer.type == "BatchNorm" and batch_statistics:
            layer.batch_norm_param.use_global_stats = False
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt", delete=False) as f:
        f.write(text_format.MessageToString(param))
    try:
        net = cct.Net(f.name, cct.TRAIN if phase == "TRAIN" else cct.TEST)
    finally:
        os.unlink(f.name)
    share_as_the_command_line_does(net, every_layer=True)  # as cct time runs it (CCT_SHARE_DIFFS=0: not)
    try:
        plan = _plan(net)
    except ValueError as e:
        conn.send(("error", str(e)))
        return
    rng = np.random.default_rng(0)
    for name, shape in plan[1].items():
        blob = net.blobs[name]
        if name.startswith("label"):  # class indices for a loss
            blob.data[...] = rng.integers(0, 10, size=shape)
        else:
            blob.data[...] = rng.standard_normal(shape, dtype=np.float32)
    conn.send(("ready", plan))

    def step() -> None:
        if forward_only:
            net.forward_prefilled()
            return
        net.clear_param_diffs()
        net.forward_prefilled()
        net.backward_all()

    _serve(conn, step)


def _serve(conn, step) -> None:
    """Time ``step()`` at each "run" message, answer "stop" with the peak RSS."""
    while True:
        if conn.recv()[0] == "stop":
            conn.send(("rss", _peak_rss_mib()))
            return
        t = time.perf_counter()
        step()
        conn.send(("time", time.perf_counter() - t))


def torch_worker(conn, plan: tuple, threads: int, forward_only: bool) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    layers, inputs, outputs = plan
    gen = torch.Generator().manual_seed(0)
    params: list[torch.Tensor] = []

    def param(*shape: int) -> torch.Tensor:
        t = (torch.randn(*shape, generator=gen) * 0.01).requires_grad_()
        params.append(t)
        return t

    for e in layers:  # parameters and state, made once
        kind = e["type"]
        if kind == "Convolution":
            e["w"] = param(e["cout"], e["cin"] // e["group"], *e["kernel"])
            e["b"] = param(e["cout"]) if e["bias"] else None
        elif kind == "InnerProduct":
            e["w"], e["b"] = param(e["cout"], e["cin"]), param(e["cout"]) if e["bias"] else None
        elif kind == "BatchNorm":
            e["mean"], e["var"] = torch.zeros(e["channels"]), torch.ones(e["channels"])
        elif kind == "Scale":
            e["w"], e["b"] = param(e["channels"]), param(e["channels"]) if e["bias"] else None

    def run() -> list[torch.Tensor]:
        blobs = {name: torch.from_numpy(np.random.default_rng(0).standard_normal(s, dtype=np.float32))
                 for name, s in inputs.items()}
        for name in blobs:
            if name.startswith("label"):
                blobs[name] = torch.randint(0, 10, inputs[name], generator=gen)
        for e in layers:
            kind, xs = e["type"], [blobs[b] for b in e["bottoms"]]
            x = xs[0] if xs else None
            if kind == "Convolution":
                y = F.conv2d(x, e["w"], e["b"], e["stride"], e["pad"], e["dilation"], e["group"])
            elif kind == "InnerProduct":
                y = F.linear(x.flatten(e["axis"]), e["w"], e["b"])
            elif kind == "ReLU":
                y = F.leaky_relu(x, e["slope"]) if e["slope"] else F.relu(x, inplace=e["tops"] == e["bottoms"])
            elif kind == "Pooling":
                if e["glob"]:
                    y = F.adaptive_max_pool2d(x, 1) if e["method"] == "max" else F.adaptive_avg_pool2d(x, 1)
                elif e["method"] == "max":
                    y = F.max_pool2d(x, e["kernel"], e["stride"], e["pad"], ceil_mode=True)
                else:
                    y = F.avg_pool2d(x, e["kernel"], e["stride"], e["pad"], ceil_mode=True, count_include_pad=True)
            elif kind == "LRN":
                y = F.local_response_norm(x, e["size"], e["alpha"], e["beta"], e["k"])
            elif kind == "BatchNorm":
                y = F.batch_norm(x, e["mean"], e["var"], training=not e["stored"], momentum=1 - e["maf"], eps=e["eps"])
            elif kind == "Scale":
                shape = (1, -1) + (1,) * (x.dim() - 2)
                y = x * e["w"].view(shape) + (e["b"].view(shape) if e["b"] is not None else 0)
            elif kind == "Eltwise":
                if e["op"] == "SUM":
                    y = sum(c * t if c != 1 else t for c, t in zip(e["coeffs"], xs))
                elif e["op"] == "PROD":
                    y = xs[0]
                    for t in xs[1:]:
                        y = y * t
                else:
                    y = xs[0]
                    for t in xs[1:]:
                        y = torch.maximum(y, t)
            elif kind == "Concat":
                y = torch.cat(xs, e["axis"])
            elif kind == "Dropout":
                y = F.dropout(x, e["ratio"], training=e["train"])
            elif kind == "Softmax":
                y = F.softmax(x, e["axis"])
            elif kind == "SoftmaxWithLoss":
                y = F.cross_entropy(x, xs[1].long().view(-1))
            elif kind in ("Flatten", "Reshape"):
                y = x.reshape(e["shape"])
            else:  # Split: every top is the bottom
                for t in e["tops"]:
                    blobs[t] = x
                continue
            blobs[e["tops"][0]] = y
        return [blobs[o] for o in outputs]

    conn.send(("ready", torch.__version__))

    def step() -> None:
        if forward_only:
            with torch.no_grad():
                run()
            return
        for p in params:
            p.grad = None if p.grad is None else p.grad.zero_()
        outs = [o for o in run() if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    _serve(conn, step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a prototxt (deploy or train)")
    ap.add_argument("--batch", type=int, default=None, help="the inputs' first dimension (default: the file's)")
    ap.add_argument("--phase", choices=("TRAIN", "TEST"), default="TRAIN",
                    help="TRAIN: BatchNorm with batch statistics unless the file stores them, Dropout on")
    ap.add_argument("--batch-statistics", action="store_true",
                    help="every BatchNorm with the batch's statistics (the file's use_global_stats set false)")
    ap.add_argument("--forward-only", action="store_true", help="time the forward alone (inference)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-native", action="store_true",
                    help="let PyTorch use its own instruction set even where numpy's OpenBLAS is held to AVX2")
    args = ap.parse_args()
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} threads={args.threads} "
          f"model={args.model} batch={args.batch or '(file)'} phase={args.phase}"
          + (" BatchNorm with batch statistics" if args.batch_statistics else "")
          + (" forward only" if args.forward_only else ""))
    print(match_torch_isa(args.torch_native))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    cct_proc = ctx.Process(target=cct_worker, args=(child, os.path.abspath(args.model), args.batch, args.phase,
                                                    args.batch_statistics, args.forward_only), daemon=True)
    cct_proc.start()
    kind, plan = parent.recv()
    if kind == "error":
        sys.exit(f"net_vs_pytorch: {args.model}: {plan}")
    workers = {"cct": (cct_proc, parent)}
    parent, child = ctx.Pipe()
    torch_proc = ctx.Process(target=torch_worker, args=(child, plan, args.threads, args.forward_only), daemon=True)
    torch_proc.start()
    print(f"{len(plan[0])} layers; pytorch {parent.recv()[1]}")
    workers["pytorch"] = (torch_proc, parent)
    times: dict[str, list[float]] = {name: [] for name in workers}
    for it in range(args.iters + 1):
        for name, (_, conn) in workers.items():
            conn.send(("run",))
            _, t = conn.recv()
            if it > 0:  # the first round is a warm-up (workspaces, allocator)
                times[name].append(t)
    rss = {}
    for name, (proc, conn) in workers.items():
        conn.send(("stop",))
        rss[name] = conn.recv()[1]
        proc.join()
    base = statistics.median(times["pytorch"])
    print(f"{'':<10}{'median ms':>10}{'min ms':>9}{'cct/pytorch':>13}{'peak RSS MiB':>14}")
    for name in workers:
        med = statistics.median(times[name])
        print(f"{name:<10}{med * 1e3:10.1f}{min(times[name]) * 1e3:9.1f}{med / base:13.2f}{rss[name]:14.0f}")
    sys.path.insert(0, str(ROOT))  # only now: the PyTorch worker must not load cct
    from cct.bench.bench import load_average
    print(f"(median of {args.iters} alternated iterations after one warm-up; {load_average()})")


if __name__ == "__main__":
    main()
