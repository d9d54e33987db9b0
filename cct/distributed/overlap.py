"""Gradient communication overlapped with backprop (Lee et al., Algorithm 2) on an :class:`MpiExchange`.

The reductions are posted from the net's per-layer backward hooks, on the last of the ``iter_size`` passes,
and run on the exchange's communication thread while backprop goes on below; the solver waits for them
group by group in its ``update_groups`` (the top layers' update starts as soon as their chunk is reduced).

``-overlap``:

* ``layer`` — one Allreduce per layer with learnable parameters, posted as soon as that layer's diffs are
  complete (the per-layer overlap of Das et al., "DP+Overlap");
* ``lee`` — the paper's two chunks: chunk 1 holds the parameters of the layers above the split, posted once
  backprop has gone below them; chunk 2 the rest, posted after the last layer (an empty chunk is skipped and
  logged).  ``-chunk_split``: a layer name (chunk 1 = the layers after it), ``k`` (chunk 1 = the top k of the
  paper's layers: Convolution, Pooling, InnerProduct, counted from the top) or ``auto`` (the first iteration
  runs as one chunk while the backward time of every layer is measured; rank 0 then picks the pooling boundary
  that an alpha-beta model of the measured reduction says finishes first, and every rank takes it).

``-replicate_fc f`` (with ``lee``) replicates the gradient computation of the first f InnerProduct layers: each
rank Allgathers their inputs ``A`` (posted right after they are computed, in forward) and the errors ``E`` at
their outputs (posted after chunk 2), and computes the whole batch's ``ΔW = Eᵀ·A`` and bias gradient itself,
scaled by ``1/P`` (every rank normalised its loss by its own batch): (K_b + K_c)·N values gathered instead of
K_b·K_c reduced.  The local weight gradient of those layers is not computed (``param_propagate_down``).  Their
update is delayed to the next iteration's forward, just before the layer runs (Algorithm 2, lines 8-9), at the
learning rate and step of the iteration it belongs to, so SGD stays exactly synchronous; a test pass, a
snapshot or the end of training applies it first (``on_weights_needed``).  With ``clip_gradients`` the norm
needs every gradient, so the replicated gradients are then computed at the update instead of one iteration late.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cct import log
from cct.distributed.mpi import MpiExchange, Op
from cct.engines.gemm import matmul_accumulate
from cct.errors import CctError

if TYPE_CHECKING:  # pragma: no cover
    from cct.solvers.solver import Solver

f32 = np.float32
OVERLAP_MODES = ("none", "layer", "lee")
PAPER_LAYERS = ("Convolution", "Deconvolution", "Pooling", "InnerProduct")


@dataclass
class Chunk:
    """Learnable parameters ``ids`` reduced together; posted after layer ``post_after``'s backward."""

    label: str
    ids: list[int]
    layers: list[str]
    post_after: int
    count: int = 0
    slot: bool = False  #: carries the root's solver action in one extra float
    buffer: np.ndarray = field(default_factory=lambda: np.empty(0, f32))
    op: Op | None = None


def first_ip_layers(net: Any, f: int) -> list[int]:
    """The indices of the first ``f`` InnerProduct layers, checked for replication (``-replicate_fc``)."""
    ips = [i for i, layer in enumerate(net.layers) if layer.type == "InnerProduct"]
    if f > len(ips):
        raise CctError(f"-replicate_fc {f}: net '{net.name}' has {len(ips)} InnerProduct layer(s)")
    used = net.param_layers()
    chosen = ips[:f]
    for i in chosen:
        name, layer = net._layer_names[i], net.layers[i]
        if layer.axis != 1:
            raise CctError(f"-replicate_fc: layer '{name}' (InnerProduct) has axis {layer.axis}; replication needs "
                           "axis 1 (one row per image)")
        for lid in _layer_param_ids(net, i):
            if used[lid] != [i]:
                raise CctError(f"-replicate_fc: layer '{name}' (InnerProduct) shares its parameters with other "
                               "layers; replication needs its own")
        if not net.layer_need_backward[i]:
            raise CctError(f"-replicate_fc: layer '{name}' (InnerProduct) does not learn (no backward)")
    return chosen


def _layer_param_ids(net: Any, i: int) -> list[int]:
    """The learnable ids a layer owns (its blobs in learnable order)."""
    return [lid for lid, layers in enumerate(net.param_layers()) if layers and layers[0] == i]


def split_index(net: Any, split: str) -> int:
    """The index of the last layer of chunk 2 for ``-chunk_split`` (a layer name or k); chunk 1 = the rest."""
    names = list(net._layer_names)
    if split.isdigit():
        k = int(split)
        paper = [i for i, layer in enumerate(net.layers) if layer.type in PAPER_LAYERS]
        if not 1 <= k <= len(paper):
            raise CctError(f"-chunk_split {split}: k must be 1..{len(paper)} (the Convolution, Pooling and "
                           f"InnerProduct layers of net '{net.name}')")
        return paper[len(paper) - k] - 1
    if split not in names:
        raise CctError(f"-chunk_split {split}: net '{net.name}' has no layer '{split}' (use a layer name, k or auto)")
    return names.index(split)


def plan_chunks(net: Any, mode: str, skip: set[int], boundary: int | None) -> list[Chunk]:
    """The chunks of ``mode`` over the learnable parameters not in ``skip``, top first; the last posted carries
    the action slot.  ``boundary``: lee's last layer of chunk 2 (None: one chunk)."""
    used = net.param_layers()
    names = net._layer_names
    owner = {lid: layers[0] for lid, layers in enumerate(used) if layers}
    ids = [lid for lid in range(len(used)) if lid not in skip and lid in owner]
    groups: list[tuple[str, list[int]]] = []
    if mode == "layer":
        by_layer: dict[int, list[int]] = {}
        for lid in ids:
            by_layer.setdefault(owner[lid], []).append(lid)
        groups = [(f"layer {names[i]}", by_layer[i]) for i in sorted(by_layer, reverse=True)]
    else:
        top = [lid for lid in ids if boundary is not None and owner[lid] > boundary]
        rest = [lid for lid in ids if lid not in top]
        groups = [("chunk 1", top), ("chunk 2", rest)]
    chunks = []
    for label, group in groups:
        if not group:
            log.info("MPI %s is empty: skipped", label)
            continue
        layers = sorted({owner[lid] for lid in group})
        chunks.append(Chunk(label, group, [names[i] for i in layers], min(min(used[lid]) for lid in group),
                            sum(net.learnable_params[lid].count for lid in group)))
    chunks.sort(key=lambda c: -c.post_after)
    if not chunks:
        chunks.append(Chunk("action", [], [], 0))
    chunks[-1].slot = True
    for c in chunks:
        c.buffer = np.empty(c.count + (1 if c.slot else 0), dtype=f32)
    return chunks


class ReplicatedFC:
    """One replicated InnerProduct layer (see the module docstring): its gathered inputs and errors, and the
    delayed update they feed."""

    def __init__(self, net: Any, index: int, exchange: MpiExchange, iter_size: int):
        self.net = net
        self.index = index
        self.name = net._layer_names[index]
        self.layer = net.layers[index]
        self.ids = _layer_param_ids(net, index)
        self.exchange = exchange
        self.iter_size = iter_size
        self.ops_a: list[Op] = []
        self.op_e: Op | None = None
        self.pending: tuple[Any, int] | None = None  #: (rate, iteration) of a gradient not yet applied
        self._shape: tuple[int, int, int] | None = None

    def _buffers(self) -> None:
        m, k, n, p, s = self.layer.M, self.layer.K, self.layer.num_output, self.exchange.size, self.iter_size
        if self._shape != (m, k, n):
            self._shape = (m, k, n)
            self.send_a = np.empty((s, m, k), f32)
            self.recv_a = np.empty((s, p, m, k), f32)
            self.send_e = np.empty((s, m, n), f32)
            self.recv_e = np.empty((p, s, m, n), f32)

    def gathered_values(self) -> tuple[int, int]:
        """(values of A, values of E) gathered per iteration over all ranks: (K_b + K_c)·N in total."""
        m, k, n = self._shape or (self.layer.M, self.layer.K, self.layer.num_output)
        p, s = self.exchange.size, self.iter_size
        return s * p * m * k, s * p * m * n

    def gather_input(self, pass_index: int) -> None:
        """Before the layer's forward: copy its input and post its Allgather (Algorithm 2, line 12)."""
        self._buffers()
        if pass_index == 0:
            self.ops_a = []
        bottom = self.net.bottom_vecs[self.index][0]
        self.send_a[pass_index] = np.asarray(bottom.data).reshape(self.send_a.shape[1:])
        self.ops_a.append(self.exchange.post_allgather(self.send_a[pass_index], self.recv_a[pass_index],
                                                       f"gather A of {self.name}"))

    def keep_error(self, pass_index: int) -> None:
        """Before the layer's backward: copy the error at its output."""
        top = self.net.top_vecs[self.index][0]
        self.send_e[pass_index] = np.asarray(top.diff).reshape(self.send_e.shape[1:])

    def gather_errors(self) -> None:
        """After the last pass: post the Allgather of the errors (Algorithm 2, line 26)."""
        self.op_e = self.exchange.post_allgather(self.send_e, self.recv_e, f"gather E of {self.name}")

    def compute_gradient(self) -> None:
        """Wait for the gathers; the whole batch's gradient, scaled by 1/P, into the layer's diffs."""
        for op in self.ops_a:
            self.exchange.wait(op, "gather of activations")
        assert self.op_e is not None
        self.exchange.wait(self.op_e, "gather of errors")
        w, bias = self.layer.blobs[0], (self.layer.blobs[1] if len(self.layer.blobs) > 1 else None)
        w.diff[...] = 0
        p, s, m, n = self.recv_e.shape
        k = self.recv_a.shape[-1]
        for pass_index in range(s):
            a = self.recv_a[pass_index].reshape(p * m, k)
            e = np.ascontiguousarray(self.recv_e[:, pass_index]).reshape(p * m, n)
            if self.layer.transpose:
                matmul_accumulate(w.diff, a.T, e)
            else:
                matmul_accumulate(w.diff, e.T, a)
        w.diff[...] *= self.exchange.scale
        if bias is not None:
            bias.diff[...] = self.recv_e.reshape(-1, n).sum(axis=0, dtype=f32) * self.exchange.scale


class OverlapCallback:
    """The solver callback of ``-overlap layer|lee`` on one rank (see the module docstring)."""

    def __init__(self, solver: Solver, exchange: MpiExchange, mode: str, split: str = "auto", replicate_fc: int = 0):
        if mode not in ("layer", "lee"):
            raise CctError(f"-overlap {mode}: overlapped modes are layer and lee")
        if replicate_fc and mode != "lee":
            raise CctError(f"-replicate_fc {replicate_fc}: replication is part of -overlap lee (got -overlap {mode})")
        self.solver = solver
        self.net = net = solver.net
        self.exchange = exchange
        self.mode = mode
        self.iter_size = int(solver.param.iter_size)
        self.clipping = solver.param.clip_gradients >= 0
        self.replicated = [ReplicatedFC(net, i, exchange, self.iter_size) for i in first_ip_layers(net, replicate_fc)]
        for r in self.replicated:
            for k in range(len(r.layer.blobs)):
                r.layer.param_propagate_down[k] = False  # each rank computes the whole batch's gradient instead
        self.skip = {lid for r in self.replicated for lid in r.ids}
        self.auto = mode == "lee" and split in ("", "auto")
        boundary = None if mode == "layer" or self.auto else split_index(net, split)
        self.chunks = plan_chunks(net, mode, self.skip, boundary)
        self._post_at: dict[int, list[Chunk]] = {}
        self._index_chunks()
        self.pass_index = -1
        self._active = False
        self._backward_times: dict[int, float] = {}
        self._t0 = 0.0
        by_index = {r.index: r for r in self.replicated}
        net.before_forward_hooks.append(self._before_forward)
        net.before_backward_hooks.append(self._before_backward)
        net.after_backward_hooks.append(self._after_backward)
        self._replicated_at = by_index
        self.describe_plan()

    # ---- plan --------------------------------------------------------------------------------
    def _index_chunks(self) -> None:
        self._post_at = {}
        for c in self.chunks:
            self._post_at.setdefault(c.post_after, []).append(c)

    def describe_plan(self) -> None:
        for c in self.chunks:
            log.info("MPI %s: %d parameters (%s)", c.label, c.count, ", ".join(c.layers) or "the solver action only")
        for r in self.replicated:
            a, e = r.gathered_values()
            log.info("MPI replicated %s: Allgather of %d activations and %d errors instead of Allreduce of %d "
                     "parameters", r.name, a, e, sum(r.net.learnable_params[i].count for i in r.ids))
        if self.auto:
            log.info("MPI chunk split auto: the first iteration runs as one chunk and measures the backward pass")

    # ---- hooks -------------------------------------------------------------------------------
    def on_start(self) -> None:
        self.pass_index = -1
        self._active = True

    def _last_pass(self) -> bool:
        return self.pass_index == self.iter_size - 1

    def _before_forward(self, i: int) -> None:
        if not self._active:  # a pass outside training iterations (the final display, a user's forward)
            return
        if i == 0:
            self.pass_index += 1
        r = self._replicated_at.get(i)
        if r is not None:
            if r.pending is not None and self.pass_index == 0:
                self._apply_delayed(r)
            r.gather_input(self.pass_index)

    def _before_backward(self, i: int) -> None:
        if not self._active:
            return
        r = self._replicated_at.get(i)
        if r is not None:
            r.keep_error(self.pass_index)
        if self.auto and self._last_pass() and i == len(self.net.layers) - 1:
            self._t0 = time.perf_counter()  # the backward pass starts: times are measured from here

    def _after_backward(self, i: int) -> None:
        if not self._active or not self._last_pass():
            return
        if self.auto:
            self._backward_times[i] = time.perf_counter() - self._t0  # when layer i's backward ended
        for c in self._post_at.get(i, ()):
            self._post(c)

    def _post(self, c: Chunk) -> None:
        params = self.net.learnable_params
        offset = 0
        for lid in c.ids:
            d = params[lid].diff
            c.buffer[offset:offset + d.size] = np.asarray(d).reshape(-1)
            offset += d.size
        if c.slot:
            c.buffer[-1] = self.exchange.action_slot()
        c.op = self.exchange.post_allreduce(c.buffer, c.label)

    def on_gradients_ready(self) -> None:
        self._active = False
        for c in self.chunks:
            if c.op is None:  # a chunk whose layers' hooks did not run (a partial backward): post it now
                self._post(c)
        for r in self.replicated:
            r.gather_errors()

    # ---- update ------------------------------------------------------------------------------
    def _finish(self, c: Chunk) -> None:
        assert c.op is not None
        self.exchange.wait(c.op, "gradient exchange")
        c.op = None
        if c.slot:
            self.exchange.take_action(c.buffer[-1])
        params = self.net.learnable_params
        offset = 0
        scale = self.exchange.scale
        for lid in c.ids:
            d = params[lid].diff
            np.multiply(c.buffer[offset:offset + d.size], scale, out=np.asarray(d).reshape(-1))
            offset += d.size

    def update_groups(self, rate: Any) -> list[tuple[Callable[[], Any] | None, list[int]]]:
        iteration = self.solver.iter
        groups: list[tuple[Callable[[], Any] | None, list[int]]] = []
        for c in self.chunks:
            groups.append((lambda c=c: self._finish(c), list(c.ids)))
        if self.clipping:  # the norm needs the replicated gradients now: no delay
            for r in self.replicated:
                groups.append((r.compute_gradient, list(r.ids)))
        else:
            for r in self.replicated:
                r.pending = (rate, iteration)
        last_wait = groups[-1][0]

        def end_of_iteration() -> None:
            if last_wait is not None:
                last_wait()
            self._end_iteration(iteration)

        groups[-1] = (end_of_iteration, groups[-1][1])
        return groups

    def _apply_delayed(self, r: ReplicatedFC) -> None:
        assert r.pending is not None
        rate, iteration = r.pending
        r.pending = None
        r.compute_gradient()
        self.solver.update_params(r.ids, rate, iteration)

    def on_weights_needed(self) -> None:
        for r in self.replicated:
            if r.pending is not None:
                self._apply_delayed(r)

    def _end_iteration(self, iteration: int) -> None:
        if self.auto:
            self._choose_split()
        log_stats(self.solver, self.exchange, iteration)

    # ---- -chunk_split auto --------------------------------------------------------------------
    def _choose_split(self) -> None:
        """After the first iteration: rank 0 picks the pooling boundary with the earliest modelled finish of
        two chunks from the measured backward times and reduction time; every rank takes its choice."""
        self.auto = False
        choice = np.zeros(1, f32)
        if self.exchange.rank == 0:
            choice[0] = self._best_boundary() + 1
        self.exchange.wait(self.exchange.post_allreduce(choice, "chunk split agreement"), "chunk split agreement")
        boundary = int(choice[0]) - 1
        self.chunks = plan_chunks(self.net, self.mode, self.skip, boundary if boundary >= 0 else None)
        self._index_chunks()
        where = f"after layer {self.net._layer_names[boundary]}" if boundary >= 0 else "none (one chunk)"
        log.info("MPI chunk split auto: %s", where)
        self.describe_plan()

    def _best_boundary(self) -> int:
        stats = self.exchange.stats
        ops = [op for op in stats.ops if op.done.is_set() and op.label == "chunk 2"]
        total = sum(c.count for c in self.chunks)
        seconds = (ops[-1].ended - ops[-1].started) if ops else 0.0
        per_value = seconds / max(total, 1)
        used = self.net.param_layers()
        counts = [p.count for p in self.net.learnable_params]
        times = self._backward_times  # seconds from the start of backprop to the end of each layer's backward
        end = max(times.values(), default=0.0)
        best, best_time = -1, float("inf")
        candidates = [i for i, layer in enumerate(self.net.layers) if layer.type == "Pooling"]
        for b in candidates:
            above = sum(counts[lid] for lid, layers in enumerate(used)
                        if layers and layers[0] > b and lid not in self.skip)
            below = sum(counts[lid] for lid, layers in enumerate(used) if layers and layers[0] <= b
                        and lid not in self.skip)
            if not above or not below:
                continue
            posted = times.get(b + 1, 0.0)
            finish = max(posted + per_value * above, end) + per_value * below
            if finish < best_time:
                best, best_time = b, finish
        return best


def log_stats(solver: Solver, exchange: MpiExchange, iteration: int) -> None:
    """At the end of each iteration's communication; rank 0, every display interval, logs the communications'
    T_c, T_b and overlap ratio R (Eq. 11) per iteration of the interval."""
    stats = exchange.stats
    stats.iterations += 1
    display = solver.param.display
    if display and iteration % display != 0:
        return
    line = stats.log_line(exchange.size)
    if display and exchange.rank == 0:
        log.info("%s", line)


class BlockingStats:
    """The display line for ``-overlap none`` (after :class:`~cct.distributed.exchange.ExchangeCallback`)."""

    def __init__(self, solver: Solver, exchange: MpiExchange):
        self.solver = solver
        self.exchange = exchange

    def on_start(self) -> None:
        return None

    def on_gradients_ready(self) -> None:
        log_stats(self.solver, self.exchange, self.solver.iter)


__all__ = ["BlockingStats", "Chunk", "OVERLAP_MODES", "OverlapCallback", "ReplicatedFC", "first_ip_layers",
           "plan_chunks", "split_index"]
