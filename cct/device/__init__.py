"""The device seam: which array module (numpy or cupy) holds a blob's memory.

cupy is optional and imported here only (see :mod:`cct.device.backend`); layer bodies call
:func:`get_array_module` on their arrays and are written once against the ``xp`` it returns.
"""
from cct.device.backend import cupy, cupy_available, get_array_module, to_host

__all__ = ["cupy", "cupy_available", "get_array_module", "to_host"]
