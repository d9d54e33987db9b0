"""Engines: how heavy layers compute.  A layer owns parameters, shapes and blobs; an engine the arithmetic.

Convolution engines implement :class:`ConvEngine` on a :class:`ConvGeometry`.  Every method is written in
terms of a plain (forward) convolution ``y = conv(x, w) + b`` with

* ``x``  — input,  shape ``(N, C, *in_shape)``
* ``w``  — filters, shape ``(O, C/group, *kernel)`` (Caffe's weight layout)
* ``y``  — output, shape ``(N, O, *out_shape)``,
  ``y[n, g*Og+o, p] = b[g*Og+o] + Σ_{c<Cg, k} w[g*Og+o, c, k] · x_pad[n, g*Cg+c, p*stride - pad + k*dil]``

and the three products of back-propagation: ``forward`` (x → y), ``backward_data`` (dy → dx, the transposed
convolution) and ``backward_weights`` (x, dy → dw).  Deconvolution uses the same engine with the roles of
``forward`` and ``backward_data`` swapped (its geometry is that of the convolution it is the transpose of).

**Cost contract.** Every engine class predicts its cost on a geometry without running it:
``Engine.estimates(geometry, dtype, rates, xp) -> [Estimate]``, one per variant it offers (the lowering
engine's three lowerings, the FFT engine's two layouts, the Winograd engine's two tile sizes) — forward
seconds, backward (data + weights) seconds and the workspace it holds. :func:`estimate_convolution` collects
them for every engine with this machine's calibrated rates: the per-layer engine choice, the memory-budget
planner of volume inference and the parallelism planner all price convolutions through it.

Engines are looked up by name with :func:`create_conv_engine`: ``lowering`` (CcT's three lowerings,
:mod:`cct.engines.lowering`), ``fft`` (ZNN's FFT convolution, :mod:`cct.engines.fft`), ``winograd``
(Lavin & Gray's minimal filtering for 3x3 kernels, :mod:`cct.engines.winograd`) and ``depthwise`` (one input
channel per group, directly: :mod:`cct.engines.depthwise`).  A layer's creator
function gets a :class:`cct.engines.choice.SelectedEngine`, which runs one of them per geometry as the
settings say (``CCT_CONV_ENGINE``, ``CCT_LOWERING``, ``CCT_PARTITIONS``; cost model and measured autotune).
"""
from __future__ import annotations

import importlib
from typing import Any

from cct.engines.base import ConvEngine, ConvGeometry, Estimate
from cct.errors import CctError

__all__ = ["ConvEngine", "ConvGeometry", "Estimate", "conv_engine_names", "create_conv_engine",
           "estimate_convolution"]


# name -> "module:Class"; imported on first use so that an engine's dependencies load only when chosen.
_CONV_ENGINES: dict[str, str] = {
    "depthwise": "cct.engines.depthwise:DepthwiseEngine",
    "fft": "cct.engines.fft:FFTEngine",
    "lowering": "cct.engines.lowering:LoweringEngine",
    "winograd": "cct.engines.winograd:WinogradEngine",
}


def conv_engine_names() -> list[str]:
    return sorted(_CONV_ENGINES)


def conv_engine_class(name: str) -> type[ConvEngine]:
    """The engine class registered as ``name``."""
    target = _CONV_ENGINES.get(name)
    if target is None:
        raise CctError(f"unknown convolution engine '{name}' (known: {', '.join(conv_engine_names())})")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def create_conv_engine(name: str) -> ConvEngine:
    """A new engine instance by name (each layer owns its engine and its buffers)."""
    return conv_engine_class(name)()


def estimate_convolution(g: ConvGeometry, dtype: Any = "float32", xp: Any = None,
                         rates: Any = None) -> dict[str, Estimate]:
    """Every variant of every engine that can run ``g``, keyed by variant (``"lowering 1"`` … ``"fft full"``),
    priced with ``rates`` (default: this machine's calibrated rates where measured, else the defaults)."""
    if rates is None:
        from cct.engines.autotune import machine_rates

        rates = machine_rates()
    return {e.variant: e for name in conv_engine_names()
            for e in conv_engine_class(name).estimates(g, dtype, rates, xp)}
