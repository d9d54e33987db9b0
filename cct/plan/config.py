"""Parallelism configurations: degrees over the image (n), channel (c), height (h) and width (w) dimensions.

A configuration ``{n, c, h, w}`` splits a layer's **output** ``(N, C, H, W)`` into ``n·c·h·w`` disjoint
parts, equal up to rounding: along an axis of size ``S`` split ``d`` ways, part ``i`` is ``[⌊iS/d⌋,
⌊(i+1)S/d⌋)`` (at most ``⌈S/d⌉`` long).  Part ``(i_n, i_c, i_h, i_w)`` is computed by worker
``j = ((i_n·c + i_c)·h + i_h)·w + i_w`` and lives on device ``j``: every configuration of every layer numbers
its workers from device 0, so a configuration with fewer workers than devices leaves the last ones idle.

The degrees tried along each dimension are the powers of two up to ``P`` and ``P`` itself
(:func:`degrees`); a configuration's product is at most ``P``, no degree exceeds the size of its dimension and
dimensions a layer cannot split stay 1 (:func:`enumerate_configs`).  At ``P = 16`` a layer that splits all
four dimensions of a large enough output has ``C(4+4, 4) = 70`` configurations.  Order matters for ties
(the search keeps the first optimum): ``n`` descending, then ``c``, ``h``, ``w`` descending, so image
parallelism on every worker (``n = P``) comes first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIMS = "nchw"


@dataclass(frozen=True)
class Config:
    """Degrees of parallelism of one layer's output; ``workers = n·c·h·w``."""

    n: int = 1
    c: int = 1
    h: int = 1
    w: int = 1

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def workers(self) -> int:
        return self.n * self.c * self.h * self.w

    @property
    def replicas(self) -> int:
        """Workers holding a copy of the same parameters: ``n·h·w`` (a channel split partitions them)."""
        return self.n * self.h * self.w

    def __str__(self) -> str:
        return "{" + ", ".join(f"{d}={v}" for d, v in zip(DIMS, self.degrees)) + "}"


def degrees(workers: int) -> list[int]:
    """Degrees tried along one dimension for ``workers`` devices: powers of two up to it, and itself; descending."""
    ds = {workers}
    d = 1
    while d <= workers:
        ds.add(d)
        d *= 2
    return sorted(ds, reverse=True)


def enumerate_configs(workers: int, extent: tuple[int, int, int, int], splits: str = DIMS) -> list[Config]:
    """Every configuration with ``n·c·h·w <= workers``, each degree at most its dimension of ``extent`` and 1
    along dimensions not in ``splits``; image parallelism first (see the module docstring)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ds = degrees(workers)
    per_dim = [[d for d in ds if d <= size] if dim in splits else [1] for dim, size in zip(DIMS, extent)]
    out = []
    for n in per_dim[0]:
        for c in per_dim[1]:
            for h in per_dim[2]:
                for w in per_dim[3]:
                    if n * c * h * w <= workers:
                        out.append(Config(n, c, h, w))
    return out


def bounds(size: int, parts: int) -> np.ndarray:
    """Split points of an axis of ``size`` into ``parts``: ``[⌊iS/d⌋ for i in 0..d]``."""
    return (np.arange(parts + 1, dtype=np.int64) * size) // parts


def part_boxes(config: Config, extent: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``, each ``(workers, 4)``: the half-open output box ``[lo, hi)`` of every worker, in worker
    order."""
    axes = [bounds(size, d) for size, d in zip(extent, config.degrees)]
    idx = np.indices(config.degrees).reshape(4, -1).T  # (workers, 4) part indices, worker order
    lo = np.stack([axes[a][idx[:, a]] for a in range(4)], axis=1)
    hi = np.stack([axes[a][idx[:, a] + 1] for a in range(4)], axis=1)
    return lo, hi


def all_part_boxes(configs: list[Config], extent: tuple[int, int, int, int], devices: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`part_boxes` of every configuration at once, padded to ``devices`` rows: ``(lo, hi, valid)`` with
    ``lo``/``hi`` of shape ``(configs, devices, 4)`` and ``valid`` ``(configs, devices)`` (False, and an empty
    box, on devices a configuration leaves idle)."""
    deg = np.array([c.degrees for c in configs], dtype=np.int64).reshape(-1, 4)  # (C, 4)
    size = np.array(extent, dtype=np.int64)
    j = np.arange(devices, dtype=np.int64)[None, :]  # (1, P)
    valid = j < deg.prod(axis=1)[:, None]
    idx = np.empty((len(configs), devices, 4), dtype=np.int64)
    rest = j
    for a in (3, 2, 1, 0):  # worker j = ((i_n·c + i_c)·h + i_h)·w + i_w
        idx[..., a] = rest % deg[:, a:a + 1]
        rest = rest // deg[:, a:a + 1]
    lo = idx * size // deg[:, None, :]
    hi = (idx + 1) * size // deg[:, None, :]
    lo[~valid], hi[~valid] = 0, 0
    return lo, hi, valid


def largest_part(config: Config, extent: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The extent of the biggest part along each axis, ``⌈S/d⌉`` (the slowest worker sets the time)."""
    return tuple(-(-size // d) for size, d in zip(extent, config.degrees))  # type: ignore[return-value]


def image_parallel(configs: list[Config]) -> Config:
    """The configuration with the most image parallelism and nothing else (``{n, 1, 1, 1}``, n largest)."""
    return max((c for c in configs if c.c == c.h == c.w == 1), key=lambda c: c.n)


def model_parallel(configs: list[Config]) -> Config:
    """The configuration with the most channel parallelism and nothing else (``{1, c, 1, 1}``, c largest)."""
    return max((c for c in configs if c.n == c.h == c.w == 1), key=lambda c: c.c)
