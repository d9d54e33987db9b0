"""Layer pairs the serial executor runs as one step: the same numbers as the two layers one after the other,
with one pass less over the blob between them.

* backward, ``ReLU → Pooling``: the ReLU in place with ``negative_slope`` 0 on the only bottom of a MAX pooling
  right after it (no mask top), its blob read by no other layer — the pooling routes each window's gradient
  times whether the window's maximum is above 0 (that maximum *is* the ReLU's output at the cell the gradient
  goes to, so this is the ReLU's ``dy · (y > 0)``, non-finite gradients included:
  :meth:`cct.layers.pooling.Pooling.backward_rectified`) and the ReLU's backward, a pass over the pooling's
  whole input, is not run (CaffeNet's pool1, 32 images on one core: 6.9 instead of 5.3 + 4.4 ms).

* ``BatchNorm → Scale``: a per-channel Scale in place on the top of a BatchNorm right before it, no loss weight
  on either.  Forward, with the compiled kernels, one pass normalizes, keeps the normalized values (BatchNorm's
  copy for its backward with batch statistics, which is exactly the Scale's input, or the Scale's own copy) and
  writes the scaled top (:func:`normalize_and_scale`); otherwise the Scale keeps its input in BatchNorm's copy
  instead of one of its own (:meth:`cct.layers.scale.ScaleLayer.input_kept_in`): a blob-sized buffer less per
  pair (Inception-v3's 94 pairs, batch 16: 547 MiB).  Backward, BatchNorm in place, one read takes the Scale's
  sums and BatchNorm's (of the Scale's data gradient, ``dy·s``, formed in registers) and one pass writes
  BatchNorm's data gradient (:func:`scaled_normalize_backward`): the Scale's pass over the gradient is not run.

(A forward ``Convolution → ReLU`` pair, the ReLU applied to each chunk of the convolution's output while in
the cache, measured no faster than the ReLU's own pass over the whole output, which finds much of it still in
the last-level cache.)

A pair runs fused only inside a pass that covers both of its layers, and only when nothing looks at the
blob in between: no per-layer callbacks (pycaffe's, a data-parallel replica's) and no ``debug_info`` (whose
lines print each layer's own result).  Loss layers never pair (a pair's layers have no loss weight).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cct import native
from cct.device import get_array_module
from cct.runtime.partition import run_channel_blocks

if TYPE_CHECKING:  # pragma: no cover
    from cct.blob import Blob
    from cct.net import NetCore


def _plain_relu(net: NetCore, i: int) -> int | None:
    """The blob id layer ``i`` rectifies in place with slope 0 and no loss weight, else None."""
    layer = net.layers[i]
    if layer.type != "ReLU" or getattr(layer, "negative_slope", None) != 0.0 or any(layer._loss):
        return None
    bottoms, tops = net._bottom_id_vecs[i], net._top_id_vecs[i]
    if len(bottoms) != 1 or bottoms != tops:
        return None
    return bottoms[0]


def backward_pairs(net: NetCore) -> dict[int, int]:
    """MAX Pooling layer index -> the index of the ReLU whose backward its own backward does."""
    pairs = {}
    for j in range(1, len(net.layers)):
        pool = net.layers[j]
        absorbs = getattr(pool, "absorbs_relu_backward", None)
        if absorbs is None or not absorbs(net.top_vecs[j]) or any(pool._loss):
            continue
        blob = _plain_relu(net, j - 1)
        if blob is None or net._bottom_id_vecs[j] != [blob]:
            continue
        readers = [k for k in range(j - 1, len(net.layers)) if blob in net._bottom_id_vecs[k]]
        if readers == [j - 1, j]:
            pairs[j] = j - 1
    return pairs


def forward_pairs(net: NetCore) -> dict[int, int]:
    """Scale layer index -> the index of the BatchNorm right before it whose kept top is the Scale's input."""
    pairs = {}
    for j in range(1, len(net.layers)):
        scale, norm = net.layers[j], net.layers[j - 1]
        if scale.type != "Scale" or norm.type != "BatchNorm" or any(scale._loss) or any(norm._loss):
            continue
        blob = net._top_id_vecs[j - 1]
        if len(blob) == 1 and net._bottom_id_vecs[j] == blob and net._top_id_vecs[j] == blob:
            pairs[j] = j - 1
    return pairs


def _scaled_views(norm: Any, scale: Any, blob: Blob) -> tuple[Any, Any, Any] | None:
    """The Scale's learned operand and bias as (C,) vectors, with its scale diff, when it applies per channel of
    the BatchNorm's ``(N, C, S)`` view of ``blob``; else None."""
    if not scale._per_channel([blob]):
        return None
    x = norm._view(blob.data)
    if scale.geometry != x.shape:
        return None
    bias = None if scale.bias_index is None else scale.blobs[scale.bias_index].data.reshape(-1)
    return scale.blobs[0].data.reshape(-1), bias, x


def normalize_and_scale(norm: Any, scale: Any, bottom: Blob, top: Blob) -> bool:
    """``norm``'s forward on ``bottom`` into ``top`` then ``scale``'s in place on ``top``, in one pass of the compiled
    kernels, the normalized values kept where each layer's backward reads them; False, nothing done, where the
    kernels do not take the arrays or the Scale is not per channel."""
    views = _scaled_views(norm, scale, top)
    if views is None:
        return False
    s, bias, y = views
    x = norm._view(bottom.data)
    kept = norm.kept_output()
    kept = scale._own_copy(top.data) if kept is None else kept
    copy = norm._view(kept)
    compiled = native.kernels_for(x, y, copy, s, *(() if bias is None else (bias,)))
    if compiled is None:
        return False
    mean, std = norm.forward_statistics(bottom)
    if get_array_module(mean) is not np or mean.dtype != x.dtype:
        mean, std = np.asarray(mean, dtype=x.dtype), np.asarray(std, dtype=x.dtype)
    cells = x.shape[2]
    run_channel_blocks(x, lambda _p, i, c: compiled.normalize_scale_rows(
        x[i, c], mean[c], std[c], s[c], None if bias is None else bias[c], y[i, c], copy[i, c], cells))
    scale.input_kept_in(None)
    scale._saved = kept
    return True


def scaled_normalize_backward(norm: Any, scale: Any, blob: Blob, bottom: Blob) -> bool:
    """``scale``'s backward (in place on ``blob``, its data gradient asked for) then ``norm``'s (in place, from
    ``blob`` into ``bottom`` — the same blob): the Scale's parameter gradients and BatchNorm's sums in one read of
    the gradient and the normalized values, BatchNorm's data gradient in one pass; the bits of the two layers'
    backward passes.  False, nothing done, where the kernels do not take the arrays."""
    views = _scaled_views(norm, scale, blob)
    if views is None or bottom is not blob or scale._saved is None:
        return False
    if not norm.use_global_stats and scale._saved is not norm.kept_output():
        return False  # the Scale saw other values than BatchNorm's (a pass that started at the Scale)
    s, _, td = views
    td = norm._view(blob.diff)
    y = norm._view(scale._saved)
    n, c, cells = td.shape
    sums, dots, tsums, tdots = (np.empty((n, c), dtype=td.dtype) for _ in range(4))
    std = norm._std
    compiled = native.kernels_for(td, y, s, std, sums, dots, tsums, tdots)
    if compiled is None:
        return False
    run_channel_blocks(td, lambda _p, i, ch: compiled.scaled_row_sums(
        td[i, ch], y[i, ch], s[ch], sums[i, ch], dots[i, ch], tsums[i, ch], tdots[i, ch], cells))
    scale.add_gradients(sums, dots)
    if norm.use_global_stats:
        run_channel_blocks(td, lambda _p, i, ch: compiled.scaled_normalize_backward_rows(
            td[i, ch], None, s[ch], None, None, std[ch], td[i, ch], cells))
        return True
    m = n * cells
    mean_td = (tsums.sum(axis=0, dtype=np.float64) / m).astype(td.dtype)
    mean_tdy = (tdots.sum(axis=0, dtype=np.float64) / m).astype(td.dtype)
    run_channel_blocks(td, lambda _p, i, ch: compiled.scaled_normalize_backward_rows(
        td[i, ch], y[i, ch], s[ch], mean_tdy[ch], mean_td[ch], std[ch], td[i, ch], cells))
    return True
