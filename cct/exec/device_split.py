"""Each batch split across devices in proportion to their speed: CcT's hybrid CPU/GPU execution (its
"ParallelizedBridge"), as the layer runner of the serial executor (:mod:`cct.exec.serial`) — no layer is
rewritten.

**Settings** (apply to nets built afterwards; :mod:`cct.config`'s ``devices`` and ``split``):
``cct.set_devices("cpu:1,cpu:1", split="auto")`` in Python, ``-devices LIST -split auto|f1,f2,...`` on the
command line, or the environment ``CCT_DEVICES`` / ``CCT_SPLIT`` (used while ``set_devices`` has not been
called, or after ``set_devices(None)``).  Devices are
:class:`~cct.device.Device` lists (``cpu``, ``cpu:T``, ``gpu:N``); two one-thread CPU devices are a real
configuration (how this path runs in CI).

**Shares.**  A batch of B items is cut into contiguous shares ``b_1 .. b_n`` along axis 0: in proportion
to the devices' peak GFLOP/s (``auto``: :meth:`Device.peak_gflops`) or to explicit fractions (which must
sum to 1 within 1e-6): ``b_i = floor(B·f_i)``, plus one item for the largest remainders (ties: the earlier
device), so ``Σ b_i = B``.  Every share must hold at least one item (else a one-line error naming the
device and its share).  The split is logged once per net: ``each batch of 8: cpu:1 gets 4, cpu:1 gets 4,
by peak FLOPS``.

**Batch-separable layers** (``Layer.batch_separable``: conv, pooling, LRN, neurons, InnerProduct, Softmax,
…): the layer is reshaped on the whole batch (its tops take their shapes), then each device runs its own
clone of the layer on its rows, all devices concurrently (one thread each, the first in the caller; BLAS
threads set once to the CPU devices' count, since OpenBLAS's setting is process wide).  Rows are views of
the net's blobs (:meth:`Blob.view_rows`, no copy) on a device that holds the net's memory, and mirrors
elsewhere (a GPU, with ``cupy`` transfers): a share of several devices' split is copied in before each layer
and out after it.  A device alone (Caffe's GPU mode) keeps its copies, one per net blob for all layers,
as Caffe's SyncedMemory does: a blob its layers write stays there for the next layer, and comes back to
the host only when host code touches it — a layer that runs on the host (data, loss, Dropout's draws),
pycaffe reading or writing it, ``debug_info`` — while a blob touched on the host is copied in again before
a device layer reads it (:class:`_Part`; :class:`cct.blob._Buffer` counts the touches).  As in Caffe, an
array taken from ``blob.data`` earlier and written after a pass is not seen by the device: take it again.
A clone is created once per layer and device, with the layer's parameter blobs given to it before its
setup (so no filler runs and no random number is drawn): on the CPU the same memory, on a GPU a device copy
that is refreshed before a forward of the layer whenever the host's weights were touched since (on the
CPU the refresh only re-points at the layer's memory if it was swapped, as a test net's is).
In backward every clone accumulates its parameter gradients into its own zeroed buffer; when all devices
are done those are added to the layer's parameter diffs in device order (deterministic for a split).  The
first device, where it holds the net's memory and has at least two items, accumulates straight into the
layer's diffs instead (the same order of additions, one buffer, zeroing and sum fewer).

**Parameters on a device alone** (GPU mode), as Caffe keeps them: one device copy per parameter buffer (layers
sharing a weight share it) of the weights and of their gradients, which the clones add into; the executor's
``clear_param_diffs`` zeroes the gradients' copies there, the solver's update runs there on them and on its
history's copies (:meth:`DeviceSplitRunner.update_on_device`), and the divergence check reads the gradients
there (:meth:`DeviceSplitRunner.newest`).  A training step moves only what the host's layers touch; weights,
gradients and history come back when host code reads them (a snapshot, pycaffe's ``net.params``).

**Weight-heavy layers on CPUs.**  When every device is a CPU, a layer with parameters whose shares would use
each weight fewer than ``SPLIT_MIN_WEIGHT_REUSE`` times (fully-connected layers below a few hundred items:
an InnerProduct uses each weight once per item) runs whole instead: splitting it adds a weight-gradient
buffer per device and short GEMMs, and gains no arithmetic units.

**Other layers** run on the whole batch, themselves: on CPU devices with all their threads together (one
partition, i.e. no batch partitions of their own, when that is fewer than the machine's cores), with a GPU
listed first where the net's blobs live (the host, with the first device's thread setting): losses
(normalised over the batch), Accuracy, data and input layers, BatchNorm in TRAIN, Dropout in TRAIN,
anything that draws random numbers — so a split run draws exactly the random numbers of a plain run.  A
single device that holds the net's memory (``cpu:T`` alone) runs every layer this way: a thread limit,
nothing split.

Results equal the single-device ones up to float rounding of the per-share GEMMs and of the gradient sum
(tests: forward/backward within 1e-5, a dozen solver steps within 1e-5).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cct import log, mode
from cct.blob import Blob, BlobVec, RowView
from cct.config import settings
from cct.device import backend
from cct.device.device import Device, copy_into, parse_devices
from cct.errors import CctError
from cct.exec.base import zero_param_diffs
from cct.exec.serial import LayerRunner
from cct.proto import caffe_pb2 as pb
from cct.runtime import partition
from cct.runtime.threads import blas_threads, cpu_cores

if TYPE_CHECKING:  # pragma: no cover
    from cct.net import NetCore

SUM_TOLERANCE = 1e-6
# On CPU devices only, a layer with parameters runs split only where every device's share uses each weight at
# least this many times (outputs per weight row per item × items): below, the split's extra weight-gradient
# buffer per device (zeroed, then added) and its short GEMMs cost more than the whole batch on all the CPU
# devices' threads, which is the same arithmetic units (CaffeNet, batch 16, two one-thread devices: fc6 + fc7
# took 169 ms split, 117 ms whole).
SPLIT_MIN_WEIGHT_REUSE = 64


# ------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceSetting:
    """Devices, and fractions (None: ``auto``, by peak FLOPS), with where each came from (for messages)."""

    devices: tuple[Device, ...]
    fractions: tuple[float, ...] | None = None
    source: str = "set_devices"
    split_source: str = "split"


def parse_split(value: str | Sequence[float] | None, devices: Sequence[Device],
                source: str = "-split") -> tuple[float, ...] | None:
    """``auto``/None/"" → None; else one fraction per device, each > 0, summing to 1 within 1e-6."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    text = value if isinstance(value, str) else ",".join(str(v) for v in value)
    try:
        fractions = tuple(float(v) for v in (value.split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        raise CctError(f"{source} {text}: expected 'auto' or comma-separated fractions, one per device") from None
    names = ",".join(d.name for d in devices)
    if len(fractions) != len(devices):
        raise CctError(f"{source} {text}: {len(fractions)} fraction(s) for {len(devices)} device(s) ({names})")
    for d, f in zip(devices, fractions):
        if not math.isfinite(f) or f <= 0:
            raise CctError(f"{source} {text}: {d} gets a share of {f:g}; every device needs a share above 0")
    total = math.fsum(fractions)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise CctError(f"{source} {text}: the fractions sum to {total:.9g}, not 1")
    return fractions


def set_devices(devices: str | Sequence[str | Device] | None, split: str | Sequence[float] | None = "auto",
                *, sources: tuple[str, str] = ("set_devices", "split")) -> None:
    """Split every batch of the nets built afterwards across ``devices`` (``"cpu:1,cpu:1"``, ``"cpu,gpu:0"``,
    or a list of names/:class:`Device`), ``split="auto"`` (by peak FLOPS) or one fraction per device
    (``"0.75,0.25"`` or ``[0.75, 0.25]``, summing to 1).  ``None``: back to the environment
    (``CCT_DEVICES``/``CCT_SPLIT``; unset → the plain single-device loop).  Errors are one-line CctErrors."""
    if devices is None:
        settings.unset("devices")
        settings.unset("split")
        return
    make_setting(devices, split, sources)  # the combination is checked now, at the call
    settings.set("devices", devices, sources[0])
    settings.set("split", split if split is not None else "auto", sources[1])


def make_setting(devices: str | Sequence[str | Device], split: str | Sequence[float] | None,
                 sources: tuple[str, str]) -> DeviceSetting:
    """Devices and fractions checked against each other (``sources`` name them in errors)."""
    if isinstance(devices, str):
        devs = parse_devices(devices, sources[0])
    else:
        devs = [d if isinstance(d, Device) else parse_devices(d, sources[0])[0] for d in devices]
        if not devs:
            raise CctError(f"{sources[0]}: no devices given")
    return DeviceSetting(tuple(devs), parse_split(split, devs, sources[1]), sources[0], sources[1])


def device_setting() -> DeviceSetting | None:
    """The setting nets are built with now (:mod:`cct.config`'s ``devices`` and ``split``), or None."""
    devices, split = settings.get("devices"), settings.get("split")
    dsrc, ssrc = settings.source("devices"), settings.source("split")
    if devices is None:
        if split is not None:
            need = {"CCT_SPLIT": "CCT_DEVICES"}.get(ssrc, "-devices" if ssrc.startswith("-") else "set_devices")
            sep = "=" if ssrc == "CCT_SPLIT" else " "
            raise CctError(f"{ssrc}{sep}{split} needs {need} (the devices to split each batch across)")
        return None
    return make_setting(devices, split or "auto", (dsrc, ssrc if split is not None else "split"))


def batch_shares(batch: int, devices: Sequence[Device], weights: Sequence[float], how: str) -> list[int]:
    """Items of a batch of ``batch`` per device, in proportion to ``weights`` (largest remainders get the
    leftover items, ties to the earlier device); every share must be ≥ 1."""
    total = math.fsum(weights)
    exact = [batch * w / total for w in weights]
    shares = [int(math.floor(e)) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: (-(exact[i] - shares[i]), i))[:batch - sum(shares)]:
        shares[i] += 1
    for i, (d, b) in enumerate(zip(devices, shares)):
        if b < 1:
            raise CctError(f"{d} (device {i + 1} of {len(devices)}) gets {b} of a batch of {batch} "
                           f"({how}: share {weights[i] / total:.4g}); every device needs at least one item")
    return shares


def gpu_mode_device(device_id: int) -> Device:
    """The device of Caffe's GPU mode (``set_mode_gpu`` + ``set_device``, ``-gpu N``)."""
    return Device("gpu", device_id)


def runner_from_settings() -> LayerRunner:
    """The layer runner the current settings ask for: the device split of the device setting, else of
    Caffe's GPU mode (every batch-separable layer on that GPU, each blob kept there between layers and
    brought to the host when host code touches it; losses and data layers on the host), else the plain
    runner."""
    setting = device_setting()
    if setting is None and mode.mode() == mode.GPU:
        setting = DeviceSetting((gpu_mode_device(mode.device()),), (1.0,), "GPU mode", "GPU mode")
    return LayerRunner() if setting is None else DeviceSplitRunner(setting)


def split_executor(devices: Sequence[Device], split: str | Sequence[float] | None = "auto") -> Any:
    """A serial executor whose layers run split across ``devices`` (what a data-parallel replica or a test
    gives the nets it builds)."""
    from cct.exec.serial import SerialExecutor

    return SerialExecutor(DeviceSplitRunner(make_setting(list(devices), split, ("devices", "split"))))


# ------------------------------------------------------------------------------------------------
# The executor
# ------------------------------------------------------------------------------------------------

class _Copies:
    """Which device buffers hold which host buffer's values, as of which version (Caffe's SyncedMemory heads,
    seen from the device): a copy is current while the host buffer was not touched since it was copied in or
    written on the device; a copy written on the device is left pending on the host buffer
    (:class:`cct.blob._Buffer`), to come back when host code first touches it.  Copies are known by their
    memory: the copies of blobs that share memory (a Split's tops, a Reshape's) share theirs."""

    def __init__(self) -> None:
        self._when: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # device buffer -> (host, version, n)

    def bring_in(self, p: Blob, what: str, dev: Any) -> None:
        """Device buffer ``dev`` made equal to ``p``'s ``what`` (all of it), unless it already is."""
        buf = p.buffer(what)
        if self._when.get(dev) == (buf, buf.version, p.count):
            return
        copy_into(dev.array[:p.count].reshape(p.shape), getattr(p, what))  # (brings a pending copy back first)
        buf.tracked = True
        self._when[dev] = (buf, buf.version, p.count)

    def wrote(self, p: Blob, what: str, dev: Any) -> None:
        """``dev`` was written on the device: the newest values of ``p``'s ``what``."""
        buf = p.buffer(what)
        self._when[dev] = (buf, buf.device_wrote(_CopyBack(buf, dev, p.count)), p.count)

    def newest(self, p: Blob, what: str) -> Any:
        """The device buffer holding newer values of ``p``'s ``what`` than the host's, else None."""
        buf = p.buffer(what)
        pending = buf.pending
        if isinstance(pending, _CopyBack) and self._when.get(pending.dev, (None,))[0] is buf:
            return pending.dev
        return None


class _CopyBack:
    """Copies the front of a device buffer into the front of a net blob's host buffer (a pending copy:
    :class:`cct.blob._Buffer`); ``owner`` names the device memory."""

    __slots__ = ("buf", "dev", "count", "owner")

    def __init__(self, buf: Any, dev: Any, count: int):
        self.buf, self.dev, self.count = buf, dev, count
        self.owner = id(dev)

    def __call__(self) -> None:
        copy_into(self.buf.array[:self.count], self.dev.array[:self.count])


@dataclass
class _Part:
    """One device's rows ``[start, stop)`` of one layer: the clone, its parameter blobs and sub-batch blobs.

    ``mirrors``: the part is the whole batch on a device that does not hold the net's memory (Caffe's GPU
    mode): its blobs are the device copies of the net's, kept between layers (``copies``, the runner's).
    Otherwise every layer copies its inputs in and its outputs out."""

    device: Device
    start: int
    stop: int
    bottoms: list[Blob]
    tops: list[Blob]
    parents: dict[int, tuple[Blob, Blob]] = field(default_factory=dict)  # id(net blob) → (net blob, ours)
    clone: Any = None
    direct: bool = False  # accumulates parameter gradients straight into the layer's own diffs
    mirrors: bool = False
    copies: _Copies = field(default_factory=_Copies)

    def stage_in(self, net_blobs: Sequence[Blob], what: str) -> None:
        for p in _unique(net_blobs):
            ours = self.parents[id(p)][1]
            if not isinstance(ours, RowView):
                self.copy_in(p, ours, what)

    def stage_out(self, net_blobs: Sequence[Blob], what: str) -> None:
        for p in _unique(net_blobs):
            ours = self.parents[id(p)][1]
            if isinstance(ours, RowView):
                continue
            if self.mirrors:
                self.copies.wrote(p, what, ours.buffer(what))
            else:
                copy_into(getattr(p, what)[self.start:self.stop], getattr(ours, what))

    def copy_in(self, p: Blob, ours: Blob, what: str, rows: bool = True) -> None:
        """``ours`` made equal to net blob ``p``'s ``what``: this part's rows of it (``rows``), or all of it (a
        parameter) — where the part keeps its copies (:attr:`mirrors`; parameters always) only if it is not
        already (:meth:`_Copies.bring_in`)."""
        if rows and not self.mirrors:
            copy_into(getattr(ours, what), getattr(p, what)[self.start:self.stop])
        else:
            self.copies.bring_in(p, what, ours.buffer(what))


@dataclass
class _Split:
    batch: int
    parts: list[_Part]


class DeviceSplitRunner(LayerRunner):
    """Runs batch-separable layers on every device's share of the batch, the others on the whole batch
    (see the module docstring)."""

    def __init__(self, setting: DeviceSetting):
        self.devices = list(setting.devices)
        self.setting = setting
        if setting.fractions is None:
            peaks = [d.peak_gflops()[0] for d in self.devices]
            self.weights = peaks
            self.how = "by peak FLOPS"
            self._detail = f" ({', '.join(f'{p:.4g}' for p in peaks)} GFLOP/s)"
        else:
            self.weights = list(setting.fractions)
            self.how = f"by {setting.split_source}"
            self._detail = ""
        self._splits: dict[int, _Split] = {}
        self._clones: dict[tuple[int, int], Any] = {}
        # one device alone (GPU mode): its copy of each net blob, shared by all layers, and what each device
        # buffer is current with (_Part.mirrors)
        self._keeps_copies = len(self.devices) == 1 and not self.devices[0].holds(np.empty(0))
        self._mirror_blobs: dict[int, tuple[Blob, Blob]] = {}
        self._copies = _Copies()
        # and its copy of each parameter buffer (weights, their gradients, the solver's history), by host buffer
        self._param_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._split_at_forward: dict[int, _Split | None] = {}
        self._shares: dict[int, list[int]] = {}
        self._whole_logged: dict[int, int] = {}
        cpu_threads = sorted({d.threads for d in self.devices if not d.is_gpu})
        self._blas = cpu_threads[0] if cpu_threads else None
        self._all_cpu = not any(d.is_gpu for d in self.devices)
        # threads of a whole-batch layer: all CPU devices' together (they would be idle), at most the cores
        self._whole_threads = min(cpu_cores(), sum(d.threads for d in self.devices)) \
            if self._all_cpu else None
        cpus = [d.name for d in self.devices if not d.is_gpu]
        if len(cpu_threads) > 1:
            log.warning("CPU devices %s run with %d BLAS thread(s) each while they compute concurrently (the "
                        "BLAS thread count is process wide)", ", ".join(cpus), self._blas)
        if len(cpus) > 1 and self._blas and self._blas > 1:
            log.warning("CPU devices %s compute concurrently with %d BLAS threads each: OpenBLAS runs one "
                        "multi-threaded matrix product at a time, so theirs take turns; one-thread CPU devices "
                        "(cpu:1) run side by side", ", ".join(cpus), self._blas)

    def attach(self, net: NetCore) -> None:
        """Log the split of the net's batch (and check every device gets a share of it)."""
        batch = self._net_batch(net)
        if batch is None:
            log.info("no batch-separable layer: every layer runs on the whole batch on %s", self.devices[0])
            return
        try:
            shares = self.shares(batch)
        except CctError as e:
            raise CctError(f"{getattr(net, '_source', 'net')}: {e}") from None
        log.info("each batch of %d: %s, %s%s", batch,
                 ", ".join(f"{d} gets {b}" for d, b in zip(self.devices, shares)), self.how, self._detail)

    def describe(self) -> str:
        return "split across " + ",".join(d.name for d in self.devices) + f" {self.how}"

    # ---- shares ------------------------------------------------------------------------------
    def shares(self, batch: int) -> list[int]:
        """Items per device for a batch of ``batch`` (cached per batch size)."""
        if batch not in self._shares:
            self._shares[batch] = batch_shares(batch, self.devices, self.weights, self.how)
        return self._shares[batch]

    def _net_batch(self, net: NetCore) -> int | None:
        for i in range(len(net.layers)):
            batch = self._separable_batch(net, i)
            if batch is not None:
                return batch
        return None

    def _split_batch(self, net: NetCore, i: int) -> int | None:
        """B if layer ``i`` runs split now: :meth:`_separable_batch`, and on CPU devices only where its shares
        use each weight ``SPLIT_MIN_WEIGHT_REUSE`` times or more (logged once per layer and batch when not)."""
        batch = self._separable_batch(net, i)
        if batch is None or not self._all_cpu:
            return batch
        layer, top = net.layers[i], net.top_vecs[i]
        if layer.blobs and layer.blobs[0].num_axes:
            reuse = min(self.shares(batch)) * top[0].count / batch / layer.blobs[0].shape[0]
            if reuse < SPLIT_MIN_WEIGHT_REUSE:
                if self._whole_logged.get(i) != batch:
                    self._whole_logged[i] = batch
                    log.info("%s runs on the whole batch of %d: its shares would use each weight %.3g times "
                             "(< %d)", net._layer_names[i], batch, reuse, SPLIT_MIN_WEIGHT_REUSE)
                return None
        return batch

    def _separable_batch(self, net: NetCore, i: int) -> int | None:
        """B if layer ``i`` can run split (separable, every bottom batch-major with the same B), else None."""
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        if not getattr(layer, "batch_separable", False) or not bottom or not top:
            return None
        if len(self.devices) == 1 and self.devices[0].holds(_memory(bottom[0])):
            return None  # one device where the net lives: nothing to split or move
        if bottom[0].num_axes == 0:
            return None
        batch = bottom[0].shape[0]
        if batch < 1 or any(b.num_axes == 0 or b.shape[0] != batch for b in bottom):
            return None
        return batch

    def _whole_batch(self, run: Callable[[], Any]) -> Any:
        """``run()`` on the whole batch: on CPU devices with all their threads (BLAS/FFT), with a GPU first
        with the first device's setting; as one partition (the layer does not split its batch over more
        cores) when those threads are fewer than the machine's cores."""
        first = self.devices[0]
        if first.is_gpu:
            return run()
        threads = self._whole_threads or first.threads
        result: list[Any] = []
        with blas_threads(threads), first.thread_context():
            if threads >= cpu_cores():
                return run()
            partition.run_concurrently(1, lambda _k: result.append(run()))
        return result[0]

    # ---- the per-layer plan --------------------------------------------------------------------
    def _split_for(self, net: NetCore, i: int, batch: int) -> _Split:
        split = self._splits.get(i)
        if split is not None and split.batch == batch:
            return split
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        parts, start = [], 0
        for k, (device, b) in enumerate(zip(self.devices, self.shares(batch))):
            # The first device, where it holds the net's memory, adds its gradients to the layer's own diffs
            # (no buffer, zeroing or sum): the order stays "layer's diff, then device 1, 2, ...".  Not with a
            # one-item share: there Scale's Caffe quirk (outer == 1) overwrites its diff instead of adding.
            # A device alone keeps its copies of the parameters and adds into their gradients' copies.
            mirrors = self._keeps_copies
            part = _Part(device, start, start + b, [], [], direct=mirrors or k == 0 and b >= 2 and all(
                device.holds(_memory(p)) for p in layer.blobs), mirrors=mirrors, copies=self._copies)
            with device.thread_context():
                part.bottoms = [self._rows(part, p) for p in bottom]
                part.tops = [self._rows(part, p) for p in top]
                clone = self._clones.get((i, k))
                if clone is None:
                    clone = self._clones[(i, k)] = self._make_clone(layer, part)
                part.clone = clone
            parts.append(part)
            start += b
        split = self._splits[i] = _Split(batch, parts)
        return split

    def _rows(self, part: _Part, p: Blob) -> Blob:
        """Our blob for rows [start, stop) of net blob ``p`` (one per net blob: in-place tops reuse it; where
        the part keeps its copies, one for all layers)."""
        known = part.parents.get(id(p))
        if known is not None:
            return known[1]
        shape = (part.stop - part.start,) + p.shape[1:]
        ours: Blob
        if part.device.holds(_memory(p)):
            ours = Blob.view_rows(p, part.start, part.stop)
        elif part.mirrors:
            if id(p) not in self._mirror_blobs:
                self._mirror_blobs[id(p)] = (p, Blob(shape, xp=part.device.xp, dtype=p.dtype))
            ours = self._mirror_blobs[id(p)][1]
        else:
            ours = Blob(shape, xp=part.device.xp, dtype=p.dtype)
        part.parents[id(p)] = (p, ours)
        return ours

    def _make_clone(self, layer: Any, part: _Part) -> Any:
        """A new layer of the same definition on ``part``'s blobs, given the layer's parameters before its
        setup (so no filler runs)."""
        from cct.layers.registry import create_layer

        lp = pb.LayerParameter()
        lp.CopyFrom(layer.layer_param)
        clone = create_layer(lp)
        clone.blobs = BlobVec(self._param_for(part, p) for p in layer.blobs)
        try:
            clone.setup_layer(part.bottoms, part.tops)
        except CctError as e:
            raise CctError(f"layer '{layer.name}' ({layer.type}) on {part.device}'s share "
                           f"[{part.start}, {part.stop}): {e}") from None
        clone.param_propagate_down = list(layer.param_propagate_down)
        return clone

    def _param_for(self, part: _Part, p: Blob) -> Blob:
        """The clone's blob for parameter ``p``: on a device that holds it, its data (the diff the device's
        own); on a device alone, blob for the device's copies of its data and diff; else a device copy."""
        device = part.device
        if device.holds(_memory(p)):
            b = Blob(p.shape, xp=p.xp, dtype=p.dtype)
            b.share_data(p)  # the same weights; the diff is this device's own buffer (or see _refresh_params)
            return b
        b = Blob(p.shape, xp=device.xp, dtype=p.dtype)
        if part.mirrors:
            self._use_param_copies(part, p, b)
        else:
            copy_into(b.data, p.data)
        return b

    def _param_copy(self, device: Device, p: Blob, what: str) -> Any:
        """The device's copy (a :class:`cct.blob._Buffer`) of parameter buffer ``p.buffer(what)`` — one per
        host buffer, so layers sharing a weight share its copy —, made on first use (not yet current)."""
        host = p.buffer(what)
        dev = self._param_copies.get(host)
        if dev is None or dev.array.size < p.count:
            with device.thread_context():
                dev = self._param_copies[host] = Blob((p.count,), xp=device.xp, dtype=p.dtype).buffer("data")
        return dev

    def _use_param_copies(self, part: _Part, p: Blob, b: Blob) -> None:
        """Point clone parameter blob ``b`` at the device's copies of ``p``'s data and diff."""
        if b.shape != p.shape:
            b.reshape(p.shape)
        for what in ("data", "diff"):
            b.set_buffer(what, self._param_copy(part.device, p, what))

    def _refresh_params(self, layer: Any, part: _Part) -> None:
        """Before a forward: the clone sees the layer's current weights (the same memory, re-pointed if the
        layer's was swapped; or a fresh device copy) and, if ``part.direct``, the layer's diff memory."""
        blobs = part.clone.blobs
        for j, p in enumerate(layer.blobs):
            b = blobs[j]
            if not part.device.holds(_memory(p)):
                if part.mirrors:
                    self._use_param_copies(part, p, b)
                elif b.shape != p.shape:
                    b.reshape(p.shape)
                part.copy_in(p, b, "data", rows=False)
            elif part.direct:
                if not (b.shares_data_with(p) and b.shares_diff_with(p)):
                    b.reshape(p.shape)
                    b.share_data(p)
                    b.share_diff(p)
            elif b.shares_diff_with(p) or b.shape != p.shape or not b.shares_data_with(p):
                blobs[j] = self._param_for(part, p)

    # ---- running -------------------------------------------------------------------------------
    def _concurrently(self, parts: list[_Part], body: Callable[[_Part], None]) -> None:
        """``body(part)`` for every part at once (the first in this thread), under one BLAS setting; the
        first exception is re-raised after all have finished.  Uses the batch partitions' thread pool and
        marks the threads as partitions, so layers do not partition their share further."""
        def run(k: int) -> None:
            with parts[k].device.thread_context():
                body(parts[k])

        blas = blas_threads(self._blas) if self._blas else contextlib.nullcontext()
        with blas:
            partition.run_concurrently(len(parts), run)

    def forward_layer(self, net: NetCore, i: int) -> float:
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        batch = self._split_batch(net, i)
        if batch is None:
            self._split_at_forward[i] = None
            return float(self._whole_batch(lambda: layer.forward_layer(bottom, top)))
        layer.reshape(bottom, top)  # the whole batch's top shapes (no arithmetic)
        split = self._split_for(net, i, batch)
        for p in _unique(bottom + top):
            p.buffer("data")  # allocated in this thread, before the devices write into rows of it
        for part in split.parts:
            with part.device.thread_context():
                for p in bottom:
                    ours = part.parents[id(p)][1]
                    if not isinstance(ours, RowView):
                        ours.reshape((part.stop - part.start,) + p.shape[1:])
                part.clone.reshape(part.bottoms, part.tops)
            for k, (p, t) in enumerate(zip(top, part.tops)):
                if t.shape != (part.stop - part.start,) + p.shape[1:]:
                    raise CctError(f"layer '{layer.name}' ({layer.type}) is declared batch-separable but its "
                                   f"top {k} on {part.device}'s {part.stop - part.start} items is "
                                   f"{t.shape_string()}, not rows of {p.shape_string()}")

        def forward(part: _Part) -> None:
            self._refresh_params(layer, part)
            part.stage_in(bottom, "data")
            part.clone.forward(part.bottoms, part.tops)
            part.stage_out(top, "data")

        self._concurrently(split.parts, forward)
        self._split_at_forward[i] = split
        loss = 0.0
        for k, t in enumerate(top):
            if layer.loss(k) != 0.0:
                loss += float((t.data * t.diff).sum(dtype="float64"))
        return loss

    def backward_layer(self, net: NetCore, i: int) -> None:
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        need = net.bottom_need_backward[i]
        split = self._split_at_forward.get(i)
        if split is None:
            self._whole_batch(lambda: layer.backward_layer(top, need, bottom))
            return
        ppd = list(layer.param_propagate_down)
        for p in _unique(bottom + top):
            p.buffer("data")  # allocated in this thread
            p.buffer("diff")

        def backward(part: _Part) -> None:
            clone = part.clone
            clone.param_propagate_down = list(ppd)
            learned = [(p, b) for j, (p, b) in enumerate(zip(layer.blobs, clone.blobs)) if j >= len(ppd) or ppd[j]]
            for p, b in learned:
                if part.mirrors:  # the device's copy of the gradient, added into
                    part.copy_in(p, b, "diff", rows=False)
                elif not part.direct:
                    b.diff[...] = 0
            part.stage_in(bottom, "data")
            part.stage_in(top, "data")
            part.stage_in(top, "diff")
            clone.backward(part.tops, need, part.bottoms)
            part.stage_out([b for b, n in zip(bottom, need) if n], "diff")
            if part.mirrors:
                for p, b in learned:
                    part.copies.wrote(p, "diff", b.buffer("diff"))

        self._concurrently(split.parts, backward)
        for j, p in enumerate(layer.blobs):
            if j < len(ppd) and not ppd[j]:
                continue
            for part in split.parts:  # fixed order: device 1, 2, ...
                if not part.direct:
                    _add_into(p.diff, part.clone.blobs[j].diff)

    # ---- parameters kept on a device alone (GPU mode) ----------------------------------------------
    def clear_param_diffs(self, net: NetCore) -> None:
        """Zero the learnable parameters' gradients: on a device alone, its copies (where it has one; the
        host's come back as zeros when touched), else the host's."""
        host = []
        for p in net.learnable_params:
            dev = self._param_copies.get(p.buffer("diff")) if self._keeps_copies else None
            if dev is None:
                host.append(p)
                continue
            with self.devices[0].thread_context():
                dev.array[:p.count].fill(0)
            self._copies.wrote(p, "diff", dev)
        zero_param_diffs(host)

    def update_on_device(self, items: Sequence[tuple[Blob, str]], update: Callable[[list[Any]], None]) -> bool:
        """``update(arrays)`` on a device alone's copies of ``items`` ((blob, "data" or "diff"): a parameter
        and its solver's history, the first a parameter its layers keep there), made current first and the
        newest afterwards; False, nothing done, where the first item has no copy on a device."""
        if not self._keeps_copies or not items or items[0][0].buffer(items[0][1]) not in self._param_copies:
            return False
        device = self.devices[0]
        copies = [self._param_copy(device, blob, what) for blob, what in items]
        with device.thread_context():
            for (blob, what), dev in zip(items, copies):
                self._copies.bring_in(blob, what, dev)
            update([dev.array[:blob.count].reshape(blob.shape) for (blob, _), dev in zip(items, copies)])
        for (blob, what), dev in zip(items, copies):
            self._copies.wrote(blob, what, dev)
        return True

    def layer_array_module(self) -> Any:
        """The device's array module where one device alone runs the layers (GPU mode), else None (a split
        runs them on several: the engines choose per clone)."""
        return self.devices[0].xp if self._keeps_copies else None

    def newest(self, blob: Blob, what: str) -> Any:
        """``blob``'s ``data`` or ``diff`` to read: this device's copy where it is newer than the host's (left
        there), else the host's values (read without counting as a touch: nothing is written)."""
        if isinstance(blob, RowView):
            return getattr(blob, what)
        dev = self._copies.newest(blob, what)
        return (dev if dev is not None else blob.buffer(what)).array[:blob.count].reshape(blob.shape)


def _memory(p: Blob) -> Any:
    """An array in ``p``'s memory, for :meth:`Device.holds` (not an access of its values: see
    :meth:`Blob.buffer`)."""
    return p.data if isinstance(p, RowView) else p.buffer().array


def _unique(blobs: Sequence[Blob]) -> list[Blob]:
    seen: set[int] = set()
    out = []
    for b in blobs:
        if id(b) not in seen:
            seen.add(id(b))
            out.append(b)
    return out


def _add_into(dst: Any, src: Any) -> None:
    """``dst += src``, moving ``src`` to ``dst``'s device first if needed."""
    if backend.array_gpu(dst) == backend.array_gpu(src):
        dst += src
        return
    tmp = backend.get_array_module(dst).empty_like(dst)
    copy_into(tmp, src)
    dst += tmp
