"""Overlap-save tiling of the dense output and the streaming loop that fills it.

The dense output ``(C_out, *O)`` (``O = V - F + 1`` per axis for a volume ``V``, or ``V`` with mirror padding) is
cut into tiles of ``D = P·J`` voxels per axis starting at ``0, D, 2D, …``; tile ``t`` needs the input patch
``[t + σ, t + σ + n)`` for each of its shifts ``σ`` (one with all pooling as MPF; see
:mod:`cct.inference.fov`), so neighbouring patches overlap by ``n - D`` voxels and their outputs abut
exactly (overlap-save).  A tile reaching past the output's end reads zeros beyond the volume and writes only
the voxels inside: every output voxel is written exactly once.

:func:`run_tiles` streams: per forward run it reads ``S`` patches (each a (tile, shift) item, tiles in raster
order), runs the net, scatters each item's fragments into its tile (:func:`cct.inference.mpf.scatter_fragments`)
and writes every completed tile, then drops it.  Only the patches of one run, the run's blobs (freed layer by
layer) and at most two tiles are in memory at once.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cct.inference.fov import NetSpec
from cct.inference.mpf import scatter_fragments

__all__ = ["Tiling", "run_tiles"]


@dataclass(frozen=True)
class Tiling:
    """Tiles of ``tile`` voxels over an output of ``out_shape``; runs read ``run_input`` voxels."""

    out_shape: tuple[int, ...]
    tile: tuple[int, ...]
    run_input: tuple[int, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(-(-o // t) for o, t in zip(self.out_shape, self.tile))

    def starts(self) -> list[tuple[int, ...]]:
        """Tile origins, raster order (last axis fastest)."""
        return [tuple(i * t for i, t in zip(idx, self.tile))
                for idx in itertools.product(*(range(c) for c in self.counts))]

    def region(self, start: Sequence[int]) -> tuple[int, ...]:
        """The part of the tile at ``start`` inside the output."""
        return tuple(min(t, o - s) for s, t, o in zip(start, self.tile, self.out_shape))


def _shift_offsets(spec: NetSpec, mpf: Sequence[bool]) -> list[tuple[tuple[int, ...], list[Any]]]:
    """Per shift: (σ per axis, per pooling layer its fixed offset or None for MPF), in
    :meth:`NetSpec.shifts` order."""
    choices = []
    for site, m in zip(spec.pools, mpf):
        choices.append([None] if m else list(itertools.product(*(range(k) for k in site.kernel))))
    out = []
    for offs in itertools.product(*choices):
        sigma = [0] * spec.num_spatial
        for site, o in zip(spec.pools, offs):
            if o is not None:
                for a in range(spec.num_spatial):
                    sigma[a] += o[a] * site.scale[a]
        out.append((tuple(sigma), list(offs)))
    return out


def run_tiles(spec: NetSpec, make_net: Callable[[int], Any], mpf: Sequence[bool], batch: int, tiling: Tiling,
              read: Callable[[Sequence[int], Sequence[int], np.ndarray], Any],
              write: Callable[[Sequence[int], np.ndarray], None],
              progress: Callable[[int], None] | None = None, starts: Sequence[tuple[int, ...]] | None = None,
              lock: Any = None) -> int:
    """Fill the dense output (see the module docstring).  ``make_net(k)``: the inference net for runs of ``k``
    patches (``batch``, and once a smaller one for the last run); ``read(start, size, out)`` fills ``out``
    ``(C, *size)`` with the input patch at ``start``; ``write(start, block)`` stores an output block;
    ``progress(voxels)`` is told each tile's voxels as it is written.  ``starts``: only these tiles (a worker's
    share; default all); ``lock``: held around ``write`` and ``progress`` (workers sharing them).  Returns the
    number of runs."""
    shifts = _shift_offsets(spec, mpf)
    frags = spec.fragments(mpf)
    tiles = tiling.starts() if starts is None else list(starts)
    items = [(start, k) for start in tiles for k in range(len(shifts))]
    guard = lock if lock is not None else contextlib.nullcontext()
    nets: dict[int, Any] = {}
    pending: dict[tuple[int, ...], list[Any]] = {}  # tile start -> [dense tile, shifts still missing]
    runs = 0
    for b0 in range(0, len(items), batch):
        chunk = items[b0:b0 + batch]
        net = nets.get(len(chunk))
        if net is None:
            net = nets[len(chunk)] = make_net(len(chunk))
        x = net.input_buffer()
        for k, (start, s) in enumerate(chunk):
            sigma = shifts[s][0]
            read(tuple(a + b for a, b in zip(start, sigma)), tiling.run_input, x[k])
        del x
        y = net.forward()
        runs += 1
        for k, (start, s) in enumerate(chunk):
            entry = pending.get(start)
            if entry is None:
                dense = np.empty((y.shape[1],) + tiling.tile, dtype=np.float32)
                entry = pending[start] = [dense, len(shifts)]
            scatter_fragments(y[k * frags:(k + 1) * frags], spec.pools, mpf, shifts[s][1], entry[0])
            entry[1] -= 1
            if entry[1] == 0:
                region = tiling.region(start)
                with guard:
                    write(start, entry[0][(slice(None),) + tuple(slice(0, r) for r in region)])
                    if progress is not None:
                        progress(math.prod(region))
                del pending[start]
        del y
    return runs
