"""Thread budgets: the cores this process may use, and how many BLAS and FFT threads the calling code may use.

OpenBLAS has one thread count for the whole process, yet several threads ask for their own at the same time:
batch partitions (``cores / p`` each), the devices of a device split, data-parallel replicas, small GEMMs that
run best on one thread.  Setting and restoring the count around each block from each thread lets the last
writer win — a thread restores a count another thread is still relying on, or leaves the process at 1 after
all are done.  So one owner, :data:`BUDGET`, keeps the books:

* every thread's requests form a stack (nested :func:`blas_threads` blocks); the BLAS libraries run with the
  *smallest* request of all threads inside a block — no thread's work ever gets more threads than it was
  promised (the machine is never oversubscribed), at worst fewer while another thread asks for fewer;
* when the last block of all threads ends, every library goes back to the count it had before the first;
* :func:`thread_budget` is the calling thread's own innermost request — what its ``scipy.fft`` calls use
  (``workers`` is per call, so FFT threads need no process-wide setting at all).

Setting a library that already has the wanted count is skipped, so a block costs a lock and a few
microseconds.  threadpoolctl (3.6 and later) lets only the first thread that sets OpenBLAS's count change it
and silently ignores the others — a partition or replica thread's request would do nothing — so the budget,
which serialises every change under its own lock, calls the library's setter itself
(:func:`_set_threads`).  The library list is looked up again whenever modules were imported since the last look (an
import can load another BLAS: scipy.linalg brings its own OpenBLAS).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _set_threads(lib: Any, n: int) -> None:
    """Set ``lib``'s thread count from whichever thread calls (see the module docstring)."""
    setter = getattr(lib, "_real_set_num_threads", None)  # threadpoolctl >= 3.6: bypasses its owner thread
    (setter or lib.set_num_threads)(n)


class ThreadBudget:
    """The owner of the BLAS libraries' process-wide thread count (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}  # requested count -> blocks inside it, all threads
        self._saved: list[tuple[Any, int]] | None = None  # each library's count before the first request
        self._local = threading.local()
        self._libs: list[Any] | None = None
        self._modules = 0
        self._known: dict[int, int] = {}  # id(library) -> its thread count, while blocks are active

    def libraries(self) -> list[Any]:
        """threadpoolctl's controllers of the BLAS libraries loaded now."""
        if self._libs is None or self._modules != len(sys.modules):
            from threadpoolctl import ThreadpoolController

            self._libs = list(ThreadpoolController().select(user_api="blas").lib_controllers)
            self._modules = len(sys.modules)
            self._known = {}  # new controller objects: read their counts again
        return self._libs

    def _set(self, n: int) -> None:
        """Every library to ``n`` threads; inside blocks the count each has is known (read when the first
        block began, then only changed here), so a library already at ``n`` costs no call."""
        known = self._known
        for lib in self.libraries():
            have = known.get(id(lib))
            if have is None:
                have = known[id(lib)] = lib.get_num_threads()
            if have != n:
                _set_threads(lib, n)
                known[id(lib)] = n

    def acquire(self, n: int) -> None:
        n = max(1, int(n))
        with self._lock:
            active = self._active
            if not active:
                self._saved = [(lib, lib.get_num_threads()) for lib in self.libraries()]
                self._known = {id(lib): count for lib, count in self._saved}
            active[n] = active.get(n, 0) + 1
            self._set(min(active))
        try:
            self._local.stack.append(n)
        except AttributeError:
            self._local.stack = [n]

    def release(self, n: int) -> None:
        n = max(1, int(n))
        self._local.stack.pop()
        with self._lock:
            active = self._active
            left = active[n] - 1
            if left:
                active[n] = left
            else:
                del active[n]
            if active:
                self._set(min(active))
            else:
                for lib, count in self._saved or []:
                    if self._known.get(id(lib), lib.get_num_threads()) != count:
                        _set_threads(lib, count)
                self._saved = None
                self._known = {}

    def thread_budget(self) -> int | None:
        """The calling thread's innermost request, or None outside any."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    def process_count(self) -> int:
        """The BLAS libraries' thread count now (the largest if they differ; the cores without a library)."""
        counts = [lib.get_num_threads() for lib in self.libraries()]
        return max(counts) if counts else cpu_cores()


BUDGET = ThreadBudget()


class blas_threads(contextlib.AbstractContextManager):  # noqa: N801 - used like the function it replaced
    """Run the block with at most ``n`` BLAS threads (see the module docstring for concurrent blocks).  A
    plain class rather than a generator context manager: GEMM helpers enter one around every call."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __enter__(self) -> None:
        BUDGET.acquire(self.n)

    def __exit__(self, *exc: object) -> None:
        BUDGET.release(self.n)


def thread_budget() -> int:
    """Threads the calling thread's work may use: its innermost :func:`blas_threads` request, else the BLAS
    libraries' count, at most the cores (what FFTs and other per-call thread counts follow)."""
    own = BUDGET.thread_budget()
    return max(1, min(own if own is not None else BUDGET.process_count(), cpu_cores()))
