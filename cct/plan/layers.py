"""What the planner knows of each layer type: Caffe's shape rule, which output dimensions a part may split,
which box of each bottom a part of the output needs, the training FLOPs of a part and the learnable
parameters.

Blobs are seen as 4-D ``(N, C, H, W)`` (fewer axes are padded with 1s; more are an error).  A part is a
half-open box ``[lo, hi)`` of the output; :meth:`LayerModel.input_box` maps arrays of parts (``lo``, ``hi``
of shape ``(..., 4)``) to the boxes of bottom ``k`` they read:

* convolution / pooling: ``[lo·s − p, (hi−1)·s − p + e)`` along H and W (``e`` the dilated kernel extent),
  clipped to the input; a channel range of a grouped convolution reads the input channels of the groups it
  touches; pooling reads the same channels;
* LRN: the output box widened by ``(size−1)/2`` along C (across channels) or H and W (within a channel);
* Concat: the box shifted by each bottom's offset along the concatenation axis and clipped to that bottom;
* element-wise layers and Eltwise: the same box;
* InnerProduct, losses and anything else: the same images, all of the rest.

Training FLOPs of a part of extent ``(n, c, h, w)`` (forward + backward): convolution ``6·(C_in/g)·kh·kw·nchw``
(forward, data and weight gradients, 2 FLOPs per multiply-add); InnerProduct ``6·K·nc``; pooling
``2·kh·kw·nchw``; LRN ``2·(size+4)·nchw``; element-wise layers a small constant per element
(:data:`ELEMENTWISE_FLOPS`); losses ``10`` per input element.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cct.engines import ConvGeometry
from cct.errors import CctError
from cct.layers.conv import conv_output_shape, conv_spatial_params
from cct.layers.pooling import pooled_shape
from cct.proto import caffe_pb2 as pb

Shape = tuple[int, ...]
Box = tuple[np.ndarray, np.ndarray]

# forward + backward FLOPs per output element of layers that work element by element
ELEMENTWISE_FLOPS = {
    "ReLU": 2, "PReLU": 4, "ELU": 4, "Sigmoid": 4, "TanH": 4, "AbsVal": 2, "BNLL": 6, "Power": 6, "Exp": 4,
    "Log": 4, "Threshold": 1, "Dropout": 3, "BatchNorm": 10, "Scale": 4, "Bias": 2, "Clip": 2, "Swish": 8,
    "Split": 1, "MVN": 10, "Softmax": 10,
}
SOURCE_TYPES = ("Input", "Data", "ImageData", "HDF5Data", "MemoryData", "DummyData", "WindowData")


def as4(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """``shape`` as ``(N, C, H, W)``: missing trailing axes are 1; more than 4 axes are an error."""
    if len(shape) > 4:
        raise CctError(f"blob shape {tuple(shape)} has {len(shape)} axes; the planner handles up to 4 "
                       "(N, C, H, W)")
    return tuple(shape) + (1,) * (4 - len(shape))  # type: ignore[return-value]


def _window(lo: np.ndarray, hi: np.ndarray, size: int, kernel: int, stride: int, pad: int, dilation: int = 1
            ) -> tuple[np.ndarray, np.ndarray]:
    """Input range read by output range ``[lo, hi)`` of a sliding window, clipped to ``[0, size)``."""
    extent = dilation * (kernel - 1) + 1
    a = np.clip(lo * stride - pad, 0, size)
    b = np.clip((hi - 1) * stride - pad + extent, 0, size)
    return a, np.maximum(a, np.where(hi > lo, b, a))


class LayerModel:
    """A layer type the planner can cost.  The base class is the generic model: image splits only, each
    part reads its own images of every bottom whose first axis is the batch (all of any other bottom),
    ``flops_per_element`` FLOPs per output element, no parameters."""

    splits = "n"
    flops_per_element = 2.0

    def __init__(self, lp: pb.LayerParameter, bottoms: Sequence[Shape], tops: Sequence[Shape]):
        self.lp = lp
        self.bottoms = [tuple(b) for b in bottoms]
        self.tops = [tuple(t) for t in tops]

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        """Caffe's shape rule for the tops; ``None`` when this model does not know it."""
        return None

    @property
    def extent(self) -> tuple[int, int, int, int]:
        """The output whose parts configurations describe (the first top; the batch of the first bottom for
        a layer whose top is a scalar, such as a loss)."""
        if self.tops and len(self.tops[0]) > 0:
            return as4(self.tops[0])
        return (self.bottoms[0][0] if self.bottoms and self.bottoms[0] else 1, 1, 1, 1)

    def input_box(self, k: int, lo: np.ndarray, hi: np.ndarray) -> Box:
        """The box of bottom ``k`` read by output parts ``[lo, hi)`` (arrays ``(..., 4)``)."""
        size = np.array(as4(self.bottoms[k]))
        new_lo, new_hi = np.zeros_like(lo), np.broadcast_to(size, hi.shape).copy()
        if size[0] == self.extent[0]:
            new_lo[..., 0], new_hi[..., 0] = lo[..., 0], hi[..., 0]
        return new_lo, new_hi

    def flops(self, part: Sequence[int]) -> float:
        """Forward + backward FLOPs of one output part of extent ``part`` (n, c, h, w)."""
        return self.flops_per_element * math.prod(part)

    def params(self) -> int:
        """Learnable parameters (weights and biases; BatchNorm's statistics are not learned)."""
        return 0

    def conv_geometry(self, part: Sequence[int]) -> ConvGeometry | None:
        """The convolution a part computes, for the engines' cost contract (None: not a convolution)."""
        return None


class SourceModel(LayerModel):
    """Input and data layers: no bottoms, no work; image splits (each worker loads its own images)."""

    flops_per_element = 0.0

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        shapes = {"Input": lp.input_param.shape, "DummyData": lp.dummy_data_param.shape}.get(lp.type)
        if not shapes:
            return None
        dims = [tuple(int(d) for d in s.dim) for s in shapes]
        return dims * len(lp.top) if len(dims) == 1 else dims


class ElementwiseModel(LayerModel):
    """Neurons, Dropout, BatchNorm, one-bottom Scale/Bias, Softmax: every part reads its own box."""

    splits = "nchw"

    def __init__(self, lp: pb.LayerParameter, bottoms: Sequence[Shape], tops: Sequence[Shape]):
        super().__init__(lp, bottoms, tops)
        self.flops_per_element = float(ELEMENTWISE_FLOPS.get(lp.type, 2))
        if lp.type == "Softmax" and self._softmax_axis() != 1:
            self.splits = "n"
        elif lp.type == "Softmax":
            self.splits = "nhw"

    def _softmax_axis(self) -> int:
        axis = self.lp.softmax_param.axis
        return axis + len(self.bottoms[0]) if axis < 0 else axis

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        return [bottoms[0]] * len(lp.top)

    def input_box(self, k: int, lo: np.ndarray, hi: np.ndarray) -> Box:
        if self.lp.type == "Softmax":  # the softmax axis is read whole
            lo, hi = lo.copy(), hi.copy()
            lo[..., 1], hi[..., 1] = 0, self.extent[1]
        return lo, hi

    def params(self) -> int:
        channels = as4(self.bottoms[0])[1]
        if self.lp.type == "Scale":
            return channels * (2 if self.lp.scale_param.bias_term else 1)
        if self.lp.type == "Bias":
            return channels
        if self.lp.type == "PReLU":
            return 1 if self.lp.prelu_param.channel_shared else channels
        return 0


class ConvolutionModel(LayerModel):
    """2-D convolution (groups, stride, padding, dilation)."""

    splits = "nchw"

    def __init__(self, lp: pb.LayerParameter, bottoms: Sequence[Shape], tops: Sequence[Shape]):
        super().__init__(lp, bottoms, tops)
        p = lp.convolution_param
        self.kernel, self.stride, self.pad, self.dilation = conv_spatial_params(p, 2)
        self.group = max(1, int(p.group))
        self.in_channels, self.out_channels = as4(self.bottoms[0])[1], int(p.num_output)
        self.bias = bool(p.bias_term)

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        p = lp.convolution_param
        out = []
        for b in bottoms:
            if len(b) != 4:
                raise CctError(f"convolution of a {len(b)}-D blob {b}: the planner handles 2-D convolutions")
            out.append((b[0], int(p.num_output)) + conv_output_shape(b[2:], *conv_spatial_params(p, 2)))
        return out

    def input_box(self, k: int, lo: np.ndarray, hi: np.ndarray) -> Box:
        _, _, H, W = as4(self.bottoms[k])
        og, cg = self.out_channels // self.group, self.in_channels // self.group
        new_lo, new_hi = lo.copy(), hi.copy()
        new_lo[..., 1] = (lo[..., 1] // og) * cg
        new_hi[..., 1] = np.where(hi[..., 1] > lo[..., 1], ((hi[..., 1] - 1) // og + 1) * cg, new_lo[..., 1])
        for a, size in ((2, H), (3, W)):
            s = a - 2
            new_lo[..., a], new_hi[..., a] = _window(lo[..., a], hi[..., a], size, self.kernel[s], self.stride[s],
                                                     self.pad[s], self.dilation[s])
        return new_lo, new_hi

    def flops(self, part: Sequence[int]) -> float:
        return 6.0 * (self.in_channels // self.group) * math.prod(self.kernel) * math.prod(part)

    def params(self) -> int:
        return self.out_channels * (self.in_channels // self.group) * math.prod(self.kernel) + \
            (self.out_channels if self.bias else 0)

    def conv_geometry(self, part: Sequence[int]) -> ConvGeometry:
        """A part as a convolution of its own: its images, output channels (and the groups they touch) and
        the input window of its rows and columns (padding counted as input)."""
        n, c, h, w = part
        og, cg = self.out_channels // self.group, self.in_channels // self.group
        groups = c // og if c % og == 0 else 1
        extent = [d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation)]
        rows = ((h - 1) * self.stride[0] + extent[0], (w - 1) * self.stride[1] + extent[1])
        return ConvGeometry(num=n, in_channels=cg * groups, out_channels=c, group=groups, in_shape=rows,
                            kernel=tuple(self.kernel), stride=tuple(self.stride), pad=(0, 0),
                            dilation=tuple(self.dilation))


class InnerProductModel(LayerModel):
    """Fully connected (axis 1): image and channel (model-parallel) splits; every part reads whole images."""

    splits = "nc"

    def __init__(self, lp: pb.LayerParameter, bottoms: Sequence[Shape], tops: Sequence[Shape]):
        super().__init__(lp, bottoms, tops)
        self.inputs = math.prod(self.bottoms[0][1:])
        self.outputs = int(lp.inner_product_param.num_output)

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        return [(bottoms[0][0], int(lp.inner_product_param.num_output))]

    def flops(self, part: Sequence[int]) -> float:
        return 6.0 * self.inputs * part[0] * part[1]

    def params(self) -> int:
        return self.inputs * self.outputs + (self.outputs if self.lp.inner_product_param.bias_term else 0)

    def conv_geometry(self, part: Sequence[int]) -> ConvGeometry:
        """``(n, K) → (n, c)`` as a 1x1 convolution of ``n`` one-pixel images."""
        return ConvGeometry(num=part[0], in_channels=self.inputs, out_channels=part[1], group=1, in_shape=(1, 1),
                            kernel=(1, 1), stride=(1, 1), pad=(0, 0), dilation=(1, 1))


class PoolingModel(LayerModel):
    """2-D pooling (MAX, AVE, STOCHASTIC; global; ceil or floor rounding)."""

    splits = "nchw"

    def __init__(self, lp: pb.LayerParameter, bottoms: Sequence[Shape], tops: Sequence[Shape]):
        super().__init__(lp, bottoms, tops)
        self.kernel, self.stride, self.pad, _ = self.window(lp.pooling_param, self.bottoms[0])

    @staticmethod
    def window(p: pb.PoolingParameter, bottom: Shape) -> tuple[tuple[int, int], ...]:
        """(kernel, stride, pad, rounding-is-ceil) as Caffe's PoolingLayer reads them."""
        if p.global_pooling:
            return (bottom[2], bottom[3]), (1, 1), (0, 0), (1, 1)
        kernel = (p.kernel_h, p.kernel_w) if p.HasField("kernel_h") else (p.kernel_size, p.kernel_size)
        stride = (p.stride_h, p.stride_w) if p.HasField("stride_h") else (p.stride, p.stride)
        pad = (p.pad_h, p.pad_w) if p.HasField("pad_h") else (p.pad, p.pad)
        if min(kernel) <= 0 or min(stride) <= 0:
            raise CctError(f"pooling kernel {kernel} / stride {stride} must be positive")
        return kernel, stride, pad, (int(p.round_mode == pb.PoolingParameter.CEIL),) * 2

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        b = bottoms[0]
        if len(b) != 4 or len(lp.pooling_param.kernel_nd):
            return None
        kernel, stride, pad, ceil = cls.window(lp.pooling_param, b)
        return [b[:2] + pooled_shape(b[2:], kernel, stride, pad, bool(ceil[0]))] * len(lp.top)

    def input_box(self, k: int, lo: np.ndarray, hi: np.ndarray) -> Box:
        _, _, H, W = as4(self.bottoms[k])
        new_lo, new_hi = lo.copy(), hi.copy()
        for a, size in ((2, H), (3, W)):
            s = a - 2
            new_lo[..., a], new_hi[..., a] = _window(lo[..., a], hi[..., a], size, self.kernel[s], self.stride[s],
                                                     self.pad[s])
        return new_lo, new_hi

    def flops(self, part: Sequence[int]) -> float:
        return 2.0 * math.prod(self.kernel) * math.prod(part)


class LRNModel(LayerModel):
    """Local response normalisation across channels (a channel halo) or within a channel (a spatial one)."""

    splits = "nchw"

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        return [bottoms[0]]

    def input_box(self, k: int, lo: np.ndarray, hi: np.ndarray) -> Box:
        p = self.lp.lrn_param
        half = (int(p.local_size) - 1) // 2
        axes = (1,) if p.norm_region == pb.LRNParameter.ACROSS_CHANNELS else (2, 3)
        size = as4(self.bottoms[k])
        new_lo, new_hi = lo.copy(), hi.copy()
        for a in axes:
            new_lo[..., a] = np.clip(lo[..., a] - half, 0, size[a])
            new_hi[..., a] = np.clip(hi[..., a] + half, 0, size[a])
        return new_lo, new_hi

    def flops(self, part: Sequence[int]) -> float:
        return 2.0 * (int(self.lp.lrn_param.local_size) + 4) * math.prod(part)


class ConcatModel(LayerModel):
    """Concatenation along ``axis``: a part reads the slice of each bottom that falls inside it."""

    splits = "nchw"

    @staticmethod
    def axis(lp: pb.LayerParameter, ndim: int) -> int:
        p = lp.concat_param
        axis = int(p.concat_dim) if p.HasField("concat_dim") else int(p.axis)
        return axis + ndim if axis < 0 else axis

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        a = cls.axis(lp, len(bottoms[0]))
        shape = list(bottoms[0])
        for b in bottoms[1:]:
            if len(b) != len(shape) or any(x != y for i, (x, y) in enumerate(zip(b, shape)) if i != a):
                raise CctError(f"bottoms {tuple(bottoms[0])} and {tuple(b)} differ off the concatenation axis {a}")
        shape[a] = sum(b[a] for b in bottoms)
        return [tuple(shape)]

    def input_box(self, k: int, lo: np.ndarray, hi: np.ndarray) -> Box:
        a = self.axis(self.lp, len(self.bottoms[0]))
        offset = sum(b[a] for b in self.bottoms[:k])
        size = as4(self.bottoms[k])[a]
        new_lo, new_hi = lo.copy(), hi.copy()
        new_lo[..., a] = np.clip(lo[..., a] - offset, 0, size)
        new_hi[..., a] = np.maximum(new_lo[..., a], np.clip(hi[..., a] - offset, 0, size))
        return new_lo, new_hi


class EltwiseModel(LayerModel):
    """Element-wise sum / product / max of same-shaped bottoms."""

    splits = "nchw"

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        if any(tuple(b) != tuple(bottoms[0]) for b in bottoms):
            raise CctError(f"bottoms of different shapes {', '.join(str(tuple(b)) for b in bottoms)}")
        return [bottoms[0]]

    def input_box(self, k: int, lo: np.ndarray, hi: np.ndarray) -> Box:
        return lo, hi

    def flops(self, part: Sequence[int]) -> float:
        return 2.0 * len(self.bottoms) * math.prod(part)


class LossModel(LayerModel):
    """Losses and Accuracy: a scalar top, image splits; ``10`` FLOPs per element of the first bottom."""

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        return [()] if len(lp.top) <= 1 else None

    def flops(self, part: Sequence[int]) -> float:
        return 10.0 * part[0] * math.prod(self.bottoms[0][1:])


class ViewModel(LayerModel):
    """Flatten (Reshape and friends through the generic path): a view of the bottom, no work."""

    flops_per_element = 0.0

    @classmethod
    def top_shapes(cls, lp: pb.LayerParameter, bottoms: Sequence[Shape]) -> list[Shape] | None:
        if lp.type != "Flatten":
            return None
        b, p = bottoms[0], lp.flatten_param
        start = p.axis + len(b) if p.axis < 0 else p.axis
        end = p.end_axis + len(b) if p.end_axis < 0 else p.end_axis
        return [tuple(b[:start]) + (math.prod(b[start:end + 1]),) + tuple(b[end + 1:])]


MODELS: dict[str, type[LayerModel]] = {
    "Convolution": ConvolutionModel, "InnerProduct": InnerProductModel, "Pooling": PoolingModel,
    "LRN": LRNModel, "Concat": ConcatModel, "Eltwise": EltwiseModel, "Flatten": ViewModel, "Reshape": ViewModel,
    **{t: SourceModel for t in SOURCE_TYPES},
    **{t: ElementwiseModel for t in ELEMENTWISE_FLOPS},
    **{t: LossModel for t in ("SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "HingeLoss",
                              "InfogainLoss", "MultinomialLogisticLoss", "ContrastiveLoss", "Accuracy")},
}


def model_class(lp: pb.LayerParameter, num_bottoms: int) -> type[LayerModel]:
    """The model of ``lp``'s type, or the generic one (also for variants the specific model does not cover:
    several bottoms of a convolution, a second bottom of Scale/Bias, an InnerProduct on an axis but 1)."""
    cls = MODELS.get(lp.type, LayerModel)
    if cls is ConvolutionModel and (num_bottoms != 1 or len(lp.convolution_param.kernel_size) > 2):
        return LayerModel
    if cls is ElementwiseModel and lp.type in ("Scale", "Bias") and num_bottoms != 1:
        return LayerModel
    if cls is InnerProductModel and lp.inner_product_param.axis not in (1, -1):
        return LayerModel
    if cls is PoolingModel and len(lp.top) != 1:
        return LayerModel
    return cls


def layer_model(lp: pb.LayerParameter, bottoms: Sequence[Shape], tops: Sequence[Shape]) -> LayerModel:
    return model_class(lp, len(bottoms))(lp, bottoms, tops)
