"""The device seam: which array module (numpy or cupy) holds a blob's memory, and the devices a batch runs on.

cupy is optional and imported here only (see :mod:`cct.device.backend`); layer bodies call
:func:`get_array_module` on their arrays and are written once against the ``xp`` it returns.
:class:`Device` (:mod:`cct.device.device`) is a CPU with a thread count or one GPU: memory helpers,
thread limits and peak FLOPS; :func:`parse_devices` reads ``cpu:1,cpu:1`` / ``cpu,gpu:0`` lists.
"""
from cct.device.backend import chunk_bytes, cupy, cupy_available, get_array_module, gpu_count, to_host
from cct.device.device import Device, parse_devices

__all__ = ["Device", "chunk_bytes", "cupy", "cupy_available", "get_array_module", "gpu_count", "parse_devices",
           "to_host"]
