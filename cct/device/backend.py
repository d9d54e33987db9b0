"""Array-module dispatch.  The one place that imports cupy.

Without cupy (or without a GPU) ``cupy`` is a stub whose ``ndarray`` matches nothing, so
``isinstance(x, cupy.ndarray)`` checks work everywhere.
"""
from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import numpy

try:  # pragma: no cover - depends on the machine
    import cupy as _cupy  # type: ignore[import-not-found]

    _cupy.cuda.runtime.getDeviceCount()
    cupy: Any = _cupy
    cupy_available = True
except Exception:  # noqa: BLE001 - any failure (no package, no driver, no device) means no cupy
    class _NoArray:  # matches no object
        pass

    cupy = SimpleNamespace(ndarray=_NoArray)
    cupy_available = False


def get_array_module(*arrays: Any) -> ModuleType:
    """numpy, or cupy if any argument is a cupy array (Chainer's ``get_array_module``)."""
    if cupy_available:
        for a in arrays:
            if isinstance(a, cupy.ndarray):
                return cupy
    return numpy


# A device runs each array operation as one kernel over the whole array: the bodies written against the array module
# take a device array in chunks of this many bytes (the whole batch, in practice) rather than the host's cache-sized
# ones, each of which costs a kernel launch per operation there (CaffeNet's pool1 walked in 64 one-image chunks:
# 48 ms forward on an H100)
DEVICE_CHUNK_BYTES = 512 << 20


def chunk_bytes(xp: Any, host_bytes: int) -> int:
    """The bytes a chunked pass over arrays of module ``xp`` takes at a time: ``host_bytes`` (a cache's worth, the
    caller's rule) on the host, at least :data:`DEVICE_CHUNK_BYTES` on a device."""
    return host_bytes if xp is numpy else max(host_bytes, DEVICE_CHUNK_BYTES)


def to_host(a: Any) -> numpy.ndarray:
    """A numpy view/copy of ``a`` wherever it lives."""
    if cupy_available and isinstance(a, cupy.ndarray):
        return cupy.asnumpy(a)
    return numpy.asarray(a)


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without cupy)."""
    return int(cupy.cuda.runtime.getDeviceCount()) if cupy_available else 0


def gpu_name(index: int) -> str:
    """The CUDA device's product name (``NVIDIA H100 80GB HBM3``)."""
    name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def array_gpu(a: Any) -> int | None:
    """The CUDA device id holding ``a``, or None for a host array."""
    if cupy_available and isinstance(a, cupy.ndarray):
        return int(a.device.id)
    return None


def data_pointer(a: Any) -> int:
    """The address of ``a``'s first element (host or device), to tell whether two views coincide."""
    if cupy_available and isinstance(a, cupy.ndarray):
        return int(a.data.ptr)
    return int(a.__array_interface__["data"][0])
