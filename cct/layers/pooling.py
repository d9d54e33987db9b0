"""Pooling (Caffe's ``pooling_layer``): MAX, AVE and STOCHASTIC over windows of the spatial axes.

The arithmetic lives in :class:`Pooler`, which works on ``(N, C, *spatial)`` arrays with any number of
spatial axes and loops only over kernel offsets; the Pooling layer (4-D as Caffe, plus N-D volumes such as
``(N, C, D, H, W)``) and SPP use it.  MAX and AVE pooling of numpy float32/float64 arrays run the compiled
kernels of :mod:`cct.native` where they are built (the same bits: the same comparisons, and additions in the same
order), their array-module bodies everywhere else.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cct import native
from cct.blob import Blob
from cct.device import chunk_bytes, get_array_module
from cct.errors import CctError, ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb
from cct.rng import get_rng
from cct.runtime.partition import batch_ranges, partitions_for, run_partitions

# MAX pooling walks the batch in chunks of images whose padded input takes at most this many bytes, so that the
# kernel offsets' passes over a chunk (its padded copy, maxima and, in training, winner codes) run in the core's
# cache: pool1 of CaffeNet (32 images of 96x55x55 per partition) forward + backward 31 -> 19 ms in training
# (winners found in forward), forward 13.6 -> 7.8 ms in TEST
MAX_POOL_CHUNK_BYTES = 2 << 20
# ... and scans a chunk as whole-chunk runs where the padded phase planes are at most this much larger than the
# output planes: every kernel offset's cells then lie at one fixed shift of the phase buffer's flat storage, so
# each pass over them is one contiguous run (the positions past an output row's end read neighbouring cells and
# are dropped) instead of one short row at a time — CaffeNet pool1 training forward 13.4 -> 9.7 ms per 32
# images on one thread, pool2 11.4 -> 7.3 ms (numpy's per-row loop overhead dominated rows of 27 and 13 cells)
FLAT_SCAN_MAX_OVERHEAD = 1.5
# ... and finds the winners in groups of up to this many kernel offsets (a stack of flags per group)
SCAN_GROUP = 16
# the compiled MAX and AVE pooling (cct.native) take windows of up to this many spatial axes
COMPILED_MAX_AXES = 8
FLT_MAX = 3.4028234663852886e38
FLT_MIN = 1.1754943508222875e-38
MAX, AVE, STOCHASTIC = pb.PoolingParameter.MAX, pb.PoolingParameter.AVE, pb.PoolingParameter.STOCHASTIC
_METHOD_NAMES = {MAX: "MAX", AVE: "AVE", STOCHASTIC: "STOCHASTIC"}


def pooled_shape(in_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int], pad: Sequence[int],
                 ceil_mode: bool = True) -> tuple[int, ...]:
    """Caffe's output size: ``ceil((in + 2*pad - kernel) / stride) + 1`` (floor in FLOOR mode); when any pad
    is non-zero, every axis drops its last window if that window would start at or beyond ``in + pad``
    (Caffe's "last pooling starts strictly inside the image" correction; none without padding, so windows
    entirely outside the image are possible then)."""
    out = []
    for n, k, s, p in zip(in_shape, kernel, stride, pad):
        num = n + 2 * p - k
        out.append((-(-num // s) if ceil_mode else num // s) + 1)
    if any(pad):
        out = [o - 1 if (o - 1) * s >= n + p else o for o, n, s, p in zip(out, in_shape, stride, pad)]
    return tuple(out)


def check_pool_window(method: int, kernel: Sequence[int], stride: Sequence[int], pad: Sequence[int],
                      field: str, names: Sequence[str] = ("kernel_size", "stride", "pad")) -> None:
    """Caffe's checks on a window: kernel > 0, stride > 0, padding only for MAX/AVE and below the kernel.
    Errors name ``field`` + the field that gave the kernel, stride or pad (``names``)."""
    kernel_name, stride_name, pad_name = names
    if any(k <= 0 for k in kernel):
        raise ParamError(f"{field}.{kernel_name}", f"Filter dimensions cannot be zero (kernel {_dims(kernel)})")
    if any(s <= 0 for s in stride):
        raise ParamError(f"{field}.{stride_name}", f"stride must be > 0 (stride {_dims(stride)})")
    if any(pad):
        if method not in (MAX, AVE):
            raise ParamError(f"{field}.{pad_name}", f"Padding implemented only for average and max pooling "
                                                    f"(pool {_METHOD_NAMES.get(method, method)}, pad {_dims(pad)})")
        if any(p >= k for p, k in zip(pad, kernel)):
            raise ParamError(f"{field}.{pad_name}", f"pad must be smaller than the kernel (pad {_dims(pad)}, "
                                                    f"kernel {_dims(kernel)})")


def _dims(t: Sequence[int]) -> str:
    return " x ".join(str(v) for v in t)


class Pooler:
    """Pooling of ``(N, C, *in_shape)`` into ``(N, C, *out_shape)`` with one window geometry.

    Windows start at ``o*stride - pad``.  MAX: Caffe's scan (initial ``-FLT_MAX``, update on strictly
    greater, kernel offsets in row-major order, so ties keep the lowest flat index); the argmax is kept
    as the flat index within the channel plane (``h*W + w``), ``-1`` for a window without cells.  AVE: sum
    over the window clipped to the image, divided by Caffe's ``pool_size`` (the window clipped to
    ``[-pad, in + pad)``, padding included; a window entirely outside gives 0/0 = NaN as in Caffe).
    STOCHASTIC: TEST ``Σx² / (FLT_MIN + Σx)``; TRAIN samples one cell with probability ∝ its activation
    (threshold ``u·Σx`` on the running sum, row-major scan), as Caffe's GPU kernel.
    """

    def __init__(self, method: int, in_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
                 pad: Sequence[int], ceil_mode: bool = True, dilation: Sequence[int] | None = None):
        self.method = method
        self.in_shape, self.kernel = tuple(in_shape), tuple(kernel)
        self.stride, self.pad = tuple(stride), tuple(pad)
        self.dilation = tuple(dilation) if dilation is not None else (1,) * len(self.kernel)
        # the window's extent: cell j of a window sits j*dilation after its start (sparse max-filtering)
        self.extent = tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilation))
        self.out_shape = pooled_shape(in_shape, self.extent, stride, pad, ceil_mode)
        if any(o <= 0 for o in self.out_shape):
            raise ParamError("pooling_param.kernel_size",
                             f"kernel larger than padded input: input {_dims(self.in_shape)}, pad "
                             f"{_dims(self.pad)}, kernel {_dims(self.kernel)} give output "
                             f"{_dims(self.out_shape)}")
        # padded extent: the image plus pad, plus whatever the (ceil-mode) last window overhangs
        self.padded_shape = tuple(max(n + 2 * p, (o - 1) * s + k) for n, p, o, s, k
                                  in zip(self.in_shape, self.pad, self.out_shape, self.stride, self.extent))
        # the padded extent split by stride phase: padded cell p of axis i is held in phase p % stride at
        # position p // stride, so each kernel offset's cells form one unit-stride block (vectorised loops)
        self.phase_extent = tuple(-(-e // s) for e, s in zip(self.padded_shape, self.stride))
        self.phase_plane = math.prod(self.phase_extent)
        self.flat_scan = self.phase_plane <= FLAT_SCAN_MAX_OVERHEAD * math.prod(self.out_shape)  # MAX (see there)
        self._blocks: list[tuple[tuple[Any, ...], tuple[slice, ...]]] | None = None
        self._buffers: dict[str, Any] = {}
        self._winners_kept = False  # whether the last MAX forward kept each window's winner (training)
        self._index: Any = None
        self._tables: dict[Any, Any] = {}  # per array module (and dtype): offset tables, divisors
        self._stats: tuple[Any, Any] | None = None
        self.plane = math.prod(self.in_shape)

    # ---- helpers -------------------------------------------------------------------------------
    def _buf(self, name: str, shape: tuple[int, ...], like: Any, fill: float | None = None,
             dtype: Any = None) -> Any:
        xp = get_array_module(like)
        dtype = like.dtype if dtype is None else np.dtype(dtype)
        b = self._buffers.get(name)
        if b is None or b.shape != shape or b.dtype != dtype or get_array_module(b) is not xp:
            b = xp.full(shape, fill if fill is not None else 0, dtype=dtype)
            self._buffers[name] = b
        return b

    def _phase_blocks(self) -> list[tuple[tuple[Any, ...], tuple[slice, ...]]]:
        """Per stride phase holding image cells: its block in the phase buffer and the matching strided slice
        of the image (every image cell in exactly one block)."""
        if self._blocks is None:
            self._blocks = []
            for phase in itertools.product(*(range(s) for s in self.stride)):
                bsl, xsl = [], []
                for r, s, p, n in zip(phase, self.stride, self.pad, self.in_shape):
                    first, last = -((r - p) // s), (n - 1 + p - r) // s  # positions whose cell is in the image
                    if last < first:
                        break
                    bsl.append(slice(first, last + 1))
                    xsl.append(slice(r + s * first - p, r + s * last - p + 1, s))
                else:
                    self._blocks.append((phase + (slice(None), slice(None)) + tuple(bsl),
                                         (slice(None), slice(None)) + tuple(xsl)))
        return self._blocks

    def _phase_buffer(self, name: str, like: Any, fill: float = 0.0) -> Any:
        """A buffer ``(*stride, N, C, *phase_extent)`` for the padded extent of ``like``'s batch; the cells
        outside the image keep ``fill`` (written once)."""
        return self._buf(name, self.stride + like.shape[:2] + self.phase_extent, like, fill)

    def _padded(self, x: Any, fill: float, images: int | None = None) -> Any:
        """``x`` in a phase buffer whose border (padding and overhang) holds ``fill``; with ``images``, a view
        of the first ``len(x)`` images of a buffer for that many (chunks of one size share it)."""
        return self._padded_storage(x, fill, images)[0]

    def _padded_storage(self, x: Any, fill: float, images: int | None = None) -> tuple[Any, Any, int]:
        """:meth:`_padded`, with the buffer's flat storage (each phase's ``(images, C, *phase_extent)`` block
        in turn, then ``fill`` cells past the largest kernel-offset shift) and the size of one phase's block."""
        n = x.shape[0]
        block = (n if images is None else images) * x.shape[1] * self.phase_plane
        phases = math.prod(self.stride)
        tail = max(shift for _, shift in self._flat_shifts())
        flat = self._buf(f"x_pad{fill}", (phases * block + tail,), x, fill)
        shape = self.stride + (n if images is None else images,) + x.shape[1:2] + self.phase_extent
        buf = flat[:phases * block].reshape(shape)[(slice(None),) * len(self.stride) + (slice(0, n),)]
        for bsl, xsl in self._phase_blocks():
            buf[bsl] = x[xsl]
        return buf, flat, block

    def _flat_shifts(self) -> list[tuple[int, int]]:
        """Per kernel offset (row-major): the stride phase holding its cells (flat over the stride axes) and
        the shift of its first window's cell within that phase's ``(N, C, *phase_extent)`` block."""
        if "shifts" not in self._tables:
            shifts = []
            for off in itertools.product(*(range(k) for k in self.kernel)):
                phase, shift = 0, 0
                for q, d, s, e in zip(off, self.dilation, self.stride, self.phase_extent):
                    phase = phase * s + (q * d) % s
                    shift = shift * e + (q * d) // s
                shifts.append((phase, shift))
            self._tables["shifts"] = shifts
        return self._tables["shifts"]

    def _flat_cells(self, flat: Any, block: int, length: int) -> list[Any]:
        """Per kernel offset, its cells for the first ``length`` positions of the ``(n, C, *phase_extent)``
        grid, as one contiguous run of the phase buffer's flat storage ``flat`` (phase blocks of ``block``):
        positions inside ``out_shape`` read exactly their window's cell, the others whatever follows."""
        return [flat[p * block + shift:p * block + shift + length] for p, shift in self._flat_shifts()]

    def _max_chunks(self, x: Any) -> list[tuple[int, int]]:
        """MAX pooling's image chunks of ``x`` (see ``MAX_POOL_CHUNK_BYTES``; a device array's by
        :func:`cct.device.chunk_bytes`), in order."""
        per_image = x.shape[1] * x.itemsize
        for s, e in zip(self.stride, self.phase_extent):
            per_image *= s * e
        step = max(1, chunk_bytes(get_array_module(x), MAX_POOL_CHUNK_BYTES) // max(per_image, 1))
        return [(a, min(a + step, x.shape[0])) for a in range(0, x.shape[0], step)]

    def _scratch(self, name: str, shape: tuple[int, ...], images: int, like: Any, dtype: Any) -> Any:
        """A ``shape`` view of a buffer for ``images`` images (the largest chunk; ``shape[0]`` at most)."""
        return self._buf(name, (images,) + shape[1:], like, dtype=dtype)[:shape[0]]

    def _unpad(self, gbuf: Any, dx: Any, accumulate: bool) -> None:
        """The image cells of the phase buffer ``gbuf`` into ``dx`` (added when ``accumulate``)."""
        for bsl, xsl in self._phase_blocks():
            if accumulate:
                dx[xsl] += gbuf[bsl]
            else:
                dx[xsl] = gbuf[bsl]

    def _offsets(self, xp: Any = np) -> list[tuple[tuple[slice, ...], Any, Any]]:
        """Per kernel offset (row-major): the index of the phase buffer holding that cell of every window,
        the cell's flat index within the channel plane (``h*W + w`` in 2-D) and whether it lies inside the
        image — arrays shaped ``out_shape`` (computed once per array module)."""
        table = self._tables.get(xp)
        if table is None:
            table = self._tables[xp] = [self._offset_entry(off, xp) for off in
                                        itertools.product(*(range(k) for k in self.kernel))]
        return table

    def _offset_entry(self, off: tuple[int, ...], xp: Any) -> tuple[tuple[slice, ...], Any, Any]:
        nd = len(off)
        # kernel offset q of a window with dilation d is padded cell s*o + q*d: phase (q*d) % s, from (q*d) // s
        cells = tuple(q * d for q, d in zip(off, self.dilation))
        sl = tuple(c % s for c, s in zip(cells, self.stride)) + (slice(None), slice(None)) + tuple(
            slice(c // s, c // s + o) for c, s, o in zip(cells, self.stride, self.out_shape))
        index, inside, mult = 0, True, 1
        for i in reversed(range(nd)):
            shape = [1] * nd
            shape[i] = self.out_shape[i]
            pos = (xp.arange(self.out_shape[i]) * self.stride[i] - self.pad[i]
                   + off[i] * self.dilation[i]).reshape(shape)
            index = index + pos * mult
            inside = inside & (pos >= 0) & (pos < self.in_shape[i])
            mult *= self.in_shape[i]
        return sl, index, inside

    def _pool_size(self, xp: Any, dtype: Any) -> tuple[Any, Any]:
        """Caffe's AVE divisor per window and its safe inverse (0 for windows without image cells)."""
        key = (xp, np.dtype(dtype))
        if key in self._tables:
            return self._tables[key]
        size, nonempty = 1, True
        nd = len(self.kernel)
        for i, (n, k, s, p, o) in enumerate(zip(self.in_shape, self.kernel, self.stride, self.pad,
                                                self.out_shape)):
            shape = [1] * nd
            shape[i] = o
            start = xp.arange(o).reshape(shape) * s - p
            extent = xp.minimum(start + k, n + p) - start
            size = size * extent
            nonempty = nonempty & (extent > 0)
        size = xp.asarray(size, dtype=dtype)
        inv = xp.where(nonempty, 1 / xp.where(nonempty, size, 1), 0).astype(dtype)
        self._tables[key] = (size, inv)
        return size, inv

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: Any, y: Any, train: bool = True, mask: Any | None = None) -> None:
        """``y`` (N, C, *out) from ``x`` (N, C, *in); MAX writes its argmax into ``mask`` if given."""
        xp = get_array_module(x)
        if self.method == MAX:
            self._forward_max(x, y, mask, xp, train)
        elif self.method == AVE:
            compiled = self._compiled(x, y)
            if compiled is not None:
                compiled.ave_pool_forward(self._geometry(x), x, self._pool_size(np, y.dtype)[0], y)
                return
            buf = self._padded(x, 0.0)
            for j, (sl, _, _) in enumerate(self._offsets(xp)):
                if j == 0:
                    y[...] = buf[sl]
                else:
                    y += buf[sl]
            with np.errstate(divide="ignore", invalid="ignore"):
                y /= self._pool_size(xp, y.dtype)[0]  # Caffe divides unguarded: 0/0 -> NaN
        elif self.method == STOCHASTIC:
            if train:
                self._forward_stochastic_train(x, y, xp)
            else:
                buf = self._padded(x, 0.0)
                s1 = self._buf("s1", y.shape, y)
                s2 = self._buf("s2", y.shape, y)
                s1.fill(FLT_MIN)
                s2.fill(0)
                for sl, _, _ in self._offsets(xp):
                    cell = buf[sl]
                    s1 += cell
                    s2 += cell * cell
                xp.divide(s2, s1, out=y)
                self._stats = (s1, s2)
        else:
            raise ParamError("pooling_param.pool", f"Unknown pooling method {self.method}")

    def _forward_max(self, x: Any, y: Any, mask: Any | None, xp: Any, train: bool = True) -> None:
        """MAX: the maxima by ``fmax`` over the kernel offsets (NaN never wins, as with Caffe's strictly-greater
        scan), kept privately for backward (the top may be changed in place after forward); in training (and
        with a mask top) also each window's winning cell (:meth:`_scan_max`), kept for backward as Caffe keeps
        its mask — the bottom may change in place before backward (an in-place layer on a Split sibling) —,
        and with a mask top the argmax (``-1`` for a window without a cell above ``-FLT_MAX``).  In chunks of
        images (:meth:`_max_chunks`), each padded into a chunk-sized buffer and scanned while in the cache."""
        ymax = self._buf("ymax", y.shape, y)
        keep = train or mask is not None
        kept = self._buf("winners", y.shape, y, dtype=self._code_dtype()) if keep else None
        self._winners_kept = keep
        compiled = self._compiled(x, ymax)
        if compiled is not None:
            direct = y.dtype == ymax.dtype and y.flags.c_contiguous
            compiled.max_pool_forward(self._geometry(x), x, ymax, y if direct else None, kept, self._code_bytes())
            if not direct:
                xp.copyto(y, ymax)
            if mask is not None:
                mask[...] = xp.where(kept > 0, self._winner_index(xp, kept, self._code_base(xp)), -1)
            self._index = None
            return
        chunks = self._max_chunks(x)
        images = chunks[0][1]
        for a, b in chunks:
            winner = None if kept is None else kept[a:b]
            self._max_chunk(xp, x[a:b], images, ymax[a:b], winner, y[a:b])
            if mask is not None:
                local = self._winner_index(xp, winner, self._code_base(xp))
                mask[a:b] = xp.where(winner > 0, local, -1)
        self._index = None

    def _max_chunk(self, xp: Any, x: Any, images: int, ymax: Any, winner: Any | None,
                   y: Any | None = None) -> None:
        """One chunk's window maxima into ``ymax`` (and ``y`` when given, while they are in the cache) and,
        when given, its winner codes into ``winner`` (all ``(n, C, *out_shape)``; ``images``: the chunk size
        the scratch buffers are made for).  With :attr:`flat_scan` over the whole ``(n, C, *phase_extent)``
        grid in contiguous runs, then cut to ``out_shape``; else over strided views shaped like the output."""
        buf, flat, block = self._padded_storage(x, float("-inf"), images)  # padding never beats -FLT_MAX
        if not self.flat_scan:
            self._scan_max(xp, [buf[sl] for sl, _, _ in self._offsets(xp)], ymax, winner, images)
            if y is not None:
                xp.copyto(y, ymax)
            return
        length = x.shape[0] * x.shape[1] * self.phase_plane
        grid = (x.shape[0], x.shape[1]) + self.phase_extent
        wide = self._scratch("ymax_wide", (length,), block, ymax, ymax.dtype)
        wide_winner = None if winner is None else self._scratch("winner_wide", (length,), block, ymax,
                                                                 winner.dtype)
        self._scan_max(xp, self._flat_cells(flat, block, length), wide, wide_winner, block)
        inside = (Ellipsis,) + tuple(slice(0, o) for o in self.out_shape)
        xp.copyto(ymax, wide.reshape(grid)[inside])
        if y is not None:
            xp.copyto(y, ymax)  # contiguous: 5x cheaper than cutting the wide grid again
        if winner is not None:
            xp.copyto(winner, wide_winner.reshape(grid)[inside])

    def _compiled(self, *arrays: Any) -> Any:
        """The compiled kernels (:mod:`cct.native`) when they run this MAX or AVE pooling: up to
        ``COMPILED_MAX_AXES`` spatial axes (MAX: at most 255 kernel cells, one-byte winner codes), and ``arrays``
        numpy float32 or float64 arrays of one dtype, C-contiguous; else None."""
        compiled = native.kernels()
        if compiled is None or len(self.kernel) > COMPILED_MAX_AXES or (
                self.method == MAX and self._code_dtype() != np.uint8):
            return None
        return compiled if native.takes(*arrays) else None

    def _geometry(self, x: Any) -> tuple[int, ...]:
        """The compiled kernels' geometry for a batch like ``x``: planes, spatial axes, then per axis the input and
        output extents, kernel, stride, pad and dilation (1-D pooling as rows of one: the kernels take 2 axes or
        more).  Kept per plane count (a layer's calls ask for a few)."""
        key = ("geometry", x.shape[0] * x.shape[1])
        geometry = self._tables.get(key)
        if geometry is None:
            lead = len(self.kernel) == 1
            fields = [(1, self.in_shape), (1, self.out_shape), (1, self.kernel), (1, self.stride), (0, self.pad),
                      (1, self.dilation)]
            axes = len(self.kernel) + lead
            geometry = self._tables[key] = (key[1], axes) + tuple(v for one, t in fields
                                                                  for v in (one,) * lead + tuple(t))
        return geometry

    def _code_bytes(self) -> Any:
        """Per kernel offset its winner code (:meth:`_codes`), as the compiled forward takes them."""
        return self._codes(np).reshape(-1)

    def _code_deltas(self) -> Any:
        """Per winner code 0-255: its cell's flat in-plane offset from the window's first cell (0 where no
        offset has that code), as the compiled backward takes them."""
        if "code_deltas" not in self._tables:
            table = np.zeros(256, dtype=np.int64)
            for code, delta in zip(self._codes(np).reshape(-1), self._offset_deltas()):
                table[int(code)] = delta
            self._tables["code_deltas"] = table
        return self._tables["code_deltas"]

    def _code_dtype(self) -> Any:
        """The winner codes' dtype: 0 (no winner) and :meth:`_codes`' values."""
        if self._delta_codes():
            return np.uint8
        k = len(self._offsets())
        return np.uint8 if k < 255 else np.uint16 if k < 65535 else np.int64

    def _delta_codes(self) -> bool:
        """Whether each kernel offset's code is its cell's flat in-plane offset from the window's first cell,
        plus 1 (so backward finds a winner's cell by one addition): when those offsets grow with the kernel
        offset (a window narrower than the image) and fit a byte; else offset ``j``'s code is ``j + 1``."""
        if "delta_codes" not in self._tables:
            deltas = self._offset_deltas()
            self._tables["delta_codes"] = all(a < b for a, b in zip(deltas, deltas[1:])) and deltas[-1] + 1 < 255
        return self._tables["delta_codes"]

    def _offset_deltas(self) -> list[int]:
        """Per kernel offset (row-major): its cell's flat in-plane offset from the window's first cell."""
        deltas = []
        for off in itertools.product(*(range(k) for k in self.kernel)):
            d, mult = 0, 1
            for i in reversed(range(len(off))):
                d += off[i] * self.dilation[i] * mult
                mult *= self.in_shape[i]
            deltas.append(d)
        return deltas

    def _codes(self, xp: Any) -> Any:
        """Per kernel offset, its winner code (increasing with the offset), as a column ``(K, 1)``."""
        key = ("codes", xp)
        if key not in self._tables:
            k = len(self._offsets())
            codes = [d + 1 for d in self._offset_deltas()] if self._delta_codes() else list(range(1, k + 1))
            self._tables[key] = xp.asarray(codes, dtype=self._code_dtype()).reshape(-1, 1)
        return self._tables[key]

    def _scan_max(self, xp: Any, cells: list[Any], ymax: Any, winner: Any | None, room: int) -> None:
        """``ymax`` = the maximum of each position's ``cells`` (one array per kernel offset, row-major, shaped
        like ``ymax``) and ``-FLT_MAX``; with ``winner``, the code (:meth:`_codes`) of the cell Caffe's scan
        keeps — each cell that is strictly greater than the running maximum replaces it, so the winner is the
        last such cell (the first equal to the maximum; NaN never is) —, 0 where no cell exceeds ``-FLT_MAX``.
        Each offset's "greater" flags go into a stack of up to ``SCAN_GROUP`` offsets, whose codes one
        product and one maximum over the stack then give: few, long calls.  ``room``: positions the scratch
        buffers are made for."""
        ymax.fill(-FLT_MAX)
        if winner is None:
            for cell in cells:
                xp.fmax(ymax, cell, out=ymax)
            return
        codes = self._codes(xp)
        k = len(cells)
        group = min(k, SCAN_GROUP)
        stack = self._buf("greater", (group, room) + ymax.shape[1:], ymax, dtype=winner.dtype)[:, :len(ymax)]
        in_place = winner.dtype == np.uint8  # the flags in the stack itself: a byte product (bool x byte is slow)
        flags = stack.view(bool) if in_place else self._buf(
            "greater_flags", (group, room) + ymax.shape[1:], ymax, dtype=bool)[:, :len(ymax)]
        best = winner if k <= group else self._scratch("group_winner", ymax.shape, room, ymax, winner.dtype)
        for g0 in range(0, k, group):
            g1 = min(k, g0 + group)
            for j in range(g0, g1):
                xp.greater(cells[j], ymax, out=flags[j - g0])
                xp.fmax(ymax, cells[j], out=ymax)
            part = stack[:g1 - g0]
            xp.multiply(part if in_place else flags[:g1 - g0], codes[g0:g1].reshape((g1 - g0,) + (1,) * ymax.ndim),
                        out=part)
            xp.max(part, axis=0, out=best)
            if best is not winner:  # later groups' codes are larger: a later winner replaces an earlier one
                if g0 == 0:
                    xp.copyto(winner, best)
                else:
                    xp.maximum(winner, best, out=winner)

    def _winner_index(self, xp: Any, winner: Any, base: Any, out: Any | None = None) -> Any:
        """Each winning cell's flat index from its window's ``base`` (:meth:`_code_base`); meaningless where
        ``winner`` is 0."""
        if self._delta_codes():
            return xp.add(winner, base, out=out)
        deltas = self._cell_deltas(xp)
        if out is None:
            return xp.take(deltas, winner) + base
        xp.take(deltas, winner, out=out, **({"mode": "clip"} if xp is np else {}))
        out += base
        return out

    def _window_start(self, xp: Any) -> Any:
        """The flat in-plane index (``h*W + w``) of each window's first (possibly padded) cell, ``out_shape``."""
        key = ("start", xp)
        if key not in self._tables:
            start, mult = 0, 1
            nd = len(self.kernel)
            for i in reversed(range(nd)):
                shape = [1] * nd
                shape[i] = self.out_shape[i]
                start = start + (xp.arange(self.out_shape[i]) * self.stride[i] - self.pad[i]).reshape(shape) * mult
                mult *= self.in_shape[i]
            self._tables[key] = xp.asarray(start, dtype=np.intp)
        return self._tables[key]

    def _cell_deltas(self, xp: Any) -> Any:
        """Per winner code (offset codes: 0 none, ``j + 1`` kernel offset ``j``): the cell's flat in-plane offset
        from its window's first cell."""
        key = ("deltas", xp)
        if key not in self._tables:
            self._tables[key] = xp.asarray([0] + self._offset_deltas(), dtype=np.intp)
        return self._tables[key]

    def _backward_max(self, dy: Any, dx: Any, x: Any | None, accumulate: bool, xp: Any, positive: bool = False
                      ) -> None:
        """Route each window's ``dy`` to the cell its forward scan kept: the flat index of that cell in ``dx``
        (the window's start plus the winning offset's delta, plus the plane's base) and one in-order scatter,
        chunk by chunk.  The winners are forward's; after a forward that kept none (TEST phase) they are found
        again from the bottom ``x``, which must still hold what forward saw (its maxima are checked)."""
        ymax = self._buffers["ymax"]
        compiled = self._compiled(dy, dx, ymax)
        if compiled is not None and (self._winners_kept or self._compiled(x, ymax) is not None):
            if self._winners_kept:
                winner = self._buffers["winners"]
            else:
                check = self._buf("check", ymax.shape, ymax)
                winner = self._buf("winner", ymax.shape, ymax, dtype=np.uint8)
                compiled.max_pool_forward(self._geometry(x), x, check, None, winner, self._code_bytes())
                self._check_bottom_unchanged(xp, check, ymax)
            compiled.max_pool_backward(self._geometry(dx), dy, ymax, winner, self._code_deltas(), dx, accumulate,
                                       positive)
            return
        chunks = self._max_chunks(dy)
        images = chunks[0][1]
        for a, b in chunks:
            if self._winners_kept:
                winner = self._buffers["winners"][a:b]
            else:
                if x is None:
                    raise CctError("max pooling backward after a TEST-phase forward needs its bottom data")
                check = self._scratch("check", ymax[a:b].shape, images, ymax, ymax.dtype)
                winner = self._scratch("winner", ymax[a:b].shape, images, ymax, self._code_dtype())
                self._max_chunk(xp, x[a:b], images, check, winner)
                self._check_bottom_unchanged(xp, check, ymax[a:b])
            index = self._winner_index(xp, winner, self._code_base(xp, winner.shape),
                                       out=self._scratch("flat_index", winner.shape, images, dy, np.intp))
            routed = dy[a:b]
            if positive:  # dy·(max > 0), as ReLU's backward multiplies (non-finite gradients stay non-finite)
                above = xp.greater(ymax[a:b], 0, out=self._scratch("above", routed.shape, images, dy, bool))
                routed = xp.multiply(routed, above, out=self._scratch("dy_positive", routed.shape, images, dy,
                                                                      dy.dtype))
            self._scatter_add(routed, dx[a:b], index, None if winner.all() else winner > 0, accumulate, xp)

    @staticmethod
    def _check_bottom_unchanged(xp: Any, check: Any, ymax: Any) -> None:
        if not bool(xp.array_equal(check, ymax)):
            raise CctError("max pooling backward: the bottom changed since the TEST-phase forward (an in-place "
                           "layer on data it shares); run forward again before backward")

    def _code_base(self, xp: Any, shape: tuple[int, ...] | None = None) -> Any:
        """What :meth:`_winner_index` adds each window's winner to: the flat in-plane index of the window's first
        cell (:meth:`_window_start`), less 1 with offset-delta codes (:meth:`_delta_codes`); for a top chunk
        of ``shape``, the flat index in the bottom chunk (plus the plane's base).  One table per chunk shape."""
        key = ("code_base", xp, shape)
        if key not in self._tables:
            base = self._window_start(xp) - (1 if self._delta_codes() else 0)
            self._tables[key] = base if shape is None else self._plane_base(shape, xp) + base
        return self._tables[key]

    def _plane_base(self, shape: tuple[int, ...], xp: Any) -> Any:
        """``(n*C + c) * plane`` for a top of ``shape``, broadcastable against it."""
        key = ("base", xp, shape[:2])
        if key not in self._tables:
            planes = shape[0] * shape[1]
            base = xp.arange(planes, dtype=np.intp) * self.plane
            self._tables[key] = base.reshape(shape[:2] + (1,) * (len(shape) - 2))
        return self._tables[key]

    def _forward_stochastic_train(self, x: Any, y: Any, xp: Any) -> None:
        buf = self._padded(x, 0.0)
        total = self._buf("s1", y.shape, y)
        total.fill(0)
        for sl, _, _ in self._offsets(xp):
            total += buf[sl]
        u = get_rng().random(y.shape, dtype=np.float64 if y.dtype == np.float64 else np.float32)
        thres = total * xp.asarray(u, dtype=y.dtype)
        running = self._buf("running", y.shape, y)
        running.fill(0)
        chosen = self._buf("chosen", y.shape, y, dtype=bool)
        chosen.fill(False)
        hit = self._buf("better", y.shape, y, dtype=bool)
        idx = self._buf("index", y.shape, y, dtype=np.int64)
        idx.fill(-1)
        y.fill(0)  # a window whose running sum never reaches the threshold outputs 0 (Caffe: stale value)
        for sl, index, inside in self._offsets(xp):
            cell = buf[sl]
            running += cell
            xp.greater_equal(running, thres, out=hit)
            hit &= ~chosen
            hit &= inside
            xp.copyto(y, cell, where=hit)
            xp.copyto(idx, index, where=hit)
            chosen |= hit
        self._index = idx

    # ---- backward ------------------------------------------------------------------------------
    def backward(self, dy: Any, dx: Any, x: Any | None = None, mask: Any | None = None,
                 train: bool = True, accumulate: bool = False, positive: bool = False) -> None:
        """``dx`` from ``dy``: overwritten, or accumulated when ``accumulate``.  MAX routes through
        ``mask`` (the float mask top) if given, else the argmax kept by forward; with ``positive`` (MAX, no
        mask) each window's gradient times whether its maximum is above 0 — what an in-place ReLU below the
        pooling would make of it (:mod:`cct.exec.fusion`)."""
        xp = get_array_module(dy)
        if self.method == MAX and mask is None:
            if "ymax" not in self._buffers:
                raise CctError("pooling backward called before forward")
            self._backward_max(dy, dx, x, accumulate, xp, positive)
            return
        if positive:
            raise ValueError("positive-only routing is MAX pooling's without a mask top")
        if self.method == MAX or (self.method == STOCHASTIC and train):
            index = self._index if mask is None else mask.astype(np.intp)
            if index is None:
                raise CctError("pooling backward called before forward")
            top_index = int(index.max()) if index.size else -1
            if top_index >= self.plane:
                raise CctError(f"pooling mask index {top_index} out of range for a plane of {self.plane}")
            valid = None if not index.size or int(index.min()) >= 0 else index >= 0
            self._scatter_add(dy, dx, index + self._plane_base(dy.shape, xp), valid, accumulate, xp)
            return
        if self.method == AVE:
            compiled = self._compiled(dy, dx)
            if compiled is not None:
                compiled.ave_pool_backward(self._geometry(dx), dy, self._pool_size(np, dy.dtype)[1], dx, accumulate)
                return
            g = dy * self._pool_size(xp, dy.dtype)[1]
            gbuf = self._phase_buffer("g_pad", dy)
            gbuf.fill(0)
            for sl, _, _ in self._offsets(xp):
                gbuf[sl] += g
        else:
            # STOCHASTIC at TEST: the gradient of Σx²/(FLT_MIN + Σx) (Caffe reuses a stale TRAIN sample)
            if self._stats is None or x is None:
                raise CctError("stochastic pooling backward (TEST phase) needs its forward and bottom data")
            s1, s2 = self._stats
            a, b = -dy * s2 / (s1 * s1), 2 * dy / s1
            xbuf = self._padded(x, 0.0)
            gbuf = self._phase_buffer("g_pad", dy)
            gbuf.fill(0)
            for sl, _, _ in self._offsets(xp):
                gbuf[sl] += a + b * xbuf[sl]
        self._unpad(gbuf, dx, accumulate)

    def _scatter_add(self, dy: Any, dx: Any, index: Any, valid: Any | None, accumulate: bool, xp: Any) -> None:
        """``dx.flat[index[w]] += dy[w]`` for every window ``w`` in order (Caffe's CPU loop: float32 sums in
        top order, so overlapping windows add up exactly as there), over ``valid`` windows only when given
        (a window without cells routes nothing, as Caffe's GPU code; its CPU code writes before the plane)."""
        target = dx if dx.flags.c_contiguous else xp.zeros(dx.shape, dx.dtype)
        if not accumulate or target is not dx:
            target.fill(0)
        flat, values = target.reshape(-1), dy.reshape(-1)
        if valid is None:
            xp.add.at(flat, index.reshape(-1), values)
        else:
            keep = valid.reshape(-1)
            xp.add.at(flat, index.reshape(-1)[keep], values[keep])
        if target is dx:
            return
        if accumulate:
            dx += target
        else:
            dx[...] = target


@register("Pooling")
class Pooling(Layer):
    """``top[n, c, o] = pool over bottom[n, c, window(o)]``, window ``o*stride - pad ... + kernel``.

    Shapes: bottom ``(N, C, H, W)`` → top ``(N, C, PH, PW)`` (see :func:`pooled_shape`; CEIL by default,
    FLOOR with ``round_mode: FLOOR``); optional second top (MAX only): the argmax as float ``h*W + w``.
    Parameters (``pooling_param``): ``pool`` (MAX | AVE | STOCHASTIC), ``kernel_size`` or ``kernel_h`` and
    ``kernel_w``, ``stride`` (1) or ``stride_h`` and ``stride_w``, ``pad`` (0) or ``pad_h`` and ``pad_w``
    (MAX/AVE only, pad < kernel), ``global_pooling`` (kernel = H×W, pad 0, stride 1), ``round_mode``.
    STOCHASTIC runs on the CPU too (Caffe: GPU only); TRAIN samples from :func:`cct.rng.get_rng`.

    N-D (a cct extension; Caffe's Pooling is 4-D only): a bottom ``(N, C, *spatial)`` with any number of
    spatial axes — ``(N, C, D, H, W)`` for volumes — pools every spatial axis with the same ``kernel_size``,
    ``stride`` and ``pad`` (``kernel_h``/``kernel_w`` and friends are 2-D only), or over the whole volume with
    ``global_pooling``.  Per-axis sizes come from the repeated cct fields ``kernel_nd``, ``stride_nd`` (1) and
    ``pad_nd`` (0): one value for every spatial axis or one per axis (any number of axes, 2-D included), each
    replacing its Caffe fields (``kernel_nd`` replaces ``kernel_size``/``kernel_h``/``kernel_w``; not both).
    The mask top holds the flat index within the channel volume (``(d*H + h)*W + w``).  4-D bottoms with
    Caffe's fields behave exactly as Caffe's.
    """

    exact_num_bottom = 1
    min_top = 1
    max_top = 2
    allow_in_place = False
    batch_separable = property(lambda self: self.method != STOCHASTIC or self.phase != pb.TRAIN)  # TRAIN samples

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.pooling_param
        f = "pooling_param"
        self.num_spatial = nd = bottom[0].num_axes - 2
        if nd < 1:
            raise CctError(self._axes_message(bottom[0]))
        self.method = p.pool
        if len(top) > 1 and self.method != MAX:
            raise ParamError("top", f"Pooling Layer produces a second (mask) top only for MAX pooling "
                                    f"(pool {_METHOD_NAMES.get(self.method, self.method)}, {len(top)} tops)")
        self.global_pooling = p.global_pooling
        has_hw = p.HasField("kernel_h") and p.HasField("kernel_w")
        kernel_nd = None
        if self.global_pooling:
            if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w") or len(p.kernel_nd):
                raise ParamError(f"{f}.global_pooling",
                                 "With Global_pooling: true Filter size cannot specified")
        elif len(p.kernel_nd):
            kernel_nd = self._nd_field(p, "kernel", bottom[0], f)
        elif p.HasField("kernel_size") and has_hw:
            raise ParamError(f"{f}.kernel_size",
                             "Filter size is kernel_size OR kernel_h and kernel_w; not both")
        elif not p.HasField("kernel_size") and not has_hw:
            raise ParamError(f"{f}.kernel_size",
                             "For non-square filters both kernel_h and kernel_w are required."
                             if p.HasField("kernel_h") or p.HasField("kernel_w")
                             else "kernel_size (or kernel_h and kernel_w, or kernel_nd) is required")
        stride_nd = self._nd_field(p, "stride", bottom[0], f)
        pad_nd = self._nd_field(p, "pad", bottom[0], f)
        if nd != 2:
            for name in ("kernel", "stride", "pad"):
                if p.HasField(f"{name}_h") or p.HasField(f"{name}_w"):
                    raise ParamError(f"{f}.{name}_h", f"{name}_h/{name}_w are for 2-D pooling only; a bottom "
                                                      f"with {nd} spatial axes ({bottom[0].shape_string()}) "
                                                      f"takes {name if name != 'kernel' else 'kernel_size'} "
                                                      f"for every axis, or {name}_nd for per-axis sizes")
        self.pad = pad_nd if pad_nd is not None else self._per_axis(p, "pad", f)
        self.stride = stride_nd if stride_nd is not None else self._per_axis(p, "stride", f)
        if self.global_pooling and (any(self.pad) or any(s != 1 for s in self.stride)):
            raise ParamError(f"{f}.global_pooling", f"With Global_pooling: true; only pad = 0 and stride = 1 "
                                                    f"(pad {_dims(self.pad)}, stride {_dims(self.stride)})")
        if self.global_pooling:
            self.kernel = tuple(bottom[0].shape[2:])
        elif kernel_nd is not None:
            self.kernel = kernel_nd
        elif p.HasField("kernel_size"):
            self.kernel = (int(p.kernel_size),) * nd
        else:
            self.kernel = (int(p.kernel_h), int(p.kernel_w))
        names = ("kernel_size" if kernel_nd is None else "kernel_nd", "stride" if stride_nd is None else "stride_nd",
                 "pad" if pad_nd is None else "pad_nd")
        check_pool_window(self.method, self.kernel, self.stride, self.pad, f, names)
        dilation_nd = self._nd_field(p, "dilation", bottom[0], f)
        self.dilation = dilation_nd if dilation_nd is not None else (1,) * nd
        if any(d < 1 for d in self.dilation):
            raise ParamError(f"{f}.dilation_nd", f"dilation_nd must be >= 1 (got {_dims(self.dilation)})")
        if any(d != 1 for d in self.dilation) and (self.method != MAX or self.global_pooling):
            what = "global pooling" if self.global_pooling else _METHOD_NAMES.get(self.method, self.method)
            raise ParamError(f"{f}.dilation_nd", f"dilation_nd {_dims(self.dilation)} applies to MAX pooling "
                                                 f"only (sparse max-filtering), not {what}")
        self.ceil_mode = p.round_mode == pb.PoolingParameter.CEIL
        self.pooler: Pooler | None = None

    def _per_axis(self, p: pb.PoolingParameter, name: str, f: str) -> tuple[int, ...]:
        """``name`` for every spatial axis, or (2-D) ``name_h`` and ``name_w`` (both, and not with ``name``)."""
        has_h, has_w = p.HasField(f"{name}_h"), p.HasField(f"{name}_w")
        if not has_h and not has_w:
            return (int(getattr(p, name)),) * self.num_spatial
        if p.HasField(name) or not (has_h and has_w):
            raise ParamError(f"{f}.{name}", f"{name} is {name} OR {name}_h and {name}_w are required.")
        return int(getattr(p, f"{name}_h")), int(getattr(p, f"{name}_w"))

    def _nd_field(self, p: pb.PoolingParameter, name: str, x: Blob, f: str) -> tuple[int, ...] | None:
        """``name_nd`` (cct) for every spatial axis — given once or once per axis — or None when empty; it
        excludes Caffe's ``name`` (``kernel_size`` for the kernel), ``name_h`` and ``name_w``."""
        values = tuple(int(v) for v in getattr(p, f"{name}_nd"))
        if not values:
            return None
        scalar = "kernel_size" if name == "kernel" else name
        known = p.DESCRIPTOR.fields_by_name
        given = [g for g in (scalar, f"{name}_h", f"{name}_w") if g in known and p.HasField(g)]
        if given:
            raise ParamError(f"{f}.{name}_nd", f"{name}_nd is {name}_nd OR {scalar} (or {name}_h and {name}_w); "
                                               f"not both ({name}_nd with {', '.join(given)})")
        nd = self.num_spatial
        if len(values) not in (1, nd):
            raise ParamError(f"{f}.{name}_nd", f"{name}_nd must be given once, or once per spatial axis "
                                               f"({len(values)} values for {nd} spatial axes, bottom "
                                               f"{x.shape_string()})")
        return values * nd if len(values) == 1 else values

    def _axes_message(self, x: Blob) -> str:
        if self.num_spatial == 2 or x.num_axes < 3:
            return (f"Pooling layer '{self.name}': Input must have 4 axes, corresponding to (num, channels, "
                    f"height, width) (got {x.shape_string()})")
        return (f"Pooling layer '{self.name}': Input must keep its {2 + self.num_spatial} axes (num, channels "
                f"and {self.num_spatial} spatial axes) (got {x.shape_string()})")

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x = bottom[0]
        if x.num_axes != 2 + self.num_spatial:
            raise CctError(self._axes_message(x))
        in_shape = tuple(x.shape[2:])
        if self.global_pooling:
            self.kernel = in_shape
        pl = self.pooler
        if pl is None or pl.in_shape != in_shape or pl.kernel != self.kernel:
            pl = Pooler(self.method, in_shape, self.kernel, self.stride, self.pad, self.ceil_mode, self.dilation)
            self.pooler = pl
            self._part_poolers: list[Pooler] = [pl]
        for t in top:
            t.reshape(x.shape[:2] + pl.out_shape)

    # Batch partitions (cct.runtime.partition) over the channel planes of the batch, not its images — every plane
    # is pooled alone, so a batch of fewer images than cores (inference of one image) still uses them all: each
    # partition pools its planes, viewed (planes, 1, *spatial), with its own Pooler (own buffers and argmax).
    # STOCHASTIC TRAIN draws its random numbers for the whole batch, and a device array is one stream of kernels:
    # neither splits.
    @staticmethod
    def _planes(a: Any) -> Any:
        return a.reshape((a.shape[0] * a.shape[1], 1) + tuple(a.shape[2:]))

    def _ranges(self, x: Blob) -> list[tuple[int, int]]:
        planes = x.shape[0] * x.shape[1]
        assert self.pooler is not None
        if self.method == STOCHASTIC or x.xp is not np:
            ranges = [(0, planes)]
        else:
            work = math.prod(x.shape[2:]) * (1 + len(self.pooler._offsets()))
            ranges = batch_ranges(planes, partitions_for(planes, work))
        while len(self._part_poolers) < len(ranges):
            pl = self.pooler
            self._part_poolers.append(Pooler(self.method, pl.in_shape, self.kernel, self.stride, self.pad,
                                             self.ceil_mode, self.dilation))
        self._last_ranges = ranges
        self.last_partitions = len(ranges)  # shown by cct.engines.choice.describe_layer_engine
        return ranges

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        assert self.pooler is not None
        mask = self._planes(top[1].data) if len(top) > 1 else None
        x, y, train = self._planes(bottom[0].data), self._planes(top[0].data), self.phase == pb.TRAIN
        ranges = self._ranges(bottom[0])
        run_partitions(ranges, lambda p, a, b: self._part_poolers[p].forward(
            x[a:b], y[a:b], train, None if mask is None else mask[a:b]))

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        self._backward(top, propagate_down, bottom, False)

    def absorbs_relu_backward(self, top: list[Blob]) -> bool:
        """Whether :meth:`backward_rectified` applies: MAX pooling without a mask top."""
        return self.method == MAX and len(top) == 1

    def backward_rectified(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        """:meth:`backward` and the backward of an in-place ReLU (slope 0) on the bottom: MAX pooling without a
        mask top routes each window's gradient only where its maximum — the ReLU's output at the winning
        cell — is above 0 (the serial executor's fused ReLU → Pooling: :mod:`cct.exec.fusion`)."""
        self._backward(top, propagate_down, bottom, True)

    def _backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob], positive: bool) -> None:
        if not propagate_down[0]:
            return
        assert self.pooler is not None
        mask = self._planes(top[1].data) if len(top) > 1 else None
        dy, dx, x = self._planes(top[0].diff), self._planes(bottom[0].diff), self._planes(bottom[0].data)
        train = self.phase == pb.TRAIN
        ranges = getattr(self, "_last_ranges", None) or [(0, x.shape[0])]
        run_partitions(ranges, lambda p, a, b: self._part_poolers[p].backward(
            dy[a:b], dx[a:b], x[a:b], None if mask is None else mask[a:b], train, positive=positive))
