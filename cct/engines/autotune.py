"""Measuring convolution engines on this machine, and remembering what was measured.

* :func:`calibrate` — the cost model's rates (:class:`~cct.engines.cost_model.MachineRates`): the GEMM peak
  and its half-speed shapes, and the lowering engine's own lowering, col2im, lifting and transposing, timed
  through :meth:`LoweringEngine.probe` on a probe layer larger than the caches (about a second, once per
  machine and thread setting); :func:`machine_rates` returns them (calibrated, cached, or the defaults);
* :func:`autotune` — the lowerings measured on one chunk of a layer's geometry;
* :func:`autotune_conv_engine` — the lowering engine against the FFT engine's layouts on a layer;
* one measuring harness for both (:func:`_measure_engines`: forward + backward of a training step, operands new
  each step, a warm-up, interleaved rounds).

What is measured is kept in the cache of :mod:`cct.engines.measured` (one JSON file; rates keyed by core count
and partition setting, measurements by geometry, dtype and the same, all per machine and BLAS kernel:
:func:`~cct.engines.measured._threads_key`), which also holds the net's measuring budget and the measured
choices of engines and layers (:func:`~cct.engines.measured.measured_choice`).  When to measure is the choice
policy's business (:mod:`cct.engines.choice`).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from cct import log
from cct.config import settings
from cct.engines.base import ConvEngine, ConvGeometry, forward_only, scoped_value
from cct.engines.cost_model import DEFAULT_RATES, MachineRates, layer_costs
from cct.engines.measured import (
    _charged,
    _concurrent,
    _ledger,
    _may_measure,
    _read_cache,
    _threads_key,
    _write_cache,
    stand_in,
)
from cct.runtime.memory import release_freed_memory

# of calibrate()'s probes (4: lowering with the images innermost on small outputs; 5: type 1's 2-D lowering
# by the compiled kernel; 6: and its col2im; 7: all probes timed in interleaved rounds; 8: one partition's copies
# alone, part_share): rates cached by another version are measured again
RATES_VERSION = 8
# of autotune_conv_engine's method (7: each engine steady in a block, operands new each step; close calls on the whole
# batch; 8: close calls measured twice, in both orders; 9: the lowerings' images-innermost layout; 10: the FFT's
# full layout costed as GEMMs over a batch; 11: Winograd's own weight gradient; 12: the lowering measured again
# where another engine beat it; 13: a partition's lowered chunk capped at PART_LOWERED_MAX_BYTES; 14: Winograd's
# tiles with the channels innermost, chunks of at least MIN_CHUNK_TILES tiles; 15: the fastest close calls measured
# on the whole batch when all of them would take too long; 16: the best of the settling steps too; 17: the FFT
# engine's layout moves image by image; 18: short 1-D and 2-D transforms as DFT matrix products; 19: those read
# and write the full layout's operands as they lie; 20: up to 64 points; 21: type 1's 2-D lowering by the compiled
# kernel; 22: types 1 and 2's 2-D lowering and col2im compiled; 25: part of the batch at least an image per batch
# partition, a beaten lowering measured again before the whole batch's candidates are picked; 26: Winograd's kernel
# transforms over the partitions; 27: part of the batch at least a chunk of Winograd's tiles per partition, one
# settling step; 28: the images-last 2-D lowering and col2im compiled; 29: Winograd's tile transforms compiled; 30:
# Winograd's weight gradient by positions over all partitions' tiles): entries measured by another version are
# measured again
ENGINE_MEASURE_VERSION = 30
# measured images per partition: enough that the largest buffer of all partitions together exceeds this
# (out of the last-level cache, like the full layer) and that a GEMM has this many columns, at most the
# largest of the candidates' chunks of a partition
AUTOTUNE_BYTES = 48 << 20
AUTOTUNE_COLUMNS = 1024
AUTOTUNE_ROUNDS = 2
# lowerings measured within this factor of the fastest are measured once more, in the other order, and keep their
# better time: one step is a few images, and one spike decided a single round (with another process on the
# machine, CaffeNet's conv4 measured lowering 2 at 4.87 ms per image against its 3.05 in the layer, and ran
# lowering 1, 20% slower)
LOWERING_RECHECK_WINDOW = 1.6
# lowerings measured within this factor of the fastest on part of the batch are measured again on the whole batch,
# where those steps are predicted to take at most LOWERING_WHOLE_SECONDS together, and the whole batch decides: a
# chunk's images run otherwise than the layer's chunks one after the other (the CcT sweep's d/o = 1/8 layer, 16
# images: on 2 per partition lowering 1 measured 8% faster per image, on the whole layer lowering 2 ran 6% faster)
LOWERING_WHOLE_WINDOW = 1.15
LOWERING_WHOLE_SECONDS = 1.0
# of the lowerings' measurement (2: close calls measured again, partitions' chunks capped; 3: the images of the
# largest chunk; 4: the images-last 2-D lowering and col2im compiled; 5: close calls on the whole batch): entries
# measured by another version are measured again
LOWERING_MEASURE_VERSION = 5
# measuring lowering vs fft runs at most this many (predicted) seconds of images per round ...
ENGINE_AUTOTUNE_SECONDS = 0.25
ENGINE_AUTOTUNE_ROUNDS = 3
# ... both FFT layouts (all axes transformed, or the first lifted) measured when predicted within this factor
FFT_LAYOUT_WINDOW = 1.5
# -autotune fast (the default) measures a net's close calls, largest layers first, for at most this many seconds in
# all, or this many times the predicted forward + backward seconds of the layers awaiting a measurement where that
# is more (a measurement takes ~10-15 of the layer's steps: VGG16's conv1_2 at 8 images 3-5 s, a third of a 2-core
# machine's iteration); the close calls after that are decided by the cost model (and measured by a later run,
# budget allowing)
FAST_BUDGET_SECONDS = 2.0
FAST_BUDGET_ITERATIONS = 2.0
# ... and, for a net built to run many iterations (a solver's training net: :func:`expecting_iterations`), this
# share of them: a close call left to the models runs its choice for the whole run (CaffeNet's solver, 450000
# iterations, a fresh cache on a 2-core AMD EPYC: conv3-conv5 had been left to the models, conv4 on Winograd's
# F(4x4,3x3) at 388 ms a step where the FFT measured runs it in 217, the iteration 1768-1818 ms against 1571-1594;
# the solver is built in 36 s instead of 8, the machine's calibration included)
RUN_BUDGET_FRACTION = 0.01
# a layer's measurement takes about this many of its steps (see above); where the deferred ones may take
# ANNOUNCED_SECONDS or more, the log says so before they start
MEASURE_STEPS = 12
ANNOUNCED_SECONDS = 10.0
# ... with steps of at least this many predicted seconds: at fewer images the FFT engine's once-per-batch kernel
# transforms and the lowering engine's per-chunk overheads weigh more than in the layer (CaffeNet's conv2 at 64
# images: measured on 5 images the FFT engine took 1.8x its per-image time at 64 and lowering 1.2x, on 20 within
# 1.2x and 1.0x; the 0.05 s steps measured 3-10 images and chose FFT where it was 15% slower)
FAST_ENGINE_SECONDS = 0.1
# candidates measured within this factor of the fastest on part of the batch are measured again on the whole
# batch, as many of the fastest of them as take at most this many seconds together
FULL_BATCH_WINDOW = 1.25
FULL_BATCH_SECONDS = 1.8
# each engine measured after this many seconds and at least SETTLE_STEPS untimed steps (its steady state:
# _measure_engines).  Its first step pays what is done once (workspaces touched, plans made, a measured choice
# of its own such as Winograd's weight-gradient method: F(4x4,3x3) on CaffeNet's conv4 at 64 images 1413 ms,
# then 260-279); from the second on the steps are steady now that freed blocks stay in the heap
# (cct.runtime.memory): the FFT's full layout there 315, then 160-165 ms, the lowering on GoogLeNet's
# conv2/3x3 at 6 images 208, 118, then 74-76 ms (the best of the timed steps counts).  Three settling steps
# (an FFT step of conv4 took 290 ms for three steps, then 148, while every pass mapped its spectra afresh) made a
# whole-batch measurement of a 0.2 s layer cost 5 of its steps per candidate instead of 3
ENGINE_SETTLE_SECONDS = 0.25
SETTLE_STEPS = 1
# the models' error on this machine: each whole-batch measurement of the engine autotune keeps measured / predicted
# seconds per engine and layout (cache section "model_error", per geometry); where the models alone decide, their
# predictions are scaled by the median of those kept (:func:`model_errors`), within this range.  On a 2-core Intel
# Xeon the FFT's full layout ran 0.56-0.69x its prediction on six 2-D layers (1.27x on VGG16's conv2_2), the
# lifted 0.94-1.06x (1.40x), the lowering 0.75-1.01x, Winograd's F(4x4,3x3) 1.05-1.37x on VGG16's layers
MODEL_ERROR_RANGE = (0.5, 2.0)
# ... and over at least this many layers, those not measured yet counting as predicted exactly: one measurement in
# a noisy spell (VGG16's conv4_2 at 8 images, the lowering 697 ms where it ran 425-486 in other runs, 1.55x its
# model) scaled every other layer's lowering by 1.55 and handed four more of them to the Winograd engine
MODEL_ERROR_MIN_LAYERS = 3
_rates_memo: dict[str, MachineRates] = {}


# ---- the budget of one net's measurements ---------------------------------------------------------------

@dataclass
class Ledger:
    """What measuring a net's engines has cost: ``spent`` seconds over ``measured`` layers; ``skipped`` close
    calls decided by the cost model once ``budget`` (seconds; infinite with ``-autotune full``) was spent; and the
    bytes of FFT spectra ``kept`` between their passes by the layers chosen so far that keep many (the engine
    choice's budget of them: :data:`cct.engines.choice.KEPT_BUDGET_BYTES`)."""

    mode: str = "fast"
    budget: float = FAST_BUDGET_SECONDS
    # the deferred measurements' budget in iterations of the layers awaiting them (measure_deferred)
    iterations: float = field(default_factory=lambda: FAST_BUDGET_ITERATIONS)
    spent: float = 0.0
    measured: int = 0
    skipped: int = 0
    # fast: shorter steps and fewer rounds than a full measurement (enough for a clear winner; a close one is
    # close either way)
    engine_seconds: float = FAST_ENGINE_SECONDS
    engine_rounds: int = 2
    lowering_rounds: int = 1
    kept: float = 0.0
    # fast: the engine measurements the layers ask for while the net is built are put off (putting_off) until the
    # whole net is known, then made largest layer first (measure_deferred): in build order VGG16 at 8 images spent
    # the budget on conv1_1 and conv1_2 and left its 13 biggest layers to the models
    putting: bool = False
    put_off: int = 0
    deferred: dict[str, list[Any]] = field(default_factory=dict)  # key: [seconds, [callbacks]]

    def may_measure(self) -> bool:
        if self.spent < self.budget:
            return True
        self.skipped += 1
        return False

    def defers(self) -> bool:
        """Whether measurements asked for while the net is built wait for :meth:`measure_deferred` (fast mode:
        within a budget, the biggest layers first)."""
        return self.mode == "fast"

    @contextlib.contextmanager
    def putting_off(self) -> Iterator[Callable[[], bool]]:
        """Within the block, an engine measurement not in the cache is put off (:func:`autotune` and
        :func:`autotune_conv_engine` return None, the models decide for now); yields a callable telling whether one
        was."""
        before, outer = self.put_off, self.putting
        self.putting = True
        try:
            yield lambda: self.put_off > before
        finally:
            self.putting = outer

    def defer(self, key: str, seconds: float, again: Callable[[], Any]) -> None:
        """Call ``again`` (choosing a layer's engine once more, measuring now) from :meth:`measure_deferred`; the
        layers of the geometry ``key`` (their predicted ``seconds`` summed) in order of that sum, largest first."""
        entry = self.deferred.setdefault(key, [0.0, []])
        entry[0] += seconds
        entry[1].append(again)

    def measure_deferred(self) -> None:
        """The deferred choices (:meth:`defer`), largest first, each measuring while the budget lasts — at least
        :attr:`iterations` times their layers' predicted seconds — (the first layer of a geometry measures it, the
        others find it in the cache).  Says so first where that may take ``ANNOUNCED_SECONDS`` or more (a training
        net's first run: ``MEASURE_STEPS`` of each layer's predicted steps, within the budget)."""
        entries = sorted(self.deferred.values(), key=lambda entry: -entry[0])
        total = sum(entry[0] for entry in entries)
        if total > 0:  # (an infinite run's budget: every one)
            self.budget = max(self.budget, self.iterations * total)
        self.deferred = {}
        expected = min(MEASURE_STEPS * total, self.budget - self.spent)
        if expected >= ANNOUNCED_SECONDS:
            log.info("Measuring the engines of %d layer geometr%s, largest first: about %.0f s, cached for the next "
                     "runs", len(entries), "y" if len(entries) == 1 else "ies", expected)
        for _seconds, calls in entries:
            for again in calls:
                again()


def _put_off() -> bool:
    """Whether a measurement asked for now waits for the whole net (:meth:`Ledger.putting_off`)."""
    ledger = _ledger.get()
    if ledger is not None and ledger.putting:
        ledger.put_off += 1
        return True
    return False


_run_iterations: ContextVar[float | None] = ContextVar("cct_run_iterations", default=None)


def expecting_iterations(iterations: float) -> contextlib.AbstractContextManager[None]:
    """A net built within the block runs about ``iterations`` iterations (a solver's training net, ``max_iter``;
    ``math.inf``: ``cct time``, which times the net as a long run runs it): its fast measuring budget is at least
    ``RUN_BUDGET_FRACTION`` of them, in iterations of the layers awaiting a measurement."""
    return scoped_value(_run_iterations, iterations)


@contextlib.contextmanager
def measuring_session() -> Iterator[Ledger]:
    """The budget of the measurements made while a net is built (nested nets share the outer one's): with
    ``-autotune fast``, ``FAST_BUDGET_SECONDS`` or ``FAST_BUDGET_ITERATIONS`` iterations of the layers awaiting a
    measurement, whichever is more, or ``RUN_BUDGET_FRACTION`` of the iterations the net is built to run
    (:func:`expecting_iterations`) where that is more still."""
    outer = _ledger.get()
    if outer is not None:
        yield outer
        return
    full = settings.get("autotune") is True
    run = _run_iterations.get() or 0
    ledger = Ledger("full", math.inf, engine_seconds=ENGINE_AUTOTUNE_SECONDS, engine_rounds=ENGINE_AUTOTUNE_ROUNDS,
                    lowering_rounds=AUTOTUNE_ROUNDS) if full else Ledger(
        "fast", FAST_BUDGET_SECONDS, iterations=max(FAST_BUDGET_ITERATIONS, RUN_BUDGET_FRACTION * run))
    token = _ledger.set(ledger)
    try:
        yield ledger
        ledger.measure_deferred()
    finally:
        _ledger.reset(token)
        if ledger.measured:  # the candidates' buffers are garbage now: back to the kernel, not kept in the heap
            release_freed_memory()


def net_ledger() -> Ledger | None:
    """The ledger of the net being built (:func:`measuring_session`), None outside a net build."""
    return _ledger.get()


def _effort() -> Ledger:
    """How hard to measure: the current net's ledger, or (outside a net) a full measurement."""
    return _ledger.get() or Ledger("full", math.inf, engine_seconds=ENGINE_AUTOTUNE_SECONDS,
                                   engine_rounds=ENGINE_AUTOTUNE_ROUNDS, lowering_rounds=AUTOTUNE_ROUNDS)


def geometry_key(g: ConvGeometry, dtype: Any) -> str:
    return (f"n{g.num}-c{g.in_channels}-o{g.out_channels}-g{g.group}-in{'x'.join(map(str, g.in_shape))}"
            f"-k{'x'.join(map(str, g.kernel))}-s{'x'.join(map(str, g.stride))}-p{'x'.join(map(str, g.pad))}"
            f"-d{'x'.join(map(str, g.dilation))}-{np.dtype(dtype).name}-{_threads_key()}")


def _passes_key() -> str:
    """The end of a measurement's cache key: which passes it timed (the forward alone, or a training step)."""
    return "-fwd" if forward_only() else ""


def lowering_key(g: ConvGeometry, dtype: Any) -> str:
    """The cache key of :func:`autotune`'s measurement of the lowerings on ``g``."""
    return f"{geometry_key(g, dtype)}-v{LOWERING_MEASURE_VERSION}{_passes_key()}"


def _rates_key() -> str:
    return f"v{RATES_VERSION}-{_threads_key()}"


def machine_rates(calibrate_if_missing: bool = False) -> MachineRates:
    """This machine's rates for the current thread setting: measured by :func:`calibrate` (once per machine,
    cached; with ``calibrate_if_missing`` measured now when not cached), else the defaults."""
    key = _rates_key()
    rates = _rates_memo.get(key)
    if rates is not None:
        return rates
    entry = _read_cache().get("rates", {}).get(key)
    if entry:
        try:
            rates = MachineRates(**entry)
        except TypeError:  # written by another version: measure again
            rates = None
    if rates is None:
        if not calibrate_if_missing:
            return DEFAULT_RATES
        rates = calibrate()
    _rates_memo[key] = rates
    return rates


# calibrate() times its probes in interleaved rounds, at least this many and for at least this long (each probe's
# best counts): on a shared 2-core Intel Xeon VM six calibrations a minute apart, each probe timed 3-5 times in a
# row, measured the GEMM peak at 119-226 GFLOP/s and the FFT rate at 4.4-9.0 GFLOP/s, uncorrelated — each probe
# caught the machine in another state, and the models' ratios moved by 1.5x
CALIBRATE_ROUNDS = 5
CALIBRATE_SECONDS = 1.0


def _interleaved_best(probes: dict[str, Any], rounds: int = CALIBRATE_ROUNDS,
                      seconds: float = CALIBRATE_SECONDS) -> dict[str, float]:
    """Best seconds of each of ``probes`` (callables), after one untimed call each, timed in turn round after
    round — at least ``rounds`` rounds and ``seconds`` seconds (at most 4x ``rounds``) —, so that a spell of the
    machine's noise costs each probe some rounds, not its whole measurement."""
    for fn in probes.values():
        fn()
    best = {name: math.inf for name in probes}
    start, done = time.perf_counter(), 0
    while done < rounds or (time.perf_counter() - start < seconds and done < 4 * rounds):
        for name, fn in probes.items():
            fn()  # the probe's operands back in the caches, as in a run of calls (what the models were fit on)
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
        done += 1
    return best


def calibrate(save: bool = True) -> MachineRates:
    """Measure the cost model's rates on this machine, with the partitions a big layer runs (about a second:
    the probes timed in interleaved rounds, :func:`_interleaved_best`), and cache them: the GEMM peak and its
    half-speed shapes; the lowering engine's own lowering, col2im, lifting + unlifting and transposing on a probe
    layer larger than the caches; the FFT engine's transform rate (2-D real transforms of 30x30 planes, ZNN's
    sizes, on the engine's FFT threads) and its fixed cost per forward + backward (a tiny 3-D layer's measured
    step less what the model predicts for its work)."""
    import scipy.fft

    from cct.engines.fft import FFTEngine, _transform_flops
    from cct.engines.fft_plan import fft_workers
    from cct.engines.lowering import LoweringEngine, Workspace
    from cct.runtime.partition import partitions_for

    parts = partitions_for(1 << 10)
    rng = np.random.default_rng(0)
    probes: dict[str, Any] = {}

    def gemm(m: int, k: int, n: int) -> Any:
        def make(_p: int) -> Any:
            a, b = stand_in(rng, (m, k), np.float32), stand_in(rng, (k, n), np.float32)
            c = np.empty((m, n), dtype=np.float32)
            return lambda: np.matmul(a, b, out=c)
        return _concurrent(parts, make)

    big, small = (256, 512, 2048), 16
    probes.update({"gemm": gemm(*big), "gemm m": gemm(small, big[1], big[2]), "gemm k": gemm(big[0], small, big[2]),
                   "gemm n": gemm(big[0], big[1], small)})

    # per partition: 16 images of a 64 -> 64 channel 3x3 layer on 28x28 (lowered matrix 29 MB; a batch of 64's
    # share on 16 partitions, 4 images, measured the steps 1.2-2.9x slower there: other rates, other choices)
    g = ConvGeometry(16, 64, 64, 1, (28, 28), (3, 3), (1, 1), (1, 1), (1, 1))
    x = stand_in(rng, (g.num, g.in_channels) + g.in_shape, np.float32)
    dy = stand_in(rng, (g.num, g.out_channels) + g.out_shape, np.float32)
    cells = g.in_channels * g.kernel_count * g.num * g.out_count  # lowered elements (and col2im's)
    planes = g.out_channels * g.num * g.out_count                  # one output-sized array

    # each partition's steps from two engines, type 1 and type 3 (lifting), sharing the partition's workspace (its
    # steps run one after the other): an engine of its own for each step kept four copies of the lowered matrix
    # and its operands per partition — 3.0 GB at 16 partitions (emulated on 2 cores; 1.7 GB now), a cold
    # cache's peak RSS
    def steps(_p: int) -> dict[str, Any]:
        ws = Workspace()
        one, three = LoweringEngine(1, workspace=ws), LoweringEngine(3, workspace=ws)
        one.configure(g, np.float32)
        three.configure(g, np.float32)
        return {**one.probe(x, dy), "lift": three.probe(x, dy)["lift"]}

    per_part = [steps(p) for p in range(parts)]
    copies = ("lower", "col2im", "lift", "transpose")
    probes.update({name: _concurrent(parts, lambda p, name=name: per_part[p][name]) for name in copies})
    if parts > 1:  # and one partition's alone (a layer of fewer images than partitions: one 3-D volume)
        probes.update({f"{name} alone": per_part[0][name] for name in copies})

    spectra = stand_in(np.random.default_rng(1), (1024, 30, 30), np.float32)
    workers = fft_workers()
    probes["fft"] = lambda: scipy.fft.rfft2(spectra, workers=workers)
    tiny = ConvGeometry(1, 2, 2, 1, (8, 8, 8), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    eng = FFTEngine(lift=False)
    eng.configure(tiny, np.float32)
    tx, tw, tdy = (stand_in(rng, shape, np.float32) for shape in ((1, 2, 8, 8, 8), (2, 2, 3, 3, 3), (1, 2, 6, 6, 6)))
    ty, tdx, tdw = np.empty_like(tdy), np.empty_like(tx), np.zeros_like(tw)

    def fft_step() -> None:
        tx.flat[0] += 0.01  # new operands each step (nothing memoized carries over)
        eng.forward(tx, tw, None, ty)
        eng.backward(tx, tdy, tw, tdx, tdw)
    probes["fft step"] = fft_step

    best = _interleaved_best(probes)
    rate_big = parts * 2.0 * math.prod(big) / best["gemm"]
    m0, k0, n0 = (small * max(0.0, best[f"gemm {axis}"] * big[i] / small / best["gemm"] - 1)
                  for i, axis in enumerate("mkn"))
    peak = rate_big / (big[0] / (big[0] + m0) * big[1] / (big[1] + k0) * big[2] / (big[2] + n0))
    t_rate = parts * planes / best["transpose"]
    lifted = 2.0 * g.kernel_count * planes  # k² slices added (lift) and copied (unlift)
    lift_rate = lifted / max(best["lift"] / parts - planes / t_rate, 1e-9)
    rates = MachineRates(peak, parts * cells / best["lower"], lift_rate, t_rate, max(m0, 1.0), max(k0, 1.0),
                         max(n0, 1.0), parts * cells / best["col2im"],
                         fft_flops=spectra.shape[0] * _transform_flops((30, 30), (30, 30)) / best["fft"],
                         fft_call_s=0.0)
    work = FFTEngine.estimate(tiny, 4, rates)["full"]["seconds"]
    # one partition's copy rate alone over the machine's (each partition's at once): 1 / parts where the copies
    # scale with the cores, more where the memory system is the limit
    share = statistics.median(best[name] / (parts * best[f"{name} alone"]) for name in copies) if parts > 1 else 1.0
    rates = replace(rates, fft_call_s=max(best["fft step"] - work, 1e-4), part_share=min(1.0, share))
    _rates_memo[_rates_key()] = rates
    if save:
        _write_cache({"rates": {_rates_key(): asdict(rates)}})
    return rates


def _largest_buffer(g: ConvGeometry, strategy: int) -> int:
    """Elements per image of a strategy's biggest buffer: the lowered matrix or the GEMM result."""
    c = layer_costs(replace(g, num=1), strategy)
    fwd_rows, fwd_inner, fwd_cols = c.gemm_shapes[0]
    return c.groups * fwd_cols * max(fwd_rows, fwd_inner)


def _measure_engines(engines: dict[Any, ConvEngine], g: ConvGeometry, dtype: Any, rounds: int,
                     settle: float = 0.0, warm: bool = False) -> dict[Any, float]:
    """Best seconds of one training step of ``g`` — forward, then backward (data and weights) — for each
    engine (of the forward alone while choosing for a net that runs no backward:
    :func:`cct.engines.base.choosing_for_forward_only`), every step on operands no earlier step saw (only the FFT
    engine's reuse within a step counts).

    ``settle`` = 0 (engines on the same threads: the lowerings): one warm-up step each (plans, workspaces;
    none when the engines are ``warm`` from an earlier measurement of ``g``), then ``rounds`` rounds
    interleaved so that machine noise hits all alike.  ``settle`` > 0 (engines on different threads: FFT and
    BLAS): each engine in a block of its own — steps until ``settle`` seconds have passed (at least
    ``SETTLE_STEPS``), then ``rounds`` more, the best of all but the first ``SETTLE_STEPS`` counting (a layer of
    a few ms runs dozens in the settling time: the best of those beats the machine's noise where the best of
    ``rounds`` did not — a 16->16 3^3 layer, lowering and FFT within 10%, went either way from run to run) —, so
    that it is timed in its steady state, as in a training loop, and not while the threads of the engine before
    it still spin on the cores (OpenBLAS's spin ~0.1 s after a call), its own pools wake up or the allocator
    adapts to its arrays: a 24->24 3^3 FFT step measured 20 ms interleaved with lowering steps and 13 ms
    steady."""
    rng = np.random.default_rng(0)
    x = stand_in(rng, (g.num, g.in_channels) + g.in_shape, dtype)
    w = stand_in(rng, (g.out_channels, g.in_channels // g.group) + g.kernel, dtype, 0.2)
    dy = stand_in(rng, (g.num, g.out_channels) + g.out_shape, dtype)
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)
    first = [float(a.flat[0]) for a in (x, w, dy)]
    steps, backward = [0], not forward_only()

    def step(eng: ConvEngine) -> float:
        # as in training, each step's input, weights and output gradient differ from every earlier step's (so
        # no memoized transform carries over) — changed in place: dropping the FFT engine's memo instead frees
        # its spectra before the step, which training does not do
        steps[0] += 1
        for a, v in zip((x, w, dy), first):
            a.flat[0] = v + 0.01 * steps[0]
        t = time.perf_counter()
        eng.forward(x, w, None, y)
        if backward:
            eng.backward(x, dy, w, dx, dw)
        return time.perf_counter() - t

    for eng in engines.values():
        eng.configure(g, dtype)
    if settle:
        best = {}
        for name, eng in engines.items():
            start, steps_run, fastest = time.perf_counter(), 0, float("inf")
            while steps_run < SETTLE_STEPS or time.perf_counter() - start < settle:
                t = step(eng)
                steps_run += 1
                if steps_run > SETTLE_STEPS:  # past the first steps, a settling step counts too
                    fastest = min(fastest, t)
            best[name] = min([fastest] + [step(eng) for _ in range(rounds)])
        return best
    if not warm:
        for eng in engines.values():
            step(eng)
    best = {name: float("inf") for name in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            best[name] = min(best[name], step(eng))
    return best


def autotune(g: ConvGeometry, dtype: Any = np.float32, candidates: Any = None,
             images: int | None = None) -> dict[int, float] | None:
    """Seconds per image of forward + backward (data and weights) of each applicable strategy (or of
    ``candidates``) on ``g``, measured with the layer's partitions on ``images`` images per partition
    (default: enough for ``AUTOTUNE_COLUMNS`` GEMM columns and for buffers of ``AUTOTUNE_BYTES`` in all —
    out of the caches, as the full layer's — at most the largest of the lowerings' chunks of a partition:
    what the layer runs at a time), strategies interleaved, the best of ``AUTOTUNE_ROUNDS`` after a warm-up
    (one round in a net's fast measurement), those within ``LOWERING_RECHECK_WINDOW`` of the fastest measured
    as often again in the other order, each keeping its best, then those within ``LOWERING_WHOLE_WINDOW`` on the
    whole batch where that takes at most ``LOWERING_WHOLE_SECONDS`` (their times from it); cached per geometry,
    dtype and thread setting.  Of the forward alone while choosing for a net that runs no backward
    (:func:`cct.engines.base.choosing_for_forward_only`; cached apart)."""
    from cct.engines.lowering import strategy_fallback

    wanted = [s for s in (candidates or (1, 2, 3)) if strategy_fallback(s, g) is None]
    key = lowering_key(g, dtype)
    cached = _read_cache().get("autotune", {}).get(key) or {}
    if all(str(s) in cached for s in wanted):
        return {s: float(cached[str(s)]) for s in wanted}
    if _put_off() or not _may_measure():
        return None
    with _charged():
        result = _autotune_lowerings(g, dtype, wanted, images)
    _write_cache({"autotune": {key: {**cached, **{str(s): t for s, t in result.items()}}}})
    _record_model_error(g, dtype, 1, {f"lowering {s}": t * g.num for s, t in result.items()})
    return result


def _autotune_lowerings(g: ConvGeometry, dtype: Any, wanted: list[int], images: int | None) -> dict[int, float]:
    from cct.engines.lowering import LoweringEngine, Workspace

    engines = {s: LoweringEngine(s, workspace=Workspace()) for s in wanted}
    for eng in engines.values():
        eng.configure(g, dtype)
    itemsize = np.dtype(dtype).itemsize
    # the largest of the lowerings' chunks: each runs the measured images in its own chunks, as in the layer
    # (type 1's chunk alone, 2 images of CaffeNet's conv4, measured too few for type 2's images-innermost GEMMs)
    parts = engines[wanted[0]].batch_partitions()
    per_part = max(eng.chunk_images() for eng in engines.values())
    if images is None:
        per_image = max(_largest_buffer(g, s) for s in wanted) * itemsize
        images = max(-(-AUTOTUNE_COLUMNS // max(1, g.out_count)),
                     -(-AUTOTUNE_BYTES // (parts * max(1, per_image))))
    k = max(1, min(per_part, images))
    n = min(g.num, k * parts)
    rounds = _effort().lowering_rounds
    best = _measure_engines(engines, replace(g, num=n), dtype, rounds)
    fastest = min(best.values())
    close = [s for s in reversed(wanted) if best[s] <= LOWERING_RECHECK_WINDOW * fastest]
    if len(close) > 1:
        again = _measure_engines({s: engines[s] for s in close}, replace(g, num=n), dtype, rounds, warm=True)
        best.update({s: min(best[s], t) for s, t in again.items()})
    per_image = {s: t / n for s, t in best.items()}
    fastest = min(per_image.values())
    whole = [s for s in wanted if per_image[s] <= LOWERING_WHOLE_WINDOW * fastest]
    if n < g.num and len(whole) > 1 and \
            sum(per_image[s] for s in whole) * g.num * (rounds + 1) <= LOWERING_WHOLE_SECONDS:
        on_all = _measure_engines({s: engines[s] for s in reversed(whole)}, g, dtype, rounds)
        per_image.update({s: t / g.num for s, t in on_all.items()})
    return per_image


def autotune_conv_engine(g: ConvGeometry, dtype: Any = np.float32, strategy: int = 1,
                         predicted: float | None = None, fft: bool = True,
                         winograd: bool = False) -> dict[str, float] | None:
    """Seconds of one forward + backward (data and weights) — of the forward alone while choosing for a net that
    runs no backward (cached apart) — of the whole layer ``g`` with the lowering engine
    (lowering ``strategy``, type 1 where it does not apply), with the FFT engine (``fft``) in its layouts whose
    predictions are within ``FFT_LAYOUT_WINDOW`` of each other (else the predicted one) and with the Winograd
    engine (``winograd``) in both tile sizes: ``{"lowering": s, "fft full": s, "fft lifted": s, "winograd 4": s,
    "winograd 2": s}``.

    Measured as a training loop runs them (:func:`_measure_engines`: every operand new each step, each engine
    timed in its steady state after ``ENGINE_SETTLE_SECONDS`` of untimed steps — the FFT and BLAS thread pools
    hand the cores over, the allocator adapts —, the best of ``ENGINE_AUTOTUNE_ROUNDS`` steps).  A layer
    ``predicted`` (seconds) to take longer than ``ENGINE_AUTOTUNE_SECONDS`` is measured on fewer images (as many
    in each of the layer's batch partitions, one at least) and scaled to the batch — the FFT engine's kernel
    transforms, done once per batch, then count for more than in the layer, and a few images' spectra stay in
    the caches where the batch's do not —, and on a quarter of those images, which tells the once-per-call part
    of a step (:func:`_once_per_call_estimate`); a lowering engine beaten there is measured once more; the
    candidates that may be within ``FULL_BATCH_WINDOW`` of the fastest are then measured again, in the other
    order, on the whole batch when that is predicted to take at most ``FULL_BATCH_SECONDS`` (that measurement
    decides; on a layer measured whole the first time, the better of the two counts).  Cached per geometry,
    dtype, thread setting, lowering and candidate set; None when nothing is cached and the net's measuring
    budget is spent."""
    from cct.engines.lowering import strategy_fallback

    strategy = strategy if strategy_fallback(strategy, g) is None else 1
    key = f"{geometry_key(g, dtype)}-lowering{strategy}" + ("" if fft else "-nofft") \
        + ("-winograd" if winograd else "") + f"-v{ENGINE_MEASURE_VERSION}{_passes_key()}"
    cached = _read_cache().get("conv_engine", {}).get(key)
    if cached and "lowering" in cached and (not fft or any(k.startswith("fft ") for k in cached)) \
            and (not winograd or any(k.startswith("winograd ") for k in cached)):
        return {k: float(t) for k, t in cached.items()}
    if _put_off() or not _may_measure():
        return None
    with _charged():
        result = _measure_conv_engines(g, dtype, strategy, predicted, fft, winograd)
    _write_cache({"conv_engine": {key: result}})
    return result


def _fastest_within(scaled: dict[str, float], seconds: float,
                    optimistic: dict[str, float] | None = None) -> list[str]:
    """The candidates that may be the fastest on the whole batch — ``optimistic`` estimate (default: the
    ``scaled`` one) within ``FULL_BATCH_WINDOW`` of the fastest ``scaled`` one —, by optimistic time, as many as
    take at most ``seconds`` together (all of them: a layer's steps measured again on the whole batch): on part of
    the batch an engine's once-per-call work counts for more than in the layer (the Winograd and FFT engines'
    kernel transforms) and its chunks hold fewer images — CaffeNet's conv3 measured on 16 of its 64 images:
    F(4x4,3x3) 1.3x slower than F(2x2,3x3); on all 64 3% faster, in the net 8% (AVX2 kernels) —, so the closest
    candidates are the ones to measure again when not all of them fit."""
    optimistic = optimistic or scaled
    fastest = min(scaled.values())
    close = sorted((optimistic[name], name) for name in scaled if optimistic[name] <= FULL_BATCH_WINDOW * fastest)
    picked: list[str] = []
    total = 0.0
    for t, name in close:
        total += t
        if total > seconds:
            break
        picked.append(name)
    return picked


def _once_per_call_estimate(at_n: dict[str, float], at_m: dict[str, float], n: int, m: int,
                            whole: int) -> dict[str, float]:
    """Whole-batch seconds of each candidate if its step is a fixed part plus a part per image — the line through
    its times at ``m`` and ``n`` images (at most ``n``'s time scaled, at least ``n``'s own): what a step with
    once-per-call work (the FFT engine's kernel transforms) takes on the batch, where scaling the few images'
    time by the batch multiplies that work too (CaffeNet's conv2, the FFT's full layout: 84 ms on 8 images,
    109 on 16, 284 on 64 — 668 scaled from 8). An optimistic estimate (a cache-bound step grows faster than
    the line): it only decides which candidates are measured again on the whole batch."""
    out = {}
    for name, t in at_n.items():
        per_image = max(0.0, (t - at_m[name]) / (n - m))
        out[name] = min(t * whole / n, max(t, t + per_image * (whole - n)))
    return out


def _measure_conv_engines(g: ConvGeometry, dtype: Any, strategy: int, predicted: float | None, fft: bool = True,
                          winograd: bool = False) -> dict[str, float]:
    from cct.engines.fft import FFTEngine
    from cct.engines.lowering import LoweringEngine, Workspace
    from cct.engines.winograd import TILES, WinogradEngine

    if predicted is None:
        rates = machine_rates()
        lowering = {e.variant: e.chosen_seconds for e in LoweringEngine.estimates(g, dtype, rates)}
        predicted = lowering[f"lowering {strategy}"]
        if fft:
            predicted = max(predicted, min(e.chosen_seconds for e in FFTEngine.estimates(g, dtype, rates)))
    effort = _effort()
    engines: dict[str, ConvEngine] = {"lowering": LoweringEngine(strategy, workspace=Workspace())}
    if fft:
        est = FFTEngine.estimate(g, np.dtype(dtype).itemsize, machine_rates())  # the layouts' own model
        layouts = [k for k in ("full", "lifted") if k in est]
        if len(layouts) == 2 and max(est[k]["seconds"] for k in layouts) > FFT_LAYOUT_WINDOW * min(
                est[k]["seconds"] for k in layouts):
            layouts = [est["choice"]]  # a clear call: only the predicted layout
        engines.update({f"fft {k}": FFTEngine(lift=k == "lifted") for k in layouts})
    if winograd:
        engines.update({f"winograd {m}": WinogradEngine(m, workspace=Workspace()) for m in TILES})
    # part of the batch, but at least an image for each of the layer's batch partitions (and as many as a chunk of
    # Winograd's tiles holds: ConvEngine.representative_images): on fewer the engines run otherwise than in the
    # layer (VGG16's conv3_2 at 8 images, measured on one: lowering 838 ms, F(4x4,3x3) 1181 scaled to the batch,
    # where on all 8 in two partitions they took 737 and 537)
    parts = least = 1
    for eng in engines.values():
        eng.configure(g, dtype)
        parts = max(parts, eng.batch_partitions())
        least = max(least, eng.representative_images())
    least = min(g.num, -(-least // parts) * parts)
    n = max(least, min(g.num, int(g.num * effort.engine_seconds / max(predicted, 1e-9))))
    n -= n % parts if n < g.num else 0  # every partition as many images (3 in two: the step takes the 2's time)
    if 2 * n > g.num:  # most of the batch: the whole of it costs less than part, a quarter and the whole again
        n = g.num  # (ResNet-50's 14x14 3x3 layers at 16 images: 15 images, 3 and 16 took 3.3 + 1.8 + 3.4 s)
    best = _measure_engines(engines, replace(g, num=n), dtype, effort.engine_rounds, settle=ENGINE_SETTLE_SECONDS)
    scaled = {name: t * g.num / n for name, t in best.items()}
    optimistic = dict(scaled)
    m = max(parts, n // 4 - n // 4 % parts)
    if m < n < g.num and len(engines) > 1:  # how much of a step is once per call: its time on fewer images
        fewer = _measure_engines(engines, replace(g, num=m), dtype, effort.engine_rounds, settle=ENGINE_SETTLE_SECONDS)
        optimistic = _once_per_call_estimate(best, fewer, n, m, g.num)
    if min(scaled, key=scaled.__getitem__) != "lowering":
        # the lowering engine is what another must beat, by a margin (cct.engines.choice): one spike in its single
        # measurement would hand the layer over (CaffeNet's conv4 at 64 images measured 288 ms once against 204 ms
        # in other runs, and went to the FFT), so it is measured once more and keeps its better time — noise
        # only adds time —, before the candidates for the whole batch are picked: measured after them, it left
        # out the one to beat it (CaffeNet's conv2 on 6 of 64 images: the FFT's full layout 811 ms scaled, 366 by
        # the line through 1 and 6 images, the lowering 939 then 608 — the FFT, the fastest on part of the batch,
        # was not measured on the whole batch, where it ran 402 against the lowering's 475 in another run)
        third = _measure_engines({"lowering": engines["lowering"]}, replace(g, num=n), dtype, effort.engine_rounds,
                                 settle=ENGINE_SETTLE_SECONDS)
        scaled["lowering"] = min(scaled["lowering"], third["lowering"] * g.num / n)
        optimistic["lowering"] = min(optimistic["lowering"], scaled["lowering"])
    close = _fastest_within(scaled, FULL_BATCH_SECONDS / (effort.engine_rounds + SETTLE_STEPS), optimistic)
    # measured again on the whole batch: a close call, or a candidate the estimates put ahead of the fastest on
    # part of the batch (a step with once-per-call work: its whole-batch time is what decides)
    again_whole = len(close) > 1 or (len(close) == 1 and close[0] != min(scaled, key=scaled.__getitem__))
    if again_whole:
        # a close call is measured again on the whole batch, the engines in the other order (drift hits both).
        # Measured on part of the batch, the whole batch decides (cache-resident spectra and tiles of a few
        # images flatter the FFT engine: CaffeNet's conv2 took 0.83x lowering's time per image at 21 images
        # and 1.15x at 64); on the whole batch both times count, the better one kept — noise only adds time
        # (a 24->24 3^3 FFT step measured 15.7 ms in one block and 12.4 ms in all later runs)
        again = dict(reversed([(name, engines[name]) for name in close]))
        second = _measure_engines(again, g, dtype, effort.engine_rounds, settle=ENGINE_SETTLE_SECONDS)
        scaled.update(second if n < g.num else {name: min(scaled[name], t) for name, t in second.items()})
    _record_model_error(g, dtype, strategy, {name: scaled[name] for name in (
        engines if n == g.num else close if again_whole else ())})
    return scaled


def _model_error_versions() -> str:
    """The end of a model-error key: the versions of the measurement and of the rates the predictions were made
    with (after the geometry key, which ends with the thread setting)."""
    return f"-v{ENGINE_MEASURE_VERSION}-r{RATES_VERSION}"


def _model_error_key(g: ConvGeometry, dtype: Any) -> str:
    return geometry_key(g, dtype) + _model_error_versions()


def _record_model_error(g: ConvGeometry, dtype: Any, strategy: int, measured: dict[str, float]) -> None:
    """Keep measured / predicted seconds of each of ``measured`` on ``g``: whole-batch times of the lowering engine
    at ``strategy`` ("lowering"), of the FFT engine's layouts ("fft full", "fft lifted") and of the Winograd
    engine's tiles ("winograd 2", "winograd 4"), or each lowering's time per image scaled to the batch
    ("lowering 1".."lowering 3": the lowerings' measurement, one chunk of the layer).  Merged into the layer's
    entry."""
    from cct.engines.fft import FFTEngine
    from cct.engines.lowering import LoweringEngine
    from cct.engines.winograd import WinogradEngine

    rates = machine_rates()
    if rates is DEFAULT_RATES or forward_only():  # not calibrated here: an error against the defaults says nothing
        return  # of the model; the errors kept are of training steps (a forward's would be another model's)
    predicted = {e.variant: e.seconds for e in FFTEngine.estimates(g, dtype, rates)}
    predicted.update({e.variant: e.seconds for e in LoweringEngine.estimates(g, dtype, rates)})
    predicted.update({e.variant: e.seconds for e in WinogradEngine.estimates(g, dtype, rates)})
    predicted["lowering"] = predicted.get(f"lowering {strategy}", 0.0)
    ratios = {name: t / predicted[name] for name, t in measured.items() if predicted.get(name, 0) > 0}
    if ratios:
        key = _model_error_key(g, dtype)
        _write_cache({"model_error": {key: {**_read_cache().get("model_error", {}).get(key, {}), **ratios}}})


def model_errors() -> dict[str, float]:
    """How far each model (``"lowering"``, ``"fft full"``, ``"fft lifted"``, ``"winograd 2"``, ``"winograd 4"``;
    ``"lowering 1"``..``"3"``) errs on this machine and thread setting: the median of measured / predicted seconds
    over the layers measured (:func:`_record_model_error`, kept in the cache) — ``MODEL_ERROR_MIN_LAYERS`` at least,
    a missing one counting as 1 —, within ``MODEL_ERROR_RANGE``; absent where none was measured (one read of the
    cache for all of them)."""
    suffix = f"-{_threads_key()}{_model_error_versions()}"  # this machine's thread setting, these versions
    ratios: dict[str, list[float]] = {}
    for key, entry in _read_cache().get("model_error", {}).items():
        if key.endswith(suffix):
            for name, ratio in entry.items():
                ratios.setdefault(name, []).append(float(ratio))
    lo, hi = MODEL_ERROR_RANGE
    return {name: min(hi, max(lo, statistics.median(values + [1.0] * (MODEL_ERROR_MIN_LAYERS - len(values)))))
            for name, values in ratios.items()}
