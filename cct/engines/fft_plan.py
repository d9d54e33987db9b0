"""Real N-D transforms for FFT convolution: transform sizes, pruned forward and inverse transforms.

Arrays are *spatial-first*: ``(*spatial, *batch)``, the spatial axes first and any number of batch axes
(images, channels) after them, so that the spectrum ``(*spectrum, *batch)`` is frequency-major and the
per-frequency channel products of :mod:`cct.engines.fft` are plain batched matrix products.

Pruning (Zlateski et al., ZNNi §III).  A block of ``L_0 × … × L_{d-1}`` non-zero values (a kernel, an
image) in a transform of ``T_0 × … × T_{d-1}`` is transformed one axis at a time, last axis first, and
each 1-D transform runs only on the lines that can be non-zero: the real FFT along axis ``d-1`` on
``L_0 ⋯ L_{d-2}`` lines, the complex FFT along axis ``d-2`` on ``L_0 ⋯ L_{d-3} · T_{d-1}/2`` lines, …, the
last one along axis 0 on all lines.  For a ``k³`` kernel in ``n³`` that is ``k² + k·n/2 + n²/2`` lines
instead of ``3·n²/2``.  The inverse is pruned the other way round: after the 1-D inverse along axis 0
only the output rows that are wanted are kept, and so on, so a ``k³`` weight gradient costs
``n²/2 + k·n/2 + k²`` inverse lines.  Zero padding up to the transform size is ``scipy.fft``'s ``n``
argument, applied one axis at a time (so the padded copies are only as large as the pruned intermediate
results); a dilated kernel is zero-inserted along its own extent first.

Measured on this project's 2-core machine (``python benchmarks/fft_vs_direct.py --prune``, four runs): 256
kernels 7³ in a 30³ transform, pruned 16-26 ms vs 24-56 ms for ``rfftn`` on the zero-padded array; the
pruned inverse to a 7³ result 11-25 ms vs 56-112 ms.  Pruning is therefore the default (:attr:`FFTPlan.pruned`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.fft as sfft

from cct.config import settings
from cct.runtime.threads import cpu_cores, thread_budget

__all__ = ["FFTPlan", "fft_workers", "positions", "transform_size"]

def fft_workers() -> int:
    """Threads for ``scipy.fft``: the ``fft_workers`` setting (``CCT_FFT_WORKERS``) if set, else the calling
    thread's budget (:func:`cct.runtime.threads.thread_budget`: a batch partition running with ``cores/p``
    BLAS threads runs its FFTs with that many), bounded by the cores this process may use."""
    n = settings.get("fft_workers")
    return max(1, min(n, cpu_cores())) if n is not None else thread_budget()


def transform_size(n: int, real: bool = False) -> int:
    """The smallest fast transform length ``≥ n`` (``scipy.fft.next_fast_len``): ``2^a 3^b 5^c`` for the
    real-to-complex axis, ``2^a 3^b 5^c 7^d 11^e`` for the complex ones."""
    return int(sfft.next_fast_len(int(n), real=real))


def _prod(values: Sequence[int]) -> int:
    return math.prod(int(v) for v in values)


@dataclass(frozen=True)
class FFTPlan:
    """Transforms of size ``size`` (one entry per spatial axis) over the leading axes of an array.

    The spectrum has shape ``size[:-1] + (size[-1]//2 + 1,)`` (real-to-complex along the last spatial
    axis).  ``pruned`` selects the line-pruned transforms described in the module docstring; ``False``
    runs ``rfftn``/``irfftn`` on the zero-padded array (kept for measurement)."""

    size: tuple[int, ...]
    pruned: bool = True

    @property
    def nd(self) -> int:
        return len(self.size)

    @property
    def spectrum_shape(self) -> tuple[int, ...]:
        return self.size[:-1] + (self.size[-1] // 2 + 1,)

    @property
    def num_frequencies(self) -> int:
        return _prod(self.spectrum_shape)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, block: Any, step: Sequence[int] | None = None, workers: int = 1, first: int = 0) -> Any:
        """The spectrum of ``block`` (real; its axes ``first … first+nd-1`` are the spatial ones, the others
        batch axes) placed at the origin of the transform, its entries ``step`` apart along each spatial axis
        (a dilated kernel); positions beyond the block are zero.  Requires ``(L-1)*step + 1 ≤ size``."""
        nd = self.nd
        axes = tuple(range(first, first + nd))
        if step is not None and any(s != 1 for s in step):
            block = self._dilate(block, step, first)
        for a, n in zip(axes, self.size):
            if block.shape[a] > n:
                raise ValueError(f"block extent {block.shape[first:first + nd]} exceeds the transform size "
                                 f"{self.size}")
        if not self.pruned:
            return sfft.rfftn(block, s=self.size, axes=axes, workers=workers)
        out = sfft.rfft(block, n=self.size[-1], axis=axes[-1], workers=workers)
        for a in reversed(range(nd - 1)):
            out = sfft.fft(out, n=self.size[a], axis=axes[a], workers=workers, overwrite_x=True)
        return out

    def _dilate(self, block: Any, step: Sequence[int], first: int) -> Any:
        nd = self.nd
        spatial = block.shape[first:first + nd]
        extent = tuple((n - 1) * s + 1 for n, s in zip(spatial, step))
        out = np.zeros(block.shape[:first] + extent + block.shape[first + nd:], dtype=block.dtype)
        out[(slice(None),) * first + tuple(slice(None, None, s) for s in step)] = block
        return out

    # ---- inverse -------------------------------------------------------------------------------
    def inverse(self, spectrum: Any, positions: Sequence[Any], workers: int = 1, first: int = 0) -> Any:
        """The real signal of ``spectrum`` (spectral axes ``first …``; it may be overwritten) at the given
        positions along each spatial axis (integer arrays with values in ``[0, size)``, or ``slice``
        objects): ``out[…, i_0, …, i_{d-1}, …] = signal[…, positions[0][i_0], …]``."""
        nd = self.nd
        axes = tuple(range(first, first + nd))
        if not self.pruned:
            out = sfft.irfftn(spectrum, s=self.size, axes=axes, workers=workers, overwrite_x=True)
            for a, where in zip(axes, positions):
                out = _take(out, where, a)
            return out
        out = spectrum
        for a in range(nd - 1):
            out = sfft.ifft(out, axis=axes[a], workers=workers, overwrite_x=True)
            out = _take(out, positions[a], axes[a])
        out = sfft.irfft(out, n=self.size[-1], axis=axes[-1], workers=workers, overwrite_x=True)
        return _take(out, positions[-1], axes[-1])


def _take(a: Any, where: Any, axis: int) -> Any:
    """``a`` restricted to ``where`` (a slice is a view; an index array a copy) along ``axis``."""
    if isinstance(where, slice):
        if where == slice(None):
            return a
        return a[(slice(None),) * axis + (where,)]
    return np.take(a, where, axis=axis)


def positions(start: int, count: int, step: int, size: int) -> Any:
    """Positions ``(start + step*i) mod size`` for ``i < count``: a slice when they do not wrap, else an
    index array."""
    first, last = start % size, start + step * (count - 1)
    if step > 0 and first + step * (count - 1) < size:
        return slice(first, first + step * (count - 1) + 1, step)
    if step < 0 and 0 <= last and start < size:
        stop = last + step
        return slice(start, None if stop < 0 else stop, step)
    return (start + step * np.arange(count)) % size
