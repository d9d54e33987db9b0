"""pycaffe's ``caffe.Net``: the constructor forms, the dict views and the Python-side forward/backward helpers.

Mirrors ``python/caffe/pycaffe.py`` + ``_caffe.cpp`` so that pycaffe scripts run unchanged with
``import cct as caffe``; the graph and loops are :class:`cct.net.NetCore`.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from cct import log
from cct.errors import CctError
from cct.exec import Executor, executor_from_settings
from cct.net import NetCore, net_state
from cct.proto import caffe_pb2 as pb

TRAIN = pb.TRAIN
TEST = pb.TEST


class InputArrayError(CctError, RuntimeError):
    """An array ``_set_input_arrays`` cannot take (pycaffe raises RuntimeError)."""


def _check_contiguous_array(arr: np.ndarray, name: str, chw: tuple[int, int, int]) -> None:
    """pycaffe's checks of an array handed to a MemoryData layer, with its messages."""
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise InputArrayError(f"{name} must be C contiguous")
    if arr.ndim != 4:
        raise InputArrayError(f"{name} must be 4-d")
    if arr.dtype != np.float32:
        raise InputArrayError(f"{name} must be float32")
    for axis, what in ((1, "number of channels"), (2, "height"), (3, "width")):
        if arr.shape[axis] != chw[axis - 1]:
            raise InputArrayError(f"{name} has wrong {what}")


class Net(NetCore):
    """A network, built from a prototxt (or a NetParameter) in a phase.

    Forms (as pycaffe)::

        Net(network_file, phase, level=0, stages=None, weights=None)
        Net(network_file, weights_file, phase)          # deprecated positional form
        Net(net_parameter, phase)                        # a caffe_pb2.NetParameter

    cct's own keyword ``executor`` (a :class:`cct.exec.Executor`) runs the net's passes; by default the one
    the settings ask for (:func:`cct.exec.executor_from_settings`: a device split, Caffe's GPU mode, or the
    plain serial loop).
    """

    def __init__(self, network_file: Any, *args: Any, phase: int | None = None, level: int = 0,
                 stages: Sequence[str] | None = None, weights: str | None = None, executor: Executor | None = None):
        if args and isinstance(args[0], (str, os.PathLike)):  # Net(file, weights, phase)
            log.warning("DEPRECATION WARNING - deprecated use of Python interface")
            log.warning("Use this instead (with the named \"weights\" parameter):")
            log.warning("Net('%s', %s, weights='%s')", network_file, args[1] if len(args) > 1 else phase,
                        args[0])
            weights = os.fspath(args[0])
            args = args[1:]
        if args:
            phase = args[0]
            if len(args) > 1:
                level = args[1]
            if len(args) > 2:
                stages = args[2]
            if len(args) > 3:
                weights = args[3]
        if phase not in (TRAIN, TEST):
            raise CctError(f"Net needs a phase (caffe.TRAIN or caffe.TEST), got {phase!r}")
        if isinstance(network_file, pb.NetParameter):
            param = pb.NetParameter()
            param.CopyFrom(network_file)
            source = "<NetParameter>"
        else:
            from cct.io.prototxt import read_net_param

            source = os.fspath(network_file)
            param = read_net_param(source)
        param.state.CopyFrom(net_state(phase, level, stages, param.state))
        self._init_net(param, source, executor if executor is not None else executor_from_settings())
        if weights is not None:
            self.copy_from(weights)

    @classmethod
    def from_param(cls, param: pb.NetParameter, source: str = "<NetParameter>",
                   executor: Executor | None = None) -> Net:
        """Build from a NetParameter whose ``state`` is already set (solver use); ``executor`` as in the
        constructor."""
        net = cls.__new__(cls)
        p = pb.NetParameter()
        p.CopyFrom(param)
        net._init_net(p, source, executor if executor is not None else executor_from_settings())
        return net

    # ---- dict views --------------------------------------------------------------------------
    @property
    def blobs(self) -> OrderedDict:
        """Blob name → Blob, in creation order (split blobs and "(automatic)" included)."""
        return OrderedDict(zip(self._blob_names, self._blobs))

    @property
    def blob_loss_weights(self) -> OrderedDict:
        return OrderedDict(zip(self._blob_names, self._blob_loss_weights))

    @property
    def layer_dict(self) -> OrderedDict:
        return OrderedDict(zip(self._layer_names, self.layers))

    @property
    def params(self) -> OrderedDict:
        """Layer name → list of its parameter Blobs, for layers that have any (in layer order)."""
        return OrderedDict((name, list(layer.blobs)) for name, layer in zip(self._layer_names, self.layers)
                           if len(layer.blobs) > 0)

    @property
    def inputs(self) -> list[str]:
        return [self._blob_names[i] for i in self._input_blob_indices]

    @property
    def outputs(self) -> list[str]:
        return [self._blob_names[i] for i in self._output_blob_indices]

    @property
    def top_names(self) -> OrderedDict:
        return OrderedDict((self._layer_names[i], [self._blob_names[b] for b in ids])
                           for i, ids in enumerate(self._top_id_vecs))

    @property
    def bottom_names(self) -> OrderedDict:
        return OrderedDict((self._layer_names[i], [self._blob_names[b] for b in ids])
                           for i, ids in enumerate(self._bottom_id_vecs))

    # ---- pycaffe methods ------------------------------------------------------------------------
    def _forward(self, start: int, end: int) -> float:
        return self.forward_from_to(start, end)

    def _backward(self, start: int, end: int) -> None:
        self.backward_from_to(start, end)

    def forward(self, blobs: Iterable[str] | None = None, start: str | None = None, end: str | None = None,
                **kwargs: Any) -> dict[str, np.ndarray]:
        """Forward from ``start`` to ``end`` (layer names, inclusive), feeding ``kwargs`` into the input
        blobs first.  Returns ``{blob: data}`` (live arrays) for the outputs (or ``end``'s tops) + ``blobs``."""
        outputs = set(self.outputs if end is None else self.top_names[end]) | set(blobs or [])
        start_ind = self._layer_names.index(start) if start is not None else 0
        end_ind = self._layer_names.index(end) if end is not None else len(self.layers) - 1
        if kwargs:
            if set(kwargs) != set(self.inputs):
                raise CctError("Input blob arguments do not match net inputs.")
            for name, value in kwargs.items():
                blob = self.blobs[name]
                value = np.asarray(value)
                if value.shape[:1] != blob.shape[:1]:
                    raise CctError(f"Input is not batch sized ({name}: {value.shape} vs {blob.shape})")
                blob.data[...] = value
        self._forward(start_ind, end_ind)
        return {out: self.blobs[out].data for out in outputs}

    def backward(self, diffs: Iterable[str] | None = None, start: str | None = None, end: str | None = None,
                 **kwargs: Any) -> dict[str, np.ndarray]:
        """Backward from ``start`` down to ``end``, seeding output diffs from ``kwargs``.  Returns
        ``{blob: diff}`` for the inputs (or ``end``'s bottoms) + ``diffs``."""
        outputs = set(self.inputs if end is None else self.bottom_names[end]) | set(diffs or [])
        start_ind = self._layer_names.index(start) if start is not None else len(self.layers) - 1
        end_ind = self._layer_names.index(end) if end is not None else 0
        if kwargs:
            if set(kwargs) != set(self.outputs):
                raise CctError("Top diff arguments do not match net outputs.")
            for name, value in kwargs.items():
                blob = self.blobs[name]
                value = np.asarray(value)
                if value.shape[:1] != blob.shape[:1]:
                    raise CctError(f"Diff is not batch sized ({name}: {value.shape} vs {blob.shape})")
                blob.diff[...] = value
        self._backward(start_ind, end_ind)
        return {out: self.blobs[out].diff for out in outputs}

    def forward_all(self, blobs: Iterable[str] | None = None, **kwargs: Any) -> dict[str, np.ndarray]:
        """Forward over inputs of any length, batch by batch (the last padded); concatenated outputs."""
        all_outs: dict[str, list[np.ndarray]] = {out: [] for out in set(self.outputs) | set(blobs or [])}
        for batch in self._batch(kwargs):
            outs = self.forward(blobs=blobs, **batch)
            for out, data in outs.items():
                all_outs[out].extend(data.copy())
        pad = len(next(iter(all_outs.values()))) - len(next(iter(kwargs.values()))) if kwargs else 0
        result = {}
        for out, items in all_outs.items():
            arr = np.asarray(items)
            result[out] = arr[:-pad] if pad else arr
        return result

    def forward_backward_all(self, blobs: Iterable[str] | None = None, diffs: Iterable[str] | None = None,
                             **kwargs: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """forward_all + backward_all; kwargs may hold inputs and output diffs."""
        all_outs: dict[str, list] = {out: [] for out in set(self.outputs) | set(blobs or [])}
        all_diffs: dict[str, list] = {d: [] for d in set(self.inputs) | set(diffs or [])}
        forward_batches = self._batch({k: v for k, v in kwargs.items() if k in self.inputs})
        backward_batches = self._batch({k: v for k, v in kwargs.items() if k in self.outputs})
        for fb, bb in zip(forward_batches, backward_batches):
            for out, data in self.forward(blobs=blobs, **fb).items():
                all_outs[out].extend(data.copy())
            for d, diff in self.backward(diffs=diffs, **bb).items():
                all_diffs[d].extend(diff.copy())
        first = next(iter(kwargs.values()))
        pad = len(next(iter(all_outs.values()))) - len(first)
        outs = {k: (np.asarray(v)[:-pad] if pad else np.asarray(v)) for k, v in all_outs.items()}
        grads = {k: (np.asarray(v)[:-pad] if pad else np.asarray(v)) for k, v in all_diffs.items()}
        return outs, grads

    def _batch(self, blobs: dict[str, Any]):
        """Yield dicts of batch-sized slices of ``blobs`` (last batch zero-padded); no blobs → one empty
        batch per forward pass, as pycaffe."""
        if not blobs:
            yield {}
            return
        num = len(next(iter(blobs.values())))
        batch_size = self._blobs[0].shape[0]
        remainder = num % batch_size
        num_batches = num // batch_size
        for b in range(num_batches):
            i = b * batch_size
            yield {name: np.asarray(blobs[name])[i:i + batch_size] for name in blobs}
        if remainder > 0:
            padded = {}
            for name in blobs:
                arr = np.asarray(blobs[name])
                pad = np.zeros((batch_size - remainder,) + arr.shape[1:], dtype=arr.dtype)
                padded[name] = np.concatenate([arr[-remainder:], pad])
            yield padded

    def set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Feed a MemoryData layer (the net's first layer) with ``data`` ``(n, C, H, W)`` and ``n`` labels.

        Unlike pycaffe, arrays of another dtype or layout are converted (pycaffe asks for C-contiguous
        float32); the layer keeps the arrays it is given, as Caffe keeps the pointers."""
        layer = self.layers[0]
        if not hasattr(layer, "reset"):
            raise CctError("set_input_arrays may only be called if the first layer is a MemoryData layer")
        layer.reset(np.ascontiguousarray(data, dtype=np.float32),
                    np.ascontiguousarray(labels, dtype=np.float32).reshape(-1))

    # ---- pycaffe's low-level members (_caffe.cpp) ---------------------------------------------------------
    @property
    def _inputs(self) -> list[int]:
        """Indices (into ``_blob_names``) of the input blobs."""
        return list(self._input_blob_indices)

    @property
    def _outputs(self) -> list[int]:
        """Indices (into ``_blob_names``) of the output blobs."""
        return list(self._output_blob_indices)

    def _bottom_ids(self, layer_index: int) -> list[int]:
        """Blob indices of layer ``layer_index``'s bottoms."""
        return list(self._bottom_id_vecs[layer_index])

    def _top_ids(self, layer_index: int) -> list[int]:
        """Blob indices of layer ``layer_index``'s tops."""
        return list(self._top_id_vecs[layer_index])

    def _set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """pycaffe's checked feed of a MemoryData layer: ``data`` and ``labels`` must be C-contiguous 4-D
        float32 arrays, ``data`` ``(n, C, H, W)`` of the layer's C, H, W, ``labels`` ``(n, 1, 1, 1)``, and ``n`` a
        multiple of the batch size; the layer keeps the arrays (no copy)."""
        layer = self.layers[0] if self.layers else None
        if not hasattr(layer, "reset"):
            raise InputArrayError("set_input_arrays may only be called if the first layer is a MemoryDataLayer")
        _check_contiguous_array(data, "data array", (layer.channels, layer.height, layer.width))
        _check_contiguous_array(labels, "labels array", (1, 1, 1))
        if data.shape[0] != labels.shape[0]:
            raise InputArrayError("data and labels must have the same first dimension")
        if data.shape[0] % layer.batch_size != 0:
            raise InputArrayError("first dimensions of input arrays must be a multiple of batch size")
        layer.reset(data, labels.reshape(-1))

    def copy_from(self, weights: str) -> None:
        """Load weights (.caffemodel or .caffemodel.h5) by layer name."""
        self.copy_trained_layers_from(weights)

    def share_with(self, other: Net) -> None:
        self.share_trained_layers_with(other)

    def save(self, filename: str) -> None:
        """Write a .caffemodel (binary NetParameter, no diffs)."""
        from cct.io.weights import write_proto_binary

        write_proto_binary(filename, self.to_proto(write_diff=False))

    def save_hdf5(self, filename: str) -> None:
        self.to_hdf5(filename, write_diff=False)

    def load_hdf5(self, filename: str) -> None:
        self._copy_from_hdf5(filename)

    def before_forward(self, callback) -> None:
        self.before_forward_hooks.append(callback)

    def after_forward(self, callback) -> None:
        self.after_forward_hooks.append(callback)

    def before_backward(self, callback) -> None:
        self.before_backward_hooks.append(callback)

    def after_backward(self, callback) -> None:
        self.after_backward_hooks.append(callback)
