"""Sliding-window inference of volumes larger than memory (Zlateski & Lee, ZNNi, arXiv 1606.05688).

A trained ConvNet whose convolutions are valid (no padding, stride 1) and whose poolings do not overlap
(kernel == stride) is a sliding-window function: output voxel ``z`` is the net on the input window
``[z, z + F)`` (``F`` the field of view, :mod:`cct.inference.fov`).  Evaluating it window by window repeats
almost all the work of neighbouring windows; evaluating it on a large patch shares it — except that each
pooling layer keeps only one of its ``p`` offsets per axis.  **Max-pooling fragments** (:mod:`cct.inference.mpf`)
keep all of them: a pooling layer becomes ``p³`` poolings at the ``p³`` offsets, stacked along the batch, and
the net's output fragments recombine into the dense output of the patch.  A patch of input
``n = F - 1 + P·J`` (``P`` the product of the pooling kernels) gives a dense ``(P·J)³`` block; the volume is
covered by such blocks whose input patches overlap by ``n - P·J`` (overlap-save, :mod:`cct.inference.tiling`),
streamed one run at a time from the input file to the output HDF5 file.

Bigger patches waste less work at their borders, so memory limits throughput: the **planner**
(:mod:`cct.inference.planner`) picks, under a memory budget, the patch size, the batch, MPF or plain pooling
per layer and each convolution's primitive — lowering 1-3 or FFT, by the engines' cost contract — with
memory formulas per primitive (:mod:`cct.inference.memory`) and a runner that frees every blob after its last
use (:mod:`cct.inference.runner`).

Python API::

    from cct.inference import infer
    result = infer("deploy.prototxt", "w.caffemodel", "volume.h5:raw", "out.h5", memory_budget="2GiB")
    result.plan.throughput, result.voxels_per_second

Command line: ``cct infer -model deploy.prototxt -weights w.caffemodel -input VOLUME -output OUT.h5
[-memory_budget 2GiB] [-plan auto|measure] [-engine auto|lowering|fft] [-pad valid|mirror]``.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cct.errors import CctError

__all__ = ["InferenceResult", "infer", "load_spec", "measure_plan", "prepare"]


@dataclass
class InferenceResult:
    """What :func:`infer` did: the ``plan``, the output ``shape`` ``(C_out, *spatial)``, ``runs`` forward
    runs in ``seconds``."""

    plan: Any
    shape: tuple[int, ...]
    runs: int
    seconds: float

    @property
    def voxels_per_second(self) -> float:
        vox = 1
        for v in self.shape[1:]:
            vox *= v
        return vox / max(self.seconds, 1e-12)


def load_spec(model: Any):
    """A checked :class:`cct.inference.fov.NetSpec` from a prototxt path or a NetParameter."""
    from cct.inference.fov import analyze_net
    from cct.proto import caffe_pb2 as pb

    if isinstance(model, pb.NetParameter):
        return analyze_net(model, model.name or "<NetParameter>")
    from cct.io.prototxt import read_net_param

    path = os.fspath(model)
    if not os.path.exists(path):
        raise CctError(f"{path}: model definition not found")
    return analyze_net(read_net_param(path), path)


def prepare(model: Any, weights: Any = None):
    """(spec, weights) for a model and a weights file (or :class:`cct.inference.runner.Weights`): the layers
    are set up once on a field-of-view patch, so that a bad weights file fails here, before planning."""
    from cct.inference.runner import InferenceNet, Weights

    spec = load_spec(model)
    w = weights if isinstance(weights, Weights) else Weights.load(weights)
    plain = (False,) * len(spec.pools)
    prims = {lp.name: "lowering 1" for lp in spec.layers if lp.type == "Convolution"}
    InferenceNet(spec, w, plain, 1, spec.fov, prims)
    return spec, w


def measure_plan(spec: Any, weights: Any, plan: Any, repeat: int = 2, seed: int = 0) -> float:
    """Seconds of one forward run of ``plan`` on random data: the best of ``repeat`` after a warm-up."""
    import numpy as np

    from cct.inference.runner import InferenceNet

    net = InferenceNet(spec, weights, plan.mpf, plan.batch, plan.run_input, plan.primitives)
    rng = np.random.default_rng(seed)
    best = float("inf")
    for i in range(repeat + 1):
        x = net.input_buffer()
        x[...] = rng.random(x.shape, dtype=np.float32)
        del x
        t = time.perf_counter()
        net.forward()
        if i:
            best = min(best, time.perf_counter() - t)
    return best


def infer(model: Any, weights: Any, volume: Any, output: Any, memory_budget: Any = "2GiB", plan: str = "auto",
          engine: str = "auto", pad: str = "valid", input_scale: float = 1.0,
          input_mean: Sequence[float] | None = None, quiet: bool = False, rates: Any = None,
          batches: Sequence[int] | None = None, report: Any = None, devices: Any = None) -> InferenceResult:
    """Dense output of ``model`` (a deploy prototxt or NetParameter) with ``weights`` (a ``.caffemodel`` /
    ``.caffemodel.h5`` path, or None for the fillers) over ``volume`` (a path — ``.h5[:dataset]``, ``.npy``,
    ``.tif``, an image — or an array), written to ``output`` (an HDF5 path: dataset ``output``; or an object
    with ``write(start, block)`` and ``close()``).

    Output convention: ``(C_out, *(V - F + 1))``, voxel ``z`` = the net on the input window starting at ``z``;
    ``pad="mirror"``: the input mirrored by ``F // 2`` around, so the output is the input's size.  ``plan``
    ``auto`` (predicted) or ``measure`` (the best candidates timed); ``engine`` restricts the primitives
    (``auto``, ``lowering``, ``fft``); ``input_mean``/``input_scale``: ``(x - mean) · scale`` before the net.
    ``devices`` (``"cpu:1,cpu:1"`` or a list of :class:`cct.device.device.Device`): CPU workers sharing the
    tiles, each with its own net, threads and an equal share of the budget (default: one worker, all cores)."""
    from cct import log
    from cct.inference.memory import format_bytes, parse_memory
    from cct.inference.planner import BATCHES, plan_inference
    from cct.inference.progress import Progress
    from cct.inference.runner import InferenceNet
    from cct.inference.tiling import Tiling
    from cct.inference.volume_io import HDF5Writer, open_volume

    budget = parse_memory(memory_budget, "-memory_budget")
    if pad not in ("valid", "mirror"):
        raise CctError(f"-pad {pad}: expected valid or mirror")
    workers = _workers(devices)
    spec, w = prepare(model, weights)
    vol = open_volume(volume, spec.num_spatial, spec.in_channels)
    writer = None
    try:
        vol.set_transform(input_mean, input_scale)
        if pad == "mirror":
            vol.set_mirror(spec.fov)
        if any(s < f for s, f in zip(vol.padded, spec.fov)):
            raise CctError(f"{vol.source}: volume {'x'.join(map(str, vol.spatial))} is smaller than the field of "
                           f"view {'x'.join(map(str, spec.fov))} of net {spec.name} (use -pad mirror, or a larger "
                           f"volume)")
        out_shape = tuple(s - f + 1 for s, f in zip(vol.padded, spec.fov))
        if len(workers) > 1:
            log.info("infer: %d workers (%s), %s of the budget each", len(workers),
                     ",".join(d.name for d in workers), format_bytes(budget // len(workers)))

        def timed(p: Any) -> float:
            with workers[0].context():
                return measure_plan(spec, w, p)
        chosen = plan_inference(spec, out_shape, budget // len(workers), engine, plan, measure=timed,
                                weights_bytes=w.nbytes(), src_itemsize=vol.dtype.itemsize, rates=rates,
                                batches=batches or BATCHES, report=report)
        shape = (spec.out_channels,) + out_shape
        if isinstance(output, (str, os.PathLike)):
            attrs = {"fov": list(spec.fov), "pad": pad, "net": spec.name,
                     "plan": f"input {chosen.run_input}, tile {chosen.tile}, batch {chosen.batch}"}
            writer = HDF5Writer(output, shape, attrs, chunk=chosen.tile)
        else:
            writer = output
        tiling = Tiling(out_shape, chosen.tile, chosen.run_input)
        bar = Progress(int(chosen.voxels), enabled=not quiet)

        def make_net(k: int) -> InferenceNet:
            return InferenceNet(spec, w, chosen.mpf, k, chosen.run_input, chosen.primitives)

        t0 = time.perf_counter()
        runs = _run_workers(workers, spec, make_net, chosen, tiling, vol, writer.write, bar.update)
        seconds = time.perf_counter() - t0
        bar.close()
        writer.close()
        writer = None
        result = InferenceResult(chosen, shape, runs, seconds)
        where = os.fspath(output) if isinstance(output, (str, os.PathLike)) else type(output).__name__
        log.info("infer: wrote %s to %s in %.3g s (%d runs): %s vox/s (predicted %s), planned peak %s",
                 "x".join(map(str, shape)), where, seconds, runs, f"{result.voxels_per_second:,.0f}",
                 f"{chosen.throughput:,.0f}", format_bytes(chosen.memory))
        return result
    finally:
        if writer is not None and hasattr(writer, "abort"):
            writer.abort()
        vol.close()


def _workers(devices: Any) -> list[Any]:
    """The CPU workers of ``devices`` (None: one with every core); a GPU is a one-line error."""
    from cct.device.device import Device, parse_devices
    from cct.runtime.partition import cpu_cores

    if devices is None or devices == "" or devices == []:
        return [Device("cpu", 0, cpu_cores())]
    found = parse_devices(devices) if isinstance(devices, str) else list(devices)
    for d in found:
        if d.is_gpu:
            raise CctError(f"-devices {','.join(x.name for x in found)}: cct infer runs on CPU devices only "
                           f"('{d.name}'; its FFT and MPF primitives are numpy code)")
    return found


def _run_workers(workers: Sequence[Any], spec: Any, make_net: Any, plan: Any, tiling: Any, vol: Any, write: Any,
                 progress: Any) -> int:
    """Every tile, by one worker (with its device's threads) or several sharing the tiles (each its own net;
    BLAS at the largest worker's thread count, process wide; scipy.fft's per thread)."""
    import threading

    from cct.inference.tiling import run_tiles
    from cct.runtime.partition import blas_threads, run_concurrently

    def read(start: Any, size: Any, out: Any) -> Any:
        return vol.read(start, size, out)
    if len(workers) == 1:
        with workers[0].context():
            return run_tiles(spec, make_net, plan.mpf, plan.batch, tiling, read, write, progress)
    starts = tiling.starts()
    lock = threading.Lock()
    runs = [0] * len(workers)

    def work(k: int) -> None:
        with workers[k].thread_context():
            runs[k] = run_tiles(spec, make_net, plan.mpf, plan.batch, tiling, read, write, progress,
                                starts=starts[k::len(workers)], lock=lock)
    with blas_threads(max(d.threads for d in workers)):
        run_concurrently(len(workers), work)
    return sum(runs)
