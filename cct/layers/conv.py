"""Convolution, Deconvolution and Im2col (Caffe's ``base_conv_layer``, ``conv_layer``, ``deconv_layer``,
``im2col_layer``).

The layer classes own parameters, shapes and blobs; the arithmetic is done by a convolution engine
(:mod:`cct.engines`), chosen by the creator functions registered here (Caffe's ``GetConvolutionLayer``):
the batch-wide lowering engine (CcT's lowering type 1, 2 or 3) or the FFT engine, as the process settings
say (:mod:`cct.engines.choice`: ``CCT_CONV_ENGINE`` / ``-conv_engine``, ``CCT_LOWERING`` / ``-lowering``;
``auto`` picks per layer from its shapes, by cost model and measurement, at the first reshape and logs the
choice).  ``convolution_param.engine`` DEFAULT, CAFFE and CUDNN all select it (they compute the same
numbers).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from cct import log
from cct.blob import Blob
from cct.engines import ConvEngine, ConvGeometry
from cct.engines.choice import configure_engine, engine_for_layer, predicted_engine_seconds
from cct.engines.lowering import LoweringEngine
from cct.errors import CctError, ParamError
from cct.fillers import fill
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb

_F = "convolution_param"


def _canonical_axis(blob: Blob, axis: int) -> int:
    try:
        return blob.canonical_axis_index(axis)
    except CctError as e:
        raise ParamError(f"{_F}.axis", str(e)) from None


def _per_axis(name: str, values: Sequence[int], num_spatial: int, default: int | None) -> tuple[int, ...]:
    """Caffe's "given once, or once per spatial dimension" rule for a repeated field."""
    n = len(values)
    if n == 0 and default is not None:
        return (default,) * num_spatial
    if n not in (1, num_spatial):
        raise ParamError(f"{_F}.{name}", f"{name} must be specified once, or once per spatial dimension "
                                         f"({name} specified {n} times; {num_spatial} spatial dims)")
    return tuple(int(values[0 if n == 1 else i]) for i in range(num_spatial))


def _hw_pair(p: pb.ConvolutionParameter, name: str, repeated: str,
             num_spatial: int) -> tuple[int, int] | None:
    """``<name>_h``/``<name>_w`` if either is set (2-D only, exclusive with the repeated field)."""
    if not (p.HasField(f"{name}_h") or p.HasField(f"{name}_w")):
        return None
    if num_spatial != 2:
        raise ParamError(f"{_F}.{name}_h", f"{name}_h & {name}_w can only be used for 2D convolution "
                                           f"(the input has {num_spatial} spatial axes)")
    if len(getattr(p, repeated)):
        raise ParamError(f"{_F}.{name}_h", f"Either {repeated} or {name}_h/w should be specified; not both")
    return int(getattr(p, f"{name}_h")), int(getattr(p, f"{name}_w"))


def conv_spatial_params(p: pb.ConvolutionParameter, num_spatial: int
                        ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(kernel, stride, pad, dilation), one entry per spatial axis, checked as Caffe's LayerSetUp does
    (plus dilation > 0, which Caffe leaves unchecked)."""
    kernel = _hw_pair(p, "kernel", "kernel_size", num_spatial) or _per_axis(
        "kernel_size", p.kernel_size, num_spatial, None)
    if any(k <= 0 for k in kernel):
        raise ParamError(f"{_F}.kernel_size", f"Filter dimensions must be nonzero (kernel {_dims(kernel)})")
    stride = _hw_pair(p, "stride", "stride", num_spatial) or _per_axis("stride", p.stride, num_spatial, 1)
    if any(s <= 0 for s in stride):
        raise ParamError(f"{_F}.stride", f"Stride dimensions must be nonzero (stride {_dims(stride)})")
    pad = _hw_pair(p, "pad", "pad", num_spatial) or _per_axis("pad", p.pad, num_spatial, 0)
    if any(q < 0 for q in pad):
        raise ParamError(f"{_F}.pad", f"pad must be >= 0 (pad {_dims(pad)})")
    dilation = _per_axis("dilation", p.dilation, num_spatial, 1)
    if any(d <= 0 for d in dilation):
        raise ParamError(f"{_F}.dilation", f"dilation must be > 0 (dilation {_dims(dilation)})")
    return kernel, stride, pad, dilation


def _dims(t: Sequence[int]) -> str:
    return " x ".join(str(v) for v in t) if t else "(none)"


def conv_output_shape(in_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
                      pad: Sequence[int], dilation: Sequence[int]) -> tuple[int, ...]:
    """``(in + 2*pad - (dilation*(kernel-1)+1)) / stride + 1`` per axis; a kernel that does not fit in the
    padded input is a ParamError (Caffe would silently produce an empty or wrong-sized top)."""
    out = []
    for i, (n, k, s, p, d) in enumerate(zip(in_shape, kernel, stride, pad, dilation)):
        ext = d * (k - 1) + 1
        if n + 2 * p < ext:
            raise ParamError(f"{_F}.kernel_size",
                             f"kernel larger than padded input along spatial axis {i}: dilated kernel extent "
                             f"{ext} (kernel {k}, dilation {d}) > input {n} + 2*pad {p}")
        out.append((n + 2 * p - ext) // s + 1)
    return tuple(out)


class BaseConvolution(Layer):
    """Shared parameter handling of Convolution and Deconvolution (Caffe's ``BaseConvolutionLayer``).

    Parameters (``convolution_param``): ``num_output`` (> 0), ``bias_term`` (true), ``kernel_size`` (once or
    per spatial axis) or ``kernel_h``/``kernel_w`` (2-D), ``stride`` (1) or ``stride_h``/``stride_w``, ``pad``
    (0) or ``pad_h``/``pad_w``, ``dilation`` (1), ``group`` (1; divides channels and num_output), ``axis`` (1:
    the channel axis; axes before it are batch-like, axes after it spatial, any number of them),
    ``weight_filler``/``bias_filler`` (constant 0), ``engine``, ``force_nd_im2col`` (accepted; the engine is
    N-D throughout).  Blobs: ``[weight, bias?]``.  Bottoms ≥ 1, one top per bottom, all bottoms the same
    shape, the same weights applied to every pair.
    """

    min_bottom = 1
    min_top = 1
    equal_num_bottom_top = True
    allow_in_place = False
    batch_separable = property(lambda self: self.channel_axis > 0)  # axes before the channel axis are batch
    # Deconvolution: the weights map top channels to bottom channels (Caffe's reverse_dimensions()).
    reverse: ClassVar[bool] = False
    # what the last reshape saw (bottom shapes, dtype, array module) and gave the tops
    _reshaped_for: Any = None
    _top_shape: tuple[int, ...] = ()

    def __init__(self, param: pb.LayerParameter, engine: ConvEngine | None = None):
        super().__init__(param)
        self.engine: ConvEngine = engine if engine is not None else engine_for_layer()

    # ---- setup ---------------------------------------------------------------------------------
    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.convolution_param
        self.channel_axis = _canonical_axis(bottom[0], p.axis)
        self.num_spatial = bottom[0].num_axes - self.channel_axis - 1
        self.kernel, self.stride, self.pad, self.dilation = conv_spatial_params(p, self.num_spatial)
        self.channels = bottom[0].shape[self.channel_axis]
        self.num_output = int(p.num_output)
        self.group = int(p.group)
        if self.num_output <= 0:
            raise ParamError(f"{_F}.num_output", f"num_output must be > 0 (got {self.num_output})")
        if self.group <= 0:
            raise ParamError(f"{_F}.group", f"group must be > 0 (got {self.group})")
        if self.channels % self.group:
            raise ParamError(f"{_F}.group", f"the input channels ({self.channels}) must be a multiple of "
                                            f"group ({self.group})")
        if self.num_output % self.group:
            raise ParamError(f"{_F}.group", f"Number of output should be multiples of group (num_output "
                                            f"{self.num_output}, group {self.group})")
        self.bias_term = bool(p.bias_term)
        if self.reverse:
            weight_shape = (self.channels, self.num_output // self.group) + self.kernel
        else:
            weight_shape = (self.num_output, self.channels // self.group) + self.kernel
        self._init_blobs(p, weight_shape)

    def _init_blobs(self, p: pb.ConvolutionParameter, weight_shape: tuple[int, ...]) -> None:
        bias_shape = (self.num_output,)
        if len(self.blobs):
            if len(self.blobs) != 1 + self.bias_term:
                raise ParamError("blobs", f"Incorrect number of weight blobs: expected {1 + self.bias_term}, "
                                          f"got {len(self.blobs)}")
            if tuple(self.blobs[0].shape) != weight_shape:
                expected = Blob(weight_shape).shape_string()
                raise ParamError("blobs", f"Incorrect weight shape: expected {expected}, "
                                          f"got {self.blobs[0].shape_string()}")
            if self.bias_term and tuple(self.blobs[1].shape) != bias_shape:
                expected = Blob(bias_shape).shape_string()
                raise ParamError("blobs", f"Incorrect bias shape: expected {expected}, "
                                          f"got {self.blobs[1].shape_string()}")
        else:
            w = Blob(weight_shape)
            fill(w, p.weight_filler, f"{_F}.weight_filler")
            self.blobs.append(w)
            if self.bias_term:
                b = Blob(bias_shape)
                fill(b, p.bias_filler, f"{_F}.bias_filler")
                self.blobs.append(b)
        self.param_propagate_down = [True] * len(self.blobs)

    # ---- reshape -------------------------------------------------------------------------------
    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0]
        # every forward reshapes: the bottoms as last time (and the tops still shaped so) leave nothing to check or
        # configure (LeNet's convolutions: 24-28 us a call, a tenth of conv1's forward)
        seen = (tuple(b.shape for b in bottom), x.dtype, x.xp)
        if seen == self._reshaped_for and all(t.shape == self._top_shape for t in top):
            return
        a = self.channel_axis
        if x.num_axes != a + 1 + self.num_spatial:
            raise CctError(f"{self.type} layer '{self.name}': bottom num_axes may not change "
                           f"(was {a + 1 + self.num_spatial}, now {x.shape_string()})")
        if x.shape[a] != self.channels:
            raise CctError(f"{self.type} layer '{self.name}': Input size incompatible with convolution "
                           f"kernel (expected {self.channels} channels on axis {a}, got {x.shape_string()})")
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != x.shape:
                raise CctError(f"{self.type} layer '{self.name}': All inputs must have the same shape "
                               f"(bottom[0] {x.shape_string()}, bottom[{i}] {b.shape_string()})")
        self.num = x.count_range(0, a)
        self.in_spatial = tuple(x.shape[a + 1:])
        self.out_spatial = self._output_spatial(self.in_spatial)
        top_shape = tuple(x.shape[:a]) + (self.num_output,) + self.out_spatial
        for t in top:
            t.reshape(top_shape)
        geometry = self._geometry()
        configure_engine(self.engine, geometry, x.dtype, x.xp, lambda: self._log_engine(geometry))
        self._reshaped_for, self._top_shape = seen, top_shape

    def _log_engine(self, geometry: ConvGeometry) -> None:
        predicted = ", ".join(f"{k}: {v * 1e3:.3g}" for k, v in predicted_engine_seconds(geometry).items())
        log.info("%s layer %s: %s [d/o = %d/%d; predicted fwd+bwd ms %s]", self.type, self.name,
                 self.engine.describe(), geometry.in_channels, geometry.out_channels, predicted)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        w = self.blobs[0]
        want_w = self.param_propagate_down[0]
        want_b = self.bias_term and self.param_propagate_down[1]
        for i, (y, x) in enumerate(zip(top, bottom)):
            dy = self._top_view(y.diff)
            if want_b:
                self.engine.backward_bias(dy, self.blobs[1].diff)
            dx = self._bottom_view(x.diff) if propagate_down[i] else None
            if want_w or dx is not None:
                self._gradients(self._bottom_view(x.data), dy, w.data, dx, w.diff if want_w else None)

    def _gradients(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        """``dx[...] =`` the bottom gradient (when ``dx``) and ``dw +=`` the weight gradient (when ``dw``) of
        one bottom ``x`` (viewed ``(num, C, *in)``) from its top gradient ``dy``."""
        raise NotImplementedError

    def _output_spatial(self, in_spatial: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError

    def _geometry(self) -> ConvGeometry:
        raise NotImplementedError

    def _bottom_view(self, a: Any) -> Any:
        return a.reshape((self.num, self.channels) + self.in_spatial)

    def _top_view(self, a: Any) -> Any:
        return a.reshape((self.num, self.num_output) + self.out_spatial)

    def _bias_view(self) -> Any:
        return self.blobs[1].data.reshape((1, self.num_output) + (1,) * self.num_spatial)


class Convolution(BaseConvolution):
    """``y[n, g*Og+o, p] = b[g*Og+o] + Σ_{c<Cg, k} W[g*Og+o, c, k] · x_pad[n, g*Cg+c, p*stride-pad+k*dil]``
    (cross-correlation, zero padding; Og = num_output/group, Cg = C/group).

    Shapes: bottom ``(*batch, C, *in)`` → top ``(*batch, num_output, *out)``,
    ``out = (in + 2*pad - (dil*(kernel-1)+1)) / stride + 1``; weight ``(num_output, C/group, *kernel)``,
    bias ``(num_output,)``.  Backward: bias grad += Σ dy; weight grad += correlation of x with dy;
    bottom grad = transposed convolution of dy (all through the engine).
    """

    def _output_spatial(self, in_spatial: tuple[int, ...]) -> tuple[int, ...]:
        return conv_output_shape(in_spatial, self.kernel, self.stride, self.pad, self.dilation)

    def _geometry(self) -> ConvGeometry:
        return ConvGeometry(self.num, self.channels, self.num_output, self.group, self.in_spatial,
                            self.kernel, self.stride, self.pad, self.dilation)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        w = self.blobs[0].data
        b = self.blobs[1].data if self.bias_term else None
        for x, y in zip(bottom, top):
            self.engine.forward(self._bottom_view(x.data), w, b, self._top_view(y.data))

    def forward_rectified(self, bottom: list[Blob], top: list[Blob]) -> bool:
        """This forward, then a plain ReLU's in place on the top (:mod:`cct.exec.fusion`), the engine rectifying the
        output as it writes it (:meth:`cct.engines.base.ConvEngine.forward_rectified`): the bits of the two
        forwards, without the ReLU's pass over the top (CaffeNet's five ReLUs after its convolutions: 8.0 ms of a
        443 ms iteration on a 16-core Xeon).  One bottom and top (a ReLU in place takes one blob)."""
        if len(bottom) != 1:
            return False
        b = self.blobs[1].data if self.bias_term else None
        self.engine.forward_rectified(self._bottom_view(bottom[0].data), self.blobs[0].data, b,
                                      self._top_view(top[0].data))
        return True

    def _gradients(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        self.engine.backward(x, dy, w, dx, dw)


class Deconvolution(BaseConvolution):
    """The transpose of Convolution: each input cell scatters ``x[n, c, p] · W[c, o, k]`` into
    ``y[n, g*Og+o, p*stride - pad + k*dil]`` (contributions outside the output are dropped), plus bias.

    Shapes: bottom ``(*batch, C, *in)`` → top ``(*batch, num_output, *out)``,
    ``out = stride*(in - 1) + dil*(kernel-1)+1 - 2*pad``; weight ``(C, num_output/group, *kernel)`` (first
    dim = bottom channels, as Caffe), bias ``(num_output,)``.  The engine runs the convolution from top to
    bottom: forward = its backward_data, bottom grad = its forward, weight grad = its backward_weights with
    the top gradient as input.
    """

    reverse = True

    def _output_spatial(self, in_spatial: tuple[int, ...]) -> tuple[int, ...]:
        out = tuple(s * (n - 1) + d * (k - 1) + 1 - 2 * p
                    for n, k, s, p, d in zip(in_spatial, self.kernel, self.stride, self.pad, self.dilation))
        for i, o in enumerate(out):
            if o <= 0:
                raise ParamError(f"{_F}.pad", f"Deconvolution output size along spatial axis {i} is {o} <= 0 "
                                              f"(input {in_spatial[i]}, kernel {self.kernel[i]}, stride "
                                              f"{self.stride[i]}, pad {self.pad[i]}, "
                                              f"dilation {self.dilation[i]})")
        return out

    def _geometry(self) -> ConvGeometry:
        # The convolution it transposes maps top (num_output channels) to bottom (C channels).
        return ConvGeometry(self.num, self.num_output, self.channels, self.group, self.out_spatial,
                            self.kernel, self.stride, self.pad, self.dilation)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        w = self.blobs[0].data
        for x, y in zip(bottom, top):
            yv = self._top_view(y.data)
            self.engine.backward_data(self._bottom_view(x.data), w, yv)
            if self.bias_term:
                yv += self._bias_view()

    def _gradients(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        # the transposed convolution's gradients: its input gradient is the convolution of dy
        self.engine.forward_and_backward_weights(dy, w, dx, x, dw)


def _conv_engine(param: pb.LayerParameter) -> ConvEngine:
    """Engine choice for Convolution/Deconvolution: the process-wide engine and lowering settings (see
    :mod:`cct.engines.choice`).  DEFAULT, CAFFE and CUDNN name the same arithmetic here."""
    engine = param.convolution_param.engine
    if engine not in (pb.ConvolutionParameter.DEFAULT, pb.ConvolutionParameter.CAFFE,
                      pb.ConvolutionParameter.CUDNN):
        raise ParamError(f"{_F}.engine", f"Layer {param.name} has unknown engine {engine}")
    return engine_for_layer()


@register("Convolution")
def create_convolution(param: pb.LayerParameter) -> Convolution:
    """Caffe's ``GetConvolutionLayer``: build the layer with the engine its parameters select."""
    return Convolution(param, _conv_engine(param))


@register("Deconvolution")
def create_deconvolution(param: pb.LayerParameter) -> Deconvolution:
    return Deconvolution(param, _conv_engine(param))


@register("Im2col")
class Im2col(Layer):
    """Lowering as a layer: ``top[n, (c, k_1..k_d), o] = x_pad[n, c, o*stride - pad + k*dil]``.

    Shapes: bottom ``(*batch, C, *in)`` (≥ 1 spatial axis) → top ``(*batch, C*prod(kernel), *out)``, column
    order c, then kernel offsets row-major; ``out`` as Convolution.  Parameters: ``convolution_param``
    kernel/stride/pad/dilation/axis (num_output, group and fillers are ignored).  Backward = col2im.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    allow_in_place = False
    batch_separable = property(lambda self: self.channel_axis > 0)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.convolution_param
        self.channel_axis = _canonical_axis(bottom[0], p.axis)
        self.num_spatial = bottom[0].num_axes - self.channel_axis - 1
        if self.num_spatial < 1:
            raise ParamError(f"{_F}.axis", f"Im2col needs at least one spatial axis after the channel axis "
                                           f"{self.channel_axis} (bottom {bottom[0].shape_string()})")
        self.kernel, self.stride, self.pad, self.dilation = conv_spatial_params(p, self.num_spatial)
        self.engine = LoweringEngine(1)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x, a = bottom[0], self.channel_axis
        if x.num_axes != a + 1 + self.num_spatial:
            raise CctError(f"Im2col layer '{self.name}': bottom num_axes may not change "
                           f"(was {a + 1 + self.num_spatial}, now {x.shape_string()})")
        self.num, self.channels = x.count_range(0, a), x.shape[a]
        self.in_spatial = tuple(x.shape[a + 1:])
        self.out_spatial = conv_output_shape(self.in_spatial, self.kernel, self.stride, self.pad,
                                             self.dilation)
        kk = 1
        for k in self.kernel:
            kk *= k
        top[0].reshape(tuple(x.shape[:a]) + (self.channels * kk,) + self.out_spatial)
        self.engine.configure(ConvGeometry(self.num, self.channels, self.channels, 1, self.in_spatial,
                                           self.kernel, self.stride, self.pad, self.dilation), x.dtype)

    def _col_view(self, a: Any) -> Any:
        """The top array as (C, *kernel, num, *out) — the engine's lowered layout."""
        nd = self.num_spatial
        v = a.reshape((self.num, self.channels) + self.kernel + self.out_spatial)
        return v.transpose((1,) + tuple(range(2, 2 + nd)) + (0,) + tuple(range(2 + nd, 2 + 2 * nd)))

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0].data.reshape((self.num, self.channels) + self.in_spatial)
        self.engine.im2col(x, out=self._col_view(top[0].data))

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            dx = bottom[0].diff.reshape((self.num, self.channels) + self.in_spatial)
            self.engine.col2im(self._col_view(top[0].diff), dx)
