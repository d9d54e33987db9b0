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
Other C libraries: nothing is changed.
"""
from __future__ import annotations

import ctypes
import threading

from cct.config import settings

# glibc's mallopt parameters (malloc.h) and the values set: blocks up to 1 GiB come from the heap, and the heap's
# free top is never trimmed below 2 GiB - 1 (mallopt takes an int)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
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


def _set_glibc_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it: another libc's mallopt is not glibc's)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
