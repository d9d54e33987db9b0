"""pycaffe's ``caffe.coord_map``: how coordinates of one NetSpec top map onto another's, and a Crop that aligns
them (the FCN recipe: crop an upsampled score map to the input).

A layer's map is ``(axis, a, b)``: output coordinate ``y`` and input coordinate ``x`` are related by
``y = a·x + b`` along each spatial axis from ``axis`` on (``a``, ``b`` are arrays, one entry per spatial axis, or
scalars for layers that do not move coordinates, whose axis is None):

* Convolution, Pooling, Im2col: ``a = 1/s``, ``b = (p - (k_e - 1)/2)/s`` with stride ``s``, pad ``p`` and the
  dilated kernel extent ``k_e = (k - 1)·d + 1``;
* Deconvolution: ``a = s``, ``b = (k_e - 1)/2 - p``;
* point-wise layers (:data:`PASS_THROUGH_LAYERS`): the identity ``(None, 1, 0)``;
* Crop: ``(crop axis - 1, 1, -offset)`` (only its first bottom is mapped; the second gives the size).

Maps compose along a path (:func:`compose`) and invert (:func:`inverse`); :func:`coord_map_from_to` finds a
common ancestor of two tops and returns the map from the second's coordinates to the first's.  Any other layer
type ends a path (:class:`UndefinedMapException`).  Layers are read from NetSpec's ``Function`` objects
(``type_name``, ``inputs``, keyword ``params``), so parameters given inside ``convolution_param=dict(...)`` or
``crop_param=dict(...)`` count as well as flat keywords; the legacy ``*_h``/``*_w`` fields are refused.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from cct.net_spec import Function, Top
from cct.net_spec import layers as L

PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log", "LRN", "Exp",
                       "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split", "TanH", "Threshold"]
_LEGACY_FIELDS = {"kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w"}

Scalars = Union[float, np.ndarray]
CoordMap = tuple[Optional[int], Scalars, Scalars]


class UndefinedMapException(Exception):
    """The layer type has no coordinate map (it mixes or discards spatial positions)."""


class AxisMismatchException(Exception):
    """Two maps act on different axes and cannot be composed."""


def _vector(value: Any) -> np.ndarray:
    return np.array(value, ndmin=1)


def conv_params(fn: Function) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """``(axis, stride, dilated kernel extent, pad)`` of a Convolution/Deconvolution/Im2col/Pooling layer."""
    params = fn.params.get("convolution_param", fn.params)
    legacy = _LEGACY_FIELDS & set(fn.params) | (_LEGACY_FIELDS & set(params))
    if legacy:
        raise AssertionError(f"cropping does not support legacy _h/_w params ({', '.join(sorted(legacy))})")
    kernel = _vector(params["kernel_size"])
    dilation = _vector(params.get("dilation", 1))
    return (params.get("axis", 1), _vector(params.get("stride", 1)), (kernel - 1) * dilation + 1,
            _vector(params.get("pad", 0)))


def crop_params(fn: Function) -> tuple[int, np.ndarray]:
    """``(axis, offset)`` of a Crop layer with Caffe's defaults (axis 2: crop the spatial axes of NCHW)."""
    params = fn.params.get("crop_param", fn.params)
    return params.get("axis", 2), _vector(params.get("offset", 0))


def coord_map(fn: Function) -> CoordMap:
    """The map ``(axis, a, b)`` of one layer (see the module doc); UndefinedMapException if it has none."""
    kind = fn.type_name
    if kind in ("Convolution", "Pooling", "Im2col"):
        axis, stride, extent, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (extent - 1) / 2) / stride
    if kind == "Deconvolution":
        axis, stride, extent, pad = conv_params(fn)
        return axis, stride, (extent - 1) / 2 - pad
    if kind in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if kind == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset  # the map's axis is the last axis before the cropped ones
    raise UndefinedMapException(kind)


def compose(base_map: CoordMap, next_map: CoordMap) -> CoordMap:
    """The map of ``next_map`` followed by ``base_map``: scales multiply, and ``next_map``'s shift is scaled by
    ``base_map``'s scale before ``base_map``'s shift is added."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise AxisMismatchException(f"axis {ax1} vs axis {ax2}")
    return (ax2 if ax1 is None else ax1), a1 * a2, a1 * b2 + b1


def inverse(coord_map: CoordMap) -> CoordMap:
    """The map back: ``x = y/a - b/a``."""
    ax, a, b = coord_map
    return ax, 1 / a, -b / a


def _mappable_bottoms(top: Top) -> tuple:
    """The bottoms a top's coordinates come from (a Crop's reference bottom only gives a size)."""
    return top.fn.inputs[:1] if top.fn.type_name == "Crop" else top.fn.inputs


def _ancestor_maps(start: Top, stop_at: dict | None = None):
    """Walk up from ``start`` composing maps: every reachable top → the map from its coordinates to
    ``start``'s.  With ``stop_at``, return ``(top, map)`` for the first top found in it (else None)."""
    maps: dict = {start: (None, 1, 0)}
    pending = [start]
    while pending:
        top = pending.pop()
        if stop_at is not None and top in stop_at:
            return top, maps[top]
        try:
            layer_map = coord_map(top.fn)
        except UndefinedMapException:
            continue
        for bottom in _mappable_bottoms(top):
            maps[bottom] = compose(maps[top], layer_map)
            pending.append(bottom)
    return maps if stop_at is None else None


def coord_map_from_to(top_from: Top, top_to: Top) -> CoordMap:
    """The map taking ``top_to``'s coordinates to ``top_from``'s, through their nearest common ancestor.
    RuntimeError when no chain of mappable layers joins them."""
    from_maps = _ancestor_maps(top_from)
    found = _ancestor_maps(top_to, stop_at=from_maps)
    if found is None:
        raise RuntimeError("Could not compute map between tops; are they connected by spatial layers?")
    common, to_map = found
    return compose(to_map, inverse(from_maps[common]))


def crop(top_from: Top, top_to: Top) -> Top:
    """A Crop layer cutting ``top_from`` to ``top_to``'s extent, with the offsets their coordinate map implies.
    AssertionError when the map is not a pure non-negative integer shift (different scales, a ``top_from``
    smaller than ``top_to``, or half-pixel offsets)."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    if not np.all(np.asarray(a) == 1):
        raise AssertionError(f"scale mismatch on crop (a = {a})")
    if not np.all(np.asarray(b) <= 0):
        raise AssertionError(f"cannot crop negative offset (b = {b})")
    if not np.all(np.round(b) == b):
        raise AssertionError(f"cannot crop noninteger offset (b = {b})")
    offset = [int(v) for v in -np.round(_vector(b)).astype(int)]
    return L.Crop(top_from, top_to, crop_param=dict(axis=ax + 1, offset=offset))
