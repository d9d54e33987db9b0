"""Weight fillers (Caffe's ``filler.hpp``), drawing from the global stream :func:`cct.rng.get_rng`.

fan_in = count / shape[0]; fan_out = count / shape[1] (count for a 1-D blob), as Caffe (post-1.0,
same values as 1.0 for <= 4-D blobs).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from cct.blob import Blob
from cct.errors import ParamError
from cct.proto import caffe_pb2 as pb
from cct.rng import get_rng

FillerFn = Callable[[pb.FillerParameter, tuple], np.ndarray]


def _fans(shape: tuple) -> tuple[float, float]:
    count = int(np.prod(shape)) if shape else 1
    fan_in = count / shape[0] if shape else count
    fan_out = count / shape[1] if len(shape) > 1 else count
    return fan_in, fan_out


def _scale_n(p: pb.FillerParameter, shape: tuple) -> float:
    fan_in, fan_out = _fans(shape)
    if p.variance_norm == pb.FillerParameter.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if p.variance_norm == pb.FillerParameter.FAN_OUT:
        return fan_out
    return fan_in


def _constant(p, shape):
    return np.full(shape, p.value, dtype=np.float32)


def _uniform(p, shape):
    return get_rng().uniform(p.min, p.max, size=shape).astype(np.float32)


def _gaussian(p, shape):
    if p.std <= 0:
        raise ParamError("weight_filler.std", f"gaussian filler needs std > 0 (got {p.std})")
    x = get_rng().normal(p.mean, p.std, size=shape).astype(np.float32)
    if p.sparse >= 0:
        if len(shape) < 1:
            raise ParamError("weight_filler.sparse", "sparse gaussian filler needs at least 1 axis")
        non_zero_probability = p.sparse / shape[0]
        x *= get_rng().random(size=shape) < non_zero_probability
    return x


def _positive_unitball(p, shape):
    x = get_rng().uniform(0.0, 1.0, size=shape).astype(np.float32)
    rows = x.reshape(shape[0] if shape else 1, -1)
    rows /= rows.sum(axis=1, keepdims=True)
    return x


def _xavier(p, shape):
    limit = math.sqrt(3.0 / _scale_n(p, shape))
    return get_rng().uniform(-limit, limit, size=shape).astype(np.float32)


def _msra(p, shape):
    std = math.sqrt(2.0 / _scale_n(p, shape))
    return get_rng().normal(0.0, std, size=shape).astype(np.float32)


def _bilinear(p, shape):
    """Upsampling kernel: w[..., y, x] = (1 - |x/f - c|)(1 - |y/f - c|), f = ceil(K/2), c = (K-1)/(2f)."""
    if len(shape) != 4 or shape[2] != shape[3]:
        raise ParamError("weight_filler.type", f"bilinear filler needs a 4-D blob with a square kernel, "
                                               f"got shape {shape}")
    k = shape[3]
    f = math.ceil(k / 2.0)
    c = np.float32((k - 1) / (2.0 * f))
    r = np.arange(k, dtype=np.float32)
    w1 = 1 - np.abs(r / np.float32(f) - c)
    kernel = (w1[:, None] * w1[None, :]).astype(np.float32)
    return np.broadcast_to(kernel, shape).copy()


FILLERS: dict[str, FillerFn] = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
}


def fill(blob: Blob, param: pb.FillerParameter, field: str = "weight_filler") -> None:
    """Fill ``blob.data`` according to ``param`` (Caffe's ``GetFiller(param)->Fill(blob)``)."""
    fn = FILLERS.get(param.type)
    if fn is None:
        raise ParamError(f"{field}.type", f"unknown filler type '{param.type}' "
                                          f"(known: {', '.join(sorted(FILLERS))})")
    blob.data[...] = blob.xp.asarray(fn(param, tuple(blob.shape)))


def constant_filler(value: float) -> pb.FillerParameter:
    """A FillerParameter for a layer's default constant filler (e.g. PReLU 0.25, Scale 1)."""
    p = pb.FillerParameter()
    p.type = "constant"
    p.value = value
    return p
