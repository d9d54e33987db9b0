"""The layer contract (Caffe's ``Layer``, in Python).

A layer implements four methods, the same names a pycaffe Python layer implements:

* ``setup(bottom, top)``   — one-time setup from ``self.layer_param``: read parameters, check them,
  create learnable ``self.blobs`` (Caffe's ``LayerSetUp``).
* ``reshape(bottom, top)`` — size the tops (and internal buffers) from the bottoms' shapes.  Called at
  setup and before every forward, so a net adapts to new input shapes.
* ``forward(bottom, top)`` — compute ``top[i].data`` from ``bottom[i].data``.
* ``backward(top, propagate_down, bottom)`` — from ``top[i].diff`` write ``bottom[i].diff`` where
  ``propagate_down[i]`` (overwrite) and **accumulate** (``+=``) into ``self.blobs[j].diff`` where
  ``self.param_propagate_down[j]``.

``bottom`` and ``top`` are lists of :class:`~cct.blob.Blob`.  Arity is declared with the class attributes
below and checked once by the framework (:meth:`setup_layer`), with Caffe's messages.  The framework
wrappers (:meth:`setup_layer`, :meth:`forward_layer`, :meth:`backward_layer`) add Caffe's bookkeeping:
count checks, loss weights, reshape-before-forward.  Bodies are written against the array module of
their blobs (``xp = get_array_module(bottom[0].data)``) so one body serves numpy and cupy.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from cct.blob import Blob, BlobVec, blob_from_proto
from cct.errors import CctError, ParamError
from cct.proto import caffe_pb2 as pb


class Layer:
    """Base class of every layer.  Subclasses declare arity and implement the four contract methods."""

    # Arity (None: no constraint), Caffe's ExactNumBottomBlobs/MinBottomBlobs/... .
    exact_num_bottom: ClassVar[int | None] = None
    min_bottom: ClassVar[int | None] = None
    max_bottom: ClassVar[int | None] = None
    exact_num_top: ClassVar[int | None] = None
    min_top: ClassVar[int | None] = None
    max_top: ClassVar[int | None] = None
    equal_num_bottom_top: ClassVar[bool] = False
    # Loss layers: missing tops are created anonymously as "(automatic)".
    auto_top_blobs: ClassVar[bool] = False
    # False for layers that must not run in place (AbsVal, Split, Flatten, Reshape, ...).
    allow_in_place: ClassVar[bool] = True
    # True where forward/backward treat each item along axis 0 independently (every bottom and top is
    # batch-major, no randomness, no whole-batch statistics): the device split (cct.exec.device_split) may then
    # run the layer on sub-batches.  A subclass whose answer depends on its parameters uses a property.
    batch_separable: ClassVar[bool] = False

    def __init__(self, param: pb.LayerParameter):
        self.layer_param = param
        self.phase = param.phase
        # Blobs stored in the layer definition itself (Caffe: "Skipping parameter initialization").
        self.blobs: BlobVec = BlobVec(blob_from_proto(b) for b in param.blobs)
        self.param_propagate_down: list[bool] = []
        self._loss: list[float] = []

    # ---- pycaffe attributes ------------------------------------------------------------------
    @property
    def type(self) -> str:
        return self.layer_param.type

    @property
    def name(self) -> str:
        return self.layer_param.name

    # ---- the contract ------------------------------------------------------------------------
    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        """One-time setup (parameters, learnable blobs).  Default: nothing."""

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.reshape")

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        """Default for layers without a gradient: fine unless a gradient is actually requested."""
        if any(propagate_down):
            raise CctError(f"layer '{self.name}' ({self.type}) cannot back-propagate to its bottoms")

    def allow_force_backward(self, bottom_index: int) -> bool:
        """Whether ``force_backward`` may send a gradient into this bottom (labels: no)."""
        return True

    # ---- exact resume --------------------------------------------------------------------------
    def resume_state(self) -> dict | None:
        """What the layer needs besides its blobs to go on exactly where it is — a data source's cursor,
        a random stream — as JSON-able values, or None (most layers).  Written into snapshots."""
        return None

    def restore_resume_state(self, state: dict) -> None:
        """Go back to a :meth:`resume_state` (a snapshot's)."""
        raise CctError(f"layer '{self.name}' ({self.type}) keeps no resume state")

    # ---- framework ---------------------------------------------------------------------------
    def setup_layer(self, bottom: list[Blob], top: list[Blob]) -> None:
        """Caffe's ``Layer::SetUp``: check counts, setup, reshape, set loss weights."""
        self.check_blob_counts(bottom, top)
        if not self.allow_in_place:
            for t in top:
                if any(t is b for b in bottom):
                    raise ParamError("top", f"{self.type} Layer does not allow in-place computation")
        self.setup(bottom, top)
        self.reshape(bottom, top)
        self.set_loss_weights(top)

    def forward_layer(self, bottom: list[Blob], top: list[Blob]) -> float:
        """Caffe's ``Layer::Forward``: reshape, forward, return the weighted loss of the tops."""
        self.reshape(bottom, top)
        self.forward(bottom, top)
        loss = 0.0
        for i, w in enumerate(self._loss):
            if w != 0.0:
                loss += float((top[i].data * top[i].diff).sum(dtype="float64"))
        return loss

    def backward_layer(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        self.backward(top, propagate_down, bottom)

    def loss(self, top_index: int) -> float:
        return self._loss[top_index] if top_index < len(self._loss) else 0.0

    def set_loss(self, top_index: int, value: float) -> None:
        if len(self._loss) <= top_index:
            self._loss.extend([0.0] * (top_index + 1 - len(self._loss)))
        self._loss[top_index] = value

    def set_loss_weights(self, top: list[Blob]) -> None:
        """Caffe's ``SetLossWeights``: a non-zero weight w on top i makes the layer a loss, and
        ``top[i].diff`` is filled with w (the loss layer's backward reads its scale from there)."""
        weights = list(self.layer_param.loss_weight)
        if not weights:
            return
        if len(weights) != len(top):
            raise ParamError("loss_weight", "loss_weight must be unspecified or specified once per top blob")
        for i, w in enumerate(weights):
            if w == 0:
                continue
            self.set_loss(i, float(w))
            top[i].diff[...] = w

    def check_blob_counts(self, bottom: list[Blob], top: list[Blob]) -> None:
        t, nb, nt = self.type, len(bottom), len(top)
        if self.exact_num_bottom is not None and nb != self.exact_num_bottom:
            raise ParamError("bottom", f"{t} Layer takes {self.exact_num_bottom} bottom blob(s) as input "
                                       f"(got {nb})")
        if self.min_bottom is not None and nb < self.min_bottom:
            raise ParamError("bottom", f"{t} Layer takes at least {self.min_bottom} bottom blob(s) as input "
                                       f"(got {nb})")
        if self.max_bottom is not None and nb > self.max_bottom:
            raise ParamError("bottom", f"{t} Layer takes at most {self.max_bottom} bottom blob(s) as input "
                                       f"(got {nb})")
        if self.exact_num_top is not None and nt != self.exact_num_top:
            raise ParamError("top", f"{t} Layer produces {self.exact_num_top} top blob(s) as output (got {nt})")
        if self.min_top is not None and nt < self.min_top:
            raise ParamError("top", f"{t} Layer produces at least {self.min_top} top blob(s) as output "
                                    f"(got {nt})")
        if self.max_top is not None and nt > self.max_top:
            raise ParamError("top", f"{t} Layer produces at most {self.max_top} top blob(s) as output "
                                    f"(got {nt})")
        if self.equal_num_bottom_top and nb != nt:
            raise ParamError("top", f"{t} Layer produces one top blob as output for each bottom blob input")

    def min_top_blobs(self) -> int:
        """How many tops the net must create for an auto-top layer (Caffe's Exact/MinTopBlobs)."""
        if self.exact_num_top is not None:
            return self.exact_num_top
        return self.min_top or 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self.name}' ({self.type})>"


class LossLayer(Layer):
    """Caffe's ``LossLayer``: two bottoms (prediction, label), one scalar top with loss weight 1 by default."""

    exact_num_bottom = 2
    exact_num_top = 1
    auto_top_blobs = True

    def setup_layer(self, bottom: list[Blob], top: list[Blob]) -> None:
        if not self.layer_param.loss_weight:
            self.layer_param.loss_weight.append(1.0)
        super().setup_layer(bottom, top)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            raise CctError(f"layer '{self.name}': the data and label should have the same first dimension "
                           f"({bottom[0].shape_string()} vs {bottom[1].shape_string()})")
        top[0].reshape(())

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 1
