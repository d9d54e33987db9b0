"""A simulator of Lee et al.'s setting: VGG-A data-parallel training on P nodes with an alpha-beta network.

Model (nothing here is measured on a cluster; every constant is named):

* Layers: the paper's 16 (8 Convolution, 5 Pooling, 3 InnerProduct) of VGG-A on 3x224x224 images, or
  VGG-128/256/512 (every convolution with that many maps).  Per layer and image: forward, backward-data and
  backward-weights FLOPs (a convolution or InnerProduct: 2·outputs·fan-in each; a pooling: its window reads).
* Compute: a layer on ``n`` images takes ``t(n) = (a + b·n)`` with ``b = FLOPs / speed`` and ``a = overhead·b``
  (``overhead`` in images: the per-call cost a small batch does not amortise).  :func:`measured_profile`
  gives the same per-layer ``(a, b)`` from timing a cct net at two batch sizes; the VGG-A tables use FLOPs
  scaled by the node speed, since the paper's nodes are not this machine.
* Network: ``Allreduce(bytes) = 2⌈log₂P⌉α + 2(P−1)/P·bytes·β``; ``Allgather(total bytes) = ⌈log₂P⌉α +
  (P−1)/P·bytes·β``; one FIFO channel per node runs them in the order posted, while compute goes on in order.
* Variants: ``DP`` (one Allreduce after backprop, waited for at once), ``DP+Overlap`` (one Allreduce per layer
  posted as its gradient is ready: Das et al. as the paper reproduces it) and ``Lee`` (Algorithm 2: chunk 1 =
  the top k layers, chunk 2 the rest, the first f InnerProduct layers replicated: their inputs gathered in
  forward, their errors after chunk 2, their whole-batch gradient computed and applied in the next forward).
* Speedup: the single node's time for the same mini-batch N (no communication) over the steady-state
  iteration time on P nodes (each with N/P images).

:func:`fit` chooses the node speed, the per-call overhead and α, β (within Aries-plausible ranges) on the
paper's two anchors (VGG-A, N = 256, P = 128: Lee 62.97×, DP 19.92×); the other figures are held out.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Layer:
    """One of the paper's layers: FLOPs per image and sizes (values per image, parameters)."""

    name: str
    kind: str  # conv | pool | fc
    params: int
    inputs: int  # values per image at its input (K_b for fc)
    outputs: int  # values per image at its output (K_c for fc)
    fwd: float  # FLOPs per image
    bwd_data: float
    bwd_weights: float


def vgg(maps: int | None = None, image: int = 224) -> list[Layer]:
    """VGG-A (configuration A of Simonyan & Zisserman) or, with ``maps``, every convolution with ``maps``
    channels (the paper's VGG-128/256/512)."""
    plan = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
    layers: list[Layer] = []
    c, h = 3, image
    conv_i = pool_i = 0
    for item in plan:
        if item == "M":
            pool_i += 1
            out = c * (h // 2) ** 2
            layers.append(Layer(f"pool{pool_i}", "pool", 0, c * h * h, out, 4.0 * out, 4.0 * out, 0.0))
            h //= 2
            continue
        conv_i += 1
        d = int(maps or item)
        fan_in = c * 9
        out = d * h * h
        flops = 2.0 * out * fan_in
        layers.append(Layer(f"conv{conv_i}", "conv", d * fan_in + d, c * h * h, out, flops,
                            flops if layers else 0.0, flops))
        c = d
    k = c * h * h
    for i, n in enumerate((4096, 4096, 1000)):
        flops = 2.0 * k * n
        layers.append(Layer(f"fc{6 + i}", "fc", k * n + n, k, n, flops, flops, flops))
        k = n
    return layers


@dataclass(frozen=True)
class Machine:
    """A node and its network: ``speed`` FLOP/s, ``overhead`` images of fixed cost per layer call, ``alpha``
    seconds per message step, ``beta`` seconds per byte."""

    speed: float
    overhead: float
    alpha: float
    beta: float

    def compute(self, flops_per_image: float, n: float) -> float:
        return flops_per_image * (self.overhead + n) / self.speed if flops_per_image else 0.0

    def allreduce(self, nbytes: float, p: int) -> float:
        return 2 * math.ceil(math.log2(p)) * self.alpha + 2 * (p - 1) / p * nbytes * self.beta if p > 1 else 0.0

    def allgather(self, nbytes: float, p: int) -> float:
        return math.ceil(math.log2(p)) * self.alpha + (p - 1) / p * nbytes * self.beta if p > 1 else 0.0


@dataclass
class Result:
    time: float  #: steady-state iteration time (s)
    comm: float  #: Σ T_c of an iteration
    blocked: float  #: Σ T_b: communication the compute waited for

    @property
    def ratio(self) -> float:
        """Eq. 11's overlap ratio R (percent)."""
        return 100.0 * (self.comm - self.blocked) / self.comm if self.comm else 100.0


class _Channel:
    """One FIFO communication channel: ops start when posted and the previous one has ended."""

    def __init__(self) -> None:
        self.free = 0.0
        self.busy = 0.0

    def post(self, at: float, seconds: float) -> float:
        start = max(at, self.free)
        self.free = start + seconds
        self.busy += seconds
        return self.free


def single_node_time(layers: Sequence[Layer], n: int, m: Machine) -> float:
    return sum(m.compute(x.fwd + x.bwd_data + x.bwd_weights, n) for x in layers)


def simulate(layers: Sequence[Layer], n_batch: int, p: int, m: Machine, variant: str, k: int = 9,
             f: int = 2, iterations: int = 4) -> Result:
    """Steady-state iteration of ``variant`` (DP | DP+Overlap | Lee) on ``p`` nodes (mini-batch ``n_batch``)."""
    n = n_batch / p
    fcs = [i for i, x in enumerate(layers) if x.kind == "fc"]
    replicated = set(fcs[:f]) if variant == "Lee" else set()
    top = set(range(len(layers) - k, len(layers))) if variant == "Lee" else set()
    chunk1 = sum(layers[i].params for i in top - replicated) * 4
    chunk2 = sum(x.params for i, x in enumerate(layers) if i not in top and i not in replicated) * 4
    channel = _Channel()
    t = 0.0
    starts, blocked = [], []
    gathers_done = 0.0
    for it in range(iterations):
        starts.append(t)
        waited = 0.0
        channel.busy = 0.0
        # ---- forward (Lee: the replicated layers' delayed gradient and update, then gathers of A)
        for i, x in enumerate(layers):
            if i in replicated and it > 0:
                if gathers_done > t:
                    waited += gathers_done - t
                    t = gathers_done
                t += m.compute(x.bwd_weights, n_batch)  # the whole batch's ΔW on every node
            t += m.compute(x.fwd, n)
            if i + 1 in replicated:
                gathers_done = channel.post(t, m.allgather(n_batch * x.outputs * 4, p))
        # ---- backward with the reductions posted as gradients are ready
        waits: list[float] = []
        for i in range(len(layers) - 1, -1, -1):
            x = layers[i]
            t += m.compute(x.bwd_data, n) + (0.0 if i in replicated else m.compute(x.bwd_weights, n))
            if variant == "DP+Overlap" and x.params:
                waits.append(channel.post(t, m.allreduce(x.params * 4, p)))
            if variant == "Lee" and top and i == min(top) and chunk1:
                waits.append(channel.post(t, m.allreduce(chunk1, p)))
        if variant == "DP":
            waits.append(channel.post(t, m.allreduce(sum(x.params for x in layers) * 4, p)))
        if variant == "Lee":
            if chunk2:
                waits.append(channel.post(t, m.allreduce(chunk2, p)))
            for i in sorted(replicated):
                gathers_done = channel.post(t, m.allgather(n_batch * layers[i].outputs * 4, p))
        for done in waits:  # the update waits chunk by chunk
            if done > t:
                waited += done - t
                t = done
        blocked.append(waited)
    comm_per_iter = channel.busy
    return Result(t - starts[-1] if iterations > 1 else t, comm_per_iter, blocked[-1])


def speedup(layers: Sequence[Layer], n_batch: int, p: int, m: Machine, variant: str, **kw) -> float:
    return single_node_time(layers, n_batch, m) / simulate(layers, n_batch, p, m, variant, **kw).time


# ---- the fit on the paper's anchors ------------------------------------------------------------------------

ANCHORS = {"Lee": 62.97, "DP": 19.92}  # VGG-A, N = 256, P = 128 (Fig. 6)
HELD_OUT = {("VGG-A", 128): 17.82, ("VGG-A", 512): 77.97, ("VGG-128", 256): 54.0, ("VGG-256", 256): 61.0,
            ("VGG-512", 256): 80.0}  # maximum Lee speedups over P (Figs. 8 and 9)
NODES = (1, 2, 4, 8, 16, 32, 64, 128)
NODE_PEAK = 2 * 16 * 2.3e9 * 32  # Cori Phase I: 2 x 16 Haswell cores at 2.3 GHz, 32 float32 FLOP/cycle (AVX2 FMA)


def model(name: str) -> list[Layer]:
    return vgg(None if name == "VGG-A" else int(name.split("-")[1]))


def fit(alphas: Sequence[float] = (1e-6, 1.5e-6, 2e-6), bandwidths: Sequence[float] = (8e9, 9e9, 10e9),
        overheads: Sequence[float] = tuple(x / 4 for x in range(0, 33)),
        speeds: Sequence[float] = tuple(NODE_PEAK / 1.05 ** i for i in range(40))) -> Machine:
    """The machine whose VGG-A speedups at N = 256, P = 128 come closest (log error) to the anchors, with α in
    1-2 µs, β from 8-10 GB/s (Aries-plausible) and the node no faster than its peak, by grid search."""
    layers = vgg()
    best, best_err = None, float("inf")
    for a in alphas:
        for bw in bandwidths:
            for o in overheads:
                for s in speeds:
                    m = Machine(s, o, a, 1.0 / bw)
                    err = sum(math.log(speedup(layers, 256, 128, m, v) / target) ** 2 for v, target in ANCHORS.items())
                    if err < best_err:
                        best, best_err = m, err
    assert best is not None
    return best


def max_speedup(name: str, n_batch: int, m: Machine, variant: str = "Lee", **kw) -> float:
    layers = model(name)
    return max(speedup(layers, n_batch, p, m, variant, **kw) for p in NODES)


def table(m: Machine, name: str = "VGG-A", n_batch: int = 256) -> str:
    """The P × {DP, DP+Overlap, Lee} speedup table (k = 9, f = 2)."""
    layers = model(name)
    lines = [f"{name}, N = {n_batch}: speedup over one node (alpha {m.alpha * 1e6:g} us, "
             f"{1e-9 / m.beta:g} GB/s, node {m.speed / 1e12:.3g} TFLOP/s, overhead {m.overhead:g} images/call)",
             f"{'P':>5} {'DP':>8} {'DP+Overlap':>11} {'Lee':>8} {'Lee R%':>7}"]
    for p in NODES:
        s = [speedup(layers, n_batch, p, m, v) for v in ("DP", "DP+Overlap", "Lee")]
        r = simulate(layers, n_batch, p, m, "Lee").ratio
        lines.append(f"{p:>5} {s[0]:>8.2f} {s[1]:>11.2f} {s[2]:>8.2f} {r:>7.1f}")
    return "\n".join(lines)


def measured_profile(net, inputs: Sequence[str], batches: tuple[int, int] = (1, 2),
                     repeats: int = 2) -> dict[str, tuple[float, float]]:
    """Per layer of a cct ``net`` whose ``inputs`` are batch-first input blobs (filled with what they hold):
    ``(a, b)`` of ``t(n) = a + b·n`` seconds for the layer's forward + backward, from the fastest of ``repeats``
    timings at each of the two batch sizes."""
    import time

    starts: dict[int, float] = {}
    spent: dict[int, float] = {}

    def before(i: int) -> None:
        starts[i] = time.perf_counter()

    def after(i: int) -> None:
        spent[i] = spent.get(i, 0.0) + time.perf_counter() - starts[i]

    hooks = (net.before_forward_hooks, net.after_forward_hooks, net.before_backward_hooks, net.after_backward_hooks)
    for h, fn in zip(hooks, (before, after, before, after)):
        h.append(fn)
    measured: list[dict[str, float]] = []
    try:
        for n in batches:
            for name in inputs:
                blob = net.blob_by_name(name)
                blob.reshape((n,) + tuple(blob.shape[1:]))
            net.reshape()
            best: dict[str, float] = {}
            for _ in range(repeats):
                spent.clear()
                net.forward_backward()
                for i, seconds in spent.items():
                    name = net._layer_names[i]
                    best[name] = min(best.get(name, float("inf")), seconds)
            measured.append(best)
    finally:
        for h, fn in zip(hooks, (before, after, before, after)):
            h.remove(fn)
    (n1, n2), (m1, m2) = batches, measured
    out = {}
    for name in m1:
        b = max((m2[name] - m1[name]) / (n2 - n1), 0.0)
        out[name] = (max(m1[name] - b * n1, 0.0), b)
    return out


__all__ = ["ANCHORS", "HELD_OUT", "Layer", "Machine", "NODES", "Result", "fit", "max_speedup", "measured_profile",
           "simulate", "single_node_time", "speedup", "table", "vgg"]
