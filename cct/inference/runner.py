"""One forward pass of a rewritten net over a batch of patches, holding only what is still needed.

:class:`InferenceNet` instantiates the layers of :meth:`NetSpec.rewrite` (the registry's layers; each
convolution with the engine of its planned primitive, :func:`conv_engine`) and runs them in order.  Unlike
:class:`cct.Net`, which keeps every top alive, a blob is dropped after its last consumer, each convolution's
scratch (lowering workspace, FFT spectra) is released after the layer, and so are the buffers layers keep for
a backward pass that inference never runs — the peak of a run is the largest *layer* (its live blobs and its
scratch, :mod:`cct.inference.memory`), not the sum of all of them.

Weights (:class:`Weights`) are read once (binary ``.caffemodel`` or ``.caffemodel.h5``) and shared by every
net of a session; a layer without weights in the file keeps its fillers (and says so once).
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cct import log
from cct.blob import Blob, BlobVec
from cct.engines import ConvEngine
from cct.errors import CctError
from cct.inference.fov import NetSpec
from cct.layers.base import Layer
from cct.proto import caffe_pb2 as pb

__all__ = ["InferenceNet", "Weights", "conv_engine", "PRIMITIVES"]

PRIMITIVES = ("lowering 1", "lowering 2", "lowering 3", "fft full", "fft lifted")
# the lowering primitives lower at most this much at a time (all batch partitions together): GEMMs of a few
# thousand columns already run at full speed, and the budget is better spent on larger patches
LOWERED_BYTES = 32 << 20

# buffers layers keep for their backward pass (inference never runs it): released after each forward, so
# they are scratch of their layer rather than memory held for the whole run
_BACKWARD_BUFFERS = {"BatchNorm": ("_x_norm",), "Scale": ("_x_copy", "_saved"), "Eltwise": ("_max_idx", "_x0_copy"),
                     "Swish": ("_s", "_x_copy")}


def conv_engine(primitive: str, workspace: Any = None) -> ConvEngine:
    """The engine that runs ``primitive`` (``"lowering 1|2|3"``, ``"fft full|lifted"``) for one layer of an
    inference net: the lowering engine with that lowering and a private workspace (released after each
    layer), or the FFT engine in that layout keeping nothing between calls."""
    family, _, kind = primitive.partition(" ")
    if family == "lowering" and kind in ("1", "2", "3"):
        from cct.engines.lowering import LoweringEngine, Workspace

        return LoweringEngine(int(kind), max_lowered_bytes=LOWERED_BYTES, source="plan",
                              workspace=workspace if workspace is not None else Workspace())
    if family == "fft" and kind in ("full", "lifted"):
        from cct.engines.fft import FFTEngine

        return FFTEngine(memoize=False, lift=kind == "lifted")
    raise CctError(f"unknown convolution primitive '{primitive}' (known: {', '.join(PRIMITIVES)})")


class Weights:
    """Parameter blobs by layer name, shared by the inference nets of one run."""

    def __init__(self, arrays: Mapping[str, Sequence[np.ndarray]] | None = None, source: str = ""):
        self.source = source
        self._arrays = {k: list(v) for k, v in (arrays or {}).items()}
        self._blobs: dict[str, BlobVec] = {}
        self._warned: set[str] = set()

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None) -> Weights:
        """Read a binary ``.caffemodel`` or an HDF5 ``.caffemodel.h5`` (None: no weights, fillers)."""
        if path is None or os.fspath(path) == "":
            return cls()
        from cct.blob import blob_from_proto
        from cct.io.weights import is_hdf5, read_caffemodel

        source = os.fspath(path)
        if not os.path.exists(source):
            raise CctError(f"{source}: weights file not found")
        if is_hdf5(source):
            from cct.io.hdf5 import read_hdf5_weights

            data = read_hdf5_weights(source)
            return cls({name: [blobs[i] for i in sorted(blobs)] for name, blobs in data.items()}, source)
        net = read_caffemodel(source)
        return cls({lp.name: [blob_from_proto(b).data for b in lp.blobs] for lp in net.layer if len(lp.blobs)},
                   source)

    def attach(self, layer: Layer) -> None:
        """Give ``layer`` its parameter blobs (before its setup): the shared ones, or those from the file."""
        name = layer.name
        if name in self._blobs:
            layer.blobs = self._blobs[name]
            return
        arrays = self._arrays.get(name)
        if arrays is None:
            return
        vec = BlobVec()
        for a in arrays:
            b = Blob(a.shape)
            b.data[...] = a
            vec.append(b)
        layer.blobs = vec

    def adopt(self, layer: Layer) -> None:
        """After setup: share ``layer``'s blobs with later nets (fillers included, so every net agrees)."""
        if len(layer.blobs) and layer.name not in self._blobs:
            if layer.name not in self._arrays and self.source and layer.name not in self._warned:
                self._warned.add(layer.name)
                log.warning("%s: no weights for layer %s in %s; it keeps its fillers", layer.type, layer.name,
                            self.source)
            self._blobs[layer.name] = layer.blobs

    def nbytes(self) -> int:
        """Bytes of every parameter blob held."""
        return sum(int(b.data.nbytes) for vec in self._blobs.values() for b in vec)


class InferenceNet:
    """The layers of ``spec`` for runs of ``batch`` inputs of ``in_spatial``, pooling as MPF where ``mpf``
    says, each convolution with ``primitives[layer name]`` (see :data:`PRIMITIVES`).

    ``forward(x)``: ``x`` ``(batch, C, *in_spatial)`` → the output blob ``(batch·F, C_out, *J)`` (``F``
    fragments per input).  ``input_buffer()`` gives a fresh input array to fill instead (no copy)."""

    def __init__(self, spec: NetSpec, weights: Weights, mpf: Sequence[bool], batch: int,
                 in_spatial: Sequence[int], primitives: Mapping[str, str]):
        from cct.engines.lowering import Workspace
        from cct.layers.conv import Convolution
        from cct.layers.registry import create_layer

        self.spec, self.mpf, self.batch = spec, tuple(mpf), int(batch)
        self.in_spatial = tuple(int(v) for v in in_spatial)
        self.shapes = spec.shapes(self.mpf, self.batch, self.in_spatial)
        self.primitives = dict(primitives)
        self.workspace = Workspace()
        self.layer_seconds: dict[str, float] | None = None  # a dict: forward records each layer's seconds
        self.params = spec.rewrite(self.mpf, self.batch, self.in_spatial)[1:]
        self.layers: list[Layer] = []
        for lp in self.params:
            try:
                if lp.type == "Convolution":
                    primitive = self.primitives.get(lp.name)
                    if primitive is None:
                        raise CctError(f"no primitive planned for convolution layer '{lp.name}'")
                    layer: Layer = Convolution(lp, conv_engine(primitive, self.workspace))
                else:
                    layer = create_layer(lp)
            except CctError as e:
                raise CctError(f"{spec.source}: layer '{lp.name}' ({lp.type}): {e}") from None
            weights.attach(layer)
            self.layers.append(layer)
        # the last layer reading each blob (the output is never dropped)
        self._last_use: dict[str, int] = {}
        for i, lp in enumerate(self.params):
            for b in lp.bottom:
                self._last_use[b] = i
        self._last_use.pop(spec.output_blob, None)
        blobs = {spec.input_blob: Blob(self.shapes[spec.input_blob].shape)}
        for i, (lp, layer) in enumerate(zip(self.params, self.layers)):
            bottom, top = self._wire(blobs, lp)
            try:
                layer.setup_layer(bottom, top)
            except CctError as e:
                raise CctError(f"{spec.source}: layer '{lp.name}' ({lp.type}): {e}") from None
            weights.adopt(layer)
            self._release(blobs, i, layer)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.shapes[self.spec.input_blob].shape

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.shapes[self.spec.output_blob].shape

    def input_buffer(self) -> np.ndarray:
        """A new input array ``(batch, C, *in_spatial)`` (float32, zero-filled) for :meth:`forward`."""
        self._input = Blob(self.input_shape)
        return self._input.data

    def forward(self, x: np.ndarray | None = None) -> np.ndarray:
        """Run every layer on ``x`` (or on the last :meth:`input_buffer`); returns the output blob's data."""
        if x is not None:
            if tuple(x.shape) != self.input_shape:
                raise CctError(f"inference input of shape {tuple(x.shape)}; this net runs {self.input_shape}")
            self.input_buffer()[...] = x
        inp = getattr(self, "_input", None)
        if inp is None:
            raise CctError("InferenceNet.forward: no input (pass x or fill input_buffer())")
        self._input = None
        blobs = {self.spec.input_blob: inp}
        del inp
        timed = self.layer_seconds is not None
        for i, (lp, layer) in enumerate(zip(self.params, self.layers)):
            bottom, top = self._wire(blobs, lp)
            t = time.perf_counter() if timed else 0.0
            layer.forward_layer(bottom, top)
            if timed:
                self.layer_seconds[lp.name] = time.perf_counter() - t
            del bottom, top
            self._release(blobs, i, layer)
        return blobs[self.spec.output_blob].data

    def _wire(self, blobs: dict[str, Blob], lp: pb.LayerParameter) -> tuple[list[Blob], list[Blob]]:
        bottom = [blobs[b] for b in lp.bottom]
        top = []
        for t in lp.top:
            if t not in blobs or t not in lp.bottom:
                blobs[t] = Blob(self.shapes[t].shape)  # a new top (or a name reused by a later layer)
            top.append(blobs[t])
        return bottom, top

    def _release(self, blobs: dict[str, Blob], i: int, layer: Layer) -> None:
        """After layer ``i``: drop the blobs it read last, its engine's scratch, its backward buffers."""
        for name in [b for b, last in self._last_use.items() if last == i]:
            blobs.pop(name, None)
        if layer.type == "Convolution":
            self.workspace.clear()
        for attr in _BACKWARD_BUFFERS.get(layer.type, ()) + ("_x_copy",):
            if isinstance(getattr(layer, attr, None), np.ndarray):
                setattr(layer, attr, None)
