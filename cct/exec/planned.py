"""A plan that runs: every layer split across the devices as a plan file says (:mod:`cct.plan.files`), as the
layer runner of the serial executor (:mod:`cct.exec.serial`) — no layer is rewritten.

``cct train -plan plan.json -devices cpu:1,cpu:1`` (``cct time -plan`` too), or in Python
``create_solver(param, executor_factory=planned_executor_factory("plan.json", "cpu:1,cpu:1"))``.

**Configurations that run.**  A plan gives each layer degrees ``n, c, h, w`` over its output; worker
``j = i_n·c + i_c`` computes part ``(i_n, i_c)`` on device ``j`` of the device list (as in
:mod:`cct.plan.config`; parts are ``[⌊iS/d⌋, ⌊(i+1)S/d⌋)`` along each split axis):

* a **sample split** (``n > 1``) of a batch-separable layer (``Layer.batch_separable``): each device runs its
  own clone of the layer on its rows of the batch;
* a **channel split** (``c > 1``) of an InnerProduct or a Convolution (``group`` 1): each device holds the
  slice of the weights and bias of its output channels (features) and computes those channels of the top,
  from the whole of the bottom (or of its rows, with ``n > 1`` too); the tops are assembled along the
  channel axis;
* everything else runs on device 0, itself, on the whole batch: a layer the plan leaves at one worker, and a
  layer that cannot run split whatever the plan says of its images (data layers, losses, Accuracy, Dropout
  and BatchNorm in TRAIN: what is not batch-separable; so a planned run draws the random numbers of a plain
  run).  An in-place element-wise layer the planner fused into a channel-split layer (a ReLU after a
  convolution: its ``node`` is that layer) keeps only the plan's sample split.

Anything else is a one-line error naming the plan file, the layer and the field, when the net is built: a
spatial split (``h`` or ``w`` above 1), a channel split of another layer type or of a grouped convolution,
more channel parts than channels, more workers than devices, a layer the net does not have, a layer of the
net the plan does not list, or one whose ``type`` differs.  A plan is made for the TRAIN net; a TEST net
(the solver's test nets) takes the entries of the layers it shares with it and runs the others on device 0.

**Data.**  The net's blobs live where the net lives (device 0's memory for CPU devices); every device
computes in its own buffers (device arrays), so each part's inputs are copied to its device before the
layer runs, and its output part is copied back into the net's blob after (for CPU stand-in devices these are
numpy copies between separate arrays).  The parameters stay the layer's own: before every forward of a split
layer each device's clone receives a copy of its slice (all of them for a sample split).

**Gradients.**  Every clone accumulates its parameter gradients into its own zeroed buffers; when all devices
are done those are added to the layer's parameter diffs (into their slice, for a channel split) in worker
order.  A bottom's gradient is the sum, in worker order, of the gradients of the parts that read its rows
(the channel parts each give a gradient of the whole input).  Results equal a single device's up to float
rounding of the per-part GEMMs and of those sums (tests: 10 solver steps within the comparison rule of
:mod:`cct.compare.tolerance`).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cct import log
from cct.blob import Blob, BlobVec
from cct.device import backend
from cct.device.device import Device, copy_into, parse_devices
from cct.errors import CctError
from cct.exec.serial import LayerRunner, SerialExecutor
from cct.plan.config import bounds
from cct.plan.files import LayerPlan, Plan, read_plan
from cct.proto import caffe_pb2 as pb
from cct.runtime import partition
from cct.runtime.threads import blas_threads

if TYPE_CHECKING:  # pragma: no cover
    from cct.net import NetCore

CHANNEL_SPLIT_TYPES = ("InnerProduct", "Convolution")


@dataclass(frozen=True)
class LayerMode:
    """How one layer of the net runs: ``n`` sample parts by ``c`` channel parts on the first ``n·c``
    devices (``n = c = 1``: the layer itself on device 0); ``why``: the reason a planned split does not run."""

    n: int = 1
    c: int = 1
    why: str = ""

    @property
    def workers(self) -> int:
        return self.n * self.c


@dataclass
class _Part:
    """Worker ``k``: rows ``[r0, r1)`` of the batch and output channels ``[c0, c1)`` (None: all) on ``device``."""

    k: int
    device: Device
    r0: int
    r1: int
    chans: tuple[int, int] | None
    clone: Any = None
    ours: dict[int, Blob] = field(default_factory=dict)  # id(net blob) -> this device's buffer
    bottoms: list[Blob] = field(default_factory=list)
    tops: list[Blob] = field(default_factory=list)
    param_index: list[tuple] = field(default_factory=list)  # per parameter: its slice of the layer's blob


@dataclass
class _Split:
    key: tuple
    parts: list[_Part]
    channel_axis: int


class PlannedRunner(LayerRunner):
    """Runs every layer of a net as ``plan`` says, on ``devices`` (see the module docstring)."""

    def __init__(self, plan: Plan, devices: Sequence[Device], devices_source: str = "-devices"):
        if not devices:
            raise CctError(f"{plan.path}: a planned run needs devices ({devices_source})")
        self.plan = plan
        self.devices = list(devices)
        self.devices_source = devices_source
        self.modes: list[LayerMode] = []
        self._splits: dict[int, _Split] = {}
        self._at_forward: dict[int, _Split | None] = {}
        cpu_threads = sorted({d.threads for d in self.devices if not d.is_gpu})
        self._blas = cpu_threads[0] if cpu_threads else None

    # ---- checking the plan against the net ---------------------------------------------------------
    def attach(self, net: NetCore) -> None:
        self.modes = self.resolve(net)
        self._log_summary(net)

    def _error(self, name: str, message: str) -> CctError:
        return CctError(f"{self.plan.path}: layer \"{name}\": {message}")

    def resolve(self, net: NetCore) -> list[LayerMode]:
        """Each layer's :class:`LayerMode` from its plan entry; one-line errors (module docstring)."""
        plan, names = self.plan, list(net._layer_names)
        strict = net.phase == pb.TRAIN
        net_name = getattr(net, "name", "") or "net"
        where = f"the net '{net_name}' ({getattr(net, '_source', 'net')})"
        if strict:
            known = set(names)
            for name in plan.layers:
                if name not in known:
                    raise self._error(name, f"not a layer of {where}; is the plan for another net?")
        modes = []
        for i, name in enumerate(names):
            layer = net.layers[i]
            entry = plan.layers.get(name)
            if entry is None:
                if strict:
                    raise self._error(name, f"a layer of {where} ({layer.type}) has no entry in the plan; is "
                                            "the plan for another net?")
                modes.append(LayerMode(why="not in the plan"))
                continue
            modes.append(self._mode(net, i, entry))
        return modes

    def _mode(self, net: NetCore, i: int, entry: LayerPlan) -> LayerMode:
        layer, name = net.layers[i], entry.name
        planned_type = self.plan.document.get("layers", {}).get(name, {}).get("type")
        if planned_type is not None and planned_type != layer.type:
            raise self._error(name, f"\"type\" is {planned_type} in the plan but the net's layer is a "
                                    f"{layer.type}")
        if entry.workers > len(self.devices):
            raise self._error(name, f"\"workers\" is {entry.workers}, more than the {len(self.devices)} "
                                    f"device(s) of {self.devices_source} "
                                    f"{','.join(d.name for d in self.devices)}")
        for dim in ("h", "w"):
            if getattr(entry, dim) > 1:
                raise self._error(name, f"\"{dim}\" is {getattr(entry, dim)}: spatial splits do not run (only "
                                        "sample (n) and channel (c) splits do)")
        n, c = entry.n, entry.c
        separable = bool(getattr(layer, "batch_separable", False))
        if c > 1:
            if layer.type not in CHANNEL_SPLIT_TYPES:
                fused = entry.node != name
                if not fused:
                    raise self._error(name, f"\"c\" is {c}: a channel split runs for InnerProduct and "
                                            f"Convolution layers only, not {layer.type}")
                c = 1  # element-wise, in place on its node's output: keep the sample split only
            else:
                outputs = int(getattr(layer, "num_output", 0))
                group = int(getattr(layer, "group", 1))
                if group != 1:
                    raise self._error(name, f"\"c\" is {c}: a channel split of a grouped convolution (group "
                                            f"{group}) does not run")
                if c > outputs:
                    raise self._error(name, f"\"c\" is {c}, more than the layer's {outputs} outputs")
        why = ""
        if n > 1 and not separable:
            why = "not batch-separable"
            if c == 1:
                return LayerMode(why=why)
            n = 1
        return LayerMode(n, c, why)

    def _log_summary(self, net: NetCore) -> None:
        doc, modes = self.plan.document, self.modes
        sample = [nm for nm, m in zip(net._layer_names, modes) if m.n > 1 and m.c == 1]
        channel = [nm for nm, m in zip(net._layer_names, modes) if m.c > 1]
        whole = [nm for nm, m in zip(net._layer_names, modes) if m.why]
        total = doc.get("totals", {}).get("plan", {}).get("cost_ms")
        cost = f", {total:.4g} ms/step in its cost model" if isinstance(total, (int, float)) else ""
        log.info("plan %s (%s, %d workers%s) on %s: %d layer(s) split over samples, %d over channels, %d on %s",
                 self.plan.path, doc.get("net") or self.plan.model or "net", self.plan.workers, cost,
                 ",".join(d.name for d in self.devices), len(sample), len(channel),
                 len(modes) - len(sample) - len(channel), self.devices[0])
        for nm, m in zip(net._layer_names, modes):
            if m.workers > 1:
                log.info("plan: %s n=%d c=%d on %s", nm, m.n, m.c,
                         ",".join(d.name for d in self.devices[:m.workers]))
        if whole:
            log.info("plan: on %s, whole, though the plan splits them: %s (%s)", self.devices[0],
                     ", ".join(whole), "; ".join(sorted({m.why for m in modes if m.why})))

    def describe(self) -> str:
        return f"plan {self.plan.path} on " + ",".join(d.name for d in self.devices)

    # ---- building the parts of a layer -------------------------------------------------------------
    def _split_for(self, net: NetCore, i: int) -> _Split:
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        mode = self.modes[i]
        key = tuple(b.shape for b in bottom)
        split = self._splits.get(i)
        if split is not None and split.key == key:
            return split
        batch = bottom[0].shape[0] if bottom and bottom[0].num_axes else 1
        if mode.n > 1 and any(b.num_axes == 0 or b.shape[0] != batch for b in bottom):
            raise CctError(f"{self.plan.path}: layer \"{net._layer_names[i]}\": \"n\" is {mode.n} but its "
                           "bottoms do not share a batch axis (" + ", ".join(b.shape_string() for b in bottom) + ")")
        axis = self._channel_axis(layer) if mode.c > 1 else 1
        rows = bounds(batch, mode.n) if mode.n > 1 else [0, batch]
        chans = bounds(int(layer.num_output), mode.c) if mode.c > 1 else None
        parts = []
        for i_n in range(mode.n):
            r0, r1 = int(rows[i_n]), int(rows[i_n + 1])
            for i_c in range(mode.c):
                k = i_n * mode.c + i_c
                if r1 <= r0:
                    continue  # a batch smaller than n: this worker has no rows
                ch = (int(chans[i_c]), int(chans[i_c + 1])) if chans is not None else None
                part = _Part(k, self.devices[k], r0, r1, ch)
                with part.device.thread_context():
                    self._build_part(layer, bottom, top, part, axis)
                parts.append(part)
        split = self._splits[i] = _Split(key, parts, axis)
        return split

    @staticmethod
    def _channel_axis(layer: Any) -> int:
        return int(layer.axis) if layer.type == "InnerProduct" else int(layer.channel_axis)

    def _build_part(self, layer: Any, bottom: list[Blob], top: list[Blob], part: _Part, axis: int) -> None:
        """The part's buffers (one per net blob, so in-place tops stay in place) and its clone of ``layer``."""
        from cct.layers.registry import create_layer

        rows = part.r1 - part.r0
        for p in bottom + top:
            if id(p) not in part.ours:
                part.ours[id(p)] = Blob((rows,) + p.shape[1:] if p.num_axes else (), xp=part.device.xp, dtype=p.dtype)
        part.bottoms = [part.ours[id(p)] for p in bottom]
        part.tops = [part.ours[id(p)] for p in top]
        lp = pb.LayerParameter()
        lp.CopyFrom(layer.layer_param)
        part.param_index = [(slice(None),) * p.num_axes for p in layer.blobs]
        if part.chans is not None:
            c0, c1 = part.chans
            if layer.type == "InnerProduct":
                lp.inner_product_param.num_output = c1 - c0
                weight_axis = 1 if layer.transpose else 0
            else:
                lp.convolution_param.num_output = c1 - c0
                weight_axis = 0
            for j in range(len(layer.blobs)):
                ax = weight_axis if j == 0 else 0
                part.param_index[j] = (slice(None),) * ax + (slice(c0, c1),)
        clone = create_layer(lp)
        clone.blobs = BlobVec(Blob(p.data[idx].shape, xp=part.device.xp, dtype=p.dtype)
                              for p, idx in zip(layer.blobs, part.param_index))
        self._refresh_params(layer, part, clone)
        try:
            clone.setup_layer(part.bottoms, part.tops)
        except CctError as e:
            raise CctError(f"layer '{layer.name}' ({layer.type}) on {part.device} (worker {part.k}): {e}") from None
        clone.param_propagate_down = list(layer.param_propagate_down)
        part.clone = clone

    @staticmethod
    def _refresh_params(layer: Any, part: _Part, clone: Any) -> None:
        """The clone's parameters: a copy of the layer's current values (its slice of them)."""
        for j, (p, idx) in enumerate(zip(layer.blobs, part.param_index)):
            want = p.data[idx]
            b = clone.blobs[j]
            if b.shape != want.shape:
                b.reshape(want.shape)
            copy_into(b.data, want)

    def _top_index(self, part: _Part, top: Blob, axis: int) -> tuple:
        """Where the part's top lands in the net's top: its rows, and its channels along ``axis``."""
        rows = slice(part.r0, part.r1)
        if part.chans is None:
            return (rows,)
        return (rows,) + (slice(None),) * (axis - 1) + (slice(*part.chans),)

    # ---- running ---------------------------------------------------------------------------------
    def _on_device0(self, run: Callable[[], Any]) -> Any:
        """``run()`` where the net lives, with device 0's threads (one partition: no batch split of its own)."""
        first = self.devices[0]
        result: list[Any] = []
        blas = blas_threads(first.threads) if not first.is_gpu else contextlib.nullcontext()
        with blas, first.thread_context():
            partition.run_concurrently(1, lambda _k: result.append(run()))
        return result[0]

    def _concurrently(self, parts: list[_Part], body: Callable[[_Part], None]) -> None:
        def run(k: int) -> None:
            with parts[k].device.thread_context():
                body(parts[k])

        blas = blas_threads(self._blas) if self._blas else contextlib.nullcontext()
        with blas:
            partition.run_concurrently(len(parts), run)

    def forward_layer(self, net: NetCore, i: int) -> float:
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        if self.modes[i].workers == 1:
            self._at_forward[i] = None
            return float(self._on_device0(lambda: layer.forward_layer(bottom, top)))
        layer.reshape(bottom, top)  # the whole batch's top shapes (no arithmetic)
        split = self._split_for(net, i)
        for p in bottom + top:
            p.data  # noqa: B018 - allocate in this thread, before the devices write into parts of it
        axis = split.channel_axis

        def forward(part: _Part) -> None:
            clone = part.clone
            self._refresh_params(layer, part, clone)
            for p, ours in zip(bottom, part.bottoms):
                copy_into(ours.data, p.data[part.r0:part.r1])
            clone.reshape(part.bottoms, part.tops)
            clone.forward(part.bottoms, part.tops)
            for p, ours in zip(top, part.tops):
                copy_into(p.data[self._top_index(part, p, axis)], ours.data)

        self._concurrently(split.parts, forward)
        self._at_forward[i] = split
        loss = 0.0
        for k, t in enumerate(top):
            if layer.loss(k) != 0.0:
                loss += float((t.data * t.diff).sum(dtype="float64"))
        return loss

    def backward_layer(self, net: NetCore, i: int) -> None:
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        need = list(net.bottom_need_backward[i])
        split = self._at_forward.get(i)
        if split is None:
            self._on_device0(lambda: layer.backward_layer(top, need, bottom))
            return
        ppd = list(layer.param_propagate_down)
        axis = split.channel_axis
        for p in bottom + top:
            p.data  # noqa: B018 - allocate in this thread
            p.diff  # noqa: B018

        def backward(part: _Part) -> None:
            clone = part.clone
            clone.param_propagate_down = list(ppd)
            for j, b in enumerate(clone.blobs):
                if j >= len(ppd) or ppd[j]:
                    b.diff[...] = 0
            for p, ours in zip(bottom, part.bottoms):
                copy_into(ours.data, p.data[part.r0:part.r1])
            for p, ours in zip(top, part.tops):
                index = self._top_index(part, p, axis)
                copy_into(ours.data, p.data[index])
                copy_into(ours.diff, p.diff[index])
            clone.backward(part.tops, need, part.bottoms)

        self._concurrently(split.parts, backward)
        for j, p in enumerate(layer.blobs):  # parameter gradients: worker order
            if j < len(ppd) and not ppd[j]:
                continue
            for part in split.parts:
                _add_into(p.diff[part.param_index[j]], part.clone.blobs[j].diff)
        for b, ours_index, wanted in zip(bottom, range(len(bottom)), need):  # bottom gradients: worker order
            if not wanted:
                continue
            written: set[tuple[int, int]] = set()
            for part in split.parts:
                rows = (part.r0, part.r1)
                dst = b.diff[part.r0:part.r1]
                src = part.bottoms[ours_index].diff
                if rows in written:
                    _add_into(dst, src)
                else:
                    copy_into(dst, src)
                    written.add(rows)


def _add_into(dst: Any, src: Any) -> None:
    """``dst += src``, moving ``src`` to ``dst``'s device first if needed."""
    if backend.array_gpu(dst) == backend.array_gpu(src):
        dst += src
        return
    tmp = backend.get_array_module(dst).empty_like(dst)
    copy_into(tmp, src)
    dst += tmp


def planned_executor_factory(plan: str | os.PathLike[str] | Plan, devices: str | Sequence[Device],
                             devices_source: str = "-devices") -> Callable[[], SerialExecutor]:
    """An executor factory (for ``create_solver(..., executor_factory=)``) running every net it builds as
    ``plan`` (a plan file or a read :class:`~cct.plan.files.Plan`) says, on ``devices``."""
    the_plan = plan if isinstance(plan, Plan) else read_plan(plan)
    devs = parse_devices(devices, devices_source) if isinstance(devices, str) else list(devices)

    def factory() -> SerialExecutor:
        return SerialExecutor(PlannedRunner(the_plan, devs, devices_source))

    return factory
