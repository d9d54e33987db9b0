"""GEMM helpers shared by layers and engines."""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from cct.device import get_array_module
from cct.runtime.threads import blas_threads, thread_budget

# GEMMs below this many flops run on one BLAS thread.  On an idle 2-core machine a second OpenBLAS thread already
# pays from ~1.5 MFLOP (20x9 by 9x4096: 17.5 -> 11.8 us; 64x200x500, 12.8 MFLOP: 105 -> 58 us), but below a few
# MFLOP the gain is about what switching the thread count costs.  The digits model per iteration: 2.07 ms at
# 16 MFLOP (ip1's three 12.8 MFLOP products on one thread), 1.92 ms at 4, 1.91 at 2.  With another process keeping
# a core busy, every threaded call waits for a time slice whatever this threshold (digits: 7.0 ms at 16 MFLOP,
# 7.5 at 4, 2.25 on one thread): on a loaded machine give cct one thread (OPENBLAS_NUM_THREADS=1).
SMALL_GEMM_FLOPS = 4e6
# A bigger GEMM runs on one BLAS thread per this many flops, up to the thread budget: a multi-threaded OpenBLAS call
# wakes each of its workers (asleep between calls: cct.runtime.threads), one after the other, so a GEMM of a few
# MFLOP spread over 16 threads spends more on the wake-ups than it gains — on a 16-core Xeon the digits LeNet ran
# 3.67 ms an iteration with 16 BLAS threads and 3.36 with 4, and makes no partitioned call there.  Half the
# threshold above: on 2 cores the rule is that threshold's (two threads from 4 MFLOP).
GEMM_FLOPS_PER_THREAD = 2e6


def gemm_threads(flops: float, xp: Any = np) -> AbstractContextManager[Any]:
    """The BLAS thread setting for a GEMM (or a run of GEMMs, each) of ``flops``: one thread when small, one per
    ``GEMM_FLOPS_PER_THREAD`` where that is fewer than the calling thread's budget (host arrays only), else the
    current one."""
    if xp is not np:
        return contextlib.nullcontext()
    if flops < SMALL_GEMM_FLOPS:
        return blas_threads(1)
    threads = int(flops / GEMM_FLOPS_PER_THREAD)
    if threads < thread_budget():
        return blas_threads(max(1, threads))
    return contextlib.nullcontext()


def split_gemm(n: int, flops: float, xp: Any, body: Callable[[int, int], None]) -> None:
    """Run a GEMM of ``flops`` as ``body(j0, j1)`` over ranges of one of its output dimensions (``n`` long).

    Host arrays: small GEMMs on one thread (:func:`gemm_threads`); larger ones split into the batch partitions
    (:func:`cct.runtime.partition.run_batch`: concurrent ranges, one BLAS thread each) rather than run on
    OpenBLAS's own threads.  OpenBLAS's worker threads spin for about 0.1 s after every threaded call, so a
    partitioned layer that follows one (CaffeNet's conv5 after fc6 in backward) shares its cores with a
    spinning thread: 164 ms instead of 118 ms on 2 cores.  Splitting the output columns keeps each operand
    read once (rows would read the weights once per partition).  Other array modules: one call."""
    if xp is np and flops >= SMALL_GEMM_FLOPS and n > 1:
        from cct.runtime.partition import GEMM_FLOPS_PER_OPERATION, run_batch

        run_batch(n, lambda _part, j0, j1: body(j0, j1), work=flops / n / GEMM_FLOPS_PER_OPERATION)
        return
    with gemm_threads(flops, xp):
        body(0, n)


class _CblasGemm:
    """``cblas_?gemm`` of the BLAS numpy itself runs, called through ctypes (``out += a @ b`` with beta = 1).

    numpy has no beta = 1 product, and scipy's ``blas.sgemm`` is usually a *second* OpenBLAS (each wheel bundles
    its own): its threads keep spinning after a call while numpy's next GEMM starts its own, so on a machine
    with as many cores as BLAS threads every GEMM after the switch runs at half speed (CaffeNet's fc6 weight
    and data gradients: 128 ms alternating the two libraries, 64 ms in numpy's alone, 2 cores).  The symbol is
    looked up from numpy's own extension module, so the dynamic linker answers with the library numpy is
    linked against; the integer width follows the symbol's name (OpenBLAS's ILP64 builds append ``64_``).
    With the compiled kernels (:mod:`cct.native`) the call goes through their ``gemm_accumulate``, one C call
    with the operands' checks and the GIL released (the ctypes call and its checks in Python held the GIL
    ~4 us longer: a lowering's per-offset GEMMs make ~1600 such calls a CaffeNet iteration).  One small
    product is checked against numpy, through the path used, before the function is trusted."""

    _SYMBOLS = (("scipy_cblas_{t}gemm64_", ctypes.c_int64), ("cblas_{t}gemm64_", ctypes.c_int64),
                ("scipy_cblas_{t}gemm", ctypes.c_int), ("cblas_{t}gemm", ctypes.c_int))
    _ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112

    def __init__(self) -> None:
        self.functions: dict[Any, Any] = {}
        self.compiled: Any = None  # cct.native's kernels, once given the functions
        try:
            core = getattr(np, "_core", None) or np.core
            lib = ctypes.CDLL(core._multiarray_umath.__file__)
        except (AttributeError, OSError):
            return
        from cct import native

        compiled = self.compiled = native.kernels()
        for dtype, t, scalar in ((np.float32, "s", ctypes.c_float), (np.float64, "d", ctypes.c_double)):
            for name, integer in self._SYMBOLS:
                fn = getattr(lib, name.format(t=t), None)
                if fn is None:
                    continue
                fn.restype = None
                fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer, scalar,
                               ctypes.c_void_p, integer, ctypes.c_void_p, integer, scalar, ctypes.c_void_p,
                               integer]
                self.functions[np.dtype(dtype)] = fn
                if compiled is not None:
                    compiled.set_gemm(np.dtype(dtype).itemsize, ctypes.cast(fn, ctypes.c_void_p).value,
                                      integer is ctypes.c_int64)
                if not self._agrees(dtype):
                    del self.functions[np.dtype(dtype)]
                    if compiled is not None:
                        compiled.set_gemm(np.dtype(dtype).itemsize, 0, False)
                break

    def _agrees(self, dtype: Any) -> bool:
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((5, 3)).astype(dtype), rng.standard_normal((3, 4)).astype(dtype)
        out = rng.standard_normal((5, 4)).astype(dtype)
        expected = out + a @ b
        self(out, a, b)
        self(out, np.asfortranarray(a), np.asfortranarray(b))
        expected += a @ b
        return bool(np.allclose(out, expected, rtol=1e-5, atol=1e-5))

    @staticmethod
    def _operand(m: Any) -> tuple[int, int] | None:
        """(transpose flag, leading dimension) of a 2-D operand whose rows or columns are unit-strided."""
        item = m.itemsize
        rows, cols = m.shape
        s0, s1 = m.strides
        if (s1 == item or cols == 1) and s0 % item == 0 and s0 // item >= max(1, cols):
            return _CblasGemm._NO_TRANS, s0 // item
        if (s0 == item or rows == 1) and s1 % item == 0 and s1 // item >= max(1, rows):
            return _CblasGemm._TRANS, s1 // item
        return None

    def __call__(self, out: Any, a: Any, b: Any) -> bool:
        """``out += a @ b`` if this BLAS can take the operands as they lie; False (nothing done) otherwise."""
        if self.compiled is not None:
            return bool(self.compiled.gemm_accumulate(out, a, b))
        fn = self.functions.get(out.dtype)
        if fn is None or a.dtype != out.dtype or b.dtype != out.dtype or out.ndim != 2 or a.ndim != 2 \
                or b.ndim != 2:
            return False
        (m, k), n = a.shape, b.shape[1]
        if b.shape[0] != k or out.shape != (m, n):
            return False
        oa, ob, oc = self._operand(a), self._operand(b), self._operand(out)
        if oa is None or ob is None or oc is None or oc[0] != self._NO_TRANS:
            return False
        if m and n and k:
            fn(self._ROW_MAJOR, oa[0], ob[0], m, n, k, 1.0, a.ctypes.data, oa[1], b.ctypes.data, ob[1], 1.0,
               out.ctypes.data, oc[1])
        return True


_CBLAS: _CblasGemm | None = None


def accumulates_in_place(dtype: Any) -> bool:
    """Whether :func:`matmul_accumulate` on host arrays of ``dtype`` is one BLAS call (no temporary)."""
    global _CBLAS
    if _CBLAS is None:
        _CBLAS = _CblasGemm()
    return np.dtype(dtype) in _CBLAS.functions


def matmul_accumulate(out: Any, a: Any, b: Any) -> None:
    """``out += a @ b`` without a temporary the size of ``out``.

    numpy float32/float64: one gemm with beta = 1 of numpy's own BLAS writing into ``out`` (see
    :class:`_CblasGemm`).  Anything else (cupy, other dtypes, layouts BLAS cannot take, a numpy whose BLAS is
    not reachable): the plain expression."""
    global _CBLAS
    xp = get_array_module(out, a, b)
    if xp is np:
        if _CBLAS is None:
            _CBLAS = _CblasGemm()
        if _CBLAS(out, a, b):
            return
    out += a @ b
