"""What a deploy net computes on a sliding window: the checks, the field of view, the valid patch sizes and
the rewrite of its pooling layers into max-pooling fragments.

**Which nets.**  One ``Input`` layer; ``Convolution`` without padding and with stride 1 (dilation and groups
allowed); ``Pooling`` (MAX or AVE) with kernel == stride and no padding; element-wise layers (the neurons,
``BatchNorm`` with global statistics, ``Scale``/``Bias`` per channel, ``Dropout``, ``Softmax`` over the
channels); ``Eltwise``, ``Concat`` over the channels and ``Crop`` of the spatial axes; one output blob.  Every
such layer maps a window of its input to one value per position, the same way at every position, so the net
is a sliding-window function.  Anything else is a :class:`CctError` naming the layer and what is wrong.

**Geometry, per spatial axis.**  Each blob ``b`` has a scale ``s_b`` (the product of the pooling kernels
above it), an offset ``o_b`` and an extent ``w_b``: position ``j`` of ``b`` depends on the input window
``[o_b + s_b·j, o_b + s_b·j + w_b)``.  The input has ``(1, 0, 1)``; a convolution with kernel ``k`` and
dilation ``d`` adds ``d·(k-1)·s`` to the extent, a pooling ``p`` adds ``(p-1)·s`` and multiplies the scale by
``p``, a crop by ``c`` adds ``c·s`` to the offset; Eltwise and Concat take the union of their bottoms'
windows (their bottoms must come through the same pooling layers).  The field of view is
``F = o_out + w_out``: output voxel ``z`` of the dense output is the net evaluated on ``input[z : z + F]``.

**Max-pooling fragments and valid sizes.**  Pooling layer ``l`` (kernel ``p_l``, scale ``s_l``) is computed
either as plain pooling, or as MPF (:mod:`cct.inference.mpf`): the pooling at every offset ``0 ≤ o_l < p_l``,
the fragments stacked along the batch.  A run whose dense output covers ``P·J`` positions per axis
(``P = Π_l p_l``, ``J`` the final fragment size) computes the dense indices
``σ + Σ_{l MPF} o_l·s_l + P·j``, where the shift ``σ = Σ_{l plain} o_l·s_l`` is fixed by where the run's
input starts: plain pooling layers need one run per offset combination.  Such a run needs the input size
``n = F + P·(J-1) + Σ_{l MPF} (p_l - 1)·s_l`` — all MPF: ``n = F - 1 + P·J``, the digest's ``v - 1 + Πp·j``;
all plain: ``F + P·(J-1)``.  Every MPF input then has ``(n + 1) mod p = 0`` and every plain pooling input
``n mod p = 0``: :meth:`NetSpec.shapes` propagates the sizes and checks that, so only valid sizes run.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from cct.errors import CctError
from cct.graph import filter_net
from cct.proto import caffe_pb2 as pb

__all__ = ["BlobShape", "NetSpec", "PoolSite", "analyze_net", "MPF_TYPE"]

MPF_TYPE = "MaxPoolingFragments"

NEURONS = frozenset(("ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "BNLL", "Power", "Exp", "Log",
                     "Threshold", "Clip", "Swish", "Dropout"))
SUPPORTED = NEURONS | {"Input", "Convolution", "Pooling", "BatchNorm", "Scale", "Bias", "Eltwise", "Concat",
                       "Crop", "Softmax", "Split"}
_SUPPORTED_TEXT = ("convolutions without padding and with stride 1, pooling with kernel == stride and no "
                   "padding, neurons, BatchNorm/Scale/Bias, Eltwise, Concat and Crop")


@dataclass(frozen=True)
class PoolSite:
    """A pooling layer of the net: its name, kernel (== stride) and scale (the product of the kernels of the
    pooling layers above it) per spatial axis, and its method (MAX or AVE)."""

    name: str
    kernel: tuple[int, ...]
    scale: tuple[int, ...]
    method: int


@dataclass(frozen=True)
class BlobShape:
    """A blob of a run: ``(batch, channels, *spatial)``."""

    batch: int
    channels: int
    spatial: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.batch, self.channels) + self.spatial

    @property
    def count(self) -> int:
        return self.batch * self.channels * math.prod(self.spatial)


@dataclass
class _Geom:
    scale: tuple[int, ...]
    offset: tuple[int, ...]
    extent: tuple[int, ...]
    pools: tuple[str, ...]
    channels: int


@dataclass
class NetSpec:
    """A checked deploy net (see the module docstring): its layers in order (the Input layer first), the
    input blob and channels, the output blob and channels, the pooling layers and the field of view."""

    name: str
    source: str
    layers: list[pb.LayerParameter]
    input_blob: str
    in_channels: int
    output_blob: str
    out_channels: int
    pools: list[PoolSite]
    fov: tuple[int, ...]
    output_offset: tuple[int, ...]
    blob_channels: dict[str, int] = field(default_factory=dict)

    @property
    def num_spatial(self) -> int:
        return len(self.fov)

    @property
    def pooling(self) -> tuple[int, ...]:
        """``P`` per axis: the product of every pooling kernel."""
        return tuple(math.prod(s.kernel[a] for s in self.pools) for a in range(self.num_spatial))

    def fragments(self, mpf: Sequence[bool]) -> int:
        """Fragments per input of a run: the product of the MPF layers' kernels over all axes."""
        return math.prod(math.prod(s.kernel) for s, m in zip(self.pools, mpf) if m)

    def shifts(self, mpf: Sequence[bool]) -> list[tuple[int, ...]]:
        """The input shifts ``σ`` (per axis) one dense tile needs: one per offset combination of the plain
        pooling layers, ``σ = Σ_{l plain} o_l·s_l`` (the order: earlier pooling layers vary slowest)."""
        out: list[tuple[int, ...]] = [(0,) * self.num_spatial]
        for site, m in zip(self.pools, mpf):
            if m:
                continue
            offsets = [tuple(o) for o in _product(site.kernel)]
            out = [tuple(s + o * sc for s, o, sc in zip(sigma, off, site.scale)) for sigma in out
                   for off in offsets]
        return out

    def run_input(self, mpf: Sequence[bool], out_size: Sequence[int]) -> tuple[int, ...]:
        """Input size per axis of a run whose final fragments are ``out_size`` (``J``) per axis:
        ``F + P·(J-1) + Σ_{l MPF} (p_l - 1)·s_l`` (checked by :meth:`shapes`)."""
        P = self.pooling
        extra = [sum((s.kernel[a] - 1) * s.scale[a] for s, m in zip(self.pools, mpf) if m)
                 for a in range(self.num_spatial)]
        return tuple(f + p * (j - 1) + e for f, p, j, e in zip(self.fov, P, out_size, extra))

    def shapes(self, mpf: Sequence[bool], batch: int, in_spatial: Sequence[int]) -> dict[str, BlobShape]:
        """Every blob's shape in a run of ``batch`` inputs of ``in_spatial`` with the pooling layers computed as
        MPF where ``mpf`` says; a size that does not fit (a kernel larger than its input, an MPF input with
        ``(n+1) mod p != 0``, a plain pooling input with ``n mod p != 0``) is a CctError naming the layer."""
        pool_mpf = {s.name: m for s, m in zip(self.pools, mpf)}
        out: dict[str, BlobShape] = {self.input_blob: BlobShape(batch, self.in_channels, tuple(in_spatial))}
        for lp in self.layers[1:]:
            bottoms = [out[b] for b in lp.bottom]
            x = bottoms[0]
            sp, n, ch = x.spatial, x.batch, x.channels
            t = lp.type
            if t == "Convolution":
                k, d = conv_kernel(lp, self.num_spatial)
                ext = tuple(di * (ki - 1) + 1 for ki, di in zip(k, d))
                if any(e > s for e, s in zip(ext, sp)):
                    raise CctError(f"layer '{lp.name}' (Convolution): input {_dims(sp)} is smaller than its "
                                   f"kernel extent {_dims(ext)}")
                sp, ch = tuple(s - e + 1 for s, e in zip(sp, ext)), int(lp.convolution_param.num_output)
            elif t == "Pooling":
                k = pool_kernel(lp, self.num_spatial)
                if pool_mpf[lp.name]:
                    if any((s + 1) % p for s, p in zip(sp, k)):
                        raise CctError(f"layer '{lp.name}' (Pooling as fragments): input {_dims(sp)} + 1 is not "
                                       f"a multiple of the kernel {_dims(k)}")
                    sp, n = tuple(s // p for s, p in zip(sp, k)), n * math.prod(k)
                else:
                    if any(s % p for s, p in zip(sp, k)):
                        raise CctError(f"layer '{lp.name}' (Pooling): input {_dims(sp)} is not a multiple of "
                                       f"the kernel {_dims(k)}")
                    sp = tuple(s // p for s, p in zip(sp, k))
                if any(s < 1 for s in sp):
                    raise CctError(f"layer '{lp.name}' (Pooling): input smaller than the kernel {_dims(k)}")
            elif t == "Concat":
                ch = sum(b.channels for b in bottoms)
                _same_spatial(lp, bottoms)
            elif t == "Eltwise":
                _same_spatial(lp, bottoms)
            elif t == "Crop":
                ref = bottoms[1]
                offs = _crop_offsets(lp, self.num_spatial)
                if any(o + r > s for o, r, s in zip(offs, ref.spatial, sp)):
                    raise CctError(f"layer '{lp.name}' (Crop): offset {_dims(offs)} + size {_dims(ref.spatial)} "
                                   f"exceeds its input {_dims(sp)}")
                sp = ref.spatial
                if _crop_axis(lp, self.num_spatial) == 1:
                    ch = ref.channels
            tops = list(lp.top)
            for top in tops:
                out[top] = BlobShape(n, ch, sp)
        return out

    def output_size(self, mpf: Sequence[bool], in_spatial: Sequence[int]) -> tuple[int, ...]:
        """The final fragment size ``J`` per axis of a run on ``in_spatial`` (CctError when not valid)."""
        return self.shapes(mpf, 1, in_spatial)[self.output_blob].spatial

    def rewrite(self, mpf: Sequence[bool], batch: int, in_spatial: Sequence[int]) -> list[pb.LayerParameter]:
        """The net's layers for a run: the Input layer shaped ``(batch, C, *in_spatial)``, each pooling layer
        computed as MPF (type ``MaxPoolingFragments``, same ``pooling_param``) where ``mpf`` says."""
        pool_mpf = {s.name: m for s, m in zip(self.pools, mpf)}
        out = []
        for lp in self.layers:
            q = pb.LayerParameter()
            q.CopyFrom(lp)
            q.phase = pb.TEST
            if q.type == "Input":
                q.input_param.ClearField("shape")
                q.input_param.shape.add().dim.extend((batch, self.in_channels) + tuple(in_spatial))
            elif q.type == "Pooling" and pool_mpf[q.name]:
                q.type = MPF_TYPE
            out.append(q)
        return out


# ---- analysis ------------------------------------------------------------------------------------------
def analyze_net(param: pb.NetParameter, source: str = "<net>") -> NetSpec:
    """Check ``param`` (a deploy net; TEST-phase layers are kept) for sliding-window inference and compute
    its geometry (see the module docstring); every problem is a one-line CctError naming the layer."""
    p = pb.NetParameter()
    p.CopyFrom(param)
    p.state.phase = pb.TEST
    net = filter_net(p)
    name = net.name or os.path.splitext(os.path.basename(source))[0]
    layers = list(net.layer)

    def fail(lp: pb.LayerParameter, message: str) -> CctError:
        return CctError(f"{source}: layer '{lp.name}' ({lp.type}): {message}")

    inputs = [lp for lp in layers if lp.type == "Input"]
    if len(inputs) != 1 or layers[0].type != "Input":
        raise CctError(f"{source}: cct infer needs a deploy net whose first layer is its one Input layer "
                       f"({len(inputs)} Input layers)")
    inp = layers[0]
    if len(inp.top) != 1 or len(inp.input_param.shape) != 1:
        raise fail(inp, "needs exactly one top and one input_param.shape (N, C, *spatial)")
    dims = tuple(inp.input_param.shape[0].dim)
    if len(dims) < 3:
        raise fail(inp, f"input shape {_dims(dims)} has no spatial axes: cct infer needs (N, C, *spatial)")
    nd = len(dims) - 2
    geom: dict[str, _Geom] = {inp.top[0]: _Geom((1,) * nd, (0,) * nd, (1,) * nd, (), int(dims[1]))}
    consumed: set[str] = set()
    pools: list[PoolSite] = []
    for lp in layers[1:]:
        if lp.type not in SUPPORTED:
            raise fail(lp, f"not supported by sliding-window inference (it takes {_SUPPORTED_TEXT})")
        for b in lp.bottom:
            if b not in geom:
                raise fail(lp, f"unknown bottom blob '{b}'")
        if not lp.bottom or not lp.top:
            raise fail(lp, "needs a bottom and a top")
        bottoms = [geom[b] for b in lp.bottom]
        g = bottoms[0]
        t = lp.type
        if t not in ("Eltwise", "Concat", "Crop", "Split") and len(lp.bottom) != 1:
            raise fail(lp, f"takes one bottom here ({len(lp.bottom)} given)")
        if t == "Convolution":
            g = _conv_geom(lp, g, nd, fail)
        elif t == "Pooling":
            g, site = _pool_geom(lp, g, nd, fail)
            pools.append(site)
        elif t in ("Eltwise", "Concat"):
            if t == "Concat":
                axis = lp.concat_param.axis if not lp.concat_param.HasField("concat_dim") else \
                    lp.concat_param.concat_dim
                if axis not in (1, -(nd + 1)):
                    raise fail(lp, f"concatenates along axis {axis}; only the channel axis 1 is supported")
            g = _merge(lp, bottoms, fail)
            if t == "Concat":
                g.channels = sum(b.channels for b in bottoms)
        elif t == "Crop":
            if len(lp.bottom) != 2:
                raise fail(lp, "needs two bottoms (data, reference)")
            if bottoms[0].pools != bottoms[1].pools or bottoms[0].scale != bottoms[1].scale:
                raise fail(lp, "its data and reference come through different pooling layers")
            offs = _crop_offsets(lp, nd, fail)
            channels = bottoms[1].channels if _crop_axis(lp, nd) == 1 else g.channels
            g = _Geom(g.scale, tuple(o + c * s for o, c, s in zip(g.offset, offs, g.scale)), g.extent, g.pools,
                      channels)
        elif t == "Softmax":
            if lp.softmax_param.axis not in (1, -(nd + 1)):
                raise fail(lp, f"softmax over axis {lp.softmax_param.axis}; only the channel axis 1 is a "
                               f"per-voxel operation")
        elif t == "BatchNorm":
            bp = lp.batch_norm_param
            if bp.HasField("use_global_stats") and not bp.use_global_stats:
                raise fail(lp, "use_global_stats: false normalises by the statistics of each patch, which a "
                               "sliding window does not have")
        elif t in ("Scale", "Bias"):
            sp = lp.scale_param if t == "Scale" else lp.bias_param
            if len(lp.bottom) != 1 or sp.axis not in (1, -(nd + 1)) or sp.num_axes != 1:
                raise fail(lp, "only a learned per-channel parameter (one bottom, axis 1, num_axes 1) is "
                               "translation invariant")
        elif t == "PReLU" or t in NEURONS:
            pass
        if t == "Convolution":
            g.channels = int(lp.convolution_param.num_output)
        for b in lp.bottom:
            consumed.add(b)
        for top in lp.top:
            geom[top] = _Geom(g.scale, g.offset, g.extent, g.pools, g.channels)
    outputs = [b for b in geom if b not in consumed]
    if len(outputs) != 1:
        raise CctError(f"{source}: cct infer needs a net with one output blob (this one has "
                       f"{len(outputs)}: {', '.join(outputs)})")
    out = geom[outputs[0]]
    fov = tuple(o + w for o, w in zip(out.offset, out.extent))
    return NetSpec(name, source, layers, inp.top[0], int(dims[1]), outputs[0], out.channels, pools, fov,
                   out.offset, {b: g.channels for b, g in geom.items()})


def _conv_geom(lp: pb.LayerParameter, g: _Geom, nd: int, fail) -> _Geom:
    p = lp.convolution_param
    if p.axis != 1:
        raise fail(lp, f"convolution_param.axis {p.axis}: only the channel axis 1 is supported")
    if any(v != 0 for v in p.pad) or p.pad_h or p.pad_w:
        raise fail(lp, "padded convolution: sliding-window inference needs valid convolutions (pad 0)")
    if any(v != 1 for v in p.stride) or (p.HasField("stride_h") and p.stride_h != 1) or \
            (p.HasField("stride_w") and p.stride_w != 1):
        raise fail(lp, "strided convolution: sliding-window inference needs stride 1 (pool instead)")
    k, d = conv_kernel(lp, nd, fail)
    ext = tuple(s * di * (ki - 1) for ki, di, s in zip(k, d, g.scale))
    return _Geom(g.scale, g.offset, tuple(w + e for w, e in zip(g.extent, ext)), g.pools, g.channels)


def _pool_geom(lp: pb.LayerParameter, g: _Geom, nd: int, fail) -> tuple[_Geom, PoolSite]:
    p = lp.pooling_param
    if p.pool not in (pb.PoolingParameter.MAX, pb.PoolingParameter.AVE):
        raise fail(lp, "only MAX and AVE pooling are supported")
    if p.global_pooling:
        raise fail(lp, "global pooling depends on the patch size")
    if any(v != 0 for v in p.pad_nd) or p.pad or p.pad_h or p.pad_w:
        raise fail(lp, "padded pooling: sliding-window inference needs pad 0")
    k = pool_kernel(lp, nd, fail)
    stride = tuple(int(v) for v in p.stride_nd) or ((int(p.stride_h), int(p.stride_w))
                                                   if p.HasField("stride_h") else (int(p.stride),))
    stride = stride * nd if len(stride) == 1 else stride
    if stride != k:
        raise fail(lp, f"stride {_dims(stride)} != kernel {_dims(k)}: only non-overlapping pooling (kernel == "
                       f"stride) turns into max-pooling fragments")
    site = PoolSite(lp.name, k, g.scale, p.pool)
    ext = tuple(w + (ki - 1) * s for w, ki, s in zip(g.extent, k, g.scale))
    return _Geom(tuple(s * ki for s, ki in zip(g.scale, k)), g.offset, ext, g.pools + (lp.name,), g.channels), site


def _merge(lp: pb.LayerParameter, bottoms: list[_Geom], fail) -> _Geom:
    first = bottoms[0]
    for b in bottoms[1:]:
        if b.pools != first.pools or b.scale != first.scale:
            raise fail(lp, f"combines blobs that come through different pooling layers "
                           f"({', '.join(first.pools) or 'none'} vs {', '.join(b.pools) or 'none'})")
    lo = tuple(min(b.offset[a] for b in bottoms) for a in range(len(first.offset)))
    hi = tuple(max(b.offset[a] + b.extent[a] for b in bottoms) for a in range(len(first.offset)))
    return _Geom(first.scale, lo, tuple(h - o for h, o in zip(hi, lo)), first.pools, first.channels)


def _same_spatial(lp: pb.LayerParameter, bottoms: list[BlobShape]) -> None:
    for b in bottoms[1:]:
        if b.spatial != bottoms[0].spatial or b.batch != bottoms[0].batch:
            raise CctError(f"layer '{lp.name}' ({lp.type}): bottoms of different sizes "
                           f"({_dims(bottoms[0].spatial)} vs {_dims(b.spatial)})")


def conv_kernel(lp: pb.LayerParameter, nd: int, fail=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(kernel, dilation) of a convolution layer, one entry per spatial axis."""
    p = lp.convolution_param
    if p.HasField("kernel_h") or p.HasField("kernel_w"):
        k = (int(p.kernel_h), int(p.kernel_w))
    else:
        k = tuple(int(v) for v in p.kernel_size)
        k = k * nd if len(k) == 1 else k
    d = tuple(int(v) for v in p.dilation) or (1,)
    d = d * nd if len(d) == 1 else d
    if len(k) != nd or len(d) != nd:
        raise (fail or _plain_fail)(lp, f"kernel {_dims(k)} / dilation {_dims(d)} do not match the input's "
                                        f"{nd} spatial axes")
    return k, d


def pool_kernel(lp: pb.LayerParameter, nd: int, fail=None) -> tuple[int, ...]:
    """The kernel of a pooling layer (``kernel_nd``, ``kernel_h``/``kernel_w`` or ``kernel_size``) per spatial axis."""
    p = lp.pooling_param
    if len(p.kernel_nd):
        k = tuple(int(v) for v in p.kernel_nd)
    elif p.HasField("kernel_h"):
        k = (int(p.kernel_h), int(p.kernel_w))
    else:
        k = (int(p.kernel_size),)
    k = k * nd if len(k) == 1 else k
    if len(k) != nd or any(v < 1 for v in k):
        raise (fail or _plain_fail)(lp, f"kernel {_dims(k)} does not match the input's {nd} spatial axes")
    return k


def _crop_axis(lp: pb.LayerParameter, nd: int) -> int:
    axis = lp.crop_param.axis
    return axis + (nd + 2) if axis < 0 else axis


def _crop_offsets(lp: pb.LayerParameter, nd: int, fail=None) -> tuple[int, ...]:
    p = lp.crop_param
    axis = _crop_axis(lp, nd)
    if axis < 1:
        raise (fail or _plain_fail)(lp, "crop_param.axis 0 would crop the batch")
    offsets = [int(v) for v in p.offset]
    per_axis = []
    for i in range(1, nd + 2):
        off = 0
        if i >= axis:
            off = offsets[0] if len(offsets) == 1 else (offsets[i - axis] if offsets else 0)
        per_axis.append(off)
    return tuple(per_axis[1:])


def _plain_fail(lp: pb.LayerParameter, message: str) -> CctError:
    return CctError(f"layer '{lp.name}' ({lp.type}): {message}")


def _product(kernel: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for k in kernel:
        out = [o + [i] for o in out for i in range(k)]
    return out


def _dims(t: Sequence[int]) -> str:
    return "x".join(str(v) for v in t) if len(t) else "()"


def dims(t: Sequence[int]) -> str:
    """``48x48x48`` (shown as ``48^3`` by :func:`cube` when isotropic)."""
    return _dims(t)


def cube(t: Sequence[int]) -> str:
    """``48^3`` for an isotropic size, else ``48x40x40``."""
    return f"{t[0]}^{len(t)}" if len(set(t)) == 1 and len(t) > 1 else _dims(t)
