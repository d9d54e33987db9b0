"""Direct convolution references (a loop over kernel offsets, einsum over channels), N-D, groups, stride,
padding, dilation — independent of the lowering engine."""
from __future__ import annotations

import itertools

import numpy as np

from cct.engines import ConvGeometry


def _cells(g: ConvGeometry, t: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(k * d, k * d + s * (m - 1) + 1, s)
                 for k, d, s, m in zip(t, g.dilation, g.stride, g.out_shape))


def _offsets(g: ConvGeometry):
    return itertools.product(*(range(k) for k in g.kernel))


def _padded(g: ConvGeometry, x: np.ndarray) -> np.ndarray:
    return np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in g.pad])


def conv_forward(g: ConvGeometry, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    xp = _padded(g, x)
    G, Cg, Og = g.group, g.in_channels // g.group, g.out_channels // g.group
    y = np.zeros((x.shape[0], g.out_channels) + g.out_shape)
    for t in _offsets(g):
        cells = xp[(slice(None), slice(None)) + _cells(g, t)]
        for gi in range(G):
            y[:, gi * Og:(gi + 1) * Og] += np.einsum("bc...,oc->bo...", cells[:, gi * Cg:(gi + 1) * Cg],
                                                     w[(slice(gi * Og, (gi + 1) * Og), slice(None)) + t])
    if b is not None:
        y += b.reshape((1, -1) + (1,) * g.num_spatial_axes)
    return y


def conv_backward_data(g: ConvGeometry, dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    G, Cg, Og = g.group, g.in_channels // g.group, g.out_channels // g.group
    dxp = np.zeros((dy.shape[0], g.in_channels) + tuple(i + 2 * p for i, p in zip(g.in_shape, g.pad)))
    for t in _offsets(g):
        for gi in range(G):
            dxp[(slice(None), slice(gi * Cg, (gi + 1) * Cg)) + _cells(g, t)] += np.einsum(
                "bo...,oc->bc...", dy[:, gi * Og:(gi + 1) * Og], w[(slice(gi * Og, (gi + 1) * Og), slice(None)) + t])
    return dxp[(slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(g.pad, g.in_shape))]


def conv_backward_weights(g: ConvGeometry, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    xp = _padded(g, x)
    G, Cg, Og = g.group, g.in_channels // g.group, g.out_channels // g.group
    dw = np.zeros((g.out_channels, Cg) + g.kernel)
    for t in _offsets(g):
        cells = xp[(slice(None), slice(None)) + _cells(g, t)]
        for gi in range(G):
            xs = cells[:, gi * Cg:(gi + 1) * Cg].reshape(x.shape[0], Cg, -1)
            dys = dy[:, gi * Og:(gi + 1) * Og].reshape(x.shape[0], Og, -1)
            dw[(slice(gi * Og, (gi + 1) * Og), slice(None)) + t] = np.einsum("bcp,bop->oc", xs, dys)
    return dw
