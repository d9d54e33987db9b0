"""Thread budgets: the cores this process may use, and how many BLAS and FFT threads the calling code may use.

OpenBLAS has one thread count for the whole process, yet several threads ask for their own at the same time:
batch partitions (one each), the devices of a device split, data-parallel replicas, small GEMMs that
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

OpenBLAS's own worker threads spin for about 2^28 cycles (~0.1 s) after every multi-threaded call before they
sleep, and the batch partitions that follow share the cores with them: on a 16-core machine CaffeNet's
conv3-conv5 backward ran 2-4x slower (lowering's 125-155 ms against 57-61 ms with the workers asleep), after
their bias gradients' products had run on 2 partitions of 8 threads each (partitions now run one thread each:
:func:`cct.runtime.partition.blas_threads_per_partition`; layers on one partition still use all the cores).
Limiting the thread count around the partitions does not stop workers already spinning; the only control is
``OPENBLAS_THREAD_TIMEOUT``, read when an OpenBLAS is loaded, so :func:`quiet_blas_workers` sets it when cct is
imported (first thing, before numpy loads its OpenBLAS) unless the environment already has a value.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

# OpenBLAS's smallest spin (2^4 cycles: a worker sleeps as soon as its share of a call is done)
BLAS_WORKER_SPIN = "4"
# the longest spin, as OpenBLAS's exponent, still counted as asleep (2^16 cycles: some tens of microseconds)
SLEEPING_SPIN_MAX = 16
_spin_state: dict[str, Any] = {"state": "not set", "sleep": False}


def quiet_blas_workers() -> None:
    """``OPENBLAS_THREAD_TIMEOUT = 4`` unless set: OpenBLAS's workers sleep right after each call instead of
    spinning (see the module docstring).  It applies to every OpenBLAS loaded from then on: numpy's when cct is
    imported before numpy, scipy's, and child processes'."""
    if "OPENBLAS_THREAD_TIMEOUT" in os.environ:
        value = os.environ["OPENBLAS_THREAD_TIMEOUT"]
        _spin_state["state"] = f"OPENBLAS_THREAD_TIMEOUT={value} (the environment's)"
        _spin_state["sleep"] = value.strip().isdigit() and int(value) <= SLEEPING_SPIN_MAX
        return
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = BLAS_WORKER_SPIN
    if "numpy" in sys.modules:
        _spin_state["state"] = ("numpy's OpenBLAS spins ~0.1 s after each multi-threaded call (numpy was loaded "
                                f"before cct; set OPENBLAS_THREAD_TIMEOUT={BLAS_WORKER_SPIN} in the environment)")
    else:
        _spin_state["state"] = f"OPENBLAS_THREAD_TIMEOUT={BLAS_WORKER_SPIN} (set by cct: workers sleep after each call)"
        _spin_state["sleep"] = True


def blas_worker_spin() -> str:
    """What :func:`quiet_blas_workers` found and did (``cct device_query`` prints it)."""
    return _spin_state["state"]


def blas_workers_sleep() -> bool:
    """Whether numpy's OpenBLAS workers sleep right after each call (:func:`quiet_blas_workers`), so that a
    multi-threaded BLAS call leaves nothing spinning beside the batch partitions that run next."""
    return bool(_spin_state["sleep"])


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


Knob = tuple[Callable[[], int], Callable[[int], None]]


def _knob(lib: Any) -> Knob:
    """``(get, set)`` of ``lib``'s thread count.  OpenBLAS on its own threads (not OpenMP's): the library's C
    functions themselves, looked up once (threadpoolctl resolves the symbol on every call: ~1 us, and a GEMM
    helper's block makes up to six such calls); anything else: threadpoolctl's controller."""
    dynlib = getattr(lib, "dynlib", None)
    if getattr(lib, "internal_api", None) == "openblas" and getattr(lib, "threading_layer", None) != "openmp" \
            and dynlib is not None:
        for prefix in ("", "scipy_"):
            for suffix in ("", "64_", "_64"):
                get = getattr(dynlib, f"{prefix}openblas_get_num_threads{suffix}", None)
                put = getattr(dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    put.restype, put.argtypes = None, [ctypes.c_int]
                    return get, put
    return lib.get_num_threads, lambda n: _set_threads(lib, n)


class _Requests(threading.local):
    """A thread's :func:`blas_threads` requests, innermost last (a class default: a thread that never made one reads
    None without a failed lookup)."""

    stack: list[int] | None = None


class ThreadBudget:
    """The owner of the BLAS libraries' process-wide thread count (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}  # requested count -> blocks inside it, all threads
        self._saved: list[tuple[Knob, int]] | None = None  # each library's count before the first request
        self._local = _Requests()
        self._libs: list[Any] | None = None
        self._modules = 0
        self._knob_libs: list[Any] | None = None
        self._knob_list: list[Knob] = []
        self._known: dict[int, int] = {}  # id(a library's setter) -> its thread count, while blocks are active

    def libraries(self) -> list[Any]:
        """threadpoolctl's controllers of the BLAS libraries loaded now."""
        if self._libs is None or self._modules != len(sys.modules):
            from threadpoolctl import ThreadpoolController

            self._libs = list(ThreadpoolController().select(user_api="blas").lib_controllers)
            self._modules = len(sys.modules)
        return self._libs

    def _knobs(self) -> list[Knob]:
        """:func:`_knob` of each of :meth:`libraries` (made again when the list is)."""
        libs = self.libraries()
        if libs is not self._knob_libs:
            self._knob_libs, self._knob_list = libs, [_knob(lib) for lib in libs]
        return self._knob_list

    def _set(self, n: int) -> None:
        """Every library to ``n`` threads; inside blocks the count each has is known (read when the first
        block began, then only changed here), so a library already at ``n`` costs no call."""
        known = self._known
        for get, put in self._knobs():
            have = known.get(id(put))
            if have is None:
                have = known[id(put)] = get()
            if have != n:
                put(n)
                known[id(put)] = n

    def acquire(self, n: int) -> None:
        n = max(1, int(n))
        with self._lock:
            active = self._active
            if not active:
                self._saved = [(knob, knob[0]()) for knob in self._knobs()]
                self._known = {id(put): count for (_, put), count in self._saved}
            active[n] = active.get(n, 0) + 1
            self._set(min(active))
        stack = self._local.stack
        if stack is None:
            self._local.stack = [n]
        else:
            stack.append(n)

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
                for (get, put), count in self._saved or []:
                    have = self._known.get(id(put))
                    if (get() if have is None else have) != count:
                        put(count)
                self._saved = None
                self._known = {}

    def thread_budget(self) -> int | None:
        """The calling thread's innermost request, or None outside any."""
        stack = self._local.stack
        return stack[-1] if stack else None

    def process_count(self) -> int:
        """The BLAS libraries' thread count now (the largest if they differ; the cores without a library)."""
        counts = [get() for get, _ in self._knobs()]
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


quiet_blas_workers()  # at import: cct's __init__ imports this module before anything loads numpy
