"""Layer pairs the serial executor runs as one step: the same numbers as the two layers one after the other,
with one pass less over the blob between them.

* backward, ``ReLU → Pooling``: the ReLU in place with ``negative_slope`` 0 on the only bottom of a MAX pooling
  right after it (no mask top), its blob read by no other layer — the pooling routes each window's gradient
  times whether the window's maximum is above 0 (that maximum *is* the ReLU's output at the cell the gradient
  goes to, so this is the ReLU's ``dy · (y > 0)``, non-finite gradients included:
  :meth:`cct.layers.pooling.Pooling.backward_rectified`) and the ReLU's backward, a pass over the pooling's
  whole input, is not run (CaffeNet's pool1, 32 images on one core: 6.9 instead of 5.3 + 4.4 ms).

* forward, ``BatchNorm → Scale``: a per-channel Scale in place on the top of a BatchNorm right before it, no loss
  weight on either.  With the compiled kernels one pass normalizes, keeps the normalized values (BatchNorm's copy
  for its backward with batch statistics, which is exactly the Scale's input, or the Scale's own copy) and writes
  the scaled top (:meth:`cct.layers.normalization.BatchNormLayer.forward_scaled`; a ResNet block's pair,
  32x64x56x56: 1.5 instead of 1.7 + 1.2 ms, one core); otherwise the Scale keeps its input in BatchNorm's copy
  instead of one of its own (:meth:`cct.layers.scale.ScaleLayer.input_kept_in`).  Either way a blob-sized buffer
  less per pair with batch statistics (Inception-v3's 94 pairs, batch 16: 547 MiB).  A plain ReLU in place right
  after the Scale (ResNet's and MobileNet's BatchNorm, Scale, ReLU) joins that pass: numpy's ``maximum(·, 0)`` on
  each scaled value as it is written — its backward reads only the top, which is the same — instead of a pass of
  its own over the blob (:func:`rectified_scales`).

* forward, ``Eltwise → ReLU``: a plain ReLU in place on the top of an Eltwise sum of two bottoms right before it
  (ResNet's block outputs): one compiled pass adds and rectifies (:func:`rectified_sums`); the sum's backward
  does not read the top.

* forward, ``Convolution → ReLU``: a plain ReLU in place on the only top of a Convolution right before it (CaffeNet,
  AlexNet, VGG, GoogLeNet): the engine rectifies each value as it writes it — in the panel GEMM's tiles, in the
  compiled move of a lowering's output into images first, in the FFT's compiled bias pass, after an image's or a
  chunk's bias while it is in the cache (:meth:`cct.engines.base.ConvEngine.forward_rectified`;
  :func:`rectified_convs`) — and the ReLU's own pass over the top is not run (CaffeNet on a 16-core Xeon: 8.0 ms
  of ReLU forwards in a 443 ms iteration).  Neither layer's backward changes (the ReLU's reads the top, which is
  the same).

* backward, ``BatchNorm → Scale (→ ReLU)``: the same run (the forward pair, and the plain ReLU after it where there
  is one) backward block by block through the three layers — the ReLU's mask, the Scale's sums and product, the
  BatchNorm's sums (with global statistics its whole gradient) on each cache-sized block in turn, then the
  BatchNorm's last pass — instead of a pass over the blob each
  (:meth:`cct.layers.normalization.BatchNormLayer.backward_scaled`; MobileNet's 16x32x112x112 with batch
  statistics: 13.6 instead of 16.2 ms).  The same kernels on the same values: the bits of the layers one by one.

(One read for the Scale's and BatchNorm's sums together — BatchNorm's sums taken of ``dy·s`` formed in registers
to keep the bits — measured slower than the two layers: four double-precision sums a value cost more than the
pass they save, 6.6 against 3.7 ms on a ResNet block.)

(The ``Convolution → ReLU`` pair with the ReLU applied to each chunk of the convolution's output after the
convolution's own passes over it, measured once on 2 cores, was no faster than the ReLU's own pass over the whole
output, which found much of it still in the last-level cache; folded into the passes that write the output, it
is a pass less.)

A pair runs fused only inside a pass that covers both of its layers, and only when nothing looks at the
blob in between: no per-layer callbacks (pycaffe's, a data-parallel replica's) and no ``debug_info`` (whose
lines print each layer's own result).  Loss layers never pair (a pair's layers have no loss weight).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
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


def rectified_scales(net: NetCore, pairs: dict[int, int]) -> dict[int, int]:
    """Scale layer index (of ``pairs``, :func:`forward_pairs`) -> the index of the plain in-place ReLU right after
    it on its blob, whose forward the pair's compiled pass does too."""
    out = {}
    for j in pairs:
        if j + 1 < len(net.layers) and _plain_relu(net, j + 1) == net._top_id_vecs[j][0]:
            out[j] = j + 1
    return out


def rectified_sums(net: NetCore) -> dict[int, int]:
    """Eltwise layer index -> the index of the plain in-place ReLU right after it on its top (ResNet's block
    outputs), for the sums the Eltwise's own pass takes (:meth:`cct.layers.eltwise.EltwiseLayer.sums_two`), whose
    forward that pass does (:meth:`~cct.layers.eltwise.EltwiseLayer.forward_rectified`, where the kernels take the
    arrays)."""
    out = {}
    for i in range(len(net.layers) - 1):
        layer = net.layers[i]
        if (layer.type == "Eltwise" and layer.sums_two() and not any(layer._loss)
                and _plain_relu(net, i + 1) == net._top_id_vecs[i][0]):
            out[i] = i + 1
    return out


def rectified_convs(net: NetCore) -> dict[int, int]:
    """Convolution layer index -> the index of the plain in-place ReLU right after it on its only top, for the
    convolution's engine to rectify its output as it writes it
    (:meth:`cct.layers.conv.Convolution.forward_rectified`)."""
    out = {}
    for i in range(len(net.layers) - 1):
        layer = net.layers[i]
        if (layer.type == "Convolution" and not any(layer._loss) and len(net._top_id_vecs[i]) == 1
                and _plain_relu(net, i + 1) == net._top_id_vecs[i][0]):
            out[i] = i + 1
    return out


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
