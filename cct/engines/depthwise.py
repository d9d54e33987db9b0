"""Depthwise convolution: 2-D layers with one input channel per group (``group`` = C, O = m·C outputs, output
channel o reading input channel o / m — MobileNet's 3x3 layers), computed directly by the compiled kernels
(:mod:`cct.native`'s ``depthwise``).

The lowering engine runs such a layer as ``group`` GEMMs of m rows each over a lowered matrix k² times the input:
one multiply-add per input value and tap, in thousands of tiny BLAS calls (a 32-channel 112x112 layer at 16 images,
forward and both gradients: 362 ms against PyTorch's 34.5 on a 2-core Xeon). Here each channel plane is one
contiguous pass per tap: the plane — or, for a strided layer, each of its stride phases — copied into a
zero-bordered buffer of wide rows in which every tap of every output cell lies at one shift (the data gradient one
such pass per phase of the input over the output gradients); small planes (MobileNet's 14x14 and 7x7) are stacked,
a channel's images one buffer and one pass (those layers 1.3-1.7x faster than plane by plane: the per-plane copies
and steps dominated). The forward and the data gradient split the planes over the batch partitions — (channel,
image) where stacked, else (image, channel) —, the weight gradient the output channels, each thread summing its
values in full, in a fixed order, so the values do not depend on the partitions. Where a layer of one output per
channel, stride 1, has planes too large to stack, both gradients run in one pass over each channel's planes
(``depthwise_backward``: the output gradient read from memory once; MobileNet's 112x112 to 28x28 layers 12-14%
faster, the same bits), split by channel. The kernels sum each output
cell's taps in float32 in their order, then add the bias (as Caffe's GEMM, then its bias); the weight gradient sums
in float lanes gathered into doubles.

CPU only (numpy arrays, the compiled kernels built and on); elsewhere the lowering engine runs these layers.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cct import native
from cct.engines.base import ConvEngine, ConvGeometry, Estimate
from cct.engines.cost_model import DEFAULT_RATES
from cct.errors import CctError
from cct.runtime.partition import partitions_for, run_batch

# taps and stride per axis, and outputs per input channel, the kernels take (DW_MAX_K and DW_MAX_FAN in
# cct/native/_kernels.c)
MAX_TAPS = 32
MAX_OUTPUTS_PER_CHANNEL = 64
# the kernels' rate as a share of the GEMM peak (both whole-machine, with as many partitions as cores): multiply-adds
# of a tap over a plane, measured at 3.5-4e9 a second on one core of a 2-core Intel Xeon (AVX-512) against ~115
# GFLOP/s of sgemm — each product counted as a GEMM's two flops
GEMM_SHARE = 0.06


class DepthwiseEngine(ConvEngine):
    """Depthwise 2-D convolutions by the compiled kernels (see the module docstring)."""

    name = "depthwise"

    def __init__(self) -> None:
        super().__init__()
        self.dtype: Any = np.dtype(np.float32)
        self._one_pass: dict[tuple[int, ...], bool] = {}  # geometry -> whether depthwise_backward takes it

    # ---- applicability and cost ---------------------------------------------------------------
    @staticmethod
    def supports(g: ConvGeometry, xp: Any = None) -> tuple[bool, str]:
        """(True, "") when the engine can compute ``g`` on arrays of ``xp`` (numpy when None), else (False, the
        reason)."""
        if xp is not None and xp is not np:
            return False, "the depthwise engine runs on the CPU and this layer's arrays are on a GPU"
        if g.num_spatial_axes != 2:
            return False, f"depthwise runs 2-D convolutions ({g.num_spatial_axes}-D here)"
        if g.group < 2 or g.in_channels != g.group:
            return False, "depthwise runs one input channel per group"
        if any(k > MAX_TAPS for k in g.kernel) or any(s > MAX_TAPS for s in g.stride):
            return False, f"depthwise runs kernels and strides of at most {MAX_TAPS} per axis"
        if g.out_channels // g.in_channels > MAX_OUTPUTS_PER_CHANNEL:
            return False, f"depthwise runs at most {MAX_OUTPUTS_PER_CHANNEL} outputs per input channel"
        if native.kernels() is None:
            return False, "depthwise runs on the compiled kernels, which are off or not built"
        return True, ""

    @classmethod
    def estimates(cls, g: ConvGeometry, dtype: Any = "float32", rates: Any = None, xp: Any = None) -> list[Estimate]:
        """One variant: a multiply-add per output cell and tap in each of the three passes (forward, data and
        weight gradients), at ``GEMM_SHARE`` of the GEMM rate; no workspace beyond a plane's buffers."""
        if not cls.supports(g, xp)[0]:
            return []
        rates = rates or DEFAULT_RATES
        products = g.num * g.out_channels * g.out_count * g.kernel_count
        one_pass = 2.0 * products / (GEMM_SHARE * rates.gemm_flops)
        return [Estimate("depthwise", "depthwise", one_pass, 2 * one_pass, 0)]

    # ---- configuration -------------------------------------------------------------------------
    def configure(self, geometry: ConvGeometry, dtype: Any = None, xp: Any = None) -> bool:
        ok, why = self.supports(geometry, xp)
        if not ok:
            raise CctError(f"the depthwise convolution engine does not apply to this layer: {why}")
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if geometry == self.geometry and dtype == self.dtype:
            return False
        self.geometry, self.dtype = geometry, dtype
        return True

    def describe(self) -> str:
        g = self._geom()
        m = g.out_channels // g.in_channels
        return "depthwise (compiled, one input channel per group" + (f", {m} outputs each)" if m > 1 else ")")

    def batch_partitions(self) -> int:
        g = self._geom()
        return partitions_for(g.num * g.out_channels, self._plane_work())

    def _geom(self) -> ConvGeometry:
        if self.geometry is None:
            raise RuntimeError("depthwise engine used before configure()")
        return self.geometry

    def _plane_work(self) -> float:
        g = self._geom()
        return float(g.out_count * g.kernel_count)

    def _arguments(self, n: int) -> tuple[int, ...]:
        g = self._geom()
        return ((n, g.in_channels, g.out_channels) + tuple(g.in_shape) + tuple(g.kernel) + tuple(g.stride)
                + tuple(g.pad) + tuple(g.dilation) + tuple(g.out_shape))

    def _kernels(self, *arrays: Any) -> Any:
        compiled = native.kernels_for(*arrays)
        if compiled is None:
            raise CctError("the depthwise convolution engine needs C-contiguous float32 or float64 numpy arrays of "
                           "one type (and the compiled kernels on)")
        return compiled

    # ---- the arithmetic ------------------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        g = self._geom()
        n = x.shape[0]
        compiled = self._kernels(x, w, y, *(() if b is None else (b,)))
        geometry = self._arguments(n)
        run_batch(n * g.out_channels, lambda _p, p0, p1: compiled.depthwise(0, x, w, y, b, geometry, p0, p1),
                  work=self._plane_work())
        return y

    def backward(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        g = self._geom()
        n = dy.shape[0]
        geometry = self._arguments(n)
        if dx is not None and dw is not None:  # both in one pass over each channel's planes where the kernels can
            compiled = self._kernels(x, dy, w, dx, dw)
            one_pass = self._one_pass.get(geometry)
            if one_pass is None:  # (asked once per geometry: first == last computes nothing)
                one_pass = self._one_pass[geometry] = compiled.depthwise_backward(x, dy, w, dx, dw, geometry, 0, 0)
            if one_pass:
                run_batch(g.in_channels,
                          lambda _p, c0, c1: compiled.depthwise_backward(x, dy, w, dx, dw, geometry, c0, c1),
                          work=2 * self._plane_work() * n)
                return
        if dx is not None:
            compiled = self._kernels(dy, w, dx)
            run_batch(n * g.in_channels, lambda _p, p0, p1: compiled.depthwise(1, dy, w, dx, None, geometry, p0, p1),
                      work=self._plane_work() * g.out_channels / g.in_channels)
        if dw is not None:
            compiled = self._kernels(x, dy, dw)
            run_batch(g.out_channels, lambda _p, c0, c1: compiled.depthwise(2, x, dy, dw, None, geometry, c0, c1),
                      work=self._plane_work() * n)
