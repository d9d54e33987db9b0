"""GEMM helpers shared by layers and engines."""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from cct.device import get_array_module
from cct.runtime.threads import blas_threads

# GEMMs below this many flops run on one BLAS thread.  Idle, a second thread saves at most ~0.05 ms on them
# (64x200x500, 12.8 MFLOP: 0.19 vs 0.14 ms on the project's 2-core machine); with the other core busy, the
# thread hand-off of every small call can cost a scheduler time slice — the digits model trained in 40 s
# instead of 17 s (1500 iterations) on a shared machine.
SMALL_GEMM_FLOPS = 16e6


def gemm_threads(flops: float, xp: Any = np) -> AbstractContextManager[Any]:
    """The BLAS thread setting for a GEMM (or a run of GEMMs, each) of ``flops``: one thread when small
    (host arrays only), else the current one."""
    if xp is np and flops < SMALL_GEMM_FLOPS:
        return blas_threads(1)
    return contextlib.nullcontext()


def matmul_accumulate(out: Any, a: Any, b: Any) -> None:
    """``out += a @ b`` without a temporary the size of ``out``.

    numpy float32/float64: one BLAS gemm with beta = 1 writing into ``out`` (through its transpose when ``out``
    is C-contiguous, since BLAS is column-major).  Anything else (cupy, other dtypes, odd layouts): the plain
    expression."""
    xp = get_array_module(out, a, b)
    if xp is np and out.dtype in (np.float32, np.float64) and a.dtype == out.dtype and b.dtype == out.dtype \
            and out.ndim == 2 and out.flags.c_contiguous:
        from scipy.linalg import blas

        gemm = blas.sgemm if out.dtype == np.float32 else blas.dgemm
        # out^T (F-contiguous) += b^T @ a^T
        result = gemm(1.0, b, a, beta=1.0, c=out.T, trans_a=1, trans_b=1, overwrite_c=1)
        if not np.shares_memory(result, out):  # BLAS wrapper made a copy after all
            out[...] = result.T
        return
    out += a @ b
