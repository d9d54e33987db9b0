"""Softmax (Caffe's ``SoftmaxLayer``) and the softmax helpers the softmax-based losses reuse.

:func:`softmax_forward` / :func:`softmax_backward` are the one body of the math; ``Softmax``,
``SoftmaxWithLoss`` and ``InfogainLoss`` all call them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import ParamError
from cct.layers.base import Layer
from cct.layers.registry import register


def canonical_axis(blob: Blob, axis: int, field: str) -> int:
    """``axis`` (negative counts from the end) as an index into ``blob``'s shape, else ParamError(field)."""
    n = blob.num_axes
    if not -n <= axis < n:
        raise ParamError(field, f"axis {axis} out of range for a {n}-D bottom of shape {blob.shape_string()}")
    return axis + n if axis < 0 else axis


def softmax_forward(x: Any, axis: int, out: Any) -> Any:
    """``out = exp(x - max) / Σ exp(x - max)`` along ``axis`` (``out`` may be ``x``)."""
    xp = get_array_module(x)
    m = xp.max(x, axis=axis, keepdims=True)
    xp.subtract(x, m, out=out)
    xp.exp(out, out=out)
    out /= xp.sum(out, axis=axis, keepdims=True)
    return out


def softmax_backward(y: Any, dy: Any, axis: int, out: Any) -> Any:
    """``out = (dy - Σ_axis dy·y) · y``, the gradient through a softmax with output ``y`` (``out`` may
    be ``dy``: the dot product is taken first)."""
    xp = get_array_module(y)
    dot = xp.sum(dy * y, axis=axis, keepdims=True)
    xp.subtract(dy, dot, out=out)
    out *= y
    return out


@register("Softmax")
class Softmax(Layer):
    """Softmax along one axis.

    ``y[o, c, i] = exp(x[o, c, i] - max_c x[o, :, i]) / Σ_c' exp(x[o, c', i] - max_c x[o, :, i])``
    for outer index ``o`` (axes before ``axis``) and inner index ``i`` (axes after).
    Backward: ``dx = (dy - Σ_c dy·y) · y``.

    Bottom: x, any shape.  Top: y, same shape (in place allowed).
    Parameters (``softmax_param``): ``axis`` (default 1, negative counts from the end); ``engine``
    is accepted (one implementation serves all engines).
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = property(lambda self: self.axis > 0)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.axis_param = int(self.layer_param.softmax_param.axis)
        self.axis = 0

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.axis = canonical_axis(bottom[0], self.axis_param, "softmax_param.axis")
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        softmax_forward(bottom[0].data, self.axis, top[0].data)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            softmax_backward(top[0].data, top[0].diff, self.axis, bottom[0].diff)
