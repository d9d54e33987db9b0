"""Loss layers: SoftmaxWithLoss, EuclideanLoss, SigmoidCrossEntropyLoss, HingeLoss,
MultinomialLogisticLoss, InfogainLoss, ContrastiveLoss.

Every class is a :class:`~cct.layers.base.LossLayer`: a scalar (0-axis) top 0 whose diff holds the loss
weight ``w`` (filled by the base class), which the backward pass reads as its scale.  Label blobs hold
float values that are truncated to int as Caffe's ``static_cast<int>`` does; a label outside
``[0, classes)`` that is not the ignore label is refused (Caffe would read out of bounds).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from cct import native
from cct.blob import Blob, blob_from_proto, proto_shape
from cct.device import get_array_module
from cct.errors import CctError, ParamError
from cct.layers.base import Layer, LossLayer
from cct.layers.registry import register
from cct.layers.softmax import canonical_axis, softmax_forward
from cct.proto import caffe_pb2 as pb

FLT_MIN = float(np.finfo(np.float32).tiny)  # SoftmaxWithLoss's clamp before log
LOG_THRESHOLD = 1e-20  # Caffe's kLOG_THRESHOLD (MultinomialLogisticLoss, InfogainLoss)

Norm = pb.LossParameter


# ---- shared helpers --------------------------------------------------------------------------
def normalization_mode(loss_param: pb.LossParameter, default: int) -> int:
    """Caffe's rule: an explicit ``normalization`` wins; else the legacy ``normalize`` bool
    (true → VALID, false → BATCH_SIZE); else ``default``."""
    if loss_param.HasField("normalization"):
        return int(loss_param.normalization)
    if loss_param.HasField("normalize"):
        return Norm.VALID if loss_param.normalize else Norm.BATCH_SIZE
    return default


def get_normalizer(mode: int, outer: int, inner: int, valid_count: int) -> float:
    """FULL = outer·inner, VALID = non-ignored count, BATCH_SIZE = outer, NONE = 1; at least 1."""
    if mode == Norm.FULL:
        value = outer * inner
    elif mode == Norm.VALID:
        value = valid_count
    elif mode == Norm.BATCH_SIZE:
        value = outer
    else:
        value = 1
    return max(1.0, float(value))


def ignore_label_of(param: Any) -> int | None:
    """``param.ignore_label`` if set (loss_param or accuracy_param), else None."""
    return int(param.ignore_label) if param.HasField("ignore_label") else None


def read_labels(layer: Layer, label: Any, shape: tuple[int, ...], num_classes: int,
                ignore_label: int | None) -> tuple[Any, Any, int]:
    """Labels as ints of ``shape`` (truncated toward zero), with ignored positions set to class 0.

    Returns ``(labels, valid, count)``: ``valid`` is a boolean mask (None without an ignore label) and
    ``count`` the number of non-ignored positions.  A label outside ``[0, num_classes)`` that is not
    the ignore label raises CctError naming the value."""
    xp = get_array_module(label)
    lab = label.reshape(shape).astype(np.int64)
    bad = (lab < 0) | (lab >= num_classes)
    valid = None
    if ignore_label is not None:
        valid = lab != ignore_label
        bad &= valid
    if bool(bad.any()):
        value = float(label.reshape(-1)[int(xp.argmax(bad.reshape(-1)))])
        extra = f" and is not the ignore_label {ignore_label}" if ignore_label is not None else ""
        raise CctError(f"layer '{layer.name}' ({layer.type}): label value {value:g} is outside "
                       f"[0, {num_classes}){extra}")
    if valid is None:
        return lab, None, lab.size
    lab = xp.where(valid, lab, 0)
    return lab, valid, int(valid.sum())


def label_geometry(layer: Layer, bottom: list[Blob], axis_param: int, field: str) -> tuple[int, int, int, int]:
    """``(axis, outer, inner, classes)`` of scores ``bottom[0]`` classified along ``axis_param``; one label per
    (outer, inner) position is required of ``bottom[1]``."""
    axis = canonical_axis(bottom[0], axis_param, field)
    outer, inner = bottom[0].count_range(0, axis), bottom[0].count_range(axis + 1)
    if outer * inner != bottom[1].count:
        raise CctError(
            f"layer '{layer.name}': number of labels must match number of predictions: prediction "
            f"shape {bottom[0].shape_string()} with axis {axis} needs {outer * inner} "
            f"labels, got {bottom[1].count} ({bottom[1].shape_string()})")
    return axis, outer, inner, bottom[0].shape[axis]


def _num(blob: Blob) -> int:
    """Caffe's ``num()``: shape(0), or 1 for a 0-axis blob."""
    return blob.shape[0] if blob.num_axes else 1


def _grid(xp: Any, outer: int, inner: int) -> tuple[Any, Any]:
    """Index arrays that, with a label array (outer, inner), pick ``x[o, label[o, i], i]``."""
    return xp.arange(outer)[:, None], xp.arange(inner)[None, :]


def _no_label_backprop(layer: Layer, propagate_down: Sequence[bool]) -> None:
    if propagate_down[1]:
        raise CctError(f"layer '{layer.name}': {layer.type} Layer cannot backpropagate to label inputs")


class _SoftmaxLabelLoss(LossLayer):
    """Shared setup for the losses that apply a softmax over ``axis`` and read one label per
    (outer, inner) position: SoftmaxWithLoss and InfogainLoss.  The optional top 1 is the softmax."""

    exact_num_top = None
    min_top = 1
    max_top = 2
    axis_field = "softmax_param.axis"

    def _setup_common(self, bottom: list[Blob], axis: int) -> None:
        lp = self.layer_param.loss_param
        self.ignore_label = ignore_label_of(lp)
        self.axis_param = int(axis)
        self.prob = Blob((), xp=bottom[0].xp, dtype=bottom[0].dtype)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        super().reshape(bottom, top)
        self.axis, self.outer, self.inner, self.classes = label_geometry(self, bottom, self.axis_param,
                                                                         self.axis_field)
        self.prob.reshape(bottom[0].shape)
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)

    def _labels(self, bottom: list[Blob]) -> tuple[Any, Any, int]:
        return read_labels(self, bottom[1].data, (self.outer, self.inner), self.classes, self.ignore_label)

    def _forward_prob(self, bottom: list[Blob], top: list[Blob]) -> Any:
        p = softmax_forward(bottom[0].data, self.axis, self.prob.data)
        if len(top) >= 2:
            top[1].share_data(self.prob)  # Caffe: top[1]->ShareData(prob_)
        return p.reshape(self.outer, self.classes, self.inner)


# ---- SoftmaxWithLoss -------------------------------------------------------------------------
@register("SoftmaxWithLoss")
class SoftmaxWithLoss(_SoftmaxLabelLoss):
    """Softmax followed by the multinomial logistic loss, in one numerically stable layer.

    ``p = softmax(x)`` along ``softmax_param.axis`` (default 1);
    ``loss = -Σ_{valid (o,i)} log(max(p[o, label[o,i], i], FLT_MIN)) / normalizer``;
    ``dx = (p - onehot(label)) · w / normalizer`` (0 at ignored positions).

    Bottoms: x (outer × C × inner), labels (count outer·inner, values in [0, C)).
    Tops: loss (scalar); optional probabilities p (shape of x; then give one loss_weight per top).
    Parameters: ``softmax_param.axis``; ``loss_param.ignore_label``; ``loss_param.normalization``
    (FULL, VALID (default), BATCH_SIZE, NONE; legacy ``normalize``: true → VALID, false →
    BATCH_SIZE); the normalizer is at least 1.  No gradient to the labels.
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        lp = self.layer_param.loss_param
        self._setup_common(bottom, self.layer_param.softmax_param.axis)
        self.normalization = normalization_mode(lp, int(lp.normalization))

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        p3 = self._forward_prob(bottom, top)
        lab, valid, count = self._labels(bottom)
        oi, ii = _grid(xp, self.outer, self.inner)
        logp = xp.log(xp.maximum(p3[oi, lab, ii], FLT_MIN))
        if valid is not None:
            logp *= valid
        norm = get_normalizer(self.normalization, self.outer, self.inner, count)
        top[0].data[...] = -logp.sum() / norm

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        if self._backward_compiled(top, bottom):
            return
        xp = get_array_module(bottom[0].data)
        lab, valid, count = self._labels(bottom)
        scale = top[0].diff / get_normalizer(self.normalization, self.outer, self.inner, count)
        # Caffe's (p - onehot) · scale in one pass over the scores: p · scale, then the label entries
        # (p - 1) · scale from the probabilities themselves (the same roundings as Caffe's copy, subtract, scale)
        oi, ii = _grid(xp, self.outer, self.inner)
        at_label = self.prob.data.reshape(self.outer, self.classes, self.inner)[oi, lab, ii]
        bd = bottom[0].diff
        xp.multiply(self.prob.data, scale, out=bd)
        bd3 = bd.reshape(self.outer, self.classes, self.inner)
        bd3[oi, lab, ii] = (at_label - 1) * scale
        if valid is not None:
            bd3 *= valid[:, None, :]

    def _backward_compiled(self, top: list[Blob], bottom: list[Blob]) -> bool:
        """The gradient in two compiled passes (the labels counted, then one over the scores), where the kernels
        take the arrays: the numpy body's values without its dozen short numpy calls (64 x 1000 scores: 88 -> 39
        us; LeNet's 64 x 10: 26 -> 9 us).  False: the numpy body runs, and reports a label out of range."""
        label, dx = bottom[1].data, bottom[0].diff
        compiled = native.kernels_for(self.prob.data, label, dx)
        if compiled is None:
            return False
        count = compiled.label_count(label, self.classes, self.ignore_label)
        if count < 0:
            return False
        scale = top[0].diff / get_normalizer(self.normalization, self.outer, self.inner, count)
        compiled.softmax_loss_backward(self.prob.data, label, dx, (self.outer, self.classes, self.inner),
                                       float(scale), self.ignore_label)
        return True


# ---- InfogainLoss ----------------------------------------------------------------------------
def read_blobproto_file(path: str, field: str, xp: Any, dtype: Any) -> Blob:
    """A Blob from a binaryproto BlobProto file; problems raise ParamError(field)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ParamError(field, f"cannot read '{path}': {e.strerror or e}") from e
    proto = pb.BlobProto()
    try:
        proto.ParseFromString(raw)
    except DecodeError as e:
        raise ParamError(field, f"'{path}' is not a binary BlobProto file ({e})") from e
    return blob_from_proto(proto, Blob(proto_shape(proto), xp=xp, dtype=dtype))


@register("InfogainLoss")
class InfogainLoss(_SoftmaxLabelLoss):
    """Infogain loss: a softmax, then the log-probabilities weighted by a row of a matrix H.

    ``p = softmax(x)`` along ``infogain_loss_param.axis`` (default 1);
    ``loss = -Σ_{valid (o,i)} Σ_l H[label, l] · log(max(p[o,l,i], 1e-20)) / normalizer``;
    ``dx[o,l,i] = (p[o,l,i] · Σ_l' H[label,l'] - H[label,l]) · w / normalizer`` (0 where ignored).
    With H = identity this is SoftmaxWithLoss (up to the clamp).

    Bottoms: x (outer × C × inner), labels (count outer·inner), optional H (count C·C).
    Tops: loss (scalar); optional probabilities p.
    Parameters: ``infogain_loss_param.source`` (binaryproto BlobProto holding H, required without a
    third bottom), ``infogain_loss_param.axis``; ``loss_param.ignore_label``,
    ``loss_param.normalization`` (default VALID; the legacy ``normalize`` is refused, as in Caffe).
    No gradient to the labels or to H.
    """

    min_bottom = 2
    max_bottom = 3
    exact_num_bottom = None
    axis_field = "infogain_loss_param.axis"

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        lp = self.layer_param.loss_param
        ip = self.layer_param.infogain_loss_param
        if lp.HasField("normalize"):
            raise ParamError("loss_param.normalize", "normalize is deprecated for InfogainLoss; "
                                                     "use loss_param.normalization")
        self._setup_common(bottom, ip.axis)
        self.normalization = int(lp.normalization)
        self.infogain: Blob | None = None
        if len(bottom) < 3:
            if not ip.source:
                raise ParamError("infogain_loss_param.source", "Infogain matrix source must be specified "
                                                               "(or give H as a third bottom)")
            self.infogain = read_blobproto_file(ip.source, "infogain_loss_param.source",
                                                bottom[0].xp, bottom[0].dtype)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        super().reshape(bottom, top)
        h = self._h_blob(bottom)
        if h.count != self.classes ** 2:
            raise CctError(f"layer '{self.name}': the infogain matrix H has {h.count} values "
                           f"({h.shape_string()}); {self.classes} labels need {self.classes}x{self.classes}")

    def allow_force_backward(self, bottom_index: int) -> bool:
        # Caffe permits it for H and then aborts in Backward; we simply never force it there.
        return bottom_index == 0

    def _h_blob(self, bottom: list[Blob]) -> Blob:
        return self.infogain if self.infogain is not None else bottom[2]

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        p3 = self._forward_prob(bottom, top)
        lab, valid, count = self._labels(bottom)
        h = self._h_blob(bottom).data.reshape(self.classes, self.classes)
        logp = xp.log(xp.maximum(p3, LOG_THRESHOLD))
        # per position: Σ_l H[label, l] · log p_l
        per_pos = (h[lab].transpose(0, 2, 1) * logp).sum(axis=1)
        if valid is not None:
            per_pos *= valid
        norm = get_normalizer(self.normalization, self.outer, self.inner, count)
        top[0].data[...] = -per_pos.sum() / norm

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        _no_label_backprop(self, propagate_down)
        if len(propagate_down) > 2 and propagate_down[2]:
            raise CctError(f"layer '{self.name}': InfogainLoss Layer cannot backpropagate into the "
                           f"infogain matrix")
        if not propagate_down[0]:
            return
        lab, valid, count = self._labels(bottom)
        h = self._h_blob(bottom).data.reshape(self.classes, self.classes)
        row_sums = h.sum(axis=1)
        p3 = self.prob.data.reshape(self.outer, self.classes, self.inner)
        bd3 = bottom[0].diff.reshape(self.outer, self.classes, self.inner)
        bd3[...] = p3 * row_sums[lab][:, None, :]
        bd3 -= h[lab].transpose(0, 2, 1)
        if valid is not None:
            bd3 *= valid[:, None, :]
        bd3 *= top[0].diff / get_normalizer(self.normalization, self.outer, self.inner, count)


# ---- EuclideanLoss ---------------------------------------------------------------------------
@register("EuclideanLoss")
class EuclideanLoss(LossLayer):
    """``loss = Σ (a - b)² / (2N)``; ``da = w (a - b) / N``, ``db = -w (a - b) / N``.

    Bottoms: a (N × …), b (N × …) with equal count(1) (shapes may differ otherwise).
    Top: loss (scalar).  Both bottoms take gradients (and force_backward reaches both).
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.diff: Any = None

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        super().reshape(bottom, top)
        if bottom[0].count_range(1) != bottom[1].count_range(1):
            raise CctError(f"layer '{self.name}': EuclideanLoss inputs must have the same dimension "
                           f"({bottom[0].shape_string()} vs {bottom[1].shape_string()})")
        d = self.diff
        if d is None or d.shape != bottom[0].shape or d.dtype != bottom[0].dtype:
            self.diff = bottom[0].xp.zeros(bottom[0].shape, dtype=bottom[0].dtype)

    def allow_force_backward(self, bottom_index: int) -> bool:
        return True

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        xp.subtract(bottom[0].data, bottom[1].data.reshape(bottom[0].shape), out=self.diff)
        flat = self.diff.reshape(-1)
        top[0].data[...] = xp.dot(flat, flat) / _num(bottom[0]) / 2

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                alpha = top[0].diff * (sign / _num(bottom[i]))
                xp.multiply(self.diff.reshape(bottom[i].shape), alpha, out=bottom[i].diff)


# ---- SigmoidCrossEntropyLoss -----------------------------------------------------------------
@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(LossLayer):
    """Cross-entropy of sigmoid(x) against targets t in [0, 1], computed stably from the logits.

    ``loss = Σ_{valid} (max(x, 0) - x·t + log(1 + exp(-|x|))) / normalizer``
    (Caffe's form ``-(x·(t - [x≥0]) - log(1 + exp(x - 2x·[x≥0])))``);
    ``dx = (sigmoid(x) - t) · w / normalizer`` (0 where ignored).

    Bottoms: x (N × …), t (same count).  Top: loss (scalar).
    Parameters (``loss_param``): ``ignore_label`` (compared with int(t)); ``normalization`` — FULL
    (count), VALID (non-ignored count), BATCH_SIZE (N; the default when neither ``normalization`` nor
    ``normalize`` is given), NONE; legacy ``normalize``: true → VALID, false → BATCH_SIZE.
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        lp = self.layer_param.loss_param
        self.ignore_label = ignore_label_of(lp)
        self.normalization = normalization_mode(lp, Norm.BATCH_SIZE)
        self.normalizer = 1.0

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            raise CctError(f"layer '{self.name}': SigmoidCrossEntropyLoss inputs must have the same count "
                           f"({bottom[0].shape_string()} vs {bottom[1].shape_string()})")
        self.outer = _num(bottom[0])
        self.inner = bottom[0].count // self.outer if self.outer else 0

    def _valid(self, t: Any) -> Any:
        return None if self.ignore_label is None else t.astype(np.int64) != self.ignore_label

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        x = bottom[0].data
        t = bottom[1].data.reshape(x.shape)
        el = xp.maximum(x, 0) - x * t + xp.log1p(xp.exp(-xp.abs(x)))
        valid = self._valid(t)
        if valid is None:
            loss, count = el.sum(), x.size
        else:
            loss, count = xp.where(valid, el, 0).sum(), int(valid.sum())
        # Caffe keeps the forward's normalizer for the backward pass.
        self.normalizer = get_normalizer(self.normalization, self.outer, self.inner, count)
        top[0].data[...] = loss / self.normalizer

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        xp = get_array_module(bottom[0].data)
        x, bd = bottom[0].data, bottom[0].diff
        t = bottom[1].data.reshape(x.shape)
        # sigmoid as Caffe's SigmoidLayer computes it: 0.5·tanh(0.5x) + 0.5
        xp.multiply(x, 0.5, out=bd)
        xp.tanh(bd, out=bd)
        bd *= 0.5
        bd += 0.5
        bd -= t
        valid = self._valid(t)
        if valid is not None:
            bd *= valid
        bd *= top[0].diff / self.normalizer


# ---- HingeLoss -------------------------------------------------------------------------------
@register("HingeLoss")
class HingeLoss(LossLayer):
    """One-vs-all hinge loss.

    With ``s_nj = -1`` if j = label_n else +1 and ``d_nj = max(0, 1 + s_nj · x_nj)`` (x viewed as
    N × dim): L1 ``loss = Σ d / N``, ``dx = s · [d > 0] · w / N``; L2 ``loss = Σ d² / N``,
    ``dx = 2 s · d · w / N``.

    Bottoms: x (N × …), labels (label n read from element n, values in [0, dim)).
    Top: loss (scalar).  Parameter: ``hinge_loss_param.norm`` (L1 default, L2).
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.norm = int(self.layer_param.hinge_loss_param.norm)
        self.margins: Any = None

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        super().reshape(bottom, top)
        n = _num(bottom[0])
        if bottom[1].count < n:
            raise CctError(f"layer '{self.name}': HingeLoss needs {n} labels, got {bottom[1].count}")

    def _labels(self, bottom: list[Blob]) -> tuple[Any, int, int]:
        n = _num(bottom[0])
        dim = bottom[0].count // n if n else 0
        lab, _, _ = read_labels(self, bottom[1].data.reshape(-1)[:n], (n,), dim, None)
        return lab, n, dim

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        lab, n, dim = self._labels(bottom)
        rows = xp.arange(n)
        d = bottom[0].data.reshape(n, dim).copy()
        d[rows, lab] *= -1
        d += 1
        xp.maximum(d, 0, out=d)
        self.margins = d
        loss = d.sum() if self.norm == pb.HingeLossParameter.L1 else xp.dot(d.reshape(-1), d.reshape(-1))
        top[0].data[...] = loss / n

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        xp = get_array_module(bottom[0].data)
        lab, n, dim = self._labels(bottom)
        bd = bottom[0].diff.reshape(n, dim)
        if self.norm == pb.HingeLossParameter.L1:
            bd[...] = self.margins > 0  # Caffe: sign(d), which is 0 at d = 0
            scale = top[0].diff / n
        else:
            bd[...] = self.margins
            scale = top[0].diff * (2.0 / n)
        bd[xp.arange(n), lab] *= -1
        bd *= scale


# ---- MultinomialLogisticLoss -----------------------------------------------------------------
@register("MultinomialLogisticLoss")
class MultinomialLogisticLoss(LossLayer):
    """Negative log-likelihood of given probabilities.

    ``loss = -Σ_n log(max(p[n, label_n], 1e-20)) / N``; ``dp[n, label_n] = -w / (N · max(p, 1e-20))``,
    0 elsewhere.

    Bottoms: p (N × dim probabilities), labels (N; all dims after the first must be 1).
    Top: loss (scalar).
    """

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        super().reshape(bottom, top)
        if any(d != 1 for d in bottom[1].shape[1:]):
            raise CctError(f"layer '{self.name}': MultinomialLogisticLoss labels must be N x 1 x 1 x 1, "
                           f"got {bottom[1].shape_string()}")

    def _picked(self, bottom: list[Blob]) -> tuple[Any, Any, int, int]:
        xp = get_array_module(bottom[0].data)
        n = _num(bottom[0])
        dim = bottom[0].count // n if n else 0
        lab, _, _ = read_labels(self, bottom[1].data, (n,), dim, None)
        p = bottom[0].data.reshape(n, dim)[xp.arange(n), lab]
        return lab, xp.maximum(p, LOG_THRESHOLD), n, dim

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        _, p, n, _ = self._picked(bottom)
        top[0].data[...] = -xp.log(p).sum() / n

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        xp = get_array_module(bottom[0].data)
        lab, p, n, dim = self._picked(bottom)
        bd = bottom[0].diff.reshape(n, dim)
        bd[...] = 0
        bd[xp.arange(n), lab] = -top[0].diff / n / p


# ---- ContrastiveLoss -------------------------------------------------------------------------
@register("ContrastiveLoss")
class ContrastiveLoss(LossLayer):
    """Contrastive loss of pairs (Hadsell, Chopra, LeCun 2006).

    ``d_n = ||a_n - b_n||``; similar pairs (int(y_n) ≠ 0) add ``d²``; dissimilar ones add
    ``max(margin - d, 0)²`` (``legacy_version``: ``max(margin - d², 0)``); ``loss = Σ / (2N)``.
    Gradient wrt a (α = w / N): similar ``α (a - b)``; dissimilar ``-α (margin - d) / (d + 1e-4) (a - b)``
    where ``margin - d > 0`` (legacy: ``-α (a - b)`` where ``margin - d² > 0``), else 0; wrt b the
    negative.  (The ``1e-4`` guard is Caffe's.)

    Bottoms: a (N × C × 1 × 1), b (N × C × 1 × 1), y (N × 1 × 1 × 1).  Top: loss (scalar).
    Parameters (``contrastive_loss_param``): ``margin`` (1), ``legacy_version`` (false).
    """

    exact_num_bottom = 3

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        cp = self.layer_param.contrastive_loss_param
        self.margin = float(cp.margin)
        self.legacy = bool(cp.legacy_version)
        self.diff: Any = None

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        super().reshape(bottom, top)
        a, b, y = bottom
        ok = (a.num_axes >= 2 and b.num_axes >= 2 and a.shape[1] == b.shape[1]
              and all(d == 1 for d in a.shape[2:] + b.shape[2:] + y.shape[1:]) and y.count == _num(a))
        if not ok:
            raise CctError(f"layer '{self.name}': ContrastiveLoss needs bottoms N x C x 1 x 1, "
                           f"N x C x 1 x 1, N x 1 x 1 x 1; got {a.shape_string()}, {b.shape_string()}, "
                           f"{y.shape_string()}")
        shape = (_num(a), a.count_range(1))
        if self.diff is None or self.diff.shape != shape or self.diff.dtype != a.dtype:
            self.diff = a.xp.zeros(shape, dtype=a.dtype)

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 2

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        n = _num(bottom[0])
        xp.subtract(bottom[0].data.reshape(n, -1), bottom[1].data.reshape(n, -1), out=self.diff)
        self.dist_sq = (self.diff * self.diff).sum(axis=1)
        self.similar = bottom[2].data.reshape(n).astype(np.int64) != 0
        if self.legacy:
            dissimilar = xp.maximum(self.margin - self.dist_sq, 0)
        else:
            dissimilar = xp.maximum(self.margin - xp.sqrt(self.dist_sq), 0) ** 2
        per_pair = xp.where(self.similar, self.dist_sq, dissimilar)
        top[0].data[...] = per_pair.sum() / (2 * n)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        n = _num(bottom[0])
        if self.legacy:
            mdist = self.margin - self.dist_sq
            beta = xp.full_like(mdist, -1.0)
        else:
            dist = xp.sqrt(self.dist_sq)
            mdist = self.margin - dist
            beta = -mdist / (dist + 1e-4)
        # per pair: coefficient of (a - b) in d loss / d a, before the α = w/N factor
        coef = xp.where(self.similar, 1.0, xp.where(mdist > 0, beta, 0.0)).astype(self.diff.dtype)
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                alpha = top[0].diff * (sign / n)
                bd = bottom[i].diff.reshape(n, -1)
                xp.multiply(self.diff, coef[:, None], out=bd)
                bd *= alpha
        if propagate_down[2]:
            bottom[2].diff[...] = 0  # the loss is piecewise constant in y (it is truncated to int)
