"""Memory of an inference run, in bytes: per primitive (ZNNi Table II, for this project's engines), per layer,
and the peak of a run; memory budgets ("2GiB", "512MiB", "1.5G").

**Convolution primitives** (forward only; ``x``/``y`` the layer's input/output, counted as live blobs, not
here).  Elements per image, ``f`` lifted leading axes (lowering 1: none, 2: the first, 3: all), ``k_F``/``k_L``
the kernel over the lifted/lowered axes, ``cols = Π in_F · Π out_L``:

* lowering ``t`` (:mod:`cct.engines.lowering`): ``4·q·m·(C·k_L·cols [or C·Π in when f = all] + k_F·O·cols
  [none for type 1 writing straight into y] + O·Π out [f > 0: the lifting buffer])`` — ``q`` batch partitions
  running at once, each on a chunk of ``m`` images (chunks keep the lowered matrices within
  :data:`cct.inference.runner.LOWERED_BYTES`, a partition's within
  :data:`cct.engines.lowering.PART_LOWERED_MAX_BYTES`);
* fft full (:mod:`cct.engines.fft`, nothing kept between calls): the input spectra ``x̃ = 8·N·C·ñ``, the kernel
  spectra ``w̃ = 8·O·C·ñ`` and the output spectra ``ỹ = 8·N·O·ñ`` (``ñ = T_0·T_1·(T_2/2+1)``) are alive together
  while the inverse transform gathers the output positions axis by axis (two copies of ``ỹ`` shrinking by
  ``n'_a/T_a``): ``x̃ + w̃ + ỹ·(1 + n'_0/T_0 + n'_0·n'_1/(T_0·T_1))``; before that, the input transform
  (``4·N·C·n`` for the spatial-first copy plus two pruned stages);
* fft lifted: the same over the axes after the first, with the input spectra lowered along it
  (``k_0·n'_0/n_0`` times larger), the kernel spectra per tap, and the output's real inverse;
* where the transforms are DFT matrix products (:mod:`cct.engines.fft_plan`: one or two short axes), no gathered
  copies: every partition's split planes (:meth:`cct.engines.fft_plan.FFTPlan.scratch_bytes`) beside the
  spectra — the full layout's transforms read ``x`` and write ``y`` as they lie, the lifted one's inverse holds
  its real result and its forward the spatial-first copy.

These equal ``tracemalloc``'s peak for the engines as they are (tests/inference/test_memory.py).

**Other layers**: MPF holds two intermediate filters of one channel block per partition
(:func:`cct.inference.mpf.fragment_temp_bytes`); Caffe's Pooling keeps a copy of its input and its maxima
between calls (held for the whole run); BatchNorm (global statistics: one pass into its top) none, in-place
Scale/PReLU and Eltwise MAX one buffer of their top (released after the layer); other element-wise layers one
temporary of their top at most.

**A run** (:func:`run_memory`): layers run in order; a blob lives from the layer that writes it to its last
reader; the peak is ``max_i (live blobs during layer i + scratch of layer i)`` plus what is held throughout
(weights, Caffe pooling buffers).  The planner adds the tiling's buffers (:mod:`cct.inference.planner`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cct.engines import ConvGeometry
from cct.errors import CctError
from cct.inference.fov import BlobShape, NetSpec
from cct.proto import caffe_pb2 as pb

__all__ = ["RunMemory", "conv_memory", "format_bytes", "parse_memory", "run_memory"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 10 ** 6, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 10 ** 9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10 ** 12, "TIB": 1 << 40}


def parse_memory(text: str | int | float, what: str = "memory budget") -> int:
    """Bytes from ``"2GiB"``, ``"512MiB"``, ``"1.5G"`` (binary: K/M/G/T, KiB…), ``"800MB"`` (decimal) or a
    number of bytes; anything else is a one-line CctError."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).upper() not in _UNITS:
            raise CctError(f"{what} '{text}': expected a size such as 2GiB, 512MiB, 1.5G or 800MB")
        value, unit = float(m.group(1)), m.group(2).upper()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise CctError(f"{what} '{text}': must be positive")
    return size


def format_bytes(n: float) -> str:
    """``1843.5 MiB`` (MiB with one decimal; KiB below 1 MiB)."""
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 2**20:.1f} MiB"


def _lowering_bytes(g: ConvGeometry, strategy: int, itemsize: int) -> int:
    from cct import native
    from cct.engines.gemm import accumulates_in_place
    from cct.engines.lowering import DIRECT_MIN_COLS, FUSED_LIFT_MIN_COLS, lowers_images_last, partition_lowered_bytes
    from cct.inference.runner import LOWERED_BYTES
    from cct.runtime.partition import batch_ranges, partitions_for_flops

    nd = g.num_spatial_axes
    f = {1: 0, 2: 1, 3: nd}[strategy]
    C, O, G = g.in_channels, g.out_channels, g.group
    kF, kL = math.prod(g.kernel[:f]), math.prod(g.kernel[f:])
    cols = math.prod(g.in_shape[:f]) * math.prod(g.out_shape[f:])
    lowered = C * kL * cols if f < nd else C * math.prod(g.in_shape)
    result = kF * O * cols
    lifting = O * g.out_count if f else 0
    last = f < nd and lowers_images_last(g, strategy)  # the output transposed into y
    direct = f == 0 and cols >= DIRECT_MIN_COLS and not last  # type 1, big images: one GEMM per image into y
    # type 2 on wide outputs: the GEMMs add straight into y (no GEMM result, no lifting buffer)
    in_place = accumulates_in_place(np.dtype(f"f{itemsize}"))
    fused = f == 1 and not last and g.out_count >= FUSED_LIFT_MIN_COLS and in_place
    # type 2 with the images innermost: the GEMMs add into the output's rows (no GEMM result; the lifted output)
    by_rows = f == 1 and last and in_place
    per_image = lowered + (0 if direct or fused or by_rows else result) + (0 if fused else lifting)
    # the input copied, zero-padded along the lowered axes (and with the images innermost), before an N-D
    # lowering: not for type 3 (one move) nor where the compiled 2-D im2col reads the input as it lies
    if f < nd and not (nd == 2 and itemsize in (4, 8) and native.kernels() is not None) and (
            last or any(g.pad[f:])):
        per_image += C * math.prod(g.in_shape[:f]) * math.prod(i + 2 * p for i, p in zip(g.in_shape[f:], g.pad[f:]))
    M, K = kF * (O // G), (C // G) * kL
    parts = partitions_for_flops(g.num, 2.0 * M * K * cols)
    budget = partition_lowered_bytes(LOWERED_BYTES, parts)
    chunk = max(lowered, result) * itemsize
    images = sum(max(1, min(n1 - n0, budget // max(chunk, 1))) for n0, n1 in batch_ranges(g.num, parts))
    weights = O * (C // G) * math.prod(g.kernel) if f else 0
    return itemsize * (images * per_image + weights)


def _gather_peak(zs: float, out: Sequence[int], T: Sequence[int], first: int, real_unit: float) -> float:
    """The inverse transform's copies beyond the output spectra ``zs``: along each complex axis ``a`` (from
    ``first``) the wanted positions are gathered into a copy ``n'_a/T_a`` the size of the last one, then the
    real axis gives a real array and its gathered positions; two consecutive copies are alive at once."""
    nd = len(out)
    seq, frac = [], 1.0
    for a in range(first, nd - 1):
        frac *= out[a] / T[a]
        seq.append(zs * frac)
    seq.append(real_unit * math.prod(out[:-1]) * T[-1])
    seq.append(real_unit * math.prod(out))
    return max([seq[0]] + [u + v for u, v in zip(seq, seq[1:])])


def _fft_bytes(g: ConvGeometry, lifted: bool, itemsize: int) -> int:
    from cct.engines.fft import fft_transform_size
    from cct.engines.fft_plan import FFTPlan

    T = fft_transform_size(g)
    nd = g.num_spatial_axes
    N, C, O = g.num, g.in_channels, g.out_channels
    cg = C // g.group
    cs = 2 * itemsize  # complex
    out, inp = g.out_shape, g.in_shape
    if not lifted:
        th = T[:-1] + (T[-1] // 2 + 1,)
        nt = math.prod(th)
        xs, ks, zs = cs * N * C * nt, cs * O * cg * nt, cs * N * O * nt
        plan = FFTPlan(T)
        if plan.by_matrices(np.float32):  # DFT matrix products: from x and into y as they lie, the split planes
            inverse = xs + ks + zs + plan.scratch_bytes(out, N * O, itemsize, inverse=True)
            forward = xs + plan.scratch_bytes(inp, N * C, itemsize)
            return int(max(inverse, forward, xs + ks))
        inverse = xs + ks + zs + _gather_peak(zs, out, T, 0, itemsize * N * O)
        # the input's transform: the spatial-first copy, then the last two pruned stages at once
        stages = [math.prod(inp[:a]) * math.prod(T[a:-1]) * th[-1] for a in range(nd)]
        forward = itemsize * N * C * math.prod(inp) + cs * N * C * (stages[-1] + (stages[-2] if nd > 1 else 0))
        return int(max(inverse, forward, xs + ks))
    T1 = T[1:]
    th = T1[:-1] + (T1[-1] // 2 + 1,)
    F = math.prod(th)
    rows_x, rows_y, k0 = inp[0] + 2 * g.pad[0], out[0], g.kernel[0]
    xs_plain = cs * F * rows_x * N * C
    xs = cs * F * rows_y * N * k0 * cg * g.group
    ks = cs * F * O * k0 * cg
    zs = cs * F * rows_y * N * O
    plan = FFTPlan(T1)
    copy = itemsize * N * C * math.prod(inp)
    if plan.by_matrices(np.float32):
        inverse = xs + ks + zs + itemsize * N * O * math.prod(out) + plan.scratch_bytes(
            out[1:], rows_y * N * O, itemsize, inverse=True)
        forward = copy + xs_plain + plan.scratch_bytes(inp[1:], rows_x * N * C, itemsize)
        return int(max(inverse, xs_plain + xs, forward))
    inverse = xs + ks + zs + _gather_peak(zs, out, T, 1, itemsize * N * O)
    return int(max(inverse, xs_plain + xs, copy + xs_plain))


def conv_memory(primitive: str, g: ConvGeometry, itemsize: int = 4) -> int:
    """Scratch bytes of ``primitive`` running the forward of ``g`` (see the module docstring)."""
    family, _, kind = primitive.partition(" ")
    if family == "lowering":
        return _lowering_bytes(g, int(kind), itemsize)
    if family == "fft":
        return _fft_bytes(g, kind == "lifted", itemsize)
    raise CctError(f"unknown convolution primitive '{primitive}'")


def conv_geometry(lp: pb.LayerParameter, x: BlobShape) -> ConvGeometry:
    """The geometry of convolution layer ``lp`` on bottom ``x`` (no padding, stride 1)."""
    from cct.inference.fov import conv_kernel

    nd = len(x.spatial)
    k, d = conv_kernel(lp, nd)
    p = lp.convolution_param
    return ConvGeometry(x.batch, x.channels, int(p.num_output), int(p.group), x.spatial, k, (1,) * nd, (0,) * nd, d)


@dataclass
class RunMemory:
    """The memory of one run: ``peak`` bytes (at layer ``at``), what is ``held`` throughout, and per layer
    ``(name, live blob bytes + scratch, scratch, primitive or "")``."""

    peak: int
    at: str
    held: int
    layers: list[tuple[str, int, int, str]]


def layer_scratch(lp: pb.LayerParameter, shapes: Mapping[str, BlobShape], primitive: str | None,
                  itemsize: int = 4) -> tuple[int, int]:
    """(scratch bytes while the layer runs, bytes it keeps between runs) of one layer of a run."""
    from cct import native
    from cct.inference.fov import MPF_TYPE, pool_kernel
    from cct.inference.mpf import fragment_temp_bytes

    x = shapes[lp.bottom[0]] if lp.bottom else None
    y = shapes[lp.top[0]]
    top = y.count * itemsize
    in_place = bool(lp.bottom) and lp.top[0] == lp.bottom[0]
    t = lp.type
    if t == "Convolution":
        return conv_memory(primitive or "lowering 1", conv_geometry(lp, x), itemsize), 0
    if t == MPF_TYPE:
        return fragment_temp_bytes(x.shape, pool_kernel(lp, len(x.spatial)), itemsize), 0
    if t == "Pooling":
        if lp.pooling_param.pool == pb.PoolingParameter.MAX:
            # the maxima; a padded chunk of images and its scan's scratch (maxima, codes: ~half of it at stride 2)
            from cct.layers.pooling import MAX_POOL_CHUNK_BYTES

            whole = x.count * itemsize
            chunk = min(whole, max(whole // max(x.batch, 1), MAX_POOL_CHUNK_BYTES))
            return 0, chunk + chunk // 2 + top
        return 0, x.count * itemsize + top  # AVE/STOCHASTIC: a padded copy of the input, and the output
    # the numpy bodies of the per-channel layers (where the compiled kernels do not run) compute in place through
    # numpy's buffer for overlapping operands
    overlap = np.getbufsize() * itemsize if in_place and native.kernels() is None else 0
    if t == "BatchNorm":
        return overlap, 0
    if t in ("ReLU", "Dropout", "Split", "Concat", "Crop", "Input"):
        return 0, 0
    if t == "Eltwise":
        op = lp.eltwise_param.operation
        return (top * 3 // 2 if op == pb.EltwiseParameter.MAX else (top if in_place else 0)), 0
    if t in ("Scale", "PReLU"):
        return (top + overlap if in_place else 0), 0
    return top, 0  # other element-wise layers: one temporary of their top at most


def live_bytes(spec: NetSpec, params: Sequence[pb.LayerParameter], shapes: Mapping[str, BlobShape],
               itemsize: int = 4) -> list[int]:
    """Per layer of a run (``params``, the Input excluded), the bytes of the blobs alive while it runs: those
    written earlier and still to be read (or the output), and its own tops."""
    last: dict[str, int] = {}
    for i, lp in enumerate(params):
        for b in lp.bottom:
            last[b] = i
    last.pop(spec.output_blob, None)
    live = {spec.input_blob: shapes[spec.input_blob].count * itemsize}
    out = []
    for i, lp in enumerate(params):
        for t in lp.top:
            if t not in lp.bottom:
                live[t] = shapes[t].count * itemsize
        out.append(sum(live.values()))
        for b in [b for b, j in last.items() if j == i]:
            live.pop(b, None)
    return out


def run_memory(spec: NetSpec, mpf: Sequence[bool], batch: int, in_spatial: Sequence[int],
               primitives: Mapping[str, str], itemsize: int = 4) -> RunMemory:
    """The peak memory of one run (see the module docstring), weights excluded."""
    shapes = spec.shapes(mpf, batch, in_spatial)
    params = spec.rewrite(mpf, batch, in_spatial)[1:]
    held = 0
    rows = []
    peak, at = 0, ""
    for lp, base in zip(params, live_bytes(spec, params, shapes, itemsize)):
        scratch, keep = layer_scratch(lp, shapes, primitives.get(lp.name), itemsize)
        held += keep
        total = base + scratch
        rows.append((lp.name, total, scratch, primitives.get(lp.name, "") if lp.type == "Convolution" else ""))
        if total > peak:
            peak, at = total, lp.name
    return RunMemory(peak + held, at, held, rows)
