"""Freed memory kept for reuse: glibc's allocator told not to hand large blocks back to the kernel.

glibc serves every allocation above its mmap threshold (128 KiB, raised by itself up to 32 MiB) with a fresh
``mmap`` and returns it with ``munmap`` when freed, so an array of hundreds of MiB allocated and freed on every
pass costs its page faults — and the zeroing of every page — again on every pass, plus, with transparent huge
pages in ``madvise`` mode (numpy advises them for large arrays), the kernel's compaction when memory is
fragmented.  The FFT convolution engine is such a user: ``scipy.fft`` has no ``out=``, so each pass allocates
its spectra, products and signals anew (CaffeNet's conv2 on the FFT: 170-260 MiB of fresh pages per pass).
:func:`retain_freed_memory` raises the mmap threshold and the trim threshold so that those blocks come from,
and return to, the allocator's heap and are reused by the next pass.

Measured (CaffeNet batch 64 with its SGD update, 2 cores, AVX2 kernels, conv2 on the FFT, which drops its
spectra after each training backward): the iteration's kernel time falls from 30-450 to 0-60 ms, the iteration
from 1189-1199 to 1119-1120 ms, peak RSS 1706 -> 1764 MiB; alternated with PyTorch
(``benchmarks/caffenet_vs_pytorch.py``, runs interleaved with and without) 1074-1174 against 1230-1397 ms in
four pairs of five, one run of 1862 against 1533 in the fifth.  Off with the ``retain_memory`` setting
(``CCT_RETAIN_MEMORY=0``).  The change is process-wide and one-way (memory freed stays with the process, ready
for reuse, as with a caching allocator); the FFT engine makes it when it is first configured on the host.
What a one-off burst freed for good (a net's engine autotune) goes back to the kernel with
:func:`release_freed_memory`, and all threads share one arena (:func:`one_malloc_arena`, at import) so that
what one thread frees, any reuses or trims.  Other C libraries: nothing is changed.
"""
from __future__ import annotations

import ctypes
import threading

from cct.config import settings

# glibc's mallopt parameters (malloc.h) and the values set: blocks up to 1 GiB come from the heap, and the heap's
# free top is never trimmed below 2 GiB - 1 (mallopt takes an int)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1

_lock = threading.Lock()
_state: bool | None = None  # None: not asked yet; else whether the allocator was changed


def retain_freed_memory() -> bool:
    """Tell glibc's allocator to keep large freed blocks for reuse (see the module docstring), once per process,
    unless the ``retain_memory`` setting is off; True when it is in effect (glibc, and the setting on)."""
    global _state
    with _lock:
        if _state is None:
            _state = bool(settings.get("retain_memory")) and _set_glibc_thresholds()
        return _state


def one_malloc_arena() -> bool:
    """Every thread allocates from glibc's main arena (``M_ARENA_MAX`` = 1) unless the environment sets
    ``MALLOC_ARENA_MAX`` itself; True where it was set.  glibc gives each new thread that allocates an arena of
    its own (up to 8 per core): a block one batch partition's thread frees is reused only by that thread, and
    ``malloc_trim`` hands back none of those arenas' free tops — with the partitions' threads working on an
    autotune's candidates, CaffeNet on 16 partitions (emulated on 2 cores, full autotune) held 857 MiB after its
    build (358 MiB from one arena) and peaked at 2176 MiB in training (1713 MiB; 1666 with the engines from the
    cache either way).  cct's threads allocate few, large blocks, so sharing one arena's lock costs nothing
    measurable (CaffeNet's 2-core iteration 519-523 against 516-533 ms).  Set when cct is imported, before
    its threads start (an arena a thread already has stays its own)."""
    import os

    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc.mallopt(M_ARENA_MAX, 1) == 1


def release_freed_memory() -> bool:
    """Hand the memory glibc's allocator holds free back to the kernel (``malloc_trim(0)``: every arena's free
    pages, the middle of the heap included); True where it ran (glibc).  For the end of a burst whose arrays
    are gone for good — a net's engine autotune, which measures candidates on the whole batch and, with
    :func:`retain_freed_memory` in effect, would leave their buffers in the heap: CaffeNet's full autotune on 16
    partitions (emulated on 2 cores) held 1284 MiB after the net was built, 796 MiB once trimmed (509 MiB when
    the engines came from the cache), and the training iterations reused little of it (peak 2344 against
    2138 MiB)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    libc.malloc_trim(0)
    return True


def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (only glibc has ``gnu_get_libc_version``: another libc's
    ``mallopt`` or ``malloc_trim`` is not glibc's), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def _set_glibc_thresholds() -> bool:
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
