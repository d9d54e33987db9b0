"""Reducing layers: Reduction (sum-like reductions over the trailing axes) and ArgMax (top-k)."""
from __future__ import annotations

from collections.abc import Sequence

from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.layers.shape import canonical_axis
from cct.proto import caffe_pb2 as pb

_Op = pb.ReductionParameter


@register("Reduction")
class ReductionLayer(Layer):
    """Reduces all axes from ``axis`` to the end, one value per leading index.

    Bottom x viewed as ``(num, dim)`` with ``num = count(0, axis)``; top shape ``x.shape[:axis]`` (a
    scalar for axis 0).  ``y = coeff * op(x_row)`` with op SUM ``Σx``, ASUM ``Σ|x|``, SUMSQ ``Σx²``,
    MEAN ``Σx / dim``.  Backward: SUM/MEAN ``bd = c*td``; ASUM ``c*td*sign(x)``; SUMSQ ``2*c*td*x``,
    where ``c = coeff`` (``coeff/dim`` for MEAN).
    Parameters (``reduction_param``): ``operation`` (SUM), ``axis`` (0, negative allowed), ``coeff`` (1).
    """

    exact_num_bottom = 1
    exact_num_top = 1

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.reduction_param
        if p.operation not in (_Op.SUM, _Op.ASUM, _Op.SUMSQ, _Op.MEAN):
            raise ParamError("reduction_param.operation", f"unknown reduction operation {p.operation}")
        self.op = p.operation

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0]
        axis = canonical_axis(x, self.layer_param.reduction_param.axis, "reduction_param.axis")
        top[0].reshape(x.shape[:axis])
        self.num = x.count_range(0, axis)
        self.dim = x.count_range(axis)
        self.coeff = self.layer_param.reduction_param.coeff
        if self.op == _Op.MEAN:
            self.coeff /= self.dim

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.num, self.dim)
        y = top[0].data.reshape(self.num)
        if self.op == _Op.ASUM:
            xp.abs(x).sum(axis=1, out=y)
        elif self.op == _Op.SUMSQ:
            y[...] = xp.einsum("ij,ij->i", x, x)
        else:
            x.sum(axis=1, out=y)
        if self.coeff != 1:
            y *= self.coeff

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = get_array_module(top[0].diff)
        scale = (top[0].diff.reshape(self.num) * self.coeff)[:, None]
        bd = bottom[0].diff.reshape(self.num, self.dim)
        x = bottom[0].data.reshape(self.num, self.dim)
        if self.op == _Op.ASUM:
            xp.multiply(xp.sign(x), scale, out=bd)
        elif self.op == _Op.SUMSQ:
            xp.multiply(x, 2 * scale, out=bd)
        else:
            bd[...] = scale


@register("ArgMax")
class ArgMaxLayer(Layer):
    """The indices (and optionally values) of the ``top_k`` largest entries.

    Without ``axis``: per item n over its ``count(1)`` values; top shape ``(N, 1, top_k)`` (or
    ``(N, 2, top_k)`` with ``out_max_val``: ``[n, 0, :]`` indices, ``[n, 1, :]`` values), padded with 1s to
    the bottom's number of axes.  With ``axis``: along that axis; top shape is the bottom's with
    ``shape[axis] = top_k``, holding values if ``out_max_val`` else indices.  Indices are stored as
    floats.  Ordering is Caffe's: (value, index) descending, so ties put the higher index first.
    No backward.  Parameters (``argmax_param``): ``top_k`` (1), ``out_max_val`` (false), ``axis``
    (optional, negative allowed).
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = property(lambda self: self.axis != 0)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.argmax_param
        self.top_k = p.top_k
        self.out_max_val = p.out_max_val
        if self.top_k < 1:
            raise ParamError("argmax_param.top_k", f"top_k must not be less than 1 (got {self.top_k})")
        self.axis = canonical_axis(bottom[0], p.axis, "argmax_param.axis") if p.HasField("axis") else None
        self._check(bottom[0])

    def _check(self, x: Blob) -> None:
        if self.axis is not None:
            if self.top_k > x.shape[self.axis]:
                raise ParamError("argmax_param.top_k", f"top_k ({self.top_k}) must be at most the size of "
                                                       f"axis {self.axis} of bottom {x.shape_string()}")
        elif self.top_k > x.count_range(1):
            raise ParamError("argmax_param.top_k", f"top_k ({self.top_k}) must be at most the flattened item "
                             f"size ({x.count_range(1)}) of bottom {x.shape_string()}")

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0]
        self._check(x)
        if self.axis is not None:
            shape = list(x.shape)
            shape[self.axis] = self.top_k
        else:
            shape = [1] * max(x.num_axes, 3)
            shape[0] = x.shape[0]
            shape[1] = 2 if self.out_max_val else 1
            shape[2] = self.top_k
        top[0].reshape(shape)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0].data
        xp = get_array_module(x)
        rows = xp.moveaxis(x, self.axis, -1) if self.axis is not None else x.reshape(x.shape[0], -1)
        dim = rows.shape[-1]
        # A stable ascending sort of the negated, reversed rows orders by value descending and, among
        # equal values, by original index descending: Caffe's partial_sort on (value, index) pairs.
        order = xp.argsort(-rows[..., ::-1], axis=-1, kind="stable")[..., :self.top_k]
        index = (dim - 1) - order
        if self.axis is not None:
            out = xp.take_along_axis(rows, index, axis=-1) if self.out_max_val else index
            top[0].data[...] = xp.moveaxis(out, -1, self.axis)
        else:
            y = top[0].data.reshape(x.shape[0], -1, self.top_k)
            y[:, 0, :] = index
            if self.out_max_val:
                y[:, 1, :] = xp.take_along_axis(rows, index, axis=-1)
