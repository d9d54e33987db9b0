"""Background prefetching (Caffe's ``BasePrefetchingDataLayer``): a daemon thread fills a queue of
``prefetch`` batches while the net computes, so a forward pass only waits when decoding is slower than
the net.

The thread runs a *producer* — an object with ``next_batch()`` and ``close()`` that owns the
database cursor and the transformer — and holds no reference to the layer, so a layer that is
dropped is collected; its finalizer sets the stop event and the thread ends within a fraction of a
second.  An exception in the producer is handed to the consumer: :meth:`Prefetcher.get` raises it as
a one-line :class:`~cct.errors.CctError`.  Batches are recycled through a free list like Caffe's
``prefetch_free_`` queue, so steady-state prefetching allocates nothing.

A producer whose batches take next to no work is then run in the consuming thread instead, batch by batch as the
net asks: the reading thread's Python work competes with the net's for the interpreter lock, and on such a producer
that costs more than the work itself (the digits LeNet: 36-44 us per batch made in the net's thread, 90-170 us of
the reading thread's CPU beside a training net; an iteration 0.14 ms, 6%, faster without the thread).  The reading
thread's CPU time is a poor judge of that work — beside a busy net on a loaded 2-core machine the same digits
batches measured 0.3-0.65 ms there (0.12-0.2 ms in the net's thread), over the 0.25 ms this rule once had, and the
thread stayed, costing LeNet's conv1 forward 0.27 ms of its 0.6 — so a producer whose ``SYNC_SAMPLE`` batches
after the first ``SYNC_SKIP`` took a median of at most ``SYNC_TRIAL_CPU_SECONDS`` there is tried in the consuming
thread for ``SYNC_SAMPLE`` batches, and kept there if those took a median of at most ``SYNC_BATCH_CPU_SECONDS``
(the Python work of small records, which holds the interpreter lock the thread would fight for), else its thread
starts again where they left it.  Producers that do real work (decoding, cropping big images, much of it outside
the lock) keep the thread.

Exact resume: a producer may have ``state()`` (its cursor and random streams, JSON-able) and
``restore(state)``.  Each batch travels with the producer's state right after making it, so
:attr:`Prefetcher.consumed_state` is the state *after the last batch the net took* — not the read-ahead
thread's — and :meth:`Prefetcher.rewind` puts the producer back there (a snapshot's resume).
"""
from __future__ import annotations

import itertools
import queue
import statistics
import threading
import time
import weakref
from typing import Any, Protocol

from cct.errors import CctError

_POLL = 0.05  # seconds between checks of the stop event while blocked
_ids = itertools.count()
# a producer whose SYNC_SAMPLE batches after the first SYNC_SKIP (its warm-up: first reads, page faults) took a
# median of at most SYNC_TRIAL_CPU_SECONDS of the reading thread's CPU time is tried in the consuming thread, and
# runs there from then on where SYNC_SAMPLE batches made there took a median of at most SYNC_BATCH_CPU_SECONDS (see
# the module docstring)
SYNC_BATCH_CPU_SECONDS = 1e-3
SYNC_TRIAL_CPU_SECONDS = 5e-3
SYNC_SKIP = 4
SYNC_SAMPLE = 8


class Producer(Protocol):
    def next_batch(self, recycled: Any | None) -> Any: ...

    def close(self) -> None: ...


def _state(producer: Producer) -> Any:
    get = getattr(producer, "state", None)
    return get() if get is not None else None


class _Failure:
    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _message(e: Exception) -> str:
    """A producer's error as one line: a CctError's own text, else the exception's type and text (a bug or an OS
    error)."""
    return str(e) if isinstance(e, CctError) else f"{type(e).__name__}: {e}"


def _run(producer: Producer, full: queue.Queue, free: queue.Queue, stop: threading.Event,
         keep_open: threading.Event) -> None:
    try:
        while not stop.is_set():
            try:
                recycled = free.get_nowait()
            except queue.Empty:
                recycled = None
            t0 = time.thread_time()
            try:
                item = (producer.next_batch(recycled), _state(producer), time.thread_time() - t0)
            except Exception as e:  # noqa: BLE001 - one line for the consumer, whatever it was
                item = _Failure(_message(e))
            while not stop.is_set():
                try:
                    full.put(item, timeout=_POLL)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return
    finally:
        if not keep_open.is_set():
            producer.close()


class Prefetcher:
    """Runs ``producer.next_batch`` in a daemon thread, keeping up to ``depth`` batches ready."""

    def __init__(self, producer: Producer, depth: int, name: str = "data"):
        self._producer = producer
        self._name = name
        self._full: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._free: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._keep_open = threading.Event()
        self._failure: str | None = None
        self.consumed_state: Any = _state(producer)
        self._costs: list[float] = []  # CPU seconds of the first batches consumed (SYNC_SKIP + SYNC_SAMPLE)
        self.synchronous = False  # the producer runs in the consuming thread (see the module docstring)
        self._trial: list[float] | None = None  # while on trial there: CPU seconds of its batches made there
        self._start()

    def _start(self) -> None:
        self.thread = threading.Thread(target=_run, daemon=True, name=f"cct-prefetch-{self._name}-{next(_ids)}",
                                       args=(self._producer, self._full, self._free, self._stop, self._keep_open))
        self.thread.start()

    def get(self) -> Any:
        """The next batch, waiting for it if needed; the producer's error as a CctError."""
        if self._failure is not None:
            raise CctError(self._failure)
        if self.synchronous:
            try:
                recycled = self._free.get_nowait()
            except queue.Empty:
                recycled = None
            t0 = time.thread_time()
            try:
                batch = self._producer.next_batch(recycled)
            except Exception as e:  # noqa: BLE001 - one line, as from the thread
                self._failure = _message(e)
                raise CctError(self._failure) from None
            self.consumed_state = _state(self._producer)
            if self._trial is not None:
                self._trial.append(time.thread_time() - t0)
                if len(self._trial) == SYNC_SAMPLE:
                    if statistics.median(self._trial) > SYNC_BATCH_CPU_SECONDS:
                        self._go_threaded()
                    self._trial = None
            return batch
        while True:
            try:
                item = self._full.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self._full.empty():
                    raise CctError("the data prefetch thread has stopped") from None
        if isinstance(item, _Failure):
            self._failure = item.message
            raise CctError(item.message)
        batch, self.consumed_state, cost = item
        if len(self._costs) < SYNC_SKIP + SYNC_SAMPLE:
            self._costs.append(cost)
            if len(self._costs) == SYNC_SKIP + SYNC_SAMPLE \
                    and statistics.median(self._costs[SYNC_SKIP:]) <= SYNC_TRIAL_CPU_SECONDS \
                    and callable(getattr(self._producer, "restore", None)) and self.consumed_state is not None:
                self._go_synchronous()
                self._trial = []
        return batch

    def _halt(self) -> None:
        """Stop the thread keeping the producer open, the batches read ahead back on the free list."""
        self._keep_open.set()
        self._stop.set()
        self.thread.join()
        while True:
            try:
                item = self._full.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, _Failure):
                self._free.put(item[0])

    def _go_synchronous(self) -> None:
        """From now on make each batch when asked, in the calling thread, from where the net's last batch left
        the producer (the batches read ahead are dropped, the cursor put back)."""
        self._halt()
        self._producer.restore(self.consumed_state)
        self.synchronous = True
        self._close = weakref.finalize(self, self._producer.close)  # no thread to close it any more: this does

    def _go_threaded(self) -> None:
        """Back to the reading thread (a producer whose batches made in the calling thread cost too much there),
        from where the net's last batch left the producer."""
        self._close.detach()
        self.synchronous = False
        self._keep_open.clear()
        self._stop.clear()
        self._start()

    def recycle(self, batch: Any) -> None:
        """Give a consumed batch back for reuse."""
        self._free.put(batch)

    def rewind(self, state: Any) -> None:
        """Stop the thread (keeping the producer open), drop the batches read ahead, ``producer.restore(state)``
        and start reading again from there."""
        if self._failure is not None:
            raise CctError(self._failure)
        if not self.synchronous:
            self._halt()
        self._producer.restore(state)
        self.consumed_state = _state(self._producer)
        if not self.synchronous:
            self._keep_open.clear()
            self._stop.clear()
            self._start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (it checks the stop event at least every 50 ms); a producer run in the
        consuming thread is closed."""
        self._stop.set()
        if self.synchronous:
            self._close()  # once: a finalizer runs at most once
            return
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def attach(self, owner: object) -> None:
        """Stop the thread when ``owner`` (the layer) is garbage-collected."""
        weakref.finalize(owner, _stop_event, self._stop)


def _stop_event(ev: threading.Event) -> None:
    ev.set()
