"""Compiled CPU kernels (``cct/native/_kernels.c``), built with the package when a C compiler is present.

numpy runs an elementwise operation at memory speed, but a step made of many such passes over small arrays (MAX
pooling's compare/select per kernel offset and its scatter in backward, AVE pooling's sums per kernel offset, LRN's
window sums, a lowering's copies and sums of short rows, ReLU's mask and product, BatchNorm's statistics and
normalization and Scale's product and sums over every channel plane, the SGD update's seven passes over every
parameter, SoftmaxWithLoss's backward's dozen calls, numpy's strided copies between the lowering's layouts, a
depthwise convolution's one-row GEMM per group, Winograd's tile transforms as Kronecker products on gathered
copies) spends its time in the passes themselves and, with the batch partitions' threads, in waiting for the GIL
between short calls. These kernels do one plane (or image, or tile of channels, or value) at a time in one pass
while it is in the core's cache, without the GIL. They compute what the numpy bodies compute, the same comparisons
and additions in the same order (the same values; col2im may give +0.0 where the numpy body keeps a -0.0; the
depthwise convolution, whose fallback is the lowering engine, sums each value in a fixed order of its own, and so do
Winograd's transforms, whose numpy bodies are BLAS products); the layers, the lowering and the SGD solver call them
through :func:`kernels` for the numpy arrays they support (:func:`takes`) and keep their array-module bodies for
everything else (cupy, other dtypes, N-D lowering and depthwise convolution, LRN within a channel or with other
powers, leaky ReLUs, the other update rules).

They also make :func:`cct.engines.gemm.matmul_accumulate`'s call into numpy's BLAS (``out += a @ b``, beta 1) in
one C call with the GIL released, where a ctypes call checked its operands in Python; and, on CPUs with AVX-512F or
AVX2 and FMA, a float32 GEMM of their own for the products OpenBLAS runs well below its peak — few rows, a moderate
inner dimension, many columns: a type-1 lowering's per-image forward (``panel_gemm`` on a lowered matrix;
``panel_conv_forward`` lowering each image span by span straight into its panels) and its weight gradient
(``panel_weight_grad``, the same with the lowered matrix's transpose) — which the lowering engine runs where
measured faster (CaffeNet's conv1).

Without a compiler the package installs without them and every layer runs its numpy body;
``cct device_query`` says which.  ``CCT_NATIVE=0`` in the environment turns them off (for A/B timing).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from cct.config import settings

# the kernels' API version this package calls (CCT_KERNELS_API in _kernels.c)
API_VERSION = 22

try:
    from cct.native import _kernels as _built
except ImportError:  # built without a C compiler: the numpy bodies run
    _built = None
_stale = _built is not None and getattr(_built, "API_VERSION", None) != API_VERSION
if _stale:  # a copy built from other sources (an older checkout's build): not called
    _built = None


def kernels() -> ModuleType | None:
    """The compiled kernels module, or None when it was not built or ``CCT_NATIVE=0``."""
    if _built is None or not settings.get("native"):
        return None
    return _built


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def takes(*arrays: Any) -> bool:
    """Whether the compiled kernels take ``arrays``: numpy float32 or float64 arrays of one dtype, C-contiguous
    (anything else, cupy arrays included, runs the numpy bodies).  Asked several times a layer call: a plain loop
    (0.6 us for three arrays, 1.4 as a generator over them)."""
    dtype = getattr(arrays[0], "dtype", None)
    if dtype not in _FLOATS:
        return False
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
            return False
    return True


def build_key() -> str:
    """Which kernels this process would run, for :func:`cct.device.query.machine_key`: the digest of the source they
    were built from (a cached speed of one of them — a panel GEMM against BLAS — holds for that build only), or
    that none were built."""
    return f"kernels {getattr(_built, 'SOURCE', 'unknown')}" if _built is not None else "no kernels"


def kernels_for(*arrays: Any) -> ModuleType | None:
    """:func:`kernels` when they take ``arrays`` (:func:`takes`), else None: the caller runs its numpy body."""
    compiled = kernels()
    return compiled if compiled is not None and takes(*arrays) else None


def describe() -> str:
    """For ``cct device_query``: which kernels run."""
    if _stale:
        return "numpy bodies (the compiled kernels found were built from other sources: reinstall cct)"
    if _built is None:
        return "numpy bodies (compiled kernels not built: no C compiler at install)"
    if kernels() is None:
        return "numpy bodies (compiled kernels off: CCT_NATIVE=0)"
    width = {64: "AVX-512", 32: "AVX2", 16: "SSE"}.get(_built.vector_width(), "?")
    return (f"compiled, {width} vectors (MAX and AVE pooling of up to 8 spatial axes; LRN across channels, "
            "beta 0.75; 2-D lowering, images first or last, and its layout moves; ReLU backward, and forward after a "
            "sum; BatchNorm and Scale per channel; SoftmaxWithLoss backward; depthwise convolution; Winograd's tile "
            "transforms; SGD update; gradients' finiteness; accumulating GEMM calls; "
            f"{'float32 panel GEMMs' if panel_gemms() else 'no panel GEMMs: neither AVX-512F nor AVX2 with FMA'}"
            "), numpy bodies elsewhere")


def panel_gemms() -> bool:
    """Whether the compiled float32 panel GEMMs run on this CPU (AVX-512F, or AVX2 with FMA): the lowering engine
    measures them against BLAS for its big type-1 layers only then."""
    compiled = kernels()
    if compiled is None:
        return False
    probe = np.zeros((1, 1), np.float32)
    return bool(compiled.panel_gemm(probe, probe, probe, None))
