"""Convolution by lowering to GEMM, batch-wide (CcT's type-1 "expensive lowering").

Lowering (im2col) copies every receptive field of every image of a batch partition into one matrix

    col[c, k_1..k_d, n, o_1..o_d] = x_pad[n, c, o_i*stride_i + k_i*dilation_i]      (zero padding)

viewed per group as ``col_g`` of shape ``(Cg*prod(k), n*prod(out))``; then one GEMM per group:

    forward           y_g  (Og, nP) = W_g (Og, K) @ col_g (K, nP)
    backward_weights  dW_g (Og, K) += dy_g (Og, nP) @ col_g^T
    backward_data     dcol_g (K, nP) = W_g^T @ dy_g,   dx = col2im(dcol)   (scatter-add, "lifting")

The lowering is one strided copy (``as_strided`` window view → transposed copy), col2im loops over the
kernel offsets only; nothing loops over images or pixels.  The whole batch is lowered at once unless its
lowered matrix would exceed ``max_lowered_bytes`` (env ``CCT_LOWERING_MAX_MB``, default 512 MiB); then it
is processed in equal partitions of whole images (CcT's batch partitions).  A 1x1/stride-1/pad-0
convolution needs no lowering: forward and backward_data are then batched GEMMs on the input itself.
Buffers (padded input, lowered matrix, transposed output gradient) are kept and reused across calls.
"""
from __future__ import annotations

import itertools
import os
from typing import Any

from cct.device import get_array_module
from cct.engines import ConvEngine, ConvGeometry

_DEFAULT_MAX_MB = 512.0


def _prod(values: tuple[int, ...]) -> int:
    n = 1
    for v in values:
        n *= v
    return n


class LoweringEngine(ConvEngine):
    """Type-1 lowering (im2col + GEMM per group + col2im), batch-wide, N-D, numpy or cupy."""

    name = "lowering"

    def __init__(self, max_lowered_bytes: int | None = None):
        super().__init__()
        if max_lowered_bytes is None:
            max_lowered_bytes = int(float(os.environ.get("CCT_LOWERING_MAX_MB", _DEFAULT_MAX_MB)) * 2**20)
        self.max_lowered_bytes = max_lowered_bytes
        self._buffers: dict[str, Any] = {}

    def configure(self, geometry: ConvGeometry) -> None:
        if geometry != self.geometry:
            pad = self._buffers.get("x_pad")
            if pad is not None:
                pad.fill(0)  # its border must be zero for the new layout
        self.geometry = geometry

    # ---- buffers -----------------------------------------------------------------------------
    def _view(self, name: str, shape: tuple[int, ...], like: Any) -> Any:
        """A ``shape`` view of the flat buffer ``name`` (grown, zero-filled, when too small)."""
        count = _prod(shape)
        buf = self._buffers.get(name)
        xp = get_array_module(like)
        if buf is None or buf.size < count or buf.dtype != like.dtype or get_array_module(buf) is not xp:
            buf = xp.zeros(max(count, 1), dtype=like.dtype)
            self._buffers[name] = buf
        return buf[:count].reshape(shape)

    def _geom(self) -> ConvGeometry:
        if self.geometry is None:
            raise RuntimeError("LoweringEngine used before configure()")
        return self.geometry

    def _partitions(self, itemsize: int) -> list[tuple[int, int]]:
        """Batch ranges lowered at once: as many whole images as fit in ``max_lowered_bytes``."""
        g = self._geom()
        per_image = g.in_channels * g.kernel_count * g.out_count * itemsize
        step = max(1, min(g.num, self.max_lowered_bytes // max(per_image, 1)))
        return [(n0, min(n0 + step, g.num)) for n0 in range(0, g.num, step)] or [(0, 0)]

    # ---- lowering and lifting -----------------------------------------------------------------
    def _padded_input(self, x: Any) -> Any:
        g = self._geom()
        if not any(g.pad):
            return x
        n = x.shape[0]
        shape = (n, g.in_channels) + tuple(i + 2 * p for i, p in zip(g.in_shape, g.pad))
        buf = self._view("x_pad", shape, x)
        interior = (slice(None), slice(None)) + tuple(slice(p, p + i) for i, p in zip(g.in_shape, g.pad))
        buf[interior] = x
        return buf

    def im2col(self, x: Any, out: Any | None = None) -> Any:
        """Lower ``x`` (n, C, *in) into ``out`` (or the engine's buffer) of shape (C, *kernel, n, *out)."""
        g = self._geom()
        xp = get_array_module(x)
        nd = g.num_spatial_axes
        n = x.shape[0]
        src = self._padded_input(x)
        st = src.strides
        window = xp.lib.stride_tricks.as_strided(
            src,
            shape=(n, g.in_channels) + g.out_shape + g.kernel,
            strides=(st[0], st[1]) + tuple(st[2 + i] * g.stride[i] for i in range(nd))
            + tuple(st[2 + i] * g.dilation[i] for i in range(nd)))
        order = (1,) + tuple(range(2 + nd, 2 + 2 * nd)) + (0,) + tuple(range(2, 2 + nd))
        if out is None:
            out = self._view("col", (g.in_channels,) + g.kernel + (n,) + g.out_shape, x)
        xp.copyto(out, window.transpose(order))
        return out

    def col2im(self, col: Any, dx: Any) -> Any:
        """Lift: ``dx[...] = Σ`` of every column entry into the input cell it was copied from.
        ``col`` has shape (C, *kernel, n, *out) (any strides); ``dx`` (n, C, *in) is overwritten."""
        g = self._geom()
        xp = get_array_module(dx)
        n = dx.shape[0]
        if any(g.pad):
            shape = (n, g.in_channels) + tuple(i + 2 * p for i, p in zip(g.in_shape, g.pad))
            target = self._view("dx_pad", shape, dx)
        else:
            target = dx
        target.fill(0)
        for off in itertools.product(*(range(k) for k in g.kernel)):
            cells = tuple(slice(o * d, o * d + s * (m - 1) + 1, s)
                          for o, d, s, m in zip(off, g.dilation, g.stride, g.out_shape))
            target[(slice(None), slice(None)) + cells] += xp.moveaxis(col[(slice(None),) + off], 0, 1)
        if target is not dx:
            dx[...] = target[(slice(None), slice(None))
                             + tuple(slice(p, p + i) for i, p in zip(g.in_shape, g.pad))]
        return dx

    # ---- the engine interface -----------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        g = self._geom()
        xp = get_array_module(x)
        G, O, C = g.group, g.out_channels, g.in_channels
        if g.is_pointwise:
            P = g.out_count
            xp.matmul(w.reshape(G, O // G, C // G), x.reshape(x.shape[0], G, C // G, P),
                      out=y.reshape(y.shape[0], G, O // G, P))
        else:
            for n0, n1 in self._partitions(x.itemsize):
                self._forward_lowered(self.im2col(x[n0:n1]), w, y[n0:n1])
        if b is not None:
            y += b.reshape((1, O) + (1,) * g.num_spatial_axes)
        return y

    def _forward_lowered(self, col: Any, w: Any, y: Any) -> None:
        """``y`` (n, O, *out) from the lowered input ``col`` (C, *k, n, *out)."""
        g = self._geom()
        xp = get_array_module(y)
        G, O, n = g.group, g.out_channels, y.shape[0]
        K, NP = g.in_channels // G * g.kernel_count, n * g.out_count
        colm, wm = col.reshape(G, K, NP), w.reshape(G, O // G, K)
        res = self._view("res", (G, O // G, NP), y)
        for gi in range(G):
            xp.matmul(wm[gi], colm[gi], out=res[gi])
        y[...] = xp.moveaxis(res.reshape((O, n) + g.out_shape), 0, 1)

    def backward_data(self, dy: Any, w: Any, dx: Any) -> Any:
        self.backward(None, dy, w, dx, None)
        return dx

    def backward_weights(self, x: Any, dy: Any, dw: Any) -> Any:
        self.backward(x, dy, None, None, dw)
        return dw

    def backward(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        """Weight and data gradients sharing one transposition of ``dy`` (and one lowering buffer)."""
        g = self._geom()
        xp = get_array_module(dy)
        G, O, C = g.group, g.out_channels, g.in_channels
        pointwise_dx = dx is not None and g.is_pointwise
        if pointwise_dx:
            P = g.out_count
            xp.matmul(w.reshape(G, O // G, C // G).transpose(0, 2, 1), dy.reshape(dy.shape[0], G, O // G, P),
                      out=dx.reshape(dx.shape[0], G, C // G, P))
            dx = None
        if dx is None and dw is None:
            return
        K = C // G * g.kernel_count
        for n0, n1 in self._partitions(dy.itemsize):
            n, NP = n1 - n0, (n1 - n0) * g.out_count
            dyt = self._view("dyT", (O, n) + g.out_shape, dy)
            dyt[...] = xp.moveaxis(dy[n0:n1], 1, 0)
            dytm = dyt.reshape(G, O // G, NP)
            if dw is not None:
                colm = self.im2col(x[n0:n1]).reshape(G, K, NP)
                dwm = dw.reshape(G, O // G, K)
                for gi in range(G):
                    dwm[gi] += xp.matmul(dytm[gi], colm[gi].T)
            if dx is not None:
                dcol = self._view("col", (C,) + g.kernel + (n,) + g.out_shape, dy)
                dcolm, wm = dcol.reshape(G, K, NP), w.reshape(G, O // G, K)
                for gi in range(G):
                    xp.matmul(wm[gi].T, dytm[gi], out=dcolm[gi])
                self.col2im(dcol, dx[n0:n1])

    def forward_and_backward_weights(self, x: Any, w: Any, y: Any | None, dy: Any, dw: Any | None) -> None:
        """``y[...] = conv(x, w)`` and ``dw += corr(x, dy)``, lowering ``x`` once (Deconvolution backward)."""
        g = self._geom()
        if g.is_pointwise or y is None or dw is None:
            super().forward_and_backward_weights(x, w, y, dy, dw)
            return
        xp = get_array_module(x)
        G, O = g.group, g.out_channels
        K = g.in_channels // G * g.kernel_count
        for n0, n1 in self._partitions(x.itemsize):
            n, NP = n1 - n0, (n1 - n0) * g.out_count
            col = self.im2col(x[n0:n1])
            dyt = self._view("dyT", (O, n) + g.out_shape, dy)
            dyt[...] = xp.moveaxis(dy[n0:n1], 1, 0)
            colm, dwm, dytm = col.reshape(G, K, NP), dw.reshape(G, O // G, K), dyt.reshape(G, O // G, NP)
            for gi in range(G):
                dwm[gi] += xp.matmul(dytm[gi], colm[gi].T)
            self._forward_lowered(col, w, y[n0:n1])
