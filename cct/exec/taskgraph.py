"""ZNN's task-graph executor (Zlateski et al., arXiv 1510.06706): a pass of the net as a graph of tasks run
by a pool of workers in priority order (:mod:`cct.exec.scheduler`).

**Graph.**  Each layer of the pass is one task (``forward_layer`` / ``backward_layer`` of the layer, exactly
what the layer executor calls), except Convolution layers (stride 1, one group, one bottom), which become
ZNN's node and edge-group tasks (:mod:`cct.exec.conv_tasks`: input transforms, per-block products summed
almost wait-free, inverse + bias + fused ReLU).  Layer B depends on layer A when B reads a blob A wrote,
or writes a blob A read or wrote (in-place layers); backward runs the same dependencies reversed.  Layers
that draw random numbers or read a data source (data layers, Dropout, stochastic pooling) keep their
order among themselves, so a run draws exactly the numbers of a layer-by-layer run.

**Priorities** (ZNN §VI-A).  The key of a task is ``(-d, n)``: ``d`` the longest path from it to the end of
the pass (to the loss forward, to the input backward), ``n`` its position in a fixed order (layer, then
block), so the critical path runs first and the edges converging on one node run together.  ``fifo`` and
``lifo`` queues are there for comparison.

**Updates** (ZNN §V).  Under a solver, the update of a parameter (its rule, then ``data -= diff``) is queued
as soon as its gradient is complete during backward, below every other task; the pool threads run updates
while there is nothing else, and the next forward's tasks that read the parameter FORCE it (run it now if
queued, wait on nothing otherwise).  :meth:`TaskGraphExecutor.sync` finishes them all (before a test pass, a
snapshot and at the end of ``Solver.step``).  The solver falls back to its own update after the whole pass
(*barrier updates*, logged with the reason) when clipping (the norm needs every gradient), ``iter_size > 1``,
shared parameters, ``on_gradients_ready`` callbacks or a solver that reads its iteration count need it.

**Workers and threads.**  ``workers`` threads (the caller and ``workers - 1`` pool threads) each run their
task bodies with ``max(1, cores // workers)`` BLAS and FFT threads (:mod:`cct.runtime.threads`), so workers
× threads never exceed the cores.

**Unsupported.**  GPU arrays: a one-line error naming the layer.  A layer type the builder does not know
(Python layers, types registered by the user) or per-layer callbacks / ``debug_info`` (which need Caffe's
order): the pass runs layer by layer, logged once with the reason.

Settings: ``-executor layer|taskgraph`` and ``-workers N`` (``CCT_EXECUTOR``, ``CCT_WORKERS``,
``cct.set_executor``), ``CCT_TASK_MIN_MS`` (least predicted work per edge task, default 2) and
``CCT_TASKGRAPH_DETERMINISTIC=1`` (convergent sums in block order).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from cct import log
from cct.errors import CctError
from cct.exec.base import Executor
from cct.exec.conv_tasks import ConvUnit, supports
from cct.exec.scheduler import DONE, POLICIES, Scheduler, Task
from cct.exec.serial import SerialExecutor
from cct.runtime import partition
from cct.runtime.threads import blas_threads, cpu_cores

if TYPE_CHECKING:  # pragma: no cover
    from cct.net import NetCore

# the layer types the graph builder knows: each runs as one task (Convolution possibly as edge groups)
KNOWN_TYPES = frozenset((
    "AbsVal", "Accuracy", "ArgMax", "BNLL", "BatchNorm", "BatchReindex", "Bias", "Clip", "Concat",
    "ContrastiveLoss", "Convolution", "Crop", "Data", "Deconvolution", "Dropout", "DummyData", "ELU", "Eltwise",
    "Embed", "EuclideanLoss", "Exp", "Filter", "Flatten", "HDF5Data", "HDF5Output", "HingeLoss", "Im2col",
    "ImageData", "InfogainLoss", "InnerProduct", "Input", "LRN", "Log", "MVN", "MaxPoolingFragments", "MemoryData",
    "MultinomialLogisticLoss", "PReLU", "Parameter", "Pooling", "Power", "ReLU", "Reduction", "Reshape", "SPP",
    "Scale", "Sigmoid", "SigmoidCrossEntropyLoss", "Silence", "Slice", "Softmax", "SoftmaxWithLoss", "Split",
    "Swish", "TanH", "Threshold", "Tile", "WindowData",
))
# layers that draw random numbers or read/write a source: kept in their order among themselves
ORDERED_TYPES = frozenset(("Data", "ImageData", "WindowData", "HDF5Data", "HDF5Output", "MemoryData",
                           "DummyData", "Dropout"))
DEFAULT_TASK_MIN_MS = 2.0


def _min_task_ms() -> float:
    raw = os.environ.get("CCT_TASK_MIN_MS", "").strip()
    if not raw:
        return DEFAULT_TASK_MIN_MS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise CctError(f"CCT_TASK_MIN_MS: must be a number of milliseconds >= 0 (got {raw!r})")
    return value


class _Pass:
    """A built graph of one pass over a layer range, and where each layer's loss lands."""

    def __init__(self, tasks: list[Task], losses: list[float]):
        self.tasks = tasks
        self.losses = losses


class TaskGraphExecutor(Executor):
    """Runs passes as task graphs (see the module docstring).  ``workers``: threads (default: the cores);
    ``policy``: ``priority`` | ``fifo`` | ``lifo``; ``min_task_ms``: least predicted work of an edge task
    (default ``CCT_TASK_MIN_MS`` or 2); ``deterministic``: convergent sums in block order (default
    ``CCT_TASKGRAPH_DETERMINISTIC``)."""

    def __init__(self, workers: int | None = None, policy: str = "priority", min_task_ms: float | None = None,
                 deterministic: bool | None = None):
        if policy not in POLICIES:
            raise CctError(f"taskgraph: queue policy must be one of {', '.join(POLICIES)} (got {policy!r})")
        self.workers = max(1, int(workers)) if workers is not None else cpu_cores()
        self.policy = policy
        self.min_task_ms = _min_task_ms() if min_task_ms is None else float(min_task_ms)
        if deterministic is None:
            deterministic = os.environ.get("CCT_TASKGRAPH_DETERMINISTIC", "").strip() in ("1", "true", "yes")
        self.deterministic = deterministic
        self.threads_per_worker = max(1, cpu_cores() // self.workers)
        self.scheduler = Scheduler(self.workers, policy, lambda: blas_threads(self.threads_per_worker))
        self.units: dict[int, ConvUnit] = {}
        self._passes: dict[tuple[str, int, int], _Pass] = {}
        self._serial = SerialExecutor()
        self._serial_reason: str | None = None
        self._logged: set[str] = set()
        self._fused: set[int] = set()  # ReLU layers whose forward a convolution's completion does
        self._update_fn: Callable[[int], None] | None = None
        self._pending: dict[int, Task] = {}  # learnable parameter id -> its update task

    # ---- setup ------------------------------------------------------------------------------------
    def attach(self, net: NetCore) -> None:
        super().attach(net)
        self._serial.attach(net)
        for i, layer in enumerate(net.layers):
            if layer.type not in KNOWN_TYPES:
                self._serial_reason = (f"layer '{net._layer_names[i]}' ({layer.type}) is not a type the task "
                                       f"graph knows")
                break
        self._plan_units(net)

    def _plan_units(self, net: NetCore) -> None:
        from cct.config import settings

        for i, layer in enumerate(net.layers):
            if supports(layer, net, i):
                continue
            engine = getattr(getattr(layer, "engine", None), "name", "lowering")
            forced = settings.get("conv_engine")
            primitive = "fft" if (forced == "fft" or (forced == "auto" and engine == "fft")) else "direct"
            fuse = self._fusable_relu(net, i)
            if fuse is not None:
                self._fused.add(fuse)
            self.units[i] = ConvUnit(net, i, primitive, self.workers, self.min_task_ms / 1e3, fuse is not None,
                                     self.deterministic)

    @staticmethod
    def _fusable_relu(net: NetCore, i: int) -> int | None:
        """The next layer when it is a plain ReLU in place on layer ``i``'s only top."""
        j = i + 1
        if j >= len(net.layers) or net.layers[j].type != "ReLU":
            return None
        top = net._top_id_vecs[i][0]
        if net._bottom_id_vecs[j] != [top] or net._top_id_vecs[j] != [top]:
            return None
        if net.layers[j].layer_param.relu_param.negative_slope != 0:
            return None
        return j

    def describe(self) -> str:
        return f"task graph ({self.workers} worker(s), {self.policy} queue)"

    def fft_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per FFT-convolution layer, the transforms of the last iteration: ``{layer: {"forward"|"backward"|
        "update": {"input", "kernel", "inverse"}}}`` (counted in single images/kernels)."""
        return {u.name: {k: dict(v) for k, v in u.counts.items()} for u in self.units.values()
                if u.primitive == "fft"}

    # ---- checks ---------------------------------------------------------------------------------
    def _check_host(self, net: NetCore, start: int, end: int) -> None:
        for i in range(min(start, end), max(start, end) + 1):
            blobs = list(net.bottom_vecs[i]) + list(net.top_vecs[i]) + list(net.layers[i].blobs)
            for b in blobs:
                if b.xp is not np:
                    raise CctError(f"taskgraph executor: layer '{net._layer_names[i]}' ({net.layers[i].type}) "
                                   f"holds GPU arrays; the task graph runs numpy arrays only (use -executor layer)")

    def _layer_by_layer(self, net: NetCore) -> str | None:
        reason = self._serial_reason
        if reason is None and (net.before_forward_hooks or net.after_forward_hooks or net.before_backward_hooks
                               or net.after_backward_hooks):
            reason = "the net has per-layer callbacks"
        if reason is None and net.debug_info:
            reason = "debug_info needs the layer order"
        if reason is not None and reason not in self._logged:
            self._logged.add(reason)
            log.info("taskgraph: %s; running layer by layer", reason)
        return reason

    # ---- dependencies -----------------------------------------------------------------------------
    @staticmethod
    def _layer_deps(net: NetCore, layers: list[int]) -> dict[int, set[int]]:
        """For each layer of ``layers`` (in order), the earlier ones it must follow (see the module docstring)."""
        deps: dict[int, set[int]] = {i: set() for i in layers}
        last_writer: dict[int, int] = {}
        readers: dict[int, list[int]] = {}
        last_ordered = None
        for i in layers:
            for b in net._bottom_id_vecs[i]:
                if b in last_writer:
                    deps[i].add(last_writer[b])
            for b in net._top_id_vecs[i]:
                if b in last_writer:
                    deps[i].add(last_writer[b])
                deps[i].update(r for r in readers.get(b, ()) if r != i)
            for b in net._bottom_id_vecs[i]:
                readers.setdefault(b, []).append(i)
            for b in net._top_id_vecs[i]:
                last_writer[b] = i
                readers[b] = []
            layer = net.layers[i]
            ordered = layer.type in ORDERED_TYPES or (
                layer.type == "Pooling" and getattr(layer, "method", None) == 2)  # STOCHASTIC
            if ordered:
                if last_ordered is not None:
                    deps[i].add(last_ordered)
                last_ordered = i
        return deps

    @staticmethod
    def _prioritize(tasks: list[Task], order: dict[Task, int]) -> None:
        """Key ``(-d, n)``: ``d`` the longest path to a task without successors, ``n`` the fixed order."""
        depth: dict[int, int] = {}
        for t in reversed(_topological(tasks)):
            depth[id(t)] = 1 + max((depth[id(s)] for s in t.successors), default=0)
        for t in tasks:
            t.key = (-depth[id(t)], order[t])

    # ---- passes -----------------------------------------------------------------------------------
    def _forward_pass(self, net: NetCore, start: int, end: int) -> _Pass:
        layers = list(range(start, end + 1))
        deps = self._layer_deps(net, layers)
        losses = [0.0] * len(net.layers)
        entries: dict[int, list[Task]] = {}
        exits: dict[int, list[Task]] = {}
        tasks: list[Task] = []
        order: dict[Task, int] = {}
        for i in layers:
            unit = self.units.get(i)
            if unit is not None:
                forces = _LazyForces(self, i)
                group, entries[i], exits[i] = unit.forward_tasks(forces)  # type: ignore[arg-type]
            else:
                t = Task(f"{net._layer_names[i]}:fwd", self._single_forward(net, i, losses))
                t.forces = _LazyForces(self, i)  # type: ignore[assignment]
                group, entries[i], exits[i] = [t], [t], [t]
            for k, t in enumerate(group):
                order[t] = i * 100000 + k
            tasks += group
            for j in deps[i]:
                for a in exits[j]:
                    a.then(*entries[i])
        self._prioritize(tasks, order)
        return _Pass(tasks, losses)

    def _single_forward(self, net: NetCore, i: int, losses: list[float]) -> Callable[[], None]:
        layer, bottom, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        fused = i in self._fused

        def body() -> None:
            if fused:  # the convolution's completion applied it
                layer.reshape(bottom, top)
                return
            losses[i] = layer.forward_layer(bottom, top)
        return body

    def _backward_pass(self, net: NetCore, start: int, end: int) -> _Pass:
        layers = list(range(end, start + 1))
        deps = self._layer_deps(net, layers)
        entries: dict[int, list[Task]] = {}
        exits: dict[int, list[Task]] = {}
        tasks: list[Task] = []
        order: dict[Task, int] = {}
        need = net.layer_need_backward
        for i in reversed(layers):
            unit = self.units.get(i)
            if unit is not None and need[i]:
                want_dx = bool(net.bottom_need_backward[i][0])
                group, entries[i], exits[i] = unit.backward_tasks(want_dx)
            else:
                t = Task(f"{net._layer_names[i]}:bwd", self._single_backward(net, i))
                group, entries[i], exits[i] = [t], [t], [t]
            if need[i] and net.layers[i].blobs:
                done = Task(f"{net._layer_names[i]}:grads", lambda i=i: self._gradients_ready(i))
                for a in exits[i]:
                    a.then(done)
                group.append(done)
            for k, t in enumerate(group):
                order[t] = (len(net.layers) - i) * 100000 + k
            tasks += group
        for i in layers:  # reversed edges: i's backward after the backward of every layer that followed it
            for j in deps[i]:
                for a in exits[i]:
                    a.then(*entries[j])
        self._prioritize(tasks, order)
        return _Pass(tasks, [])

    @staticmethod
    def _single_backward(net: NetCore, i: int) -> Callable[[], None]:
        layer = net.layers[i]

        def body() -> None:
            if net.layer_need_backward[i]:
                layer.backward_layer(net.top_vecs[i], net.bottom_need_backward[i], net.bottom_vecs[i])
        return body

    def _get(self, kind: str, net: NetCore, start: int, end: int) -> _Pass:
        key = (kind, start, end)
        p = self._passes.get(key)
        if p is None:
            self._check_host(net, start, end)
            p = self._forward_pass(net, start, end) if kind == "forward" else self._backward_pass(net, start, end)
            self._passes[key] = p
            if kind == "forward" and self.units:
                log.info("taskgraph: %s; %s", self.describe(),
                         "; ".join(u.describe() for i, u in sorted(self.units.items()) if start <= i <= end))
        return p

    def forward(self, net: NetCore, start: int, end: int) -> float:
        if self._layer_by_layer(net):
            self.sync()
            return self._serial.forward(net, start, end)
        p = self._get("forward", net, start, end)
        for i in range(start, end + 1):
            p.losses[i] = 0.0
        self.scheduler.run(p.tasks)
        return float(sum(p.losses[start:end + 1]))

    def backward(self, net: NetCore, start: int, end: int) -> None:
        if self._layer_by_layer(net):
            self._serial.backward(net, start, end)
            if self._update_fn is not None:
                for i in range(start, end - 1, -1):
                    if net.layer_need_backward[i] and net.layers[i].blobs:
                        self._gradients_ready(i)
            return
        self.scheduler.run(self._get("backward", net, start, end).tasks)

    # ---- updates ----------------------------------------------------------------------------------
    def arm_updates(self, update: Callable[[int], None] | None) -> None:
        """Apply ``update(learnable_id)`` to each learnable parameter as soon as its gradient is complete in
        the coming backward (None: stop doing so)."""
        self._update_fn = update

    def _gradients_ready(self, i: int) -> None:
        update = self._update_fn
        net = self.net
        if update is None:
            return
        ids = sorted({net._learnable_param_ids[p] for p in net._param_id_vecs[i]})
        tasks = []
        for lid in ids:
            t = Task(f"update {net._layer_names[i]}[{lid}]", lambda lid=lid: self._run_update(update, lid))
            self._pending[lid] = t
            tasks.append(t)
        self.scheduler.submit_background(tasks)

    def _run_update(self, update: Callable[[int], None], lid: int) -> None:
        """The solver's rule and ``data -= diff`` for one parameter, then its diff zeroed for the next pass
        (the diff does not keep the update value as after a barrier update)."""
        update(lid)
        self.net.learnable_params[lid].diff[...] = 0

    def pending_updates(self, i: int) -> list[Task]:
        """The update tasks of layer ``i``'s parameters not known to be done."""
        if not self._pending:
            return []
        net = self.net
        out = []
        for p in net._param_id_vecs[i]:
            t = self._pending.get(net._learnable_param_ids[p])
            if t is not None:
                out.append(t)
        return out

    def sync(self) -> None:
        """Finish every pending update."""
        if self._pending:
            pending, self._pending = list(self._pending.values()), {}
            self.scheduler.drain(pending)

    def clear_param_diffs(self, net: NetCore) -> None:
        """Zero the diffs, except those of parameters whose update is pending (it zeroes them when done)."""
        for lid, p in enumerate(net.learnable_params):
            t = self._pending.get(lid)
            if t is None or t.state == DONE:
                partition.zero(p.diff)

    def close(self) -> None:
        self.sync()
        self.scheduler.close()


class _LazyForces(list):
    """The pending update tasks of layer ``i``, looked up when a task runs (a forward's FORCE list)."""

    def __init__(self, executor: TaskGraphExecutor, i: int):
        super().__init__()
        self._executor, self._i = executor, i

    def __iter__(self):
        return iter(self._executor.pending_updates(self._i))


def _topological(tasks: list[Task]) -> list[Task]:
    indeg = {id(t): t.num_deps for t in tasks}
    ready = [t for t in tasks if indeg[id(t)] == 0]
    out = []
    while ready:
        t = ready.pop()
        out.append(t)
        for s in t.successors:
            indeg[id(s)] -= 1
            if indeg[id(s)] == 0:
                ready.append(s)
    if len(out) != len(tasks):
        raise CctError("taskgraph: the layer dependencies form a cycle")
    return out

