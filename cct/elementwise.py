"""Element-wise operations that layers and convolution engines share: the ReLU's ``max(x, 0)`` (the ReLU layer's
forward, and a convolution's output rectified where an in-place ReLU follows it: :mod:`cct.exec.fusion`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from cct.device import get_array_module
from cct.runtime.partition import run_batch

# numpy runs ``maximum`` of two arrays in its vector loop but ``maximum`` with a scalar operand element by element
# (numpy 2.4, float32: 4x the time in the cache, CaffeNet's relu1 over 74 MB 2.9 -> 2.0 ms on one core), so
# :func:`relu_into` compares with a row of zeros this long, broadcast over the array's rows
ZERO_ROW = 4096
_zero_rows: dict[Any, Any] = {}


def relu_into(x: Any, out: Any) -> Any:
    """``out = max(x, 0)`` (NaN stays NaN, as Caffe's ``std::max(x, 0)``); ``x`` and ``out`` may be one array."""
    xp = get_array_module(x)
    n = x.size
    if xp is not np or n < ZERO_ROW or not (x.flags.c_contiguous and out.flags.c_contiguous):
        return xp.maximum(x, 0, out=out)
    zeros = _zero_rows.get(x.dtype)
    if zeros is None:
        zeros = _zero_rows[x.dtype] = np.zeros(ZERO_ROW, x.dtype)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    whole = n - n % ZERO_ROW
    np.maximum(flat_x[:whole].reshape(-1, ZERO_ROW), zeros, out=flat_out[:whole].reshape(-1, ZERO_ROW))
    if whole < n:
        np.maximum(flat_x[whole:], zeros[:n - whole], out=flat_out[whole:])
    return out


def rectify(y: Any) -> Any:
    """``y = max(y, 0)`` in place (:func:`relu_into`), over the batch partitions as the ReLU layer runs it."""
    if y.ndim == 0:
        return relu_into(y, y)
    run_batch(y.shape[0], lambda _p, a, b: relu_into(y[a:b], y[a:b]), work=y.size / max(y.shape[0], 1))
    return y
