"""Eltwise: an element-wise sum, product or maximum over two or more bottoms of identical shape."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cct import native
from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import CctError, ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb
from cct.runtime.partition import batch_rows, run_batch

_OP = pb.EltwiseParameter


@register("Eltwise")
class EltwiseLayer(Layer):
    """Element-wise combination of K ≥ 2 bottoms ``x_0 .. x_{K-1}`` (all the same shape) into one top.

    * SUM (default): ``y = Σ_i c_i x_i``;  ``dx_i = c_i dy``.  ``eltwise_param.coeff``: none (all 1) or
      one per bottom.
    * PROD: ``y = Π_i x_i``;  ``dx_i = dy Π_{j≠i} x_j`` with ``stable_prod_grad`` (default true), else
      ``dx_i = dy * y / x_i``.  Coefficients are not allowed.
    * MAX: ``y = max_i x_i``;  ``dx_i = dy`` where bottom i was the arg max, else 0.  Caffe's CPU tie
      rule: between bottoms 0 and 1 a tie goes to bottom **1** (``x_0 > x_1 ? 0 : 1``); each later bottom
      replaces the running max only when strictly greater (a tie keeps the earlier one).

    In place (top = bottom 0) gives the out-of-place results (Caffe's SUM would zero x_0 first).
    """

    min_bottom = 2
    exact_num_top = 1
    batch_separable = True

    _max_idx: Any = None
    _x0_copy: Any = None

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.eltwise_param
        coeffs = list(p.coeff)
        if coeffs and len(coeffs) != len(bottom):
            raise ParamError("eltwise_param.coeff", f"Eltwise Layer takes one coefficient per bottom blob "
                                                    f"({len(bottom)} bottoms, {len(coeffs)} coefficients)")
        if p.operation == _OP.PROD and coeffs:
            raise ParamError("eltwise_param.coeff", "Eltwise layer only takes coefficients for summation "
                                                    "(operation is PROD)")
        if p.operation not in (_OP.SUM, _OP.PROD, _OP.MAX):
            raise ParamError("eltwise_param.operation", f"unknown operation {p.operation}")
        self.op = p.operation
        self.coeffs = [float(c) for c in coeffs] if coeffs else [1.0] * len(bottom)
        self.stable_prod_grad = bool(p.stable_prod_grad)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != bottom[0].shape:
                raise CctError(f"Eltwise: bottom[{i}] has shape {b.shape_string()} but bottom[0] has "
                               f"{bottom[0].shape_string()}; all bottoms must have the same shape")
        top[0].reshape(bottom[0].shape)

    def sums_two(self) -> bool:
        """Whether this is the usual sum of two bottoms, coefficients 1 (what :meth:`forward_rectified` takes)."""
        return self.op == _OP.SUM and self.coeffs == [1.0, 1.0]

    def forward_rectified(self, bottom: list[Blob], top: list[Blob]) -> bool:
        """This forward, then a plain ReLU's in place on the top (:mod:`cct.exec.fusion`), in one compiled pass —
        numpy's add, then its ``maximum(·, 0)``: the bits of the two forwards — for the usual sum of two bottoms
        (:meth:`sums_two`) where the kernels take the arrays; False, nothing computed, otherwise."""
        if not self.sums_two():
            return False
        a, b, y = bottom[0].data, bottom[1].data, top[0].data
        compiled = native.kernels_for(a, b, y)
        if compiled is None:
            return False
        xs, ys = [batch_rows(a), batch_rows(b)], batch_rows(y)
        run_batch(len(ys), lambda _p, r0, r1: compiled.add_rectified(xs[0][r0:r1], xs[1][r0:r1], ys[r0:r1]),
                  work=float(ys.shape[1] * 2))
        return True

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x0 = bottom[0].data
        xp = get_array_module(x0)
        y = top[0].data
        in_place = top[0] is bottom[0]
        dt = x0.dtype.type
        if self.op == _OP.SUM:
            xs, coeffs = [batch_rows(b.data) for b in bottom], self.coeffs
            ys = batch_rows(y)

            def add(_part: int, a: int, b: int) -> None:  # each ufunc writes element by element: y may be x_0
                out, first = ys[a:b], 1
                if coeffs[0] == 1 and coeffs[1] == 1:  # one pass for the usual two-bottom sum
                    xp.add(xs[0][a:b], xs[1][a:b], out=out)
                    first = 2
                elif coeffs[0] == 1:
                    if not in_place:
                        xp.copyto(out, xs[0][a:b])
                else:
                    xp.multiply(xs[0][a:b], dt(coeffs[0]), out=out)
                for x, c in zip(xs[first:], coeffs[first:]):
                    if c == 1:
                        out += x[a:b]
                    else:
                        out += x[a:b] * dt(c)

            run_batch(len(ys), add, work=float(ys.shape[1] * len(bottom)))
        elif self.op == _OP.PROD:
            if in_place:  # the backward needs x_0, which the product overwrites
                c = self._x0_copy
                if c is None or c.shape != x0.shape or c.dtype != x0.dtype or type(c) is not type(x0):
                    self._x0_copy = x0.copy()
                else:
                    c[...] = x0
            xp.multiply(x0, bottom[1].data, out=y)
            for b in bottom[2:]:
                y *= b.data
        else:
            idx = self._max_idx
            if idx is None or idx.shape != x0.shape or type(idx) is not type(x0):
                idx = self._max_idx = xp.empty(x0.shape, dtype="int32")
            x1 = bottom[1].data
            first = x0 > x1  # tie between bottoms 0 and 1 -> bottom 1 (Caffe's CPU rule)
            xp.copyto(idx, 1)
            xp.copyto(idx, 0, where=first)
            if not in_place:
                xp.copyto(y, x0)
            xp.copyto(y, x1, where=~first)
            for i, b in enumerate(bottom[2:], 2):
                xi = b.data
                better = xi > y  # strictly greater: a tie keeps the earlier bottom
                xp.copyto(y, xi, where=better)
                xp.copyto(idx, i, where=better)

    def _sum_backward(self, top: Blob, propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        """``dx_i = c_i dy`` over the batch partitions, each range of dy read once for every bottom; in place
        (bottom 0's diff is dy) bottom 0 comes last."""
        dy = batch_rows(top.diff)
        xp = get_array_module(dy)
        order = [i for i in range(1, len(bottom)) if propagate_down[i]] + [0] * bool(propagate_down[0])
        if not order:
            return
        dxs = {i: batch_rows(bottom[i].diff) for i in order}

        def spread(_part: int, a: int, b: int) -> None:
            for i in order:
                c, dx = self.coeffs[i], dxs[i][a:b]
                if c != 1:
                    xp.multiply(dy[a:b], dx.dtype.type(c), out=dx)
                elif bottom[i] is not top:
                    xp.copyto(dx, dy[a:b])

        run_batch(len(dy), spread, work=float(dy.shape[1] * len(order)))

    def _x(self, bottom: list[Blob], top: list[Blob], i: int) -> Any:
        if i == 0 and top[0] is bottom[0]:
            return self._x0_copy
        return bottom[i].data

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if self.op == _OP.SUM:
            self._sum_backward(top[0], propagate_down, bottom)
            return
        dy = top[0].diff
        xp = get_array_module(dy)
        if top[0] is bottom[0] and propagate_down[0]:
            dy = dy.copy()  # bottom 0's diff is dy itself: read dy before it is overwritten
        y = top[0].data
        for i, b in enumerate(bottom):
            if not propagate_down[i]:
                continue
            dx = b.diff
            if self.op == _OP.PROD:
                if self.stable_prod_grad:
                    others = [self._x(bottom, top, j) for j in range(len(bottom)) if j != i]
                    grad = others[0].copy()
                    for o in others[1:]:
                        grad *= o
                else:
                    grad = y / self._x(bottom, top, i)
                xp.multiply(grad, dy, out=dx)
            else:
                xp.multiply(dy, self._max_idx == i, out=dx)
