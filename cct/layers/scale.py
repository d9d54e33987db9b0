"""Broadcast multiply and add: the Scale and Bias layers.

Both apply a second operand ``p`` (a learned blob, or bottom 1) whose shape equals a run of the data's
axes ``x.shape[axis : axis + p.num_axes]``.  Viewing x as ``(outer, dim, inner)`` with
``outer = count(0, axis)``, ``dim = p.count``, ``inner = count(axis + p.num_axes)``, p is broadcast over
outer and inner.  A 0-axis (scalar) p forces ``axis = 0``, as Caffe does.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import CctError, ParamError
from cct.fillers import constant_filler, fill
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.layers.shape import canonical_axis


def operand_shape(x: Blob, axis: int, num_axes: int, section: str) -> tuple[int, ...]:
    """Shape of a learned operand: ``x.shape[axis : axis + num_axes]`` (``num_axes`` -1 = to the end)."""
    start = canonical_axis(x, axis, f"{section}.axis")
    if num_axes < -1:
        raise ParamError(f"{section}.num_axes", f"num_axes must be non-negative, or -1 to extend to the end "
                                                f"of bottom[0] (got {num_axes})")
    if num_axes >= 0 and x.num_axes < start + num_axes:
        raise ParamError(f"{section}.num_axes", f"the operand's shape extends past bottom[0]'s shape "
                         f"{x.shape_string()} when applied from axis {start} with num_axes {num_axes}")
    return x.shape[start:] if num_axes == -1 else x.shape[start:start + num_axes]


def broadcast_geometry(x: Blob, p: Blob, axis: int, section: str, what: str) -> tuple[int, int, int]:
    """``(outer, dim, inner)`` for applying operand ``p`` to ``x`` from ``axis`` (0 for a scalar p)."""
    start = 0 if p.num_axes == 0 else canonical_axis(x, axis, f"{section}.axis")
    if x.shape[start:start + p.num_axes] != p.shape or x.num_axes < start + p.num_axes:
        raise CctError(f"{what} blob shape {p.shape_string()} does not match bottom[0] shape "
                       f"{x.shape_string()} starting at axis {start}")
    return x.count_range(0, start), p.count, x.count_range(start + p.num_axes)


def _reduce_outer_inner(a: Any, outer: int, dim: int, inner: int) -> Any:
    """``Σ`` over outer and inner of ``a`` viewed as ``(outer, dim, inner)``: a ``(dim,)`` array."""
    return a.reshape(outer, dim, inner).sum(axis=(0, 2))


@register("Bias")
class BiasLayer(Layer):
    """Broadcast add: ``y = x + b``.

    Bottoms: x, and optionally b (else b is the learned ``blobs[0]`` of shape
    ``x.shape[axis : axis + num_axes]``, filler default constant 0).  Top: x's shape.
    Backward: ``bd = td``; ``db = Σ_{outer, inner} td`` (accumulated into the learned blob, written
    into bottom 1).  Parameters (``bias_param``): ``axis`` (1), ``num_axes`` (1; -1 = to the end,
    0 = scalar), ``filler``.  In-place supported.
    """

    min_bottom = 1
    max_bottom = 2
    exact_num_top = 1
    # separable with a learned operand applied after axis 0 (outer = count(0, axis) > 1)
    batch_separable = property(lambda self: len(self.layer_param.bottom) == 1 and self.geometry[0] > 1)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.bias_param
        if len(bottom) == 1 and not self.blobs:
            blob = Blob(operand_shape(bottom[0], p.axis, p.num_axes, "bias_param"))
            fill(blob, p.filler, "bias_param.filler")  # the default FillerParameter is constant 0
            self.blobs.append(blob)
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        b = bottom[1] if len(bottom) > 1 else self.blobs[0]
        axis = self.layer_param.bias_param.axis
        self.geometry = broadcast_geometry(bottom[0], b, axis, "bias_param", "bias")
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        outer, dim, inner = self.geometry
        b = bottom[1] if len(bottom) > 1 else self.blobs[0]
        xp.add(bottom[0].data.reshape(outer, dim, inner), b.data.reshape(1, dim, 1),
               out=top[0].data.reshape(outer, dim, inner))

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        td = top[0].diff
        if propagate_down[0] and bottom[0] is not top[0]:
            bottom[0].diff[...] = td
        if len(bottom) == 1:
            if self.param_propagate_down[0]:
                b = self.blobs[0]
                b.diff[...] += _reduce_outer_inner(td, *self.geometry).reshape(b.shape)
        elif propagate_down[1]:
            bottom[1].diff[...] = _reduce_outer_inner(td, *self.geometry).reshape(bottom[1].shape)


@register("Scale")
class ScaleLayer(Layer):
    """Broadcast multiply, optionally plus a bias: ``y = x * s (+ b)``.

    Bottoms: x, and optionally s (else s is the learned ``blobs[0]`` of shape
    ``x.shape[axis : axis + num_axes]``, filler default constant 1).  Top: x's shape.
    With ``bias_term`` a learned bias b (shape of s, ``bias_filler`` default constant 0) is appended as
    the last blob.

    Backward: ``bd = td * s``; ``ds = Σ_{outer, inner} td * x``; ``db = Σ_{outer, inner} td``.
    Caffe's quirk, reproduced: the learned ``ds`` is *overwritten*, not accumulated, when
    ``count(x) == count(s)`` or when ``outer == 1 and inner > 1 and dim > 1`` (otherwise accumulated);
    a bottom-1 s always gets its diff overwritten.  Like Caffe, the product ``td * x`` is formed in
    bottom 0's diff (or, in place, in the saved copy of x) before the reduction.

    Parameters (``scale_param``): ``axis`` (1), ``num_axes`` (1; -1 = to the end, 0 = scalar), ``filler``,
    ``bias_term`` (false), ``bias_filler``.  In-place supported.
    """

    min_bottom = 1
    max_bottom = 2
    exact_num_top = 1
    # separable with a learned operand applied after axis 0 (outer = count(0, axis) > 1)
    batch_separable = property(lambda self: len(self.layer_param.bottom) == 1 and self.geometry[0] > 1)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.scale_param
        x = bottom[0]
        if len(bottom) == 1 and not self.blobs:
            blob = Blob(operand_shape(x, p.axis, p.num_axes, "scale_param"))
            fill(blob, p.filler if p.HasField("filler") else constant_filler(1.0), "scale_param.filler")
            self.blobs.append(blob)
        self.bias_index: int | None = None
        if p.bias_term:
            bias_num_axes = bottom[1].num_axes if len(bottom) > 1 else p.num_axes
            shape = operand_shape(x, p.axis, bias_num_axes, "scale_param")
            if len(self.blobs) + len(bottom) < 3:  # no stored bias: create it
                blob = Blob(shape)
                fill(blob, p.bias_filler, "scale_param.bias_filler")  # default FillerParameter: constant 0
                self.blobs.append(blob)
            self.bias_index = len(self.blobs) - 1
        self.param_propagate_down = [True] * len(self.blobs)

    def _scale(self, bottom: list[Blob]) -> Blob:
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0]
        axis = self.layer_param.scale_param.axis
        self.geometry = broadcast_geometry(x, self._scale(bottom), axis, "scale_param", "scale")
        if self.bias_index is not None:
            bias = self.blobs[self.bias_index]
            self.bias_geometry = broadcast_geometry(x, bias, axis, "scale_param", "bias")
        top[0].reshape(x.shape)
        if top[0] is x:  # in place: keep x for the scale gradient
            xp = get_array_module(x.data)
            old = getattr(self, "_x_copy", None)
            if old is None or old.shape != x.shape or old.dtype != x.dtype or get_array_module(old) is not xp:
                self._x_copy = xp.empty(x.shape, dtype=x.dtype)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        if top[0] is bottom[0]:
            self._x_copy[...] = bottom[0].data
        outer, dim, inner = self.geometry
        y = top[0].data
        xp.multiply(bottom[0].data.reshape(outer, dim, inner), self._scale(bottom).data.reshape(1, dim, 1),
                    out=y.reshape(outer, dim, inner))
        if self.bias_index is not None:
            bo, bdim, bi = self.bias_geometry
            y.reshape(bo, bdim, bi)[...] += self.blobs[self.bias_index].data.reshape(1, bdim, 1)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        xp = get_array_module(top[0].diff)
        td = top[0].diff
        in_place = top[0] is bottom[0]
        if self.bias_index is not None and self.param_propagate_down[self.bias_index]:
            bias = self.blobs[self.bias_index]
            bias.diff[...] += _reduce_outer_inner(td, *self.bias_geometry).reshape(bias.shape)
        learned = len(bottom) == 1
        s = self._scale(bottom)
        outer, dim, inner = self.geometry
        if (learned and self.param_propagate_down[0]) or (not learned and propagate_down[1]):
            x = self._x_copy if in_place else bottom[0].data
            if bottom[0].count == s.count:
                # Elementwise: the product goes straight into the scale diff (overwriting it).
                xp.multiply(td, x, out=s.diff.reshape(td.shape))
            else:
                product = self._x_copy if in_place else bottom[0].diff
                xp.multiply(td, x, out=product)
                grad = _reduce_outer_inner(product, outer, dim, inner).reshape(s.shape)
                # Caffe's quirk: a learned scale diff is overwritten when outer == 1, inner > 1 and
                # dim > 1 (its gemv writes with beta 0), accumulated in the other cases.
                overwrite = not learned or (outer == 1 and inner > 1 and dim > 1)
                if overwrite:
                    s.diff[...] = grad
                else:
                    s.diff[...] += grad
        if propagate_down[0]:
            xp.multiply(td.reshape(outer, dim, inner), s.data.reshape(1, dim, 1),
                        out=bottom[0].diff.reshape(outer, dim, inner))
