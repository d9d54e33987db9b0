"""Neuron layers: one bottom, one top of the same shape, an element-wise function (Caffe's ``NeuronLayer``).

ReLU, PReLU, ELU, Sigmoid, TanH, AbsVal, Power, Exp, Log, BNLL, Threshold, Dropout, and [HEAD] Clip and
Swish.  Every one runs in place (``top == bottom``) except AbsVal, as in Caffe.  A backward written in
terms of the output y is exact in place; where the backward needs the input x and x is overwritten in
place, the layer keeps a copy of x (Caffe does so for PReLU only; for the others Caffe would read y
where it expects x, which gives wrong gradients, so here in-place results equal the out-of-place ones).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cct.blob import Blob
from cct.device import get_array_module
from cct.elementwise import relu_into
from cct.errors import CctError, ParamError
from cct.fillers import constant_filler, fill
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.native import kernels, takes
from cct.proto import caffe_pb2 as pb
from cct.rng import get_rng
from cct.runtime.partition import run_batch


class NeuronLayer(Layer):
    """Base of the element-wise layers: 1 bottom, 1 top, ``top.shape == bottom.shape``.

    Subclasses whose backward reads x override :meth:`backward_needs_input`; they call
    :meth:`save_input` at the start of ``forward`` and read x back with :meth:`saved_input`.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = True

    _x_copy: Any = None

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        top[0].reshape(bottom[0].shape)

    def backward_needs_input(self) -> bool:
        """Whether backward reads the input x (so an in-place forward must keep a copy)."""
        return False

    def _keeps_copy(self, bottom: list[Blob], top: list[Blob]) -> bool:
        return top[0] is bottom[0] and self.backward_needs_input()

    def save_input(self, bottom: list[Blob], top: list[Blob]) -> None:
        """In place, copy x before the forward overwrites it (Caffe's PReLU ``bottom_memory_``)."""
        if not self._keeps_copy(bottom, top):
            return
        x = bottom[0].data
        buf = self._x_copy
        if buf is None or type(buf) is not type(x) or buf.shape != x.shape or buf.dtype != x.dtype:
            self._x_copy = x.copy()
        else:
            buf[...] = x

    def saved_input(self, bottom: list[Blob], top: list[Blob]) -> Any:
        """x as the forward saw it: the copy when running in place, else the bottom's data."""
        return self._x_copy if self._keeps_copy(bottom, top) else bottom[0].data


def _scalar(x: Any, value: float) -> Any:
    """``value`` as a scalar of ``x``'s dtype (Caffe converts float parameters to Dtype)."""
    return x.dtype.type(value)


# ---- rectifiers ------------------------------------------------------------------------------------
@register("ReLU")
class ReLULayer(NeuronLayer):
    """Rectified linear unit, optionally leaky.

    ``y = max(x, 0) + negative_slope * min(x, 0)``;  ``dx = dy * ((x > 0) + negative_slope * (x <= 0))``.
    Parameters: ``relu_param.negative_slope`` (0).  In place the backward reads y, whose sign is x's for
    slope >= 0; a negative slope in place keeps a copy of x.
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.negative_slope = float(self.layer_param.relu_param.negative_slope)

    def backward_needs_input(self) -> bool:
        return self.negative_slope < 0

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.save_input(bottom, top)
        x, y = bottom[0].data, top[0].data
        if x.ndim == 0:
            self._forward_part(x, y)
            return
        # batch partitions (cct.runtime.partition): element-wise, so any split gives the same result
        run_batch(x.shape[0], lambda p, a, b: self._forward_part(x[a:b], y[a:b]), work=x.size / max(x.shape[0], 1))

    def _forward_part(self, x: Any, y: Any) -> None:
        xp = get_array_module(x)
        if self.negative_slope == 0:
            relu_into(x, y)
        else:
            neg = xp.minimum(x, 0) * _scalar(x, self.negative_slope)
            relu_into(x, y)
            y += neg

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = self.saved_input(bottom, top)
        dy, dx = top[0].diff, bottom[0].diff
        if x.ndim == 0:
            self._backward_part(x, dy, dx)
            return
        n = x.shape[0]
        run_batch(n, lambda p, a, b: self._backward_part(x[a:b], dy[a:b], dx[a:b]), work=x.size / max(n, 1))

    def _backward_part(self, x: Any, dy: Any, dx: Any) -> None:
        xp = get_array_module(x)
        if self.negative_slope == 0:
            k = kernels()
            if k is not None and takes(x, dy, dx):  # one pass instead of the mask's and the product's
                k.relu_backward(x, dy, dx)
            else:
                xp.multiply(dy, x > 0, out=dx)
        else:
            dx[...] = xp.where(x > 0, dy, dy * _scalar(x, self.negative_slope))


@register("PReLU")
class PReLULayer(NeuronLayer):
    """Parametric ReLU: a learned negative slope per channel (axis 1), or one shared slope.

    ``y = max(x, 0) + a_c * min(x, 0)``;  ``da_c += Σ dy * x * (x <= 0)`` (over all but the channel);
    ``dx = dy * ((x > 0) + a_c * (x <= 0))``.  Bottom: ≥ 2 axes, channels = shape[1].
    Blobs: ``[slopes]`` of shape ``(C,)``, or ``()`` with ``channel_shared``.
    Parameters: ``prelu_param.filler`` (default constant 0.25), ``prelu_param.channel_shared`` (false).
    In place supported (a copy of x is kept, as Caffe does).
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.prelu_param
        if bottom[0].num_axes < 2:
            raise ParamError("bottom", f"PReLU: number of axes of bottom blob must be >= 2 "
                                       f"(got shape {bottom[0].shape_string()})")
        channels = bottom[0].shape[1]
        self.channel_shared = bool(p.channel_shared)
        if not self.blobs:
            shape: tuple[int, ...] = () if self.channel_shared else (channels,)
            slopes = Blob(shape, xp=bottom[0].xp, dtype=bottom[0].dtype)
            fill(slopes, p.filler if p.HasField("filler") else constant_filler(0.25), "prelu_param.filler")
            self.blobs.append(slopes)
        expected = 1 if self.channel_shared else channels
        if len(self.blobs) != 1 or self.blobs[0].count != expected:
            got = ", ".join(b.shape_string() for b in self.blobs)
            raise ParamError("prelu_param.channel_shared",
                             f"Negative slope size is inconsistent with prototxt config: expected "
                             f"{expected} slope(s), got blobs [{got}]")
        self.param_propagate_down = [True]

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        if bottom[0].num_axes < 2:
            raise CctError(f"PReLU: number of axes of bottom blob must be >= 2 "
                           f"(got shape {bottom[0].shape_string()})")
        top[0].reshape(bottom[0].shape)

    def backward_needs_input(self) -> bool:
        return True

    def _slopes(self, x: Any) -> Any:
        """The slopes shaped to broadcast against x: ``(1, C, 1, ...)`` or a 0-d array."""
        a = self.blobs[0].data
        if self.channel_shared:
            return a.reshape(())
        return a.reshape((1, x.shape[1]) + (1,) * (x.ndim - 2))

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.save_input(bottom, top)
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        neg = xp.minimum(x, 0) * self._slopes(x)
        relu_into(x, y)
        y += neg

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        x = self.saved_input(bottom, top)
        xp = get_array_module(x)
        dy = top[0].diff
        # The slope gradient first: in place, writing dx overwrites dy.
        if self.param_propagate_down[0]:
            contrib = dy * xp.minimum(x, 0)  # x * (x <= 0) == min(x, 0)
            slope_diff = self.blobs[0].diff
            if self.channel_shared:
                slope_diff += contrib.sum()
            else:
                axes = (0,) + tuple(range(2, x.ndim))
                slope_diff += contrib.sum(axis=axes)
        if propagate_down[0]:
            a = self._slopes(x)
            bottom[0].diff[...] = xp.where(x > 0, dy, dy * a)


@register("ELU")
class ELULayer(NeuronLayer):
    """Exponential linear unit.

    ``y = max(x, 0) + alpha * (exp(min(x, 0)) - 1)``;  ``dx = dy * ((x > 0) + (y + alpha) * (x <= 0))``.
    Parameters: ``elu_param.alpha`` (1).  In place the sign test reads y (same sign as x for alpha >= 0);
    a negative alpha in place keeps a copy of x.
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.alpha = float(self.layer_param.elu_param.alpha)

    def backward_needs_input(self) -> bool:
        return self.alpha < 0

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.save_input(bottom, top)
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        # exp(.) - 1 rather than expm1, as Caffe computes it.
        neg = xp.exp(xp.minimum(x, 0))
        neg -= 1
        neg *= _scalar(x, self.alpha)
        relu_into(x, y)
        y += neg

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = self.saved_input(bottom, top)
        xp = get_array_module(x)
        y, dy = top[0].data, top[0].diff
        bottom[0].diff[...] = xp.where(x > 0, dy, dy * (y + _scalar(x, self.alpha)))


# ---- squashing functions -----------------------------------------------------------------------------
@register("Sigmoid")
class SigmoidLayer(NeuronLayer):
    """Logistic sigmoid, computed as Caffe does: ``y = 0.5 * tanh(0.5 * x) + 0.5``;
    ``dx = dy * y * (1 - y)`` (reads y only, so in place is exact)."""

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        xp.multiply(x, 0.5, out=y)
        xp.tanh(y, out=y)
        y *= 0.5
        y += 0.5

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            y = top[0].data
            bottom[0].diff[...] = top[0].diff * y * (1 - y)


@register("TanH")
class TanHLayer(NeuronLayer):
    """Hyperbolic tangent: ``y = tanh(x)``;  ``dx = dy * (1 - y²)``."""

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        xp.tanh(bottom[0].data, out=top[0].data)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            y = top[0].data
            bottom[0].diff[...] = top[0].diff * (1 - y * y)


@register("AbsVal")
class AbsValLayer(NeuronLayer):
    """Absolute value: ``y = |x|``;  ``dx = sign(x) * dy`` with sign(0) = 0.  No in-place (as Caffe)."""

    allow_in_place = False

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        xp.abs(bottom[0].data, out=top[0].data)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            xp = get_array_module(bottom[0].data)
            xp.multiply(xp.sign(bottom[0].data), top[0].diff, out=bottom[0].diff)


@register("BNLL")
class BNLLLayer(NeuronLayer):
    """Binomial normal log likelihood (softplus): ``y = log(1 + exp(x))``, computed stably as
    ``max(x, 0) + log1p(exp(-|x|))``;  ``dx = dy * e / (e + 1)`` with ``e = exp(min(x, 50))`` (Caffe's
    threshold).  In place keeps a copy of x."""

    THRESHOLD = 50.0

    def backward_needs_input(self) -> bool:
        return True

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.save_input(bottom, top)
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        soft = xp.log1p(xp.exp(-xp.abs(x)))
        relu_into(x, y)
        y += soft

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = self.saved_input(bottom, top)
        xp = get_array_module(x)
        e = xp.exp(xp.minimum(x, _scalar(x, self.THRESHOLD)))
        bottom[0].diff[...] = top[0].diff * e / (e + 1)


# ---- power, exp, log ---------------------------------------------------------------------------------
@register("Power")
class PowerLayer(NeuronLayer):
    """``y = (shift + scale * x) ^ power``.

    Backward, with Caffe's special cases (``ds = power * scale``):
    ``ds == 0`` → y is the constant ``power == 0 ? 1 : shift^power`` and ``dx = 0`` (whatever dy);
    ``power == 1`` → ``dx = scale * dy``; ``power == 2`` → ``dx = dy * 2*scale*(shift + scale*x)``;
    ``shift == 0`` → ``dx = dy * power * y / x``; else ``dx = dy * ds * y / (shift + scale*x)`` (a zero
    base gives inf/NaN, as in Caffe).  Parameters: ``power_param.power`` (1), ``scale`` (1), ``shift`` (0).
    In place keeps a copy of x where the backward needs it.
    """

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.power_param
        self.power, self.scale, self.shift = float(p.power), float(p.scale), float(p.shift)
        self.diff_scale = self.power * self.scale

    def backward_needs_input(self) -> bool:
        return self.diff_scale != 0 and self.power != 1

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.save_input(bottom, top)
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        if self.diff_scale == 0:
            y[...] = 1.0 if self.power == 0 else _scalar(x, self.shift) ** _scalar(x, self.power)
            return
        if self.scale != 1:
            xp.multiply(x, _scalar(x, self.scale), out=y)
        elif top[0] is not bottom[0]:
            y[...] = x
        if self.shift != 0:
            y += _scalar(x, self.shift)
        if self.power != 1:
            xp.power(y, _scalar(x, self.power), out=y)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        if self.diff_scale == 0:
            dx[...] = 0
            return
        dy = top[0].diff
        if self.power == 1:
            xp = get_array_module(dy)
            xp.multiply(dy, _scalar(dy, self.diff_scale), out=dx)
            return
        x, y = self.saved_input(bottom, top), top[0].data
        s = lambda v: _scalar(x, v)  # noqa: E731
        if self.power == 2:
            grad = x * s(self.diff_scale * self.scale)
            if self.shift != 0:
                grad += s(self.diff_scale * self.shift)
        elif self.shift == 0:
            grad = y / x
            grad *= s(self.power)
        else:
            base = x * s(self.scale) if self.scale != 1 else x.copy()
            base += s(self.shift)
            grad = y / base
            if self.diff_scale != 1:
                grad *= s(self.diff_scale)
        dx[...] = dy * grad


def _log_base(base: float, field: str) -> float:
    """ln(base), with Caffe's convention that base -1 means e (ln taken as exactly 1)."""
    if base == -1:
        return 1.0
    if not base > 0:
        raise ParamError(field, f"base must be strictly positive (got {base:g})")
    value = math.log(base)
    if math.isnan(value) or math.isinf(value):
        raise ParamError(field, f"{'NaN' if math.isnan(value) else 'Inf'} result: "
                                f"log(base) = log({base:g}) = {value:g}")
    return value


@register("Exp")
class ExpLayer(NeuronLayer):
    """``y = base ^ (shift + scale * x)``, computed as ``outer * exp(inner * x)`` with
    ``inner = ln(base) * scale`` and ``outer = base ^ shift``;  ``dx = dy * y * inner``.
    Parameters: ``exp_param.base`` (-1 meaning e; otherwise > 0), ``scale`` (1), ``shift`` (0)."""

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.exp_param
        base, scale, shift = float(p.base), float(p.scale), float(p.shift)
        log_base = _log_base(base, "exp_param.base")
        self.inner_scale = log_base * scale
        if shift == 0:
            self.outer_scale = 1.0
        else:
            self.outer_scale = math.exp(shift) if base == -1 else base ** shift

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        if self.inner_scale == 1:
            xp.exp(x, out=y)
        else:
            xp.multiply(x, _scalar(x, self.inner_scale), out=y)
            xp.exp(y, out=y)
        if self.outer_scale != 1:
            y *= _scalar(x, self.outer_scale)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        dx[...] = top[0].diff * top[0].data
        if self.inner_scale != 1:
            dx *= _scalar(dx, self.inner_scale)


@register("Log")
class LogLayer(NeuronLayer):
    """``y = log_base(shift + scale * x) = ln(shift + scale * x) / ln(base)``;
    ``dx = dy * scale / ln(base) / (shift + scale * x)``.
    Parameters: ``log_param.base`` (-1 meaning e; otherwise > 0 and != 1), ``scale`` (1), ``shift`` (0).
    In place keeps a copy of x."""

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.log_param
        base = float(p.base)
        log_base = _log_base(base, "log_param.base")
        if log_base == 0:
            raise ParamError("log_param.base", f"Inf result: 1/log(base) = 1/log({base:g}) = inf")
        self.base_scale = 1.0 / log_base
        self.scale, self.shift = float(p.scale), float(p.shift)
        self.backward_num_scale = self.scale / log_base

    def backward_needs_input(self) -> bool:
        return True

    def _affine(self, x: Any, out: Any) -> Any:
        """``shift + scale * x`` into ``out`` (None: a new array)."""
        xp = get_array_module(x)
        if self.scale != 1:
            out = xp.multiply(x, _scalar(x, self.scale), out=out)
        elif out is None:
            out = x.copy()
        elif out is not x:
            out[...] = x
        if self.shift != 0:
            out += _scalar(x, self.shift)
        return out

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.save_input(bottom, top)
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        xp.log(self._affine(x, y), out=y)
        if self.base_scale != 1:
            y *= _scalar(x, self.base_scale)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = self.saved_input(bottom, top)
        grad = self._affine(x, None)
        xp = get_array_module(x)
        xp.reciprocal(grad, out=grad)
        if self.backward_num_scale != 1:
            grad *= _scalar(x, self.backward_num_scale)
        xp.multiply(top[0].diff, grad, out=bottom[0].diff)


# ---- threshold, clip, swish ----------------------------------------------------------------------------
@register("Threshold")
class ThresholdLayer(NeuronLayer):
    """Step function: ``y = (x > threshold) ? 1 : 0``.  No gradient (an error if one is requested).
    Parameters: ``threshold_param.threshold`` (0)."""

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.threshold = float(self.layer_param.threshold_param.threshold)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0].data
        top[0].data[...] = x > _scalar(x, self.threshold)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            raise CctError(f"layer '{self.name}' (Threshold) has no backward; it cannot back-propagate "
                           f"to its bottom (set propagate_down: false)")


@register("Clip")
class ClipLayer(NeuronLayer):
    """[HEAD] Clip to an interval: ``y = max(min, min(x, max))``;  ``dx = dy * (min <= x <= max)``.
    Parameters: ``clip_param.min``, ``clip_param.max`` (both required).  In place keeps a copy of x."""

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.clip_param
        for name in ("min", "max"):
            if not p.HasField(name):
                raise ParamError(f"clip_param.{name}", "required field is missing")
        self.min, self.max = float(p.min), float(p.max)

    def backward_needs_input(self) -> bool:
        return True

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.save_input(bottom, top)
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        xp.minimum(x, _scalar(x, self.max), out=y)
        xp.maximum(y, _scalar(x, self.min), out=y)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = self.saved_input(bottom, top)
        xp = get_array_module(x)
        inside = (x >= _scalar(x, self.min)) & (x <= _scalar(x, self.max))
        xp.multiply(top[0].diff, inside, out=bottom[0].diff)


@register("Swish")
class SwishLayer(NeuronLayer):
    """[HEAD] Swish: ``y = x * s`` with ``s = sigmoid(beta * x)``;
    ``dx = dy * (beta * y + s * (1 - beta * y))`` (reads y and s only, so in place is exact).
    Parameters: ``swish_param.beta`` (1)."""

    _s: Any = None

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.beta = float(self.layer_param.swish_param.beta)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x, y = bottom[0].data, top[0].data
        xp = get_array_module(x)
        s = self._s
        if s is None or type(s) is not type(x) or s.shape != x.shape or s.dtype != x.dtype:
            s = self._s = xp.empty_like(x)
        # sigmoid(beta * x), as Caffe's Sigmoid layer computes it: 0.5 * tanh(0.5 * beta * x) + 0.5
        xp.multiply(x, _scalar(x, self.beta), out=s)
        s *= 0.5
        xp.tanh(s, out=s)
        s *= 0.5
        s += 0.5
        xp.multiply(x, s, out=y)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        y, s = top[0].data, self._s
        by = y * _scalar(y, self.beta)
        grad = 1 - by
        grad *= s
        grad += by
        bottom[0].diff[...] = top[0].diff * grad


# ---- dropout -------------------------------------------------------------------------------------------
@register("Dropout")
class DropoutLayer(NeuronLayer):
    """Dropout (inverted): TRAIN ``y = x * m * scale`` with ``m ~ Bernoulli(1 - dropout_ratio)`` drawn from
    the global stream (:func:`cct.rng.get_rng`) at every forward — Caffe's GPU rule, ``m = u > UINT_MAX ·
    dropout_ratio`` for a uniform 32-bit ``u`` per value, two from each of the generator's 64-bit outputs (its
    CPU rule draws a uniform double per value: numpy's float32 draws took 1.7x as long, CaffeNet's drop6 at 64
    images 0.74 against 0.44 ms) — and ``scale = 1 / (1 - dropout_ratio)``;
    ``dx = dy * m * scale`` with the mask of the last forward.  TEST: ``y = x``, ``dx = dy``.
    Parameters: ``dropout_param.dropout_ratio`` (0.5), in [0, 1) (Caffe's release build accepts 1 and
    then outputs NaN; here it is an error).  The phase is the layer's (``self.phase``)."""

    _mask: Any = None
    batch_separable = property(lambda self: self.phase != pb.TRAIN)  # TRAIN draws masks

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        ratio = float(self.layer_param.dropout_param.dropout_ratio)
        if not 0 <= ratio < 1:
            raise ParamError("dropout_param.dropout_ratio", f"must be in [0, 1) (got {ratio:g})")
        self.ratio = ratio
        self.scale = 1.0 / (1.0 - ratio)
        # Caffe's uint_thres_: UINT_MAX · ratio in the net's type, truncated
        self._threshold = int(_scalar(bottom[0].data, 4294967295.0) * _scalar(bottom[0].data, ratio))  # < 2^32

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x, y = bottom[0].data, top[0].data
        if self.phase != pb.TRAIN:
            if top[0] is not bottom[0]:
                y[...] = x
            return
        xp = get_array_module(x)
        bits = get_rng().bit_generator.random_raw(-(-x.size // 2)).view(np.uint32)[:x.size]
        keep = (bits > np.uint32(self._threshold)).reshape(x.shape)
        mask = self._mask
        if mask is None or type(mask) is not type(x) or mask.shape != x.shape or mask.dtype != x.dtype:
            mask = self._mask = xp.empty_like(x)
        # m * scale, stored once: x * (m * scale) == x * m * scale exactly since m is 0 or 1.
        mask[...] = xp.asarray(keep)
        mask *= _scalar(x, self.scale)
        xp.multiply(x, mask, out=y)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        if self.phase != pb.TRAIN:
            if top[0] is not bottom[0]:
                dx[...] = dy
            return
        if self._mask is None or self._mask.shape != dy.shape:
            raise CctError(f"layer '{self.name}' (Dropout): backward before a TRAIN forward")
        get_array_module(dy).multiply(dy, self._mask, out=dx)
