"""Batch partitions (CcT §2.2): split a batch into ``p`` partitions processed concurrently by ``p`` threads,
each running its BLAS calls on one thread (:func:`blas_threads_per_partition`).

numpy releases the GIL inside BLAS and inside large ufunc loops and copies, so ``p`` Python threads each
working on ``n/p`` images of a layer run truly in parallel; with ``p ≤ cores`` the machine is never
oversubscribed.  Everything here is a facility that layer and engine bodies call — no layer is
wrapped or replaced:

* :func:`partitions_for` — how many partitions a layer should use for a batch of ``n`` items doing
  ``work`` elementary operations per item (the ``partitions`` setting of :mod:`cct.config`:
  ``-partitions`` / ``CCT_PARTITIONS`` = ``N`` | ``auto``; ``auto`` is the cost model below);
* :func:`batch_ranges` — the ``p`` contiguous, near-equal ``[n0, n1)`` item ranges;
* :func:`run_partitions` — call ``fn(part, n0, n1)`` for each range, concurrently when ``p > 1``;
* :func:`run_channel_blocks` — ``fn(part, images, channels)`` over cache-sized blocks of an ``(N, C, S)``
  array in the partitions (per-channel layers: BatchNorm, Scale);
* :func:`zero` — ``a[...] = 0`` over value ranges of a large host array (parameter gradients before a pass).

A body that accumulates across the batch (a weight gradient, a bias gradient) gives each partition its own
accumulator and sums them after :func:`run_partitions` returns, in partition order — so results are
deterministic for a given ``p`` and equal the unpartitioned ones up to float rounding of that sum.
Layers whose result depends on whole-batch statistics take per-image partial statistics in the partitions and
combine them in image order afterwards (BatchNorm: the same numbers for any ``p``); losses and anything drawing
random numbers in sequence simply do not call this.

While partitions run, the interpreter's switch interval is :data:`PARTITION_SWITCH_INTERVAL` (Python's default
is 5 ms): a partition thread back from a GIL-free call (a GEMM, an FFT, a compiled kernel) then waits at most
that long for the thread holding the interpreter to let it go.  With 16 partitions on a 16-core Xeon, CaffeNet's
training iteration took 497 instead of 554 ms (conv3-conv5 forward 23 instead of 27-31 ms).

``auto`` (the cost model): ``p = min(cores, n)`` when a partition still holds at least
``MIN_WORK_PER_PARTITION`` operations (thread start-up and the BLAS thread switch cost some tens of
microseconds; below that a layer is not worth splitting), else 1; GEMM-bound work counts its flops
``GEMM_FLOPS_PER_OPERATION`` to an operation (:func:`partitions_for_flops`).
"""
from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from cct.config import settings
from cct.runtime.threads import blas_threads, cpu_cores

MIN_WORK_PER_PARTITION = 1 << 20
# GEMM flops per operation of MIN_WORK_PER_PARTITION's count (elementwise work is memory-bound, GEMMs are not):
# convolution layers gain from two partitions on 2 cores from ~24 MFLOP per partition (a 3x3 layer of 64 8x8
# images, 24 -> 32 channels: forward and backward 0.84x one partition's time with two BLAS threads; 20 -> 50
# channels on 4x4 images, 9 MFLOP: 1.67x, the thread hand-offs cost more than the GEMMs gain)
GEMM_FLOPS_PER_OPERATION = 24.0

# seconds; see the module docstring
PARTITION_SWITCH_INTERVAL = 5e-4
# bytes of one operand in a block of run_channel_blocks: BatchNorm's passes over 32x64x56x56 (2 cores, compiled
# kernels) took 0.6 ms (global statistics) and 2.0 ms (the batch's) with 1 or 2 MiB blocks, 0.7-0.8 and 2.3 ms
# with 512 KiB and 1.4 and 3.7 ms with 128 KiB ones (each block a few Python calls)
BLOCK_BYTES = 1 << 20


class _Mark(threading.local):
    """Whether the thread runs a partition body (a class default: no lookup that fails and raises in a thread that
    never set it — ``in_partition`` is asked some twenty times a LeNet iteration)."""

    active = False


_local = _Mark()


def partitions_for(n: int, work: float = float("inf")) -> int:
    """Partitions for ``n`` items of ``work`` operations each: the forced count (capped at ``n``) or the
    ``auto`` cost model.  Always 1 inside a partition (no nesting)."""
    if n <= 1 or in_partition():
        return 1
    forced = settings.get("partitions")
    if forced is not None:
        return max(1, min(forced, n))
    cores = cpu_cores()
    if cores <= 1:
        return 1
    p = min(cores, n)
    while p > 1 and n * work / p < MIN_WORK_PER_PARTITION:
        p -= 1
    return p


def partitions_for_flops(n: int, flops: float) -> int:
    """:func:`partitions_for` ``n`` items of ``flops`` GEMM flops each (``GEMM_FLOPS_PER_OPERATION``)."""
    return partitions_for(n, flops / GEMM_FLOPS_PER_OPERATION)


def batch_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, n)``, sizes differing by at most one."""
    parts = max(1, min(parts, n)) if n > 0 else 1
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def in_partition() -> bool:
    """Whether the calling thread is running a partition body."""
    return _local.active


def blas_threads_per_partition(parts: int) -> int:
    """BLAS threads of each of ``parts`` concurrent partitions: one (a single partition: all the cores).

    OpenBLAS runs one multi-threaded level-3 call at a time (a lock around its threaded GEMM driver; one-thread
    calls bypass it), so partitions with several threads each would run their GEMMs one after the other: on a
    16-core Xeon, CaffeNet's conv layers on 8 partitions of 2 threads took 2-4x the time of 16 partitions of
    one.  And every multi-threaded call leaves OpenBLAS's workers spinning into what follows (see
    :mod:`cct.runtime.threads`).  A layer with fewer partitions than cores (little work per item) leaves the
    other cores idle rather than meet either."""
    return cpu_cores() if parts <= 1 else 1


def _inside(fn: Callable[[int], None], k: int) -> None:
    """``fn(k)`` marked as running inside a partition (in whatever thread calls)."""
    was = _local.active
    _local.active = True
    try:
        fn(k)
    finally:
        _local.active = was


class _Call:
    """One :func:`run_concurrently` call as the crew sees it: its body, how many of its other calls are still
    running, and a lock held until the last of them is done."""

    __slots__ = ("fn", "left", "count_lock", "done", "error")

    def __init__(self, fn: Callable[[int], None], others: int) -> None:
        self.fn = fn
        self.left = others
        self.count_lock = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()
        self.error: BaseException | None = None

    def finished(self, error: BaseException | None) -> None:
        with self.count_lock:
            if error is not None and self.error is None:
                self.error = error
            self.left -= 1
            last = not self.left
        if last:
            self.done.release()


class _Crew:
    """The partition threads: ``cores - 1`` daemon threads started on first use, taking ``(call, k)`` from one
    queue.  A hand-off is a queue put per task and one lock per call, where a ``ThreadPoolExecutor`` makes a
    future, a work item and a condition per task (``benchmarks/partition_handoff.py``, 2-core AMD EPYC: 28
    against 40 us a call of 2 partitions, 33 against 83 of 4; ``run_concurrently`` took 55 and 84 us on the
    executor; on a 16-core Xeon 50-59 against 206-260 us a call of 16 partitions, 35-44 against 25-32 of 2).
    CaffeNet's training iteration makes about 80 such calls; one image of Inception-v3 18 on 2 cores and, with 16
    cores, 25 of up to 13 partitions.  One queue, not one per thread: with task k always on thread k, 16
    partitions took 259-296 us on that Xeon (every thread woken, each taking the interpreter in turn, where the
    first threads awake drain one queue) and nets gained nothing."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[_Call, int]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _serve(self) -> None:
        take = self._tasks.get
        while True:
            call, k = take()
            try:
                _inside(call.fn, k)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                call.finished(e)
            else:
                call.finished(None)
            del call

    def _staffed(self) -> None:
        want = max(1, cpu_cores() - 1)
        if len(self._threads) >= want:
            return
        with self._lock:
            while len(self._threads) < want:
                t = threading.Thread(target=self._serve, name=f"cct-part-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)

    def run(self, count: int, fn: Callable[[int], None]) -> BaseException | None:
        """``fn(k)`` for ``1 <= k < count`` on the crew while the caller runs ``fn(0)``; the first exception
        raised, after every call has finished."""
        self._staffed()
        call = _Call(fn, count - 1)
        put = self._tasks.put
        for k in range(1, count):
            put((call, k))
        error: BaseException | None = None
        try:
            _inside(fn, 0)
        except BaseException as e:  # noqa: BLE001 - re-raised after the other calls finish
            error = e
        call.done.acquire()
        return error or call.error


_crew = _Crew()


def _new_crew_after_fork() -> None:
    """A forked child has none of its parent's threads: it starts its own crew on first use."""
    global _crew
    _crew = _Crew()


os.register_at_fork(after_in_child=_new_crew_after_fork)


class _SwitchInterval:
    """The interpreter's switch interval at most :data:`PARTITION_SWITCH_INTERVAL` while any thread is inside
    (blocks of several threads nest: the first sets it, the last restores what it found)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._saved = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if not self._inside:
                self._saved = sys.getswitchinterval()
                if self._saved > PARTITION_SWITCH_INTERVAL:
                    sys.setswitchinterval(PARTITION_SWITCH_INTERVAL)
            self._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside:
                sys.setswitchinterval(self._saved)


_short_switches = _SwitchInterval()


def run_concurrently(count: int, fn: Callable[[int], None]) -> None:
    """``fn(k)`` for ``k < count`` at once, ``k = 0`` in the calling thread and the rest on the partition
    threads (:class:`_Crew`), every call marked as running inside a partition (so layers do not split
    further).  The first exception is re-raised after all calls have finished."""
    if count <= 1:
        _inside(fn, 0)
        return
    with _short_switches:
        error = _crew.run(count, fn)
    if error is not None:
        raise error


def run_partitions(ranges: list[tuple[int, int]], fn: Callable[[int, int, int], None]) -> None:
    """``fn(part, n0, n1)`` for every range; concurrently (the first in the calling thread) when there are
    several, with :func:`blas_threads_per_partition` BLAS threads each.  The first exception is re-raised."""
    if len(ranges) <= 1 or in_partition():
        for part, (n0, n1) in enumerate(ranges):
            fn(part, n0, n1)
        return
    with blas_threads(blas_threads_per_partition(len(ranges))):
        run_concurrently(len(ranges), lambda k: fn(k, *ranges[k]))


def run_batch(n: int, fn: Callable[[int, int, int], None], work: float = float("inf"),
              parts: int | None = None) -> int:
    """Split ``n`` items into :func:`partitions_for` (or ``parts``) ranges and :func:`run_partitions`
    over them; returns the number of partitions used."""
    p = partitions_for(n, work) if parts is None else parts
    ranges = batch_ranges(n, p)
    run_partitions(ranges, fn)
    return len(ranges)


def batch_rows(a: Any) -> Any:
    """A blob's contiguous array as (items, values) — a view — for an elementwise body over :func:`run_batch`'s
    item ranges (a 0-d array as one item of one value)."""
    return a.reshape(a.shape[0], -1) if a.ndim else a.reshape(1, 1)


def run_channel_blocks(x3: Any, fn: Callable[[int, slice, slice], None], budget: int | None = None) -> int:
    """``fn(part, images, channels)`` (two slices) over blocks of the ``(N, C, S)`` array ``x3`` — runs of whole
    images of at most ``budget`` bytes (``BLOCK_BYTES``), or one image's channel ranges where an image is more —
    the blocks split over the partitions, each in one: a per-channel layer's steps on a block then find it in the
    core's cache, and a batch of fewer images than cores still uses them all.  A device array is one block (its
    steps are kernels over the whole array).  Returns the number of partitions."""
    n, c, s = x3.shape
    if not isinstance(x3, np.ndarray):
        fn(0, slice(0, n), slice(0, c))
        return 1
    budget = BLOCK_BYTES if budget is None else budget
    per_image = c * s * x3.itemsize
    if per_image <= budget:
        step = max(1, budget // max(per_image, 1))
        blocks = [(slice(i, min(i + step, n)), slice(0, c)) for i in range(0, n, step)]
    else:  # the blocks, not the images, are split over the partitions: one large image keeps every core busy
        rows = max(1, budget // max(s * x3.itemsize, 1))
        blocks = [(slice(i, i + 1), slice(c0, min(c0 + rows, c))) for i in range(n) for c0 in range(0, c, rows)]

    def body(part: int, a: int, b: int) -> None:
        for images, channels in blocks[a:b]:
            fn(part, images, channels)

    return run_batch(len(blocks), body, work=float(x3.size) / max(len(blocks), 1))


def zero(a: Any) -> None:
    """``a[...] = 0``; a large C-contiguous host array's value ranges in the batch partitions (one core does not
    write memory at the machine's bandwidth: CaffeNet's 61M parameter gradients before every backward)."""
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.size < 2 * MIN_WORK_PER_PARTITION:
        a[...] = 0
        return
    flat = a.reshape(-1)
    run_batch(flat.size, lambda _p, v0, v1: flat[v0:v1].fill(0), work=1.0)
