"""Spatial pyramid pooling (Caffe's ``spp_layer``): pool at ``pyramid_height`` levels, flatten, concat."""
from __future__ import annotations

import math
from collections.abc import Sequence

from cct.blob import Blob
from cct.errors import CctError, ParamError
from cct.layers.base import Layer
from cct.layers.pooling import Pooler, check_pool_window
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb

_F = "spp_param"
# SPPParameter and PoolingParameter number their methods alike (MAX 0, AVE 1, STOCHASTIC 2).
_POOL = {pb.SPPParameter.MAX: pb.PoolingParameter.MAX, pb.SPPParameter.AVE: pb.PoolingParameter.AVE,
         pb.SPPParameter.STOCHASTIC: pb.PoolingParameter.STOCHASTIC}


def spp_level_window(level: int, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int],
                                                                     tuple[int, int]]:
    """(kernel, stride, pad) of pyramid level ``level`` (``2**level`` bins per axis), Caffe's
    ``GetPoolingParam``: ``kernel = ceil(in / bins)``, ``pad = (kernel*bins - in + 1) // 2``,
    ``stride = kernel``."""
    bins = 2 ** level
    kernel, pad = [], []
    for n in (height, width):
        k = math.ceil(n / bins)
        kernel.append(k)
        pad.append((k * bins - n + 1) // 2)
    return (kernel[0], kernel[1]), (kernel[0], kernel[1]), (pad[0], pad[1])


@register("SPP")
class SPP(Layer):
    """``top[n] = concat_l flatten(pool_l(bottom[n]))`` for levels ``l = 0 .. pyramid_height-1``.

    Each level pools with the window of :func:`spp_level_window` (CEIL rounding, Caffe's pad correction),
    so it covers the whole image with about ``2**l × 2**l`` bins.  Shapes: bottom ``(N, C, H, W)`` → top
    ``(N, Σ_l C·PH_l·PW_l)``; with ``pyramid_height: 1`` the single level's 4-D output ``(N, C, PH, PW)``
    is the top (no flatten), as in Caffe.  Parameters (``spp_param``): ``pyramid_height`` (> 0), ``pool``
    (MAX | AVE | STOCHASTIC; STOCHASTIC allows no padding, so only sizes that need none).  Backward sums
    the levels' gradients.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    allow_in_place = False
    batch_separable = property(lambda self: self.method != pb.PoolingParameter.STOCHASTIC or self.phase != pb.TRAIN)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.spp_param
        self.pyramid_height = int(p.pyramid_height)
        if self.pyramid_height <= 0:
            raise ParamError(f"{_F}.pyramid_height",
                             f"pyramid_height must be > 0 (got {self.pyramid_height})")
        if p.pool not in _POOL:
            raise ParamError(f"{_F}.pool", f"Unknown pooling method {p.pool}")
        self.method = _POOL[p.pool]
        self.poolers: list[Pooler] = []
        self._in_shape: tuple[int, ...] = ()

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0]
        if x.num_axes != 4:
            raise CctError(f"SPP layer '{self.name}': Input must have 4 axes, corresponding to (num, "
                           f"channels, height, width) (got {x.shape_string()})")
        h, w = x.shape[2:]
        if h <= 0 or w <= 0:
            raise CctError(f"SPP layer '{self.name}': Input dimensions cannot be zero ({x.shape_string()})")
        if self._in_shape != (h, w):
            self.poolers = []
            for level in range(self.pyramid_height):
                kernel, stride, pad = spp_level_window(level, h, w)
                try:
                    check_pool_window(self.method, kernel, stride, pad, "pooling_param")
                except ParamError as e:
                    raise ParamError(f"{_F}.pyramid_height",
                                     f"level {level} of the pyramid on a {h}x{w} input needs kernel "
                                     f"{kernel}, pad {pad}: {e.message}") from None
                self.poolers.append(Pooler(self.method, (h, w), kernel, stride, pad))
            self._in_shape = (h, w)
        n, c = x.shape[:2]
        if self.pyramid_height == 1:
            top[0].reshape((n, c) + self.poolers[0].out_shape)
        else:
            top[0].reshape((n, sum(c * pl.out_shape[0] * pl.out_shape[1] for pl in self.poolers)))

    def _level_views(self, a, n: int, c: int) -> list:
        """Per level, the part of the (flattened) top array that holds its (N, C, PH, PW) output."""
        if self.pyramid_height == 1:
            return [a]
        views, start = [], 0
        for pl in self.poolers:
            size = c * pl.out_shape[0] * pl.out_shape[1]
            views.append(a[:, start:start + size].reshape((n, c) + pl.out_shape))
            start += size
        return views

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0].data
        train = self.phase == pb.TRAIN
        for pl, y in zip(self.poolers, self._level_views(top[0].data, *x.shape[:2])):
            pl.forward(x, y, train)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = bottom[0].data
        train = self.phase == pb.TRAIN
        for i, (pl, dy) in enumerate(zip(self.poolers, self._level_views(top[0].diff, *x.shape[:2]))):
            pl.backward(dy, bottom[0].diff, x, train=train, accumulate=i > 0)
