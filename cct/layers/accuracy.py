"""Accuracy (Caffe's ``AccuracyLayer``): top-k classification accuracy.  Not a loss; no backward."""
from __future__ import annotations

from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import ParamError
from cct.layers.base import Layer
from cct.layers.loss import ignore_label_of, label_geometry, read_labels
from cct.layers.registry import register


@register("Accuracy")
class Accuracy(Layer):
    """Fraction of positions whose true class is among the top k scores.

    For each (outer o, inner i) position with label ``y`` (scores ``s[o, :, i]`` along ``axis``):
    correct iff ``#{c : s[o,c,i] >= s[o,y,i]} <= top_k`` — Caffe HEAD's tie rule: classes scoring the
    same as the true class count against it, the true class itself included.
    ``accuracy = #correct / #counted`` over positions whose label is not the ignore label (0 if none).

    Bottoms: scores (outer × C × inner), labels (count outer·inner, values in [0, C)).
    Tops: accuracy (scalar); optional per-class accuracy, shape (C,) (``correct_c / count_c``, 0 for a
    class with no counted position).
    Parameters (``accuracy_param``): ``top_k`` (1, at most C), ``axis`` (1), ``ignore_label``.
    """

    exact_num_bottom = 2
    min_top = 1
    max_top = 2

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        ap = self.layer_param.accuracy_param
        self.top_k = int(ap.top_k)
        self.axis_param = int(ap.axis)
        self.ignore_label = ignore_label_of(ap)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        classes_available = bottom[0].count // bottom[1].count if bottom[1].count else 0
        if self.top_k > classes_available:
            raise ParamError("accuracy_param.top_k", f"top_k ({self.top_k}) must be less than or equal to "
                                                     f"the number of classes ({classes_available})")
        self.axis, self.outer, self.inner, self.classes = label_geometry(self, bottom, self.axis_param,
                                                                         "accuracy_param.axis")
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((self.classes,))

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        lab, valid, count = read_labels(self, bottom[1].data, (self.outer, self.inner), self.classes,
                                        self.ignore_label)
        s3 = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        true_score = s3[xp.arange(self.outer)[:, None], lab, xp.arange(self.inner)[None, :]]
        at_least = (s3 >= true_score[:, None, :]).sum(axis=1)
        correct = at_least <= self.top_k
        if valid is not None:
            correct &= valid
        top[0].data[...] = correct.sum() / count if count else 0
        if len(top) > 1:
            counted = lab if valid is None else lab[valid]
            per_class = xp.bincount(counted.reshape(-1), minlength=self.classes)
            hits = xp.bincount(lab[correct], minlength=self.classes)
            top[1].data[...] = xp.where(per_class > 0, hits / xp.maximum(per_class, 1), 0)
