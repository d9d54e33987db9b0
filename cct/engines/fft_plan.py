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

DFT by matrix products.  Short transforms over one or two axes (every size at most ``MATRIX_DFT_MAX``, the
2-D layers of image nets) run as products with the DFT matrices instead: BLAS GEMMs over the whole batch, on
the real and imaginary parts kept as separate planes (the complex axis as one real GEMM with the 2x2 block
matrix ``[[C, -S], [S, C]]``), interleaved into complex numbers once at the end (forward) or split once at the
start (inverse).  Pruning comes for free: a matrix has columns only for the block's values (and its dilation),
rows only for the wanted positions.  ``O(n)`` operations per value instead of ``O(log n)``, but at BLAS
rates, a run of batch columns at a time in the cache: CaffeNet's conv2 output gradient, 16384 planes 27x27 into
30x30 spectra, 16.6-17.0 vs 28.0-30.5 ms with ``scipy.fft`` (2 cores, AVX-512 kernels), its 16384 outputs back
22.0-22.4 vs 25.1-27.7 ms; the CaffeNet iteration's transforms 94 -> 52 ms (``scipy.fft`` ran near 10 GFLOP/s
on these lengths).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.fft as sfft

from cct.config import settings
from cct.runtime.partition import GEMM_FLOPS_PER_OPERATION, batch_ranges, partitions_for, run_partitions
from cct.runtime.threads import blas_threads, cpu_cores, thread_budget

__all__ = ["FFTPlan", "fft_workers", "positions", "transform_size"]

# transforms over at most two axes of at most this length run as DFT matrix products (module docstring) ...
# (n x n planes, 8M values, 2 cores, forward + inverse of whole planes against scipy.fft: at n = 32, 48, 64, 80
# with AVX-512 kernels 0.67, 0.66, 0.71, 0.84 of the time; with AVX2 ones 0.86, 0.87, 1.04, 1.42 — but a
# convolution's kernels and weight-gradient taps are narrow blocks, where the products gain most: 16 images
# 64->64 3x3 on 56x56 (58x58 transforms), FFT engine forward + backward 55.1 vs 83.5 ms with AVX-512 kernels and
# 69.1 vs 86.4 with AVX2 ones at 64 rather than 48; 32->64 5x5 on 58x58 36.7 vs 54.3 and 51.3 vs 58.9 ms)
MATRIX_DFT_MAX = 64
# ... a run of batch columns at a time, about this many bytes of split planes, from the input's columns to the
# output's while in the cache
MATRIX_DFT_CHUNK_BYTES = 2 << 20

def fft_workers() -> int:
    """Threads for ``scipy.fft``: the ``fft_workers`` setting (``CCT_FFT_WORKERS``) if set, else the calling
    thread's budget (:func:`cct.runtime.threads.thread_budget`: a batch partition, on one BLAS thread, runs its
    FFTs on one; a whole-batch call on all the cores), bounded by the cores this process may use."""
    n = settings.get("fft_workers")
    return max(1, min(n, cpu_cores())) if n is not None else thread_budget()


def transform_size(n: int, real: bool = False) -> int:
    """The smallest fast transform length ``≥ n`` (``scipy.fft.next_fast_len``): ``2^a 3^b 5^c`` for the
    real-to-complex axis, ``2^a 3^b 5^c 7^d 11^e`` for the complex ones."""
    return int(sfft.next_fast_len(int(n), real=real))


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
        return math.prod(self.spectrum_shape)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, block: Any, step: Sequence[int] | None = None, workers: int = 1, first: int = 0) -> Any:
        """The spectrum of ``block`` (real; its axes ``first … first+nd-1`` are the spatial ones, the others
        batch axes) placed at the origin of the transform, its entries ``step`` apart along each spatial axis
        (a dilated kernel); positions beyond the block are zero.  Requires ``(L-1)*step + 1 ≤ size``."""
        nd = self.nd
        axes = tuple(range(first, first + nd))
        spread = self._spread(block.shape[first:first + nd], step)
        if first == 0 and self.by_matrices(block.dtype):
            return self._forward_by_matrices(block, spread)
        if any(s != 1 for s in spread):
            block = self._dilate(block, spread, first)
        if not self.pruned:
            return sfft.rfftn(block, s=self.size, axes=axes, workers=workers)
        out = sfft.rfft(block, n=self.size[-1], axis=axes[-1], workers=workers)
        for a in reversed(range(nd - 1)):
            out = sfft.fft(out, n=self.size[a], axis=axes[a], workers=workers, overwrite_x=True)
        return out

    def forward_batch_first(self, block: Any, step: Sequence[int] | None = None, workers: int = 1,
                            conjugate: bool = False) -> Any:
        """:meth:`forward` of a batch-first ``block`` ``(*batch, *spatial)``, as the spectrum ``(*spectrum,
        *batch)``: the DFT matrix products read it as it lies; ``scipy.fft`` from a spatial-first copy.  With
        ``conjugate``, the spectrum's complex conjugate: by the DFT matrices with their sign flipped (the block
        is real: the same values, zeros' signs aside, and no pass over the spectrum), or conjugated after
        ``scipy.fft``."""
        nd = self.nd
        spread = self._spread(block.shape[-nd:], step)
        if self.by_matrices(block.dtype):
            return self._forward_by_matrices(block, spread, batch_first=True, sign=1 if conjugate else -1)
        lead = block.ndim - nd
        moved = np.moveaxis(block, tuple(range(lead, block.ndim)), tuple(range(nd)))
        out = self.forward(np.ascontiguousarray(moved), step, workers)
        return np.conjugate(out, out=out) if conjugate else out

    def _spread(self, spatial: Sequence[int], step: Sequence[int] | None) -> tuple[int, ...]:
        """``step`` per spatial axis (1 when None), checked: a block of ``spatial`` values that far apart fits
        the transform."""
        spread = tuple(step) if step is not None else (1,) * self.nd
        extent = tuple((n - 1) * s + 1 for n, s in zip(spatial, spread))
        if any(e > n for e, n in zip(extent, self.size)):
            raise ValueError(f"block extent {extent} exceeds the transform size {self.size}")
        return spread

    def _dilate(self, block: Any, step: Sequence[int], first: int) -> Any:
        nd = self.nd
        spatial = block.shape[first:first + nd]
        extent = tuple((n - 1) * s + 1 for n, s in zip(spatial, step))
        out = np.zeros(block.shape[:first] + extent + block.shape[first + nd:], dtype=block.dtype)
        out[(slice(None),) * first + tuple(slice(None, None, s) for s in step)] = block
        return out

    # ---- inverse -------------------------------------------------------------------------------
    def inverse(self, spectrum: Any, positions: Sequence[Any], workers: int = 1, first: int = 0,
                out: Any | None = None) -> Any:
        """The real signal of ``spectrum`` (spectral axes ``first …``; it may be overwritten) at the given
        positions along each spatial axis (integer arrays with values in ``[0, size)``, or ``slice``
        objects), returned as ``r[…, i_0, …, i_{d-1}, …] = signal[…, positions[0][i_0], …]``; with ``out``
        (``first`` 0) written batch-first into it instead, ``out[*batch, i_0, …]``, whatever its strides (the
        DFT matrix products write it there directly), and returned."""
        if out is not None:
            if first == 0 and self.by_matrices(spectrum.real.dtype):
                return self._inverse_by_matrices(spectrum, positions, out)
            signal = self.inverse(spectrum, positions, workers, first)
            out[...] = np.moveaxis(signal, tuple(range(self.nd)), tuple(range(out.ndim - self.nd, out.ndim)))
            return out
        nd = self.nd
        axes = tuple(range(first, first + nd))
        if not self.pruned:
            out = sfft.irfftn(spectrum, s=self.size, axes=axes, workers=workers, overwrite_x=True)
            for a, where in zip(axes, positions):
                out = _take(out, where, a)
            return out
        if first == 0 and self.by_matrices(spectrum.real.dtype):
            return self._inverse_by_matrices(spectrum, positions)
        out = spectrum
        for a in range(nd - 1):
            out = sfft.ifft(out, axis=axes[a], workers=workers, overwrite_x=True)
            out = _take(out, positions[a], axes[a])
        out = sfft.irfft(out, n=self.size[-1], axis=axes[-1], workers=workers, overwrite_x=True)
        return _take(out, positions[-1], axes[-1])

    # ---- DFT by matrix products ------------------------------------------------------------------
    def by_matrices(self, dtype: Any) -> bool:
        """Whether this plan's transforms of ``dtype`` values run as DFT matrix products (module docstring;
        pruned plans only: the unpruned ones are ``rfftn``/``irfftn`` of the zero-padded arrays)."""
        return (self.pruned and self.nd <= 2 and max(self.size) <= MATRIX_DFT_MAX
                and np.dtype(dtype) in (np.float32, np.float64))

    def _forward_by_matrices(self, block: Any, step: tuple[int, ...], batch_first: bool = False,
                             sign: int = -1) -> Any:
        """:meth:`forward` (``first`` 0, pruned) as DFT matrix products, run by run of batch columns: the real
        axis on split planes; then the first axis by the block matrix on them, interleaving the result — or,
        for a block of few rows (:meth:`_narrow`: a kernel), interleaving those rows and finishing with one
        complex product per frequency straight into the spectrum (the large array written once)."""
        nd, dtype = self.nd, block.dtype
        if batch_first:
            batch, spatial = block.shape[:-nd], block.shape[-nd:]
            x = np.ascontiguousarray(block).reshape((math.prod(batch),) + spatial)
        else:
            spatial, batch = block.shape[:nd], block.shape[nd:]
            x = np.ascontiguousarray(block).reshape(spatial + (math.prod(batch),))
        rows = math.prod(batch)
        k = self.size[-1] // 2 + 1
        narrow = self._narrow(spatial[0])
        real, first = _forward_matrices(self.size, tuple(spatial), tuple(step), sign, np.dtype(dtype).str, narrow)
        lead = spatial[:-1]  # 2-D: the block's rows, transformed next
        ctype = np.result_type(dtype, np.complex64)
        out = np.empty(self.spectrum_shape + (rows,), dtype=ctype)
        if nd == 2:
            n0, l0 = self.size[0], spatial[0]

        def run(scratch: Any, c0: int, c1: int) -> None:
            cols = c1 - c0
            planes = scratch("half", lead + (2 * k, cols))
            np.matmul(real, np.moveaxis(x[c0:c1], 0, -1) if batch_first else x[..., c0:c1], out=planes)
            if nd == 2 and narrow:
                lines = scratch("lines", (k, l0, 2 * cols)).view(ctype)  # (frequency, block row, column)
                split = planes.reshape(l0, 2, k, cols).transpose(1, 2, 0, 3)
                lines.real = split[0]
                lines.imag = split[1]
                np.matmul(first, lines, out=out[..., c0:c1].transpose(1, 0, 2))
                return
            if nd == 2:
                full = scratch("full", (2 * n0, k * cols))
                np.matmul(first, planes.reshape(2 * l0, k * cols), out=full)
                planes = full
            planes = planes.reshape(self.spectrum_shape[:-1] + (2, k, cols))
            dst = out[..., c0:c1]
            dst.real = planes[..., 0, :, :]
            dst.imag = planes[..., 1, :, :]

        _by_columns(rows, *self._matrix_columns(spatial, False), dtype, run)
        return out.reshape(self.spectrum_shape + batch)

    def _inverse_by_matrices(self, spectrum: Any, where: Sequence[Any], into: Any | None = None) -> Any:
        """:meth:`inverse` (``first`` 0, pruned) as DFT matrix products, run by run of batch columns: the first
        axis by the block matrix on split planes of the spectrum — or, to few positions (:meth:`_narrow`: a
        weight gradient's taps), by one complex product per frequency on the spectrum as it is, splitting only
        its small result —, then the real axis by one real product."""
        nd = self.nd
        dtype = spectrum.real.dtype
        batch = spectrum.shape[nd:]
        rows = math.prod(batch)
        k = self.size[-1] // 2 + 1
        wanted = tuple(_integers(np.arange(size)[p] if isinstance(p, slice) else p)
                       for p, size in zip(where, self.size))
        narrow = self._narrow(len(wanted[0]))
        last, first = _inverse_matrices(self.size, wanted, np.dtype(dtype).str, np.dtype(spectrum.dtype).str, narrow)
        if nd == 2:
            n0, p0 = self.size[0], len(wanted[0])
        z = spectrum.reshape(spectrum.shape[:nd] + (rows,))
        counts = tuple(len(w) for w in wanted)
        out = np.empty(counts + (rows,), dtype=dtype) if into is None else None
        last_t = last.T

        def finish(planes: Any, c0: int, c1: int) -> None:
            """The real axis' product of ``planes`` (..., 2k, columns) into the columns' signal."""
            if into is None:
                np.matmul(last, planes, out=out[..., c0:c1])
                return
            inner = batch[-1]  # columns of one run of the innermost batch axis lie evenly in ``into``
            c = c0
            while c < c1:
                i0 = c % inner
                stop = min(c1, c - i0 + inner)
                dst = into[_unravel(c // inner, batch[:-1]) + (slice(i0, i0 + stop - c),)]
                src = planes[..., c - c0:stop - c0]
                if nd == 2:  # (positions, columns, last positions)
                    np.matmul(src.transpose(0, 2, 1), last_t, out=dst.transpose(1, 0, 2))
                else:
                    np.matmul(src.T, last_t, out=dst)
                c = stop

        def run(scratch: Any, c0: int, c1: int) -> None:
            cols = c1 - c0
            if nd == 2 and narrow:
                lines = scratch("lines", (k, p0, 2 * cols)).view(spectrum.dtype)  # (frequency, position, column)
                np.matmul(first, z[..., c0:c1].transpose(1, 0, 2), out=lines)
                planes = scratch("planes", (p0, 2, k, cols))
                planes[:, 0] = lines.real.transpose(1, 0, 2)
                planes[:, 1] = lines.imag.transpose(1, 0, 2)
                finish(planes.reshape(p0, 2 * k, cols), c0, c1)
                return
            planes = scratch("planes", z.shape[:-2] + (2, k, cols))  # (..., part, frequency, columns)
            src = z[..., c0:c1]
            planes[..., 0, :, :] = src.real
            planes[..., 1, :, :] = src.imag
            if nd == 2:
                half = scratch("half", (2 * p0, k * cols))  # rows (position, part)
                np.matmul(first, planes.reshape(2 * n0, k * cols), out=half)
                planes = half.reshape(p0, 2 * k, cols)
            else:
                planes = planes.reshape(2 * k, cols)
            finish(planes, c0, c1)

        _by_columns(rows, *self._matrix_columns(counts, True), dtype, run)
        return into if into is not None else out.reshape(counts + batch)

    def _narrow(self, lines: int) -> bool:
        """Whether a two-axis transform with ``lines`` block rows (forward) or wanted positions (inverse) along
        the first axis runs that axis as complex products on interleaved values: when they are at most half
        the transform's length, the complex values on that side are the fewer to interleave."""
        return self.nd == 2 and 2 * lines <= self.size[0]

    def _matrix_columns(self, extent: tuple[int, ...], inverse: bool) -> tuple[int, float]:
        """Scratch values and flops per batch column of the matrix products: forward of a block of ``extent``,
        or ``inverse`` to ``extent`` positions per axis."""
        k = self.size[-1] // 2 + 1
        if self.nd == 1:
            return 2 * k, 4.0 * k * extent[0]
        n0 = self.size[0]
        flops = 4.0 * k * extent[0] * (2 * n0 + extent[1])
        if self._narrow(extent[0]):
            return 4 * k * extent[0], flops
        return (n0 + extent[0]) * 2 * k, flops

    def scratch_bytes(self, extent: tuple[int, ...], columns: int, itemsize: int, inverse: bool = False) -> int:
        """Bytes of scratch a transform of ``columns`` batch columns allocates beyond its input and result (the
        matrix products' split planes, every partition's at once; ``extent`` as for :meth:`_matrix_columns`);
        0 for ``scipy.fft`` (its copies are the callers' to count)."""
        if not self.by_matrices(np.float32):
            return 0
        per_column, flops = self._matrix_columns(extent, inverse)
        width, ranges = _column_runs(columns, per_column * itemsize, flops)
        return sum(min(width, j1 - j0) for j0, j1 in ranges) * per_column * itemsize


def _column_runs(columns: int, bytes_per_column: int, flops_per_column: float) -> tuple[int, list[tuple[int, int]]]:
    """The run width (about ``MATRIX_DFT_CHUNK_BYTES`` of scratch) and the batch partitions' column ranges."""
    width = max(1, MATRIX_DFT_CHUNK_BYTES // max(bytes_per_column, 1))
    return width, batch_ranges(columns, partitions_for(columns, flops_per_column / GEMM_FLOPS_PER_OPERATION))


def _by_columns(columns: int, values_per_column: int, flops_per_column: float, dtype: Any, run: Any) -> None:
    """``run(scratch, c0, c1)`` over ``[0, columns)`` in runs of about ``MATRIX_DFT_CHUNK_BYTES`` of scratch
    planes (``values_per_column`` values of ``dtype`` and ``flops_per_column`` each), the runs split over the
    batch partitions (:mod:`cct.runtime.partition`), each partition's products on one BLAS thread (not
    OpenBLAS's own threads, which spin after a call and slow the partitioned work that follows);
    ``scratch(name, shape)``: a buffer of the partition's, reused by its runs."""
    dtype = np.dtype(dtype)
    width, ranges = _column_runs(columns, values_per_column * dtype.itemsize, flops_per_column)
    # every partition's planes allocated here, before any runs: the peak is the same however the threads interleave
    arenas = [np.empty(min(width, j1 - j0) * values_per_column, dtype=dtype) for j0, j1 in ranges]

    def body(part: int, j0: int, j1: int) -> None:
        arena, places = arenas[part], {}  # each plane's (offset, size), set by the partition's first (widest) run

        def scratch(name: str, shape: tuple[int, ...]) -> Any:
            if name not in places:
                places[name] = (sum(size for _, size in places.values()), math.prod(shape))
            start = places[name][0]
            return arena[start:start + math.prod(shape)].reshape(shape)

        with blas_threads(1):
            for c0 in range(j0, j1, width):
                run(scratch, c0, min(j1, c0 + width))

    run_partitions(ranges, body)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``np.unravel_index(flat, shape)`` for one index, in Python ints (a tenth of numpy's per-call cost)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _dft_split(n: int, rows: Any, cols: Any, sign: int, dtype: Any) -> Any:
    """The DFT matrix ``exp(sign·2πi·r·c/n)`` for frequencies or positions ``rows`` × ``cols`` (integers) as its
    real and imaginary parts ``(2, len(rows), len(cols))`` in ``dtype`` (computed in float64).  Made once per
    arguments and read-only: every pass of a layer asks for the same few (the cosines and sines took ~50 us a
    call, a dozen calls a CaffeNet layer pass, outside the batch partitions)."""
    return _dft_split_made(int(n), _integers(rows), _integers(cols), int(sign), np.dtype(dtype).str)


@functools.lru_cache(maxsize=256)
def _forward_matrices(size: tuple[int, ...], spatial: tuple[int, ...], step: tuple[int, ...], sign: int, dtype: str,
                      narrow: bool) -> tuple[Any, Any]:
    """:meth:`FFTPlan._forward_by_matrices`' matrices for a block of ``spatial`` values ``step`` apart: the real
    axis' split DFT ``(2k, spatial[-1])``, and for two axes the first axis' — complex ``(n0, l0)`` for a
    ``narrow`` block (:meth:`FFTPlan._narrow`), else its real block form ``(2·n0, 2·l0)`` — or None.  Made once
    each, read-only."""
    n, k = size[-1], size[-1] // 2 + 1
    real = _dft_split(n, np.arange(k), np.arange(spatial[-1]) * step[-1], sign, dtype).reshape(2 * k, spatial[-1])
    first = None
    if len(size) == 2:
        first = _dft_split(size[0], np.arange(size[0]), np.arange(spatial[0]) * step[0], sign, dtype)
        first = (first[0] + 1j * first[1]).astype(np.result_type(np.dtype(dtype), np.complex64)) if narrow \
            else _complex_block(first)
        first.flags.writeable = False
    return real, first


@functools.lru_cache(maxsize=256)
def _inverse_matrices(size: tuple[int, ...], wanted: tuple[tuple[int, ...], ...], dtype: str,
                      complex_dtype: str, narrow: bool) -> tuple[Any, Any]:
    """:meth:`FFTPlan._inverse_by_matrices`' matrices to the ``wanted`` positions per axis: the real axis'
    ``(len(wanted[-1]), 2k)`` (irfft's weights folded in) and for two axes the first axis' — complex to
    ``narrow`` positions (:meth:`FFTPlan._narrow`), else its real block form — or None.  Made once each,
    read-only."""
    k, n = size[-1] // 2 + 1, size[-1]
    # irfft: the bins between 0 and the Nyquist one count twice (their mirror images); the imaginary parts
    # of bin 0 and of the Nyquist bin are ignored — their sines are 0 at every position
    twice = np.where((np.arange(k) == 0) | (2 * np.arange(k) == n), 1.0, 2.0)
    last = _dft_split(n, wanted[-1], np.arange(k), 1, np.float64) * twice / math.prod(size)
    last[1] *= -1  # out = Σ Re(A)·Re(Y) - Im(A)·Im(Y)
    last = np.ascontiguousarray(last.transpose(1, 0, 2).reshape(len(wanted[-1]), 2 * k), dtype=dtype)
    last.flags.writeable = False
    first = None
    if len(size) == 2:
        first = _dft_split(size[0], wanted[0], np.arange(size[0]), 1, dtype)
        first = (first[0] + 1j * first[1]).astype(complex_dtype) if narrow else _complex_block(first)
        first.flags.writeable = False
    return last, first


def _integers(values: Any) -> tuple[int, ...]:
    return tuple(np.asarray(values).ravel().tolist())


@functools.lru_cache(maxsize=512)
def _dft_split_made(n: int, rows: tuple[int, ...], cols: tuple[int, ...], sign: int, dtype: str) -> Any:
    ints = np.int64
    angle = (sign * 2 * np.pi / n) * np.outer(np.asarray(rows, dtype=ints) % n, np.asarray(cols, dtype=ints) % n)
    out = np.stack([np.cos(angle), np.sin(angle)]).astype(dtype)
    out.flags.writeable = False
    return out


def _complex_block(m: Any) -> Any:
    """The real matrix acting as the complex matrix ``m = (2, R, C)`` (real, imaginary parts) on split vectors:
    rows ``(row, part)``, columns ``(column, part)``."""
    c, s = m[0], m[1]
    out = np.empty((c.shape[0], 2, c.shape[1], 2), dtype=m.dtype)  # (row, out part, column, in part)
    out[:, 0, :, 0], out[:, 0, :, 1], out[:, 1, :, 0], out[:, 1, :, 1] = c, -s, s, c
    return out.reshape(2 * c.shape[0], 2 * c.shape[1])


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
