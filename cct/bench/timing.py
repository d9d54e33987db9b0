"""Caffe's ``caffe time`` measurement: every layer's forward, then every layer's backward, timed one layer at a
time for a number of iterations.  Each layer runs through the per-layer runner of the net's serial executor
(so a device split is what is timed), and every layer's backward is timed whether or not the net needs it, as
Caffe's ``time`` does (a TEST-phase net still computes its parameter gradients there).  A pair the executor runs
as one step in training (:mod:`cct.exec.fusion`: a max pooling doing the in-place ReLU's backward below it; a
BatchNorm doing the in-place Scale's forward above it, and the in-place ReLU's above that) is timed as that step,
on the pooling or the BatchNorm, the other layers' passes then taking 0 ms (:attr:`NetTiming.fused` and
:attr:`NetTiming.fused_forward` name them)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cct.errors import CctError


@dataclass
class NetTiming:
    """Summed wall-clock times of ``iterations`` passes: per layer (microseconds), per pass and in total."""

    layer_names: list[str]
    iterations: int = 0
    forward_us: list[int] = field(default_factory=list)
    backward_us: list[int] = field(default_factory=list)
    forward_total_us: int = 0
    backward_total_us: int = 0
    iteration_ms: list[float] = field(default_factory=list)  # forward + backward of each pass
    forward_ms: list[float] = field(default_factory=list)    # the forward of each pass
    total_ms: int = 0
    # the layer of a fused backward step (a pooling, a BatchNorm) -> the layers whose backwards its line includes
    fused_backward: dict[str, list[str]] = field(default_factory=dict)
    # BatchNorm -> the Scale (and ReLU) whose forwards it includes
    fused_forward: dict[str, list[str]] = field(default_factory=dict)


def device_synchronizer() -> Callable[[], None]:
    """What waits for queued device work after each layer: the GPU's synchronize in Caffe's GPU mode, else
    nothing."""
    from cct import mode
    from cct.device import cupy, cupy_available

    if cupy_available and mode.mode() == mode.GPU:
        return lambda: cupy.cuda.Device().synchronize()
    return lambda: None


def _us(t0: float) -> int:
    return int((time.perf_counter() - t0) * 1e6)


def time_layers(net, iterations: int, synchronize: Callable[[], None] = lambda: None,
                on_iteration: Callable[[int, float], None] | None = None, warmup: int = 0) -> NetTiming:
    """Time ``iterations`` forward/backward passes of ``net`` layer by layer (Caffe's timers: whole
    microseconds per layer), after ``warmup`` untimed ones.  ``synchronize`` waits for a device's queued work
    after each layer; ``on_iteration(j, ms)`` is called after pass ``j`` (1-based) with its wall-clock
    milliseconds."""
    n_layers = len(net.layers)
    runner = getattr(net.executor, "runner", None)
    if runner is None:
        raise CctError(f"per-layer times need the layer-by-layer executor; this net runs under "
                       f"{net.executor.describe()}")
    backward_fused = getattr(net.executor, "backward_fused", lambda _net, _i: None)
    forward_step = getattr(net.executor, "forward_step",
                           lambda _net, i, _start, _end: (i + 1, runner.forward_layer(net, i)))

    def one_pass(into: NetTiming) -> float:
        """One forward/backward pass, its times added to ``into``; returns its milliseconds."""
        iter_start = time.perf_counter()
        i = 0
        while i < n_layers:
            t0 = time.perf_counter()
            following, _ = forward_step(net, i, 0, n_layers - 1)
            synchronize()
            into.forward_us[i] += _us(t0)
            if following > i + 1:  # the pair a training pass runs as one step: timed on the first layer
                into.fused_forward[net._layer_names[i]] = list(net._layer_names[i + 1:following])
            i = following
        into.forward_ms.append((time.perf_counter() - iter_start) * 1e3)
        into.forward_total_us += _us(iter_start)
        backward_start = time.perf_counter()
        i = n_layers - 1
        while i >= 0:
            t0 = time.perf_counter()
            fused = backward_fused(net, i)
            if fused is None:
                following, owner = i - 1, i
                runner.backward_layer(net, i)
            else:  # the layers a training pass runs as one step: timed on the step's layer, the others' 0
                following, owner, others = fused
                into.fused_backward[net._layer_names[owner]] = [net._layer_names[k] for k in others]
            synchronize()
            into.backward_us[owner] += _us(t0)
            i = following
        into.backward_total_us += _us(backward_start)
        ms = (time.perf_counter() - iter_start) * 1e3
        into.iteration_ms.append(ms)
        return ms

    for _ in range(warmup):
        one_pass(NetTiming(list(net._layer_names), 1, [0] * n_layers, [0] * n_layers))
    result = NetTiming(list(net._layer_names), iterations, [0] * n_layers, [0] * n_layers)
    total_start = time.perf_counter()
    for j in range(iterations):
        ms = one_pass(result)
        if on_iteration is not None:
            on_iteration(j + 1, ms)
    result.total_ms = int((time.perf_counter() - total_start) * 1e3)
    return result
