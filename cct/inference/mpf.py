"""Max-pooling fragments (ZNNi §V; Giusti et al. 2013) and the recombination of fragments into a dense output.

**MPF.**  Pooling with kernel ``p`` (== stride) of an ``n``-voxel axis at offset ``0 ≤ o < p`` keeps the
windows ``[o + p·j, o + p·j + p)``, ``j < m``.  When ``(n + 1) mod p = 0`` every offset gives ``m = ⌊n/p⌋``
windows and together they are the ``n - p + 1`` windows of a sliding (max-)filter: ``o + p·j`` enumerates
``0 … n - p`` exactly once.  The layer computes that sliding filter axis by axis (``p - 1`` element-wise
maxima over shifted slices, no argmax) and lays the fragments out along the batch:

    bottom (S, C, *n)  →  top (S·P, C, *m),   P = Π_a p_a,  top[s·P + o] = pool at offset o of bottom[s],
    o = (o_0·p_1 + o_1)·p_2 + o_2                (row-major over the spatial axes, axis 0 slowest)

The last axis's filter writes straight into the top through a strided view (``(m, p)`` splits of each
axis), so the only copies are the intermediate filters of the other axes, done per channel block.  FLOPs:
``S·f·n³·(p-1)`` comparisons per axis (ZNNi Table I counts ``S·f·n³·p³`` for the direct form).  AVE pooling
works the same with sums, divided by ``P`` at the end.

**Recombination.**  After ``L`` pooling layers (kernels ``p_1 … p_L``, scales ``s_l = Π_{k<l} p_k``) the
batch index of a fragment is ``((s·P_1 + o_1)·P_2 + o_2)…`` (the first layer's offset slowest) and dense
output index ``x = σ + o_1·s_1 + o_2·s_2 + … + P·j`` per axis, ``P = Π p_l``, ``σ`` the input shift of the run
(plain pooling layers, whose offsets are fixed per run).  :func:`scatter_fragments` views the dense tile
``(C, *(P·J))`` with each axis split as ``(J, p_L, …, p_1)`` and assigns the fragments, transposed to the
same order — every dense index is written by exactly one (fragment, position) pair.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cct.blob import Blob
from cct.errors import CctError, ParamError
from cct.inference.fov import MPF_TYPE, PoolSite
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb
from cct.runtime.partition import batch_ranges, partitions_for, run_partitions

__all__ = ["MaxPoolingFragments", "fragment_pool", "fragment_temp_bytes", "scatter_fragments"]

# intermediate (axis-by-axis) filters are computed per block of channel planes of at most this many bytes
CHUNK_BYTES = 16 << 20


def _split_view(a: Any, kernel: Sequence[int], first: int) -> Any:
    """``a`` with each spatial axis ``first + i`` (length ``p_i·m_i``) split into ``(m_i, p_i)``: a view."""
    shape = list(a.shape[:first])
    for i, p in enumerate(kernel):
        n = a.shape[first + i]
        shape += [n // p, p]
    v = a.reshape(shape)
    if not np.shares_memory(v, a):  # pragma: no cover - numpy always splits a strided axis without copying
        raise RuntimeError("fragment view needs a copy")
    return v


def fragment_pool(x: np.ndarray, kernel: Sequence[int], method: int = pb.PoolingParameter.MAX,
                  out: np.ndarray | None = None) -> np.ndarray:
    """Max- (or average-) pooling fragments of ``x`` ``(S, C, *n)`` with ``(n + 1) mod p = 0`` on every axis:
    ``out`` ``(S·P, C, *(n // p))`` as in the module docstring (allocated when None)."""
    kernel = tuple(int(k) for k in kernel)
    S, C, *n = x.shape
    nd = len(n)
    if len(kernel) != nd or any((v + 1) % p for v, p in zip(n, kernel)):
        raise CctError(f"max-pooling fragments: input {'x'.join(map(str, n))} + 1 is not a multiple of the "
                       f"kernel {'x'.join(map(str, kernel))}")
    m = tuple(v // p for v, p in zip(n, kernel))
    P = math.prod(kernel)
    if out is None:
        out = np.empty((S * P, C) + m, dtype=x.dtype)
    # out as (S, *p, C, *m), seen in dense order (S, C, m0, p0, m1, p1, ...)
    o = out.reshape((S,) + kernel + (C,) + m)
    dense = o.transpose((0, 1 + nd) + tuple(v for a in range(nd) for v in (2 + nd + a, 1 + a)))
    combine = np.maximum if method == pb.PoolingParameter.MAX else np.add
    lengths = tuple(v - p + 1 for v, p in zip(n, kernel))
    plane = max(1, math.prod(n)) * x.itemsize
    block = max(1, min(C, CHUNK_BYTES // plane))
    jobs = [(s, c0, min(C, c0 + block)) for s in range(S) for c0 in range(0, C, block)]

    def body(_part: int, j0: int, j1: int) -> None:
        for s, c0, c1 in jobs[j0:j1]:
            cur = x[s, c0:c1]
            for a in range(nd):
                p, length = kernel[a], lengths[a]
                last = a == nd - 1
                if p == 1 and not last:
                    continue
                sl: list[Any] = [slice(None)] * (1 + nd)
                views = []
                for t in range(p):
                    sl[1 + a] = slice(t, t + length)
                    v = cur[tuple(sl)]
                    views.append(_split_view(v, kernel, 1) if last else v)
                if last:
                    dst = dense[s, c0:c1]
                else:
                    dst = np.empty(cur.shape[:1 + a] + (length,) + cur.shape[2 + a:], dtype=x.dtype)
                if p == 1:
                    np.copyto(dst, views[0])
                else:
                    combine(views[0], views[1], out=dst)
                    for v in views[2:]:
                        combine(dst, v, out=dst)
                cur = dst
    work = float(math.prod(n)) * block * sum(kernel)
    run_partitions(batch_ranges(len(jobs), partitions_for(len(jobs), work)), body)
    if method != pb.PoolingParameter.MAX:
        out *= x.dtype.type(1.0 / P)
    return out


def fragment_temp_bytes(shape: Sequence[int], kernel: Sequence[int], itemsize: int = 4) -> int:
    """Scratch bytes :func:`fragment_pool` holds at its peak for an input ``shape`` ``(S, C, *n)``: the
    intermediate filters of one channel block per running partition (two consecutive axes' at a time)."""
    S, C, *n = shape
    nd = len(n)
    plane = max(1, math.prod(n)) * itemsize
    block = max(1, min(C, CHUNK_BYTES // plane))
    jobs = S * -(-C // block)
    parts = partitions_for(jobs, float(math.prod(n)) * block * sum(kernel))
    sizes = []
    cur = list(n)
    for a in range(nd - 1):
        if kernel[a] == 1:
            continue
        cur[a] = n[a] - kernel[a] + 1
        sizes.append(math.prod(cur) * block * itemsize)
    peak = max([sizes[i] + (sizes[i - 1] if i else 0) for i in range(len(sizes))], default=0)
    return min(parts, jobs) * peak


def scatter_fragments(frags: np.ndarray, sites: Sequence[PoolSite], mpf: Sequence[bool],
                      offsets: Sequence[tuple[int, ...] | None], dense: np.ndarray) -> None:
    """Write the fragments ``frags`` ``(F, C, *J)`` of one input (``F`` = the product of the MPF layers'
    kernels) into the dense tile ``dense`` ``(C, *(P·J))``: dense index ``Σ_l o_l·s_l + P·j`` per axis, with
    ``o_l`` running over every offset for an MPF layer and fixed to ``offsets[l]`` for a plain one."""
    nd = dense.ndim - 1
    C, J = frags.shape[1], frags.shape[2:]
    mpf_sites = [s for s, m in zip(sites, mpf) if m]
    lm = len(mpf_sites)
    src = frags.reshape(tuple(k for s in mpf_sites for k in s.kernel) + (C,) + tuple(J))
    perm = [lm * nd] + [v for a in range(nd) for v in [lm * nd + 1 + a] + [q * nd + a for q in reversed(range(lm))]]
    src = src.transpose(perm)
    view_shape = (C,) + tuple(v for a in range(nd) for v in (J[a],) + tuple(s.kernel[a] for s in reversed(sites)))
    view = dense.reshape(view_shape)
    if not np.shares_memory(view, dense):  # pragma: no cover - dense is contiguous
        raise RuntimeError("dense tile must be contiguous")
    index: list[Any] = [slice(None)]
    for a in range(nd):
        index.append(slice(None))
        for l in reversed(range(len(sites))):
            index.append(slice(None) if mpf[l] else int(offsets[l][a]))  # type: ignore[index]
    view[tuple(index)] = src


def _kernel_of(p: pb.PoolingParameter, nd: int) -> tuple[int, ...]:
    if len(p.kernel_nd):
        k = tuple(int(v) for v in p.kernel_nd)
    elif p.HasField("kernel_h") or p.HasField("kernel_w"):
        k = (int(p.kernel_h), int(p.kernel_w))
    elif p.HasField("kernel_size"):
        k = (int(p.kernel_size),)
    else:
        raise ParamError("pooling_param.kernel_size", "max-pooling fragments need a kernel")
    return k * nd if len(k) == 1 else k


@register(MPF_TYPE)
class MaxPoolingFragments(Layer):
    """Max-pooling fragments (a cct-only layer type, used in the nets ``cct infer`` rewrites; see the module
    docstring): bottom ``(S, C, *n)`` with ``(n + 1) mod p = 0`` → top ``(S·P, C, *(n // p))``.

    Parameters: ``pooling_param`` as the Pooling layer it replaces — ``pool`` MAX (or AVE), the kernel
    (``kernel_size``, ``kernel_h``/``kernel_w`` or ``kernel_nd``), stride equal to it (or unset), no padding.
    Forward only: inference nets do not back-propagate (the base class refuses a gradient request)."""

    exact_num_bottom = 1
    exact_num_top = 1
    allow_in_place = False
    batch_separable = True

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.pooling_param
        nd = bottom[0].num_axes - 2
        if nd < 1:
            raise ParamError("bottom", f"max-pooling fragments need (N, C, *spatial), got {bottom[0].shape_string()}")
        if p.pool not in (pb.PoolingParameter.MAX, pb.PoolingParameter.AVE):
            raise ParamError("pooling_param.pool", "max-pooling fragments: MAX or AVE pooling only")
        self.kernel = _kernel_of(p, nd)
        stride = tuple(int(v) for v in p.stride_nd) or ((int(p.stride_h), int(p.stride_w))
                                                       if p.HasField("stride_h") else (int(p.stride),))
        stride = stride * nd if len(stride) == 1 else stride
        if (len(p.stride_nd) or p.HasField("stride") or p.HasField("stride_h")) and stride != self.kernel:
            raise ParamError("pooling_param.stride", f"max-pooling fragments need stride == kernel "
                                                     f"({stride} vs {self.kernel})")
        if any(v != 0 for v in p.pad_nd) or p.pad or p.pad_h or p.pad_w:
            raise ParamError("pooling_param.pad", "max-pooling fragments take no padding")
        self.method = p.pool

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        S, C, *n = bottom[0].shape
        if len(n) != len(self.kernel) or any((v + 1) % k for v, k in zip(n, self.kernel)):
            raise CctError(f"layer '{self.name}' ({MPF_TYPE}): input {'x'.join(map(str, n))} + 1 is not a "
                           f"multiple of the kernel {'x'.join(map(str, self.kernel))}")
        top[0].reshape((S * math.prod(self.kernel), C) + tuple(v // k for v, k in zip(n, self.kernel)))

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        fragment_pool(bottom[0].data, self.kernel, self.method, out=top[0].data)
