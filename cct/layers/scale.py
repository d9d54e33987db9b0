"""Broadcast multiply and add: the Scale and Bias layers.

Both apply a second operand ``p`` (a learned blob, or bottom 1) whose shape equals a run of the data's
axes ``x.shape[axis : axis + p.num_axes]``.  Viewing x as ``(outer, dim, inner)`` with
``outer = count(0, axis)``, ``dim = p.count``, ``inner = count(axis + p.num_axes)``, p is broadcast over
outer and inner.  A 0-axis (scalar) p forces ``axis = 0``, as Caffe does.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cct import native
from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import CctError, ParamError
from cct.fillers import constant_filler, fill
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.layers.shape import canonical_axis
from cct.runtime.partition import run_channel_blocks


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

    # in place, the input is kept for the scale gradient: in the layer's own copy, or where the executor says the
    # layer below keeps exactly these values (BatchNorm's normalized output: cct.exec.fusion.forward_pairs)
    _x_copy: Any = None
    _given: Any = None
    _saved: Any = None

    def input_kept_in(self, array: Any | None) -> None:
        """For the next forward only: ``array`` holds this in-place layer's input as it is now (None: copy it)."""
        self._given = array

    def keep_input(self, x: Any) -> tuple[Any, bool]:
        """Where this forward's input ``x`` is kept (in place; recorded for backward): the array given by
        :meth:`input_kept_in`, or the layer's own copy — and whether it must still be copied there."""
        given, self._given = self._given, None
        if given is not None and given.shape == x.shape and given.dtype == x.dtype and \
                get_array_module(given) is get_array_module(x):
            self._saved = given
            return given, False
        self._saved = self._own_copy(x)
        return self._saved, True

    def _own_copy(self, like: Any) -> Any:
        """The layer's own array shaped like ``like`` (allocated on first need: a kept input given by the
        executor every pass never needs it)."""
        old = self._x_copy
        if old is None or old.shape != like.shape or old.dtype != like.dtype or \
                get_array_module(old) is not get_array_module(like):
            self._x_copy = get_array_module(like).empty(like.shape, dtype=like.dtype)
        return self._x_copy

    def channel_operands(self, blob: Blob) -> tuple[Any, Any | None] | None:
        """The learned scale and bias as ``(dim,)`` vectors where they apply per channel to ``blob`` (a single
        bottom: :meth:`_per_channel`), else None."""
        if not self._per_channel([blob]):
            return None
        bias = None if self.bias_index is None else self.blobs[self.bias_index].data.reshape(-1)
        return self.blobs[0].data.reshape(-1), bias

    def _per_channel(self, bottom: list[Blob]) -> bool:
        """Whether the learned scale (and bias) apply per channel of ``(outer, dim, inner)`` rows, one value per
        row — the blocked passes of :meth:`_forward_rows` and :meth:`_backward_rows` (BatchNorm's companion in
        ResNet-style nets) — rather than elementwise (``count(x) == count(s)``) or from a second bottom."""
        return len(bottom) == 1 and bottom[0].count != self.blobs[0].count and (
            self.bias_index is None or self.bias_geometry == self.geometry)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        if self._per_channel(bottom):
            self._forward_rows(bottom[0], top[0])
            return
        xp = get_array_module(bottom[0].data)
        if top[0] is bottom[0]:
            kept, copy = self.keep_input(bottom[0].data)
            if copy:
                kept[...] = bottom[0].data
        outer, dim, inner = self.geometry
        y = top[0].data
        xp.multiply(bottom[0].data.reshape(outer, dim, inner), self._scale(bottom).data.reshape(1, dim, 1),
                    out=y.reshape(outer, dim, inner))
        if self.bias_index is not None:
            bo, bdim, bi = self.bias_geometry
            y.reshape(bo, bdim, bi)[...] += self.blobs[self.bias_index].data.reshape(1, bdim, 1)

    def _forward_rows(self, bottom: Blob, top: Blob) -> None:
        """``y = x · s (+ b)`` block by block in the batch partitions (:func:`run_channel_blocks`), saving x first
        in place — one pass over memory (compiled where it takes the arrays, else numpy's steps on the block)."""
        outer, dim, inner = self.geometry
        x3, y3 = bottom.data.reshape(outer, dim, inner), top.data.reshape(outer, dim, inner)
        save = None
        if top is bottom:
            kept, copy = self.keep_input(bottom.data)
            save = kept.reshape(outer, dim, inner) if copy else None
        s = self.blobs[0].data.reshape(dim)
        b = None if self.bias_index is None else self.blobs[self.bias_index].data.reshape(dim)
        xp = get_array_module(x3)
        compiled = native.kernels_for(x3, y3, s, *(() if b is None else (b,)), *(() if save is None else (save,)))

        def body(_part: int, i: slice, c: slice) -> None:
            if compiled is not None:
                compiled.scale_rows(x3[i, c], s[c], None if b is None else b[c], y3[i, c],
                                    None if save is None else save[i, c], inner)
                return
            if save is not None:
                xp.copyto(save[i, c], x3[i, c])
            xp.multiply(x3[i, c], s[c, None], out=y3[i, c])
            if b is not None:
                y3[i, c] += b[c, None]

        run_channel_blocks(x3, body)

    def _backward_rows(self, top: Blob, propagate_down: Sequence[bool], bottom: Blob) -> None:
        """The gradients block by block in the batch partitions, each block read once: per (outer, channel) row
        ``Σ td`` and ``Σ td·x`` (summed over the rows in order afterwards, as Caffe's reductions: the scale's
        diff overwritten when ``outer == 1``, else accumulated) and ``bd = td · s``."""
        body, finish = self.backward_rows_steps(top, propagate_down, bottom)
        run_channel_blocks(top.diff.reshape(self.geometry), body)
        finish()

    def backward_rows_steps(self, top: Blob, propagate_down: Sequence[bool], bottom: Blob) -> tuple[Any, Any]:
        """:meth:`_backward_rows` as ``(body, finish)``: ``body(part, images, channels)`` the gradients of one
        block of the ``(outer, dim, inner)`` view, ``finish()`` the learned diffs once every block has run — for
        a caller running the block steps of several layers together (:meth:`cct.layers.normalization.
        BatchNormLayer.backward_scaled`)."""
        outer, dim, inner = self.geometry
        td = top.diff.reshape(outer, dim, inner)
        x = (self._saved if top is bottom else bottom.data).reshape(outer, dim, inner)
        bd = bottom.diff.reshape(outer, dim, inner) if propagate_down[0] else None
        scale = self.blobs[0]
        s = scale.data.reshape(dim)
        want_scale = bool(self.param_propagate_down[0])
        want_bias = self.bias_index is not None and bool(self.param_propagate_down[self.bias_index])
        xp = get_array_module(td)
        sums, dots = xp.empty((outer, dim), dtype=td.dtype), xp.empty((outer, dim), dtype=td.dtype)
        ones = xp.ones(inner, dtype=td.dtype)
        compiled = native.kernels_for(td, x, s, sums, dots, *(() if bd is None else (bd,)))

        def body(_part: int, i: slice, c: slice) -> None:
            if compiled is not None:
                if want_scale or want_bias:
                    compiled.row_sums(td[i, c], x[i, c] if want_scale else None, sums[i, c],
                                      dots[i, c] if want_scale else None, inner)
                if bd is not None:
                    compiled.scale_rows(td[i, c], s[c], None, bd[i, c], None, inner)
                return
            rows = td[i, c].reshape(-1, inner)
            shape = sums[i, c].shape
            if want_bias:
                sums[i, c] = xp.matmul(rows, ones).reshape(shape)
            if want_scale:
                dots[i, c] = xp.einsum("rs,rs->r", rows, x[i, c].reshape(-1, inner)).reshape(shape)
            if bd is not None:
                xp.multiply(td[i, c], s[c, None], out=bd[i, c])

        return body, lambda: self._add_gradients(sums if want_bias else None, dots if want_scale else None)

    def _add_gradients(self, sums: Any | None, dots: Any | None) -> None:
        """The learned diffs from per (outer, channel) row sums of ``td`` (the bias's) and of ``td·x`` (the
        scale's), summed over the rows in order; each only where asked for (``param_propagate_down``; None: not
        computed).  The scale's diff is overwritten when ``outer == 1`` (Caffe's quirk, see :meth:`backward`)."""
        outer, dim, inner = self.geometry
        xp = get_array_module(self.blobs[0].data)
        if sums is not None and self.bias_index is not None and self.param_propagate_down[self.bias_index]:
            bias = self.blobs[self.bias_index]
            bias.diff[...] += sums.sum(axis=0, dtype=xp.float64).astype(sums.dtype).reshape(bias.shape)
        if dots is not None and self.param_propagate_down[0]:
            scale = self.blobs[0]
            grad = dots.sum(axis=0, dtype=xp.float64).astype(dots.dtype).reshape(scale.shape)
            if outer == 1 and inner > 1 and dim > 1:
                scale.diff[...] = grad
            else:
                scale.diff[...] += grad

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        in_place = top[0] is bottom[0]
        if self._per_channel(bottom) and (propagate_down[0] or in_place or not self.param_propagate_down[0]):
            # (Caffe forms the product td·x in bottom 0's diff: where that diff is not overwritten by the data
            # gradient, the general body below leaves it there as Caffe does)
            self._backward_rows(top[0], propagate_down, bottom[0])
            return
        xp = get_array_module(top[0].diff)
        td = top[0].diff
        if self.bias_index is not None and self.param_propagate_down[self.bias_index]:
            bias = self.blobs[self.bias_index]
            bias.diff[...] += _reduce_outer_inner(td, *self.bias_geometry).reshape(bias.shape)
        learned = len(bottom) == 1
        s = self._scale(bottom)
        outer, dim, inner = self.geometry
        if (learned and self.param_propagate_down[0]) or (not learned and propagate_down[1]):
            x = self._saved if in_place else bottom[0].data
            if bottom[0].count == s.count:
                # Elementwise: the product goes straight into the scale diff (overwriting it).
                xp.multiply(td, x, out=s.diff.reshape(td.shape))
            else:
                product = self._own_copy(x) if in_place else bottom[0].diff  # (a kept input given is not ours)
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
