"""PyTorch held to the vector instruction set numpy's OpenBLAS runs, so that a cct-vs-PyTorch ratio compares
the frameworks and not two vector widths.

``OPENBLAS_CORETYPE=Haswell`` (set on some machines for safety) makes numpy's OpenBLAS run AVX2 kernels even
on an AVX-512 CPU, while PyTorch's oneDNN convolutions and MKL GEMMs pick their own instruction set: on a
2-core Zen 5, CaffeNet's conv2 forward + backward took PyTorch 248 ms with AVX-512 and 416 ms held to AVX2,
where cct's lowering took 421 ms on the AVX2 kernels.  :func:`match_torch_isa` caps PyTorch with oneDNN's
``ONEDNN_MAX_CPU_ISA`` and MKL's ``MKL_ENABLE_INSTRUCTIONS`` when numpy's OpenBLAS kernel is an AVX2 (or
older) one; with an AVX-512 kernel both sides run AVX-512 and PyTorch is left alone.  Call it before a
PyTorch worker process starts (spawned workers inherit the environment); ``--torch-native`` in the scripts
skips it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cct from this checkout, as the scripts use it

# numpy's OpenBLAS kernel (threadpoolctl's "architecture", lower case) -> (oneDNN ISA cap, MKL's)
_CAPS = {"haswell": ("AVX2", "AVX2"), "zen": ("AVX2", "AVX2"), "sandybridge": ("AVX", "AVX"),
         "nehalem": ("SSE41", "SSE4_2"), "core2": ("SSE41", "SSE4_2")}


def numpy_blas_kernel() -> str:
    """The kernel numpy's BLAS runs ("Haswell", "SkylakeX", ...; "" when unknown)."""
    from cct.device.query import blas_libraries

    libs = blas_libraries()
    mine = [lib for lib in libs if "numpy" in lib.path] or libs
    return mine[0].kernel if mine else ""


def match_torch_isa(native: bool = False) -> str:
    """Cap PyTorch's instruction set to numpy's BLAS kernel's (unless ``native``); a line saying what was done."""
    kernel = numpy_blas_kernel()
    caps = _CAPS.get(kernel.lower())
    if native or caps is None:
        return f"PyTorch on its own instruction set (numpy's OpenBLAS kernel: {kernel or 'unknown'})"
    os.environ["ONEDNN_MAX_CPU_ISA"], os.environ["MKL_ENABLE_INSTRUCTIONS"] = caps
    return (f"PyTorch held to numpy's OpenBLAS {kernel} kernel: ONEDNN_MAX_CPU_ISA={caps[0]} "
            f"MKL_ENABLE_INSTRUCTIONS={caps[1]} (--torch-native lifts it)")
