"""InnerProduct: a fully connected layer, one GEMM over all rows."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from cct.blob import Blob, shape_equals_legacy
from cct.device import get_array_module
from cct.engines.gemm import gemm_threads, matmul_accumulate, split_gemm
from cct.errors import CctError, ParamError
from cct.fillers import fill
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.runtime.threads import blas_workers_sleep

# products below this many flops run directly, unmeasured (CaffeNet's fc8, 0.5 GFLOP, is measured)
ORIENTATION_MIN_FLOPS = 2e8


def check_param_blob(blob: Blob, expected: tuple[int, ...], field: str, what: str) -> None:
    """A weight stored in the layer definition must have the shape the layer needs.  A legacy 4-D shape
    that pads ``expected`` with leading 1s (V1 files: ``1 1 N K``) is accepted and reshaped."""
    if blob.shape == expected:
        return
    if len(blob.shape) == 4 and shape_equals_legacy(blob.shape, expected):
        data = blob.data.copy()
        blob.reshape(expected)
        blob.data[...] = data.reshape(expected)
        return
    got = " ".join(str(d) for d in blob.shape) or "()"
    want = " ".join(str(d) for d in expected) or "()"
    raise ParamError(field, f"{what} blob has shape ({got}), expected ({want})")


def _one_call(n: int, flops: float, xp: Any, body: Any) -> None:
    """``body(0, n)``: a product as one BLAS call on the calling thread's BLAS threads."""
    with gemm_threads(flops, xp):
        body(0, n)


@register("InnerProduct")
class InnerProductLayer(Layer):
    """Fully connected: ``y = x W^T + b`` over rows of x.

    With ``axis`` a (default 1, negative allowed), the bottom is seen as an ``M x K`` matrix, ``M =
    count(0, a)``, ``K = count(a)``; the top has shape ``bottom.shape[:a] + (num_output,)``.
    Blobs: ``[weight (num_output, K), bias (num_output,)]``; with ``transpose`` the weight is stored
    ``(K, num_output)`` and ``y = x W + b``.  Backward: ``dW += dy^T x`` (transpose: ``x^T dy``),
    ``db += Σ_rows dy``, ``dx = dy W`` (transpose: ``dy W^T``).
    Parameters (``inner_product_param``): ``num_output``, ``bias_term`` (true), ``weight_filler``,
    ``bias_filler`` (both default constant 0), ``axis`` (1), ``transpose`` (false).
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = property(lambda self: self.axis > 0)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.inner_product_param
        if p.num_output <= 0:
            raise ParamError("inner_product_param.num_output", f"must be given and positive "
                                                               f"(got {p.num_output})")
        self.num_output = int(p.num_output)
        self.bias_term = bool(p.bias_term)
        self.transpose = bool(p.transpose)
        self.axis = bottom[0].canonical_axis_index(p.axis)
        self.K = bottom[0].count_range(self.axis)
        n, k = self.num_output, self.K
        w_shape = (k, n) if self.transpose else (n, k)
        n_blobs = 2 if self.bias_term else 1
        if self.blobs:
            if len(self.blobs) != n_blobs:
                raise ParamError("blobs", f"InnerProduct with bias_term {str(self.bias_term).lower()} "
                                          f"takes {n_blobs} blob(s), the definition stores {len(self.blobs)}")
            check_param_blob(self.blobs[0], w_shape, "blobs", "weight")
            if self.bias_term:
                check_param_blob(self.blobs[1], (n,), "blobs", "bias")
        else:
            weight = Blob(w_shape, xp=bottom[0].xp, dtype=bottom[0].dtype)
            fill(weight, p.weight_filler, "inner_product_param.weight_filler")
            self.blobs.append(weight)
            if self.bias_term:
                bias = Blob((n,), xp=bottom[0].xp, dtype=bottom[0].dtype)
                fill(bias, p.bias_filler, "inner_product_param.bias_filler")
                self.blobs.append(bias)
        self.param_propagate_down = [True] * len(self.blobs)
        self._scratch: dict[str, Any] = {}
        self._choices: dict[str, str] = {}  # product key -> the way measured fastest (_fastest)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        axis = bottom[0].canonical_axis_index(self.layer_param.inner_product_param.axis)
        if bottom[0].count_range(axis) != self.K:
            raise CctError(f"InnerProduct: input size incompatible with inner product parameters: bottom "
                           f"shape {bottom[0].shape_string()} gives {bottom[0].count_range(axis)} inputs "
                           f"per row from axis {axis}, the weights expect {self.K}")
        self.axis = axis
        self.M = bottom[0].count_range(0, axis)
        top[0].reshape(bottom[0].shape[:axis] + (self.num_output,))

    def _product(self, which: str, out: Any, a: Any, b: Any) -> None:
        """``out = a @ b`` the way this machine runs it faster: directly, or as ``(bᵀ aᵀ)ᵀ`` into a scratch copy
        transposed into ``out`` — the same sums, the operands swapped (CaffeNet's fc6 forward, 64 rows: 18.4 vs
        14.7 ms with AVX-512 OpenBLAS kernels on 2 cores; 1-3% the other way with AVX2 ones) —, each split by
        ``out``'s columns over the batch partitions (one BLAS thread each) or as one call on the BLAS's own
        threads (fc8, 2 cores, AVX-512 kernels: the data gradient 1.73 ms in one call against 1.80-1.97 split, the
        forward swapped 1.73-1.75 against 1.80-1.87 with cold caches).  One call is offered only where
        OpenBLAS's workers sleep after each call (:func:`cct.runtime.threads.blas_workers_sleep`): spinning, they
        slow the partitioned layers that follow (conv5's backward after fc6's: 164 instead of 127 ms).  Measured
        once per shape and machine (:meth:`_fastest`)."""
        xp = get_array_module(out)
        rows, inner = a.shape
        cols = out.shape[1]
        flops = 2.0 * rows * inner * cols

        def direct(j0: int, j1: int) -> None:
            xp.matmul(a, b[:, j0:j1], out=out[:, j0:j1])

        def swapped(j0: int, j1: int) -> None:  # (made before the partitions run it)
            scratch = self._scratch[which]
            xp.matmul(b[:, j0:j1].T, a.T, out=scratch[j0:j1])
            out[:, j0:j1] = scratch[j0:j1].T

        if xp is np and flops >= ORIENTATION_MIN_FLOPS:  # where the swapped way may run (_fastest)
            scratch = self._scratch.get(which)
            if scratch is None or scratch.shape != (cols, rows) or scratch.dtype != out.dtype:
                self._scratch[which] = xp.empty((cols, rows), dtype=out.dtype)
        self._fastest(which, f"m{rows}-k{inner}-n{cols}", flops, out, cols, {"direct": direct, "swapped": swapped})

    def _fastest(self, which: str, shape: str, flops: float, out: Any, n: int, bodies: dict[str, Any],
                 accumulates: bool = False) -> None:
        """Run the fastest way of computing a product into ``out``: each of ``bodies`` (``body(j0, j1)``: the
        product over ranges of one of ``out``'s dimensions, ``n`` long; the same sums) split over the batch
        partitions (:func:`cct.engines.gemm.split_gemm`), or, where OpenBLAS's workers sleep after each call, as
        one call on its threads (``"<name>, one call"``).  Measured once per product, shape and machine
        (:func:`cct.engines.measured.measured_choice`), with the caches evicted before each run as the other
        layers of a net leave them, where the product is big enough to matter (:data:`ORIENTATION_MIN_FLOPS`),
        else — and off the host — the first body, split.  Ways that add into
        ``out`` (``accumulates``: the weight gradient) are measured only while it holds zeros, as a solver
        leaves it before each pass, and leave it that way for the chosen one's run; until then the first runs."""
        xp = get_array_module(out)
        first = next(iter(bodies.values()))
        if xp is not np or flops < ORIENTATION_MIN_FLOPS:  # (every small product of a small net: nothing built)
            split_gemm(n, flops, xp, first)
            return
        ways = {name: functools.partial(split_gemm, n, flops, xp, body) for name, body in bodies.items()}
        if blas_workers_sleep():
            for name, body in bodies.items():
                ways[f"{name}, one call"] = functools.partial(_one_call, n, flops, xp, body)
        key = f"{which}-{shape}-{'t' if self.transpose else 'n'}-{out.dtype.name}-{len(ways)}ways"
        choice = self._choices.get(key)
        if choice is None:
            from cct.engines.measured import cache_evictor, known_choice, measured_choice

            choice = known_choice("inner_product_gemm", key, ways)
            if choice is None:
                if accumulates and out.any():
                    split_gemm(n, flops, xp, first)
                    return
                choice = measured_choice("inner_product_gemm", key, ways, between=cache_evictor())
                if accumulates:
                    out[...] = 0
            self._choices[key] = choice
        ways[choice]()

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0].data.reshape(self.M, self.K)
        y = top[0].data.reshape(self.M, self.num_output)
        w = self.blobs[0].data
        self._product("forward", y, x, w if self.transpose else w.T)  # (M, K) @ (K, N)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        dy = top[0].diff.reshape(self.M, self.num_output)
        x = bottom[0].data.reshape(self.M, self.K)
        flops = 2.0 * self.M * self.K * self.num_output
        if self.param_propagate_down[0]:
            w_diff = self.blobs[0].diff
            if self.transpose:  # (K, N) += x^T dy, by output columns
                def body(j0: int, j1: int) -> None:
                    matmul_accumulate(w_diff[:, j0:j1], x.T, dy[:, j0:j1])
            else:  # (N, K) += dy^T x, by output rows
                def body(j0: int, j1: int) -> None:
                    matmul_accumulate(w_diff[j0:j1], dy[:, j0:j1].T, x)
            self._fastest("weights", f"m{self.M}-k{self.K}-n{self.num_output}", flops, w_diff, self.num_output,
                          {"split": body}, accumulates=True)
        if propagate_down[0]:
            w = self.blobs[0].data
            self._product("data", bottom[0].diff.reshape(self.M, self.K), dy, w.T if self.transpose else w)
        if self.bias_term and self.param_propagate_down[1]:
            b_diff = self.blobs[1].diff
            b_diff += dy.sum(axis=0)
