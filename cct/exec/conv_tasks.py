"""A Convolution layer as ZNN's edge-group tasks (Zlateski et al. §II-§IV), for the task-graph executor.

The ``C`` input and ``O`` output channels are cut into blocks; block ``c`` of the input is a *node* (its
channels over the batch), block ``o`` of the output another, and the pair ``(o, c)`` an *edge group*: the
convolutions of its ``|o|·|c|`` kernels.  Inside a block the channel sums run in one matrix product (per
frequency, or one GEMM); across blocks the partial sums of an output block meet in a
:class:`~cct.exec.scheduler.ConcurrentSum`.  Blocks are sized so that an edge task carries at least
``CCT_TASK_MIN_MS`` (2 ms) of predicted work (Python's per-task overhead is 10-50 µs) while there are still
about two edge tasks per worker.  Two primitives, the one the layer's engine uses:

**FFT** (memoized, the unlifted layout of :mod:`cct.engines.fft`; ``^`` the real DFT of size ``T``, ``ξ`` the
input, ``κ`` the dilated kernel, ``ζ`` the output gradient, per frequency):

* forward — node task: ``conj(ξ^)`` of the block (``N·|c|`` transforms); edge task: the kernel spectra
  ``κ^`` (``|o|·|c|`` transforms, kept) and ``Y^ += conj(ξ^)·κ^ᵀ``; completion: one inverse per output
  image (``N·|o|``), bias, and the following in-place ReLU fused;
* backward — node task: ``ζ^`` of the output block (``N·|o|``) and the bias gradient; data edge:
  ``dX^ += ζ^·κ^`` with the forward's kernel spectra (no kernel transform); completion: ``N·|c|`` inverses;
* update (weight gradient) edge: ``dW += irfft(ζ^ᵀ·conj(ξ^))`` at the kernel taps, with the forward's input
  spectra and the backward's gradient spectra: ``|o|·|c|`` inverses and nothing else.

So per layer and iteration, with ``S`` images, ``f`` input and ``f'`` output channels (ZNN Table II,
memoized): forward ``S·f + f'·f + S·f'`` transforms, backward ``S·f' + S·f`` (the second term only where the
bottom needs a gradient), update ``f'·f`` inverses — :attr:`ConvUnit.counts`.

**Direct** (lowering): each edge group runs the layer's lowering engine (:mod:`cct.engines.lowering`, the
same CcT lowering type, on the group's ``|o|×|c|`` sub-convolution; lowered matrices live in the workspace
of the worker's thread): forward ``Y[o] += conv(X[c], W[o, c])``, completion bias (+ReLU); backward one task
per edge group for both gradients, sharing the unlifted ``dY[o]``: ``dW[o, c] += corr(X[c], dY[o])`` and
``dX[c] += conv_transpose(dY[o], W[o, c])``, completion the sum.  The node tasks only compute the bias
gradient.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from cct.elementwise import relu_into
from cct.engines.base import ConvGeometry
from cct.engines.fft import fft_transform_size
from cct.engines.fft_plan import FFTPlan, fft_workers, positions
from cct.engines.lowering import LoweringEngine
from cct.exec.scheduler import ConcurrentSum, Task

if TYPE_CHECKING:  # pragma: no cover
    from cct.net import NetCore

FFT_FLOPS_PER_S = 4e9     # one thread: scipy.fft on lines of 16-64
PRODUCT_FLOPS_PER_S = 4e9  # one thread: batched complex products, a few rows per frequency
GEMM_FLOPS_PER_S = 2e10    # one thread: float32 GEMM


def supports(layer: Any, net: NetCore, i: int) -> str:
    """Why layer ``i`` cannot be split into edge groups ("" when it can)."""
    if layer.type != "Convolution":
        return "not a Convolution"
    if len(net.bottom_vecs[i]) != 1:
        return "several bottoms"
    if getattr(layer, "channel_axis", 1) != 1:
        return "channel axis is not 1"
    if layer.group != 1:
        return "groups"
    if any(s != 1 for s in layer.stride):
        return "stride"
    if any(layer.loss(k) for k in range(len(net.top_vecs[i]))):
        return "loss weight on its top"
    return ""


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(n, parts))
    edges = [round(k * n / parts) for k in range(parts + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _fft_flops(size: tuple[int, ...], lines_of: tuple[int, ...]) -> float:
    total, nd = 0.0, len(size)
    spec = size[:-1] + (size[-1] // 2 + 1,)
    for a in reversed(range(nd)):
        lines = math.prod(lines_of[:a]) * math.prod(spec[a + 1:])
        total += lines * 5 * size[a] * math.log2(max(size[a], 2)) * (0.5 if a == nd - 1 else 1.0)
    return total


class ConvUnit:
    """The tasks of Convolution layer ``i`` of ``net`` (see the module docstring).  ``primitive``: ``fft`` or
    ``direct``; ``workers``: the scheduler's; ``min_s``: least predicted seconds per edge task;
    ``fuse_relu``: apply ``max(0, ·)`` in the forward completion (an in-place ReLU follows)."""

    def __init__(self, net: NetCore, i: int, primitive: str, workers: int, min_s: float, fuse_relu: bool,
                 deterministic: bool = False):
        self.net, self.i, self.layer = net, i, net.layers[i]
        self.name = net._layer_names[i]
        self.primitive = primitive
        self.fuse_relu = fuse_relu
        self.deterministic = deterministic
        self.counts = self._zero_counts()
        self._count_lock = threading.Lock()
        self.geometry: ConvGeometry | None = None
        lay = self.layer
        C, O = lay.channels, lay.num_output
        g = lay._geometry()
        work = self._edge_seconds(g, C, O)  # all edges of the layer, one thread
        target = 1 if workers == 1 else max(1, min(2 * workers, int(work / max(min_s, 1e-9))))
        if primitive == "direct":  # input blocks only: each input block is lowered once, by its own edge
            n_c, n_o = min(C, workers, target), 1
        else:
            n_c = min(C, workers, target)
            n_o = min(O, max(1, -(-target // n_c)))
        self.in_blocks = _blocks(C, n_c)
        self.out_blocks = _blocks(O, n_o)
        self.predicted_edge_ms = 1e3 * work / (len(self.in_blocks) * len(self.out_blocks))
        self._state: dict[str, Any] = {}
        self._engines: dict[tuple[int, int], LoweringEngine] = {}

    @staticmethod
    def _zero_counts() -> dict[str, dict[str, int]]:
        return {p: {"input": 0, "kernel": 0, "inverse": 0} for p in ("forward", "backward", "update")}

    def _count(self, phase: str, kind: str, n: int) -> None:
        with self._count_lock:
            self.counts[phase][kind] += n

    def _edge_seconds(self, g: ConvGeometry, C: int, O: int) -> float:
        if self.primitive == "direct":
            return 2.0 * g.num * O * C * g.kernel_count * g.out_count / GEMM_FLOPS_PER_S
        T = fft_transform_size(g)
        F = math.prod(T[:-1]) * (T[-1] // 2 + 1)
        return (8.0 * F * g.num * O * C / PRODUCT_FLOPS_PER_S
                + O * C * _fft_flops(T, g.extent) / FFT_FLOPS_PER_S)

    def describe(self) -> str:
        return (f"{self.name}: {self.primitive}, {len(self.out_blocks)}x{len(self.in_blocks)} edge groups "
                f"(~{self.predicted_edge_ms:.1f} ms each){', ReLU fused' if self.fuse_relu else ''}")

    # ---- geometry and operands -----------------------------------------------------------------------
    def _setup(self) -> None:
        """The layer's reshape (as the layer executor's forward does), then the transform plan if the
        geometry changed."""
        net, i, lay = self.net, self.i, self.layer
        lay.reshape(net.bottom_vecs[i], net.top_vecs[i])
        g = lay._geometry()
        if g != self.geometry:
            self.geometry = g
            if self.primitive == "fft":
                T = fft_transform_size(g)
                self.plan = FFTPlan(T)
                self.pos_y = [positions(p, o, -1, t) for p, o, t in zip(g.pad, g.out_shape, T)]
                self.pos_dx = [positions(p, n, 1, t) for p, n, t in zip(g.pad, g.in_shape, T)]
                self.pos_dw = [positions(p, k, -d, t) for p, k, d, t in zip(g.pad, g.kernel, g.dilation, T)]
            else:
                self._configure_engines(g)
        self.counts = self._zero_counts()
        s = self._state
        s.clear()
        s["ysum"] = {o: ConcurrentSum(len(self.in_blocks), self.deterministic) for o in range(len(self.out_blocks))}

    def _configure_engines(self, g: ConvGeometry) -> None:
        """One lowering engine per edge group, on the group's sub-geometry, with the layer's lowering type."""
        engine = getattr(self.layer, "engine", None)
        strategy = getattr(engine, "strategy", 1) if getattr(engine, "name", "") == "lowering" else 1
        dtype = self.layer.blobs[0].data.dtype
        for o, (o0, o1) in enumerate(self.out_blocks):
            for c, (c0, c1) in enumerate(self.in_blocks):
                sub = dataclasses.replace(g, in_channels=c1 - c0, out_channels=o1 - o0)
                eng = self._engines.get((o, c))
                if eng is None:
                    eng = self._engines[(o, c)] = LoweringEngine(strategy, source="task graph")
                eng.configure(sub, dtype)

    def _x(self) -> Any:
        lay = self.layer
        return self.net.bottom_vecs[self.i][0].data.reshape((lay.num, lay.channels) + lay.in_spatial)

    def _dx(self) -> Any:
        lay = self.layer
        return self.net.bottom_vecs[self.i][0].diff.reshape((lay.num, lay.channels) + lay.in_spatial)

    def _y(self, diff: bool = False) -> Any:
        lay, top = self.layer, self.net.top_vecs[self.i][0]
        return (top.diff if diff else top.data).reshape((lay.num, lay.num_output) + lay.out_spatial)

    def _spatial_first(self, a: Any) -> Any:
        nd = a.ndim - 2
        return np.ascontiguousarray(np.moveaxis(a, (0, 1), (nd, nd + 1)))

    def _from_spatial_first(self, a: Any) -> Any:
        nd = a.ndim - 2
        return np.moveaxis(a, (nd, nd + 1), (0, 1))

    def _w_block(self, o: int, c: int) -> Any:
        (o0, o1), (c0, c1) = self.out_blocks[o], self.in_blocks[c]
        return self.layer.blobs[0].data[o0:o1, c0:c1]

    # ---- forward --------------------------------------------------------------------------------------
    def _node_forward(self, c: int) -> None:
        c0, c1 = self.in_blocks[c]
        x = self._x()[:, c0:c1]
        g = self.geometry
        if self.primitive == "fft":
            spec = self.plan.forward(self._spatial_first(x), None, fft_workers())
            spec = spec.reshape(-1, g.num, c1 - c0)
            np.conjugate(spec, out=spec)
            self._state[("xs", c)] = spec
            self._count("forward", "input", g.num * (c1 - c0))

    def _edge_forward(self, o: int, c: int) -> None:
        g = self.geometry
        w = self._w_block(o, c)
        if self.primitive == "fft":
            ks = self.plan.forward(self._spatial_first(w), g.dilation, fft_workers())
            ks = ks.reshape(-1, w.shape[0], w.shape[1])
            self._state[("ks", o, c)] = ks
            self._count("forward", "kernel", w.shape[0] * w.shape[1])
            z = np.matmul(self._state[("xs", c)], ks.transpose(0, 2, 1))
        else:
            z = np.empty((g.num, w.shape[0]) + g.out_shape, dtype=w.dtype)
            self._engines[(o, c)].forward(self._x()[:, slice(*self.in_blocks[c])], w, None, z)
        self._state["ysum"][o].add(z, c)

    def _complete_forward(self, o: int) -> None:
        g, lay = self.geometry, self.layer
        o0, o1 = self.out_blocks[o]
        z = self._state["ysum"][o].value
        y = self._y()[:, o0:o1]
        if self.primitive == "fft":
            sig = self.plan.inverse(z.reshape(self.plan.spectrum_shape + (g.num, o1 - o0)), self.pos_y,
                                    fft_workers())
            y[...] = self._from_spatial_first(sig)
            self._count("forward", "inverse", g.num * (o1 - o0))
        else:
            y[...] = z.reshape(y.shape)
        if lay.bias_term:
            y += lay.blobs[1].data[o0:o1].reshape((1, -1) + (1,) * g.num_spatial_axes)
        if self.fuse_relu:
            relu_into(y, y)

    def forward_tasks(self, forces: list[Task]) -> tuple[list[Task], list[Task], list[Task]]:
        """(all, entries, exits) of the forward; edges and completions force ``forces`` (the layer's
        pending updates) first."""
        setup = Task(f"{self.name}:setup", self._setup)
        nodes = [Task(f"{self.name}:x{c}", lambda c=c: self._node_forward(c)) for c in range(len(self.in_blocks))]
        done = [Task(f"{self.name}:y{o}", lambda o=o: self._complete_forward(o)) for o in range(len(self.out_blocks))]
        edges = []
        for o in range(len(self.out_blocks)):
            for c in range(len(self.in_blocks)):
                e = Task(f"{self.name}:e{o},{c}", lambda o=o, c=c: self._edge_forward(o, c))
                e.forces = forces
                nodes[c].then(e)
                e.then(done[o])
                edges.append(e)
        for d in done:
            d.forces = forces
        setup.then(*nodes)
        return [setup, *nodes, *edges, *done], [setup], done

    # ---- backward -------------------------------------------------------------------------------------
    def _node_backward(self, o: int, want_w: bool, want_b: bool) -> None:
        g, lay = self.geometry, self.layer
        o0, o1 = self.out_blocks[o]
        dy = self._y(diff=True)[:, o0:o1]
        if want_b:
            lay.blobs[1].diff[o0:o1] += dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))
        if self.primitive == "fft":
            spec = self.plan.forward(self._spatial_first(dy), None, fft_workers()).reshape(-1, g.num, o1 - o0)
            self._state[("ds", o)] = spec
            self._count("backward", "input", g.num * (o1 - o0))

    def _edge_data(self, c: int, o: int) -> None:
        z = np.matmul(self._state[("ds", o)], self._state[("ks", o, c)])
        self._state["dxsum"][c].add(z, o)

    def _edge_backward_direct(self, o: int, c: int, want_dx: bool, want_w: bool) -> None:
        """Both gradients of edge group ``(o, c)`` with its lowering engine (one unlifting of ``dY[o]``)."""
        (o0, o1), (c0, c1) = self.out_blocks[o], self.in_blocks[c]
        g, lay = self.geometry, self.layer
        dx = np.empty((g.num, c1 - c0) + g.in_shape, dtype=lay.blobs[0].dtype) if want_dx else None
        dw = np.zeros((o1 - o0, c1 - c0) + g.kernel, dtype=lay.blobs[0].dtype) if want_w else None
        self._engines[(o, c)].backward(self._x()[:, c0:c1], self._y(diff=True)[:, o0:o1], self._w_block(o, c),
                                       dx, dw)
        if want_w:
            lay.blobs[0].diff[o0:o1, c0:c1] += dw
        if want_dx:
            self._state["dxsum"][c].add(dx, o)

    def _complete_data(self, c: int) -> None:
        g = self.geometry
        c0, c1 = self.in_blocks[c]
        z = self._state["dxsum"][c].value
        dx = self._dx()[:, c0:c1]
        if self.primitive == "fft":
            sig = self.plan.inverse(z.reshape(self.plan.spectrum_shape + (g.num, c1 - c0)), self.pos_dx,
                                    fft_workers())
            dx[...] = self._from_spatial_first(sig)
            self._count("backward", "inverse", g.num * (c1 - c0))
        else:
            dx[...] = z

    def _edge_weights(self, o: int, c: int) -> None:
        (o0, o1), (c0, c1) = self.out_blocks[o], self.in_blocks[c]
        dw = self.layer.blobs[0].diff[o0:o1, c0:c1]
        ds = self._state[("ds", o)]
        q = np.matmul(ds.transpose(0, 2, 1), self._state[("xs", c)])
        taps = self.plan.inverse(q.reshape(self.plan.spectrum_shape + (o1 - o0, c1 - c0)), self.pos_dw,
                                 fft_workers())
        dw += self._from_spatial_first(taps)
        self._count("update", "inverse", (o1 - o0) * (c1 - c0))

    def _backward_setup(self) -> None:
        self._state["dxsum"] = {c: ConcurrentSum(len(self.out_blocks), self.deterministic)
                                for c in range(len(self.in_blocks))}

    def _release(self) -> None:
        """Drop the spectra and lowered matrices of this iteration."""
        for k in [k for k in self._state if isinstance(k, tuple)]:
            del self._state[k]

    def backward_tasks(self, want_dx: bool) -> tuple[list[Task], list[Task], list[Task]]:
        """(all, entries, exits) of the backward: bias and output-gradient nodes, data edges and completions
        (``want_dx``), weight-gradient edges; the last task frees the iteration's operands."""
        lay = self.layer
        want_w = bool(lay.param_propagate_down[0])
        want_b = bool(lay.bias_term and lay.param_propagate_down[1])
        setup = Task(f"{self.name}:bsetup", self._backward_setup)
        nodes = [Task(f"{self.name}:dy{o}", lambda o=o: self._node_backward(o, want_w, want_b))
                 for o in range(len(self.out_blocks))]
        setup.then(*nodes)
        release = Task(f"{self.name}:release", self._release)
        tasks = [setup, *nodes]
        if self.primitive != "fft" and (want_dx or want_w):
            done = [Task(f"{self.name}:dx{c}", lambda c=c: self._complete_data(c)) for c in range(len(self.in_blocks))]
            for o in range(len(self.out_blocks)):
                for c in range(len(self.in_blocks)):
                    e = Task(f"{self.name}:b{o},{c}",
                             lambda o=o, c=c: self._edge_backward_direct(o, c, want_dx, want_w))
                    nodes[o].then(e)
                    e.then(done[c] if want_dx else release)
                    tasks.append(e)
            if want_dx:
                tasks += done
                for d in done:
                    d.then(release)
            tasks.append(release)
            return tasks, [setup], [release]
        if want_dx:
            done = [Task(f"{self.name}:dx{c}", lambda c=c: self._complete_data(c)) for c in range(len(self.in_blocks))]
            for c in range(len(self.in_blocks)):
                for o in range(len(self.out_blocks)):
                    e = Task(f"{self.name}:d{c},{o}", lambda c=c, o=o: self._edge_data(c, o))
                    nodes[o].then(e)
                    e.then(done[c])
                    tasks.append(e)
            tasks += done
            for d in done:
                d.then(release)
        if want_w:
            for o in range(len(self.out_blocks)):
                for c in range(len(self.in_blocks)):
                    e = Task(f"{self.name}:w{o},{c}", lambda o=o, c=c: self._edge_weights(o, c))
                    nodes[o].then(e)
                    e.then(release)
                    tasks.append(e)
        if not release.num_deps:
            for n in nodes:
                n.then(release)
        tasks.append(release)
        return tasks, [setup], [release]
