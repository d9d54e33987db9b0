"""Background prefetching (Caffe's ``BasePrefetchingDataLayer``): a daemon thread fills a queue of
``prefetch`` batches while the net computes, so a forward pass only waits when decoding is slower than
the net.

The thread runs a *producer* — an object with ``next_batch()`` and ``close()`` that owns the
database cursor and the transformer — and holds no reference to the layer, so a layer that is
dropped is collected; its finalizer sets the stop event and the thread ends within a fraction of a
second.  An exception in the producer is handed to the consumer: :meth:`Prefetcher.get` raises it as
a one-line :class:`~cct.errors.CctError`.  Batches are recycled through a free list like Caffe's
``prefetch_free_`` queue, so steady-state prefetching allocates nothing.

Exact resume: a producer may have ``state()`` (its cursor and random streams, JSON-able) and
``restore(state)``.  Each batch travels with the producer's state right after making it, so
:attr:`Prefetcher.consumed_state` is the state *after the last batch the net took* — not the read-ahead
thread's — and :meth:`Prefetcher.rewind` puts the producer back there (a snapshot's resume).
"""
from __future__ import annotations

import itertools
import queue
import threading
import weakref
from typing import Any, Protocol

from cct.errors import CctError

_POLL = 0.05  # seconds between checks of the stop event while blocked
_ids = itertools.count()


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


def _run(producer: Producer, full: queue.Queue, free: queue.Queue, stop: threading.Event,
         keep_open: threading.Event) -> None:
    try:
        while not stop.is_set():
            try:
                recycled = free.get_nowait()
            except queue.Empty:
                recycled = None
            try:
                item = (producer.next_batch(recycled), _state(producer))
            except CctError as e:
                item = _Failure(str(e))
            except Exception as e:  # a bug or an OS error: still one line for the consumer
                item = _Failure(f"{type(e).__name__}: {e}")
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
        self._start()

    def _start(self) -> None:
        self.thread = threading.Thread(target=_run, daemon=True, name=f"cct-prefetch-{self._name}-{next(_ids)}",
                                       args=(self._producer, self._full, self._free, self._stop, self._keep_open))
        self.thread.start()

    def get(self) -> Any:
        """The next batch, waiting for it if needed; the producer's error as a CctError."""
        if self._failure is not None:
            raise CctError(self._failure)
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
        batch, self.consumed_state = item
        return batch

    def recycle(self, batch: Any) -> None:
        """Give a consumed batch back for reuse."""
        self._free.put(batch)

    def rewind(self, state: Any) -> None:
        """Stop the thread (keeping the producer open), drop the batches read ahead, ``producer.restore(state)``
        and start reading again from there."""
        if self._failure is not None:
            raise CctError(self._failure)
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
        self._producer.restore(state)
        self.consumed_state = _state(self._producer)
        self._keep_open.clear()
        self._stop.clear()
        self._start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (it checks the stop event at least every 50 ms)."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def attach(self, owner: object) -> None:
        """Stop the thread when ``owner`` (the layer) is garbage-collected."""
        weakref.finalize(owner, _stop_event, self._stop)


def _stop_event(ev: threading.Event) -> None:
    ev.set()
