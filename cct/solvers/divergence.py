"""Divergence: where the first non-finite value of a training iteration came from.

The per-iteration check reads each learnable gradient once: by the compiled kernels' test of every value's
exponent bits (:mod:`cct.native`), a large gradient split over the batch partitions (CaffeNet's 61M gradients on a
2-core Intel Xeon: numpy's sums 26.7 ms, 1.9% of an iteration; this pass 13.6-16.0 ms, 0.8-1.05%:
``benchmarks/divergence_check.py``), else by one reduction per gradient — ``sum(diff)`` is finite exactly when
every element is finite, unless finite values overflow the float32 sum, which the exact element test then
settles.  Only when it fails does :func:`first_nonfinite` walk the net to name the layer: the forward pass in
order (each layer's tops), then the backward pass in reverse order (each layer's parameter gradients and the
gradients it sends to its bottoms).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from cct import native
from cct.device import get_array_module, to_host
from cct.runtime.partition import run_batch

# gradients of at least this many values are tested over the batch partitions (smaller ones in one call: a small
# net's eight, split, took 3x the time of numpy's sums)
SPLIT_MIN_VALUES = 1 << 21


def _finite(a: Any, compiled: Any = None) -> bool:
    """Whether every element of ``a`` is finite (call under ``np.errstate(over="ignore", invalid="ignore")``);
    ``compiled``: :func:`cct.native.kernels`, which test it where they take it."""
    if compiled is not None and native.takes(a):
        flat = a.reshape(-1)
        if flat.size < SPLIT_MIN_VALUES:
            return compiled.all_finite(flat)
        found: list[bool] = []
        run_batch(flat.size, lambda _part, i0, i1: found.append(compiled.all_finite(flat[i0:i1])), work=1.0)
        return all(found)
    xp = get_array_module(a)
    total = np.add.reduce(a.reshape(-1)) if xp is np else xp.sum(a, dtype=a.dtype)  # numpy: no wrapper layers
    return math.isfinite(total) or bool(xp.isfinite(a).all())


def gradients_finite(net: Any) -> bool:
    """True when every learnable parameter's gradient is finite (read where the passes left it: in GPU mode
    on the device, :meth:`cct.exec.base.Executor.newest`)."""
    newest, compiled = net.executor.newest, native.kernels()
    with np.errstate(over="ignore", invalid="ignore"):
        return all(_finite(newest(p, "diff"), compiled) for p in net.learnable_params)


def _first_bad(a: Any) -> str:
    host = np.asarray(to_host(a)).ravel()
    i = int(np.flatnonzero(~np.isfinite(host))[0])
    return f"{host[i]} at element {i}"


def first_nonfinite(net: Any) -> str | None:
    """Where the first non-finite value of the last forward/backward pass is, in words; None if nowhere."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _first_nonfinite(net)


def _first_nonfinite(net: Any) -> str | None:
    names = net._blob_names
    for layer, tops, top_ids in zip(net.layers, net._top_vecs, net._top_id_vecs):
        for blob, bid in zip(tops, top_ids):
            if blob.count and not _finite(blob.data):
                return (f"top '{names[bid]}' of layer '{layer.name}' ({layer.type}) in the forward pass "
                        f"({_first_bad(blob.data)})")
    for index in range(len(net.layers) - 1, -1, -1):
        layer = net.layers[index]
        for k, blob in enumerate(layer.blobs):
            if blob.count and not _finite(blob.diff):
                return (f"gradient of parameter {k} of layer '{layer.name}' ({layer.type}) in the backward pass "
                        f"({_first_bad(blob.diff)})")
        if not net._layer_need_backward[index]:
            continue
        for blob, bid, down in zip(net._bottom_vecs[index], net._bottom_id_vecs[index],
                                   net._bottom_need_backward[index]):
            if down and blob.count and not _finite(blob.diff):
                return (f"gradient of bottom '{names[bid]}' of layer '{layer.name}' ({layer.type}) in the backward "
                        f"pass ({_first_bad(blob.diff)})")
    return None
