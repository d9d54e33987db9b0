"""Local response normalization (Caffe's ``lrn_layer``), across channels or within a channel.

Across channels with beta = 3/4 on numpy float32/float64 arrays, the compiled kernels of :mod:`cct.native`
run it where they are built (the same bits as the array-module body below, which runs everything else)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cct import native
from cct.blob import Blob
from cct.device import chunk_bytes, get_array_module
from cct.errors import CctError, ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb
from cct.runtime.partition import partitions_for, run_batch

_F = "lrn_param"
# the element-wise passes of forward and backward (a dozen over the square, the window sums, the scale, its power
# and the product) run over chunks of about this many bytes of input, so that the chunk's half-dozen arrays
# stay in the cache between passes — yet each pass is long enough that two batch partitions do not queue for the
# interpreter lock between their calls (one image per chunk at 256 KiB: CaffeNet's norm2, 64 images on 2 cores,
# forward 5.1 -> 2.7 ms and backward 5.1 -> 2.6 ms at 1 MiB; norm1 6.6 -> 4.6 and 7.2 -> 4.3 ms; one thread
# alike at either size)
CHUNK_BYTES = 1 << 20


def _window_sum(a: Any, axis: int, size: int, out: Any, offset: float = 0.0) -> Any:
    """``out[..., i, ...] = offset + Σ_{|j-i| <= (size-1)/2} a[..., j, ...]`` along ``axis``, zero outside: the
    centre (plus ``offset``) in one pass, then each distance's two neighbours added where they exist."""
    xp = get_array_module(a)
    n = a.shape[axis]
    if offset:
        xp.add(a, offset, out=out)
    else:
        xp.copyto(out, a)
    lead = (slice(None),) * axis
    for d in range(1, min((size - 1) // 2, n - 1) + 1):
        out[lead + (slice(d, None),)] += a[lead + (slice(0, n - d),)]
        out[lead + (slice(0, n - d),)] += a[lead + (slice(d, None),)]
    return out


def _chunk_images(x: Any) -> int:
    """Images per chunk of ``x`` (``CHUNK_BYTES``, a device array's by :func:`cct.device.chunk_bytes`; at least
    one)."""
    return max(1, chunk_bytes(get_array_module(x), CHUNK_BYTES) // max(x[0].nbytes, 1)) if len(x) else 1


def _chunks(x: Any) -> list[tuple[int, int]]:
    step = _chunk_images(x)
    return [(a, min(a + step, len(x))) for a in range(0, len(x), step)]


def _negative_power(xp: Any, base: Any, beta: float, out: Any) -> Any:
    """``out = base^(-beta)`` for LRN's scale (``k`` plus a non-negative sum; a zero or negative base gives inf
    or NaN, as ``power`` does).  beta = 3/4 (Caffe's default): ``1 / (√base · √√base)``, correctly rounded
    steps, so every machine and the compiled kernel (:mod:`cct.native`) give the same bits; else
    ``exp(-beta · log(base))``, 1.6x as fast as numpy's float32 ``power`` (2.3M values: 1.3 vs 2.0 ms),
    within a few float32 roundings of it."""
    if beta == 0.75:
        root = xp.sqrt(base, out=out)
        quarter = xp.sqrt(root)
        out *= quarter
        return xp.divide(1, out, out=out)
    xp.log(base, out=out)
    out *= -beta
    return xp.exp(out, out=out)


@register("LRN")
class LRN(Layer):
    """Local response normalization, ``y = x · scale^(-beta)``.

    ACROSS_CHANNELS: ``scale[n,c,h,w] = k + (alpha/size) · Σ_{c' = c-(size-1)/2}^{c+(size-1)/2} x[n,c',h,w]²``
    (zero outside ``[0, C)``).  WITHIN_CHANNEL: ``scale = 1 + (alpha/size²) · Σ_{size×size window} x²``
    (zero padding; divisor always size², ``k`` is ignored — Caffe builds it from AVE pooling and Power).
    Backward (both, with N = size resp. size²):
    ``dx = dy · scale^(-beta) - (2·alpha·beta/N) · x · Σ_{window} (dy · y / scale)``.

    Shapes: bottom ``(N, C, H, W)`` → top of the same shape.  Parameters (``lrn_param``): ``local_size``
    (5, odd), ``alpha`` (1), ``beta`` (0.75), ``k`` (1), ``norm_region``.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    allow_in_place = False  # backward needs both x and y
    batch_separable = True

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.lrn_param
        self.size = int(p.local_size)
        if self.size % 2 != 1:
            raise ParamError(f"{_F}.local_size",
                             f"LRN only supports odd values for local_size (got {self.size})")
        self.alpha, self.beta, self.k = float(p.alpha), float(p.beta), float(p.k)
        self.region = p.norm_region
        if self.region not in (pb.LRNParameter.ACROSS_CHANNELS, pb.LRNParameter.WITHIN_CHANNEL):
            raise ParamError(f"{_F}.norm_region", f"Unknown normalization region {self.region}")
        self._scale: Any = None
        self._factor_kept = False
        self._buffers: dict[str, Any] = {}

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0]
        if x.num_axes != 4:
            raise CctError(f"LRN layer '{self.name}': Input must have 4 axes, corresponding to (num, "
                           f"channels, height, width) (got {x.shape_string()})")
        top[0].reshape(x.shape)

    def _buffer(self, name: str, shape: tuple[int, ...], like: Any) -> Any:
        """A scratch array kept across calls (zero-filled when (re)allocated)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype:
            buf = get_array_module(like).zeros(shape, dtype=like.dtype)
            self._buffers[name] = buf
        return buf

    def _scratch(self, name: str, a: Any) -> Any:
        """A scratch array shaped like the chunk ``a``: a view of one kept for a whole chunk."""
        return self._buffer(name, (_chunk_images(a),) + a.shape[1:], a)[:len(a)]

    def _neighbourhood_sum(self, a: Any, out: Any, part: int = 0, offset: float = 0.0) -> Any:
        """``offset`` + Σ over the normalization window: channels, or the size×size spatial square (separable)."""
        if self.region == pb.LRNParameter.ACROSS_CHANNELS:
            return _window_sum(a, 1, self.size, out, offset)
        tmp = self._scratch(f"tmp-{part}", a)
        _window_sum(a, 2, self.size, tmp)
        return _window_sum(tmp, 3, self.size, out, offset)

    def _split(self, n: int, body: Any, x: Any) -> None:
        """Run ``body(part, n0, n1)`` over the batch partitions (cct.runtime.partition)."""
        run_batch(n, body, parts=partitions_for(n, x[0].size * (self.size + 6) if n else 0))

    @property
    def _norm(self) -> tuple[float, float]:
        """(constant, coefficient): scale = constant + coefficient · Σ_window x²."""
        if self.region == pb.LRNParameter.ACROSS_CHANNELS:
            return self.k, self.alpha / self.size
        return 1.0, self.alpha / (self.size * self.size)

    def _compiled(self, *arrays: Any) -> Any:
        """The compiled kernels (:mod:`cct.native`) when they run this LRN: across channels with beta = 3/4, on
        numpy float32 or float64 arrays of one dtype, C-contiguous, with images; else None (the numpy body)."""
        compiled = native.kernels()
        if compiled is None or self.region != pb.LRNParameter.ACROSS_CHANNELS or self.beta != 0.75:
            return None
        return compiled if len(arrays[0]) and native.takes(*arrays) else None

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x, y = bottom[0].data, top[0].data
        scale = self._scale = self._buffer("scale", x.shape, x)
        compiled = self._compiled(x, scale, y)
        self._factor_kept = compiled is None  # the compiled kernels compute it again in backward
        if compiled is not None:
            const, coeff = self._norm
            planes = x.shape[1], math.prod(x.shape[2:])
            self._split(x.shape[0], lambda p, a, b: compiled.lrn_forward(x[a:b], scale[a:b], y[a:b], b - a, *planes,
                                                                         self.size, const, coeff), x)
            return
        factor = self._buffer("factor", x.shape, x)
        self._split(x.shape[0], lambda p, a, b: self._forward_part(p, x[a:b], scale[a:b], factor[a:b], y[a:b]),
                    x)

    def _forward_part(self, part: int, x: Any, scale: Any, factor: Any, y: Any) -> None:
        """``y = x · factor`` with ``factor = scale^(-beta)``, kept (with ``scale``) for backward; chunk by chunk
        of images."""
        xp = get_array_module(x)
        const, coeff = self._norm
        for a, b in _chunks(x):
            xc, sc, fc = x[a:b], scale[a:b], factor[a:b]
            sq = self._scratch(f"sq-{part}", xc)
            xp.multiply(xc, xc, out=sq)
            sq *= coeff
            self._neighbourhood_sum(sq, sc, part, const)  # const + coeff · Σ x²
            _negative_power(xp, sc, self.beta, fc)
            xp.multiply(xc, fc, out=y[a:b])

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        x, y, dy, dx = bottom[0].data, top[0].data, top[0].diff, bottom[0].diff
        scale = self._scale
        if scale is None:
            raise CctError(f"LRN layer '{self.name}': backward called before forward")
        compiled = self._compiled(x, y, dy, scale, dx)
        if compiled is not None:
            gain = -2.0 * self._norm[1] * self.beta
            planes = x.shape[1], math.prod(x.shape[2:])
            self._split(x.shape[0], lambda p, a, b: compiled.lrn_backward(
                x[a:b], y[a:b], dy[a:b], scale[a:b], dx[a:b], b - a, *planes, self.size, gain), x)
            return
        factor = self._buffer("factor", x.shape, x)
        if not self._factor_kept:  # forward ran the compiled kernels
            _negative_power(get_array_module(scale), scale, self.beta, factor)
        self._split(x.shape[0], lambda p, a, b: self._backward_part(p, x[a:b], y[a:b], dy[a:b], dx[a:b],
                                                                    scale[a:b], factor[a:b]), x)

    def _backward_part(self, part: int, x: Any, y: Any, dy: Any, dx: Any, scale: Any, factor: Any) -> None:
        xp = get_array_module(dy)
        const, coeff = self._norm
        for a, b in _chunks(x):
            t = self._scratch(f"sq-{part}", x[a:b])
            xp.multiply(dy[a:b], y[a:b], out=t)
            t /= scale[a:b]
            ratio = self._scratch(f"ratio-{part}", x[a:b])
            self._neighbourhood_sum(t, ratio, part)
            ratio *= x[a:b]
            ratio *= -2.0 * coeff * self.beta
            xp.multiply(dy[a:b], factor[a:b], out=dx[a:b])
            dx[a:b] += ratio
