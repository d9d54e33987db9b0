"""The throughput planner (ZNNi §VI-A): under a memory budget, choose how each pooling layer runs (MPF or plain
pooling), the patch size (only valid sizes), the batch and each convolution's primitive.

**Search.**  For every choice of MPF / plain pooling per pooling layer (``2^L``) and batch ``S ∈ {1, 2, 4, 8}``:

1. the largest final fragment size ``J`` (per axis, at most what the volume needs) whose run fits the budget
   with each layer's least-memory primitive — memory grows with ``J``, so a bisection finds it;
2. for that ``J`` and the dozen below it (and the smallest ``J`` of every tile count, for small volumes):
   each convolution takes the primitive predicted fastest among those whose layer fits the budget
   (:func:`cct.engines.estimate_convolution`, the engines' cost contract, on this machine's calibrated
   rates, times a per-primitive factor: the engines' models are fitted to training steps, and a forward
   alone runs faster (lowering) or slower (FFT, whose kernel transforms a training step shares between its
   passes) than their forward share — :func:`forward_factors` measures the factors once per machine on three
   probe layers and caches them; memory from :mod:`cct.inference.memory`); the other layers cost their memory
   traffic at a measured streaming rate;
3. predicted throughput = valid output voxels / (forward runs · seconds per run + reading and writing).

The best predicted candidate wins (``plan="auto"``); ``plan="measure"`` runs the ``MEASURE_TOP`` best once each
on random data (after a warm-up) and takes the fastest measured.  A budget too small for any valid run is a
one-line CctError naming the layer that needs the most and the budget that would do.

**Memory of a plan** = the run's peak (:func:`cct.inference.memory.run_memory`) + the weights + what the tiling
holds: the fragments written into a dense tile (the run's output and up to two tiles), the read block of one
patch in the source's dtype, and HDF5's chunk caches.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cct import log
from cct.engines import ConvGeometry, Estimate, estimate_convolution
from cct.errors import CctError
from cct.inference.fov import MPF_TYPE, BlobShape, NetSpec, cube, dims, pool_kernel
from cct.inference.memory import conv_geometry, conv_memory, format_bytes, layer_scratch, live_bytes
from cct.inference.runner import PRIMITIVES

__all__ = ["Plan", "plan_inference", "BATCHES", "MEASURE_TOP"]

BATCHES = (1, 2, 4, 8)
MEASURE_TOP = 5
NEAR_LIMIT = 8             # patch sizes evaluated below the largest that fits ...
REFINE = 3                 # ... for this many of the best (pooling, batch) configurations
HDF5_CACHE_BYTES = 2 << 20  # h5py's chunk caches (input and output datasets, 1 MiB each)
ENGINES = {"auto": PRIMITIVES, "lowering": tuple(p for p in PRIMITIVES if p.startswith("lowering")),
           "fft": tuple(p for p in PRIMITIVES if p.startswith("fft"))}
# memory passes (reads + writes of the top's size) of the layers that are not convolutions
_PASSES = {"ReLU": 2, "Dropout": 0, "Split": 0, "Concat": 2, "Crop": 2, "Eltwise": 3, "BatchNorm": 2, "Scale": 3,
           "Bias": 3, "Softmax": 8, "Pooling": 4}


@dataclass
class Plan:
    """One way to run the volume: pooling as MPF where ``mpf`` says, ``batch`` inputs of ``run_input`` per
    forward run, each giving final fragments ``out_size`` (``J``) and a dense tile ``tile`` (``P·J``) per input
    (``shifts`` runs per tile with plain pooling), each convolution with ``primitives[name]``.  Predictions:
    ``seconds`` per run, ``memory`` bytes at peak (at layer ``memory_at``), ``throughput`` voxels/s."""

    mpf: tuple[bool, ...]
    batch: int
    out_size: tuple[int, ...]
    run_input: tuple[int, ...]
    tile: tuple[int, ...]
    shifts: int
    primitives: dict[str, str]
    seconds: float
    io_seconds: float
    runs: int
    tiles: int
    voxels: int
    memory: int
    memory_at: str
    layer_rows: list[tuple[str, str]] = field(default_factory=list)
    measured_seconds: float | None = None

    @property
    def total_seconds(self) -> float:
        return self.runs * self.seconds + self.io_seconds

    @property
    def throughput(self) -> float:
        """Predicted output voxels per second over the whole volume."""
        return self.voxels / max(self.total_seconds, 1e-12)

    @property
    def measured_throughput(self) -> float | None:
        if self.measured_seconds is None:
            return None
        return self.voxels / max(self.runs * self.measured_seconds + self.io_seconds, 1e-12)

    def key(self) -> tuple[Any, ...]:
        return (self.mpf, self.batch, self.out_size, tuple(sorted(self.primitives.items())))


FACTORS_CACHE = "inference.json"
# probe layers of forward_factors: a first layer on a large patch, a middle layer on fragments, a deep one
_PROBES = (ConvGeometry(1, 1, 16, 1, (48, 48, 48), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1)),
           ConvGeometry(8, 16, 16, 1, (24, 24, 24), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1)),
           ConvGeometry(64, 16, 16, 1, (12, 12, 12), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1)))


def forward_factors(rates: Any, measure: bool = True) -> dict[str, float]:
    """Per primitive, measured forward seconds over the cost contract's ``forward_seconds`` (geometric mean over
    ``_PROBES``, each the best of two runs after a warm-up): measured once per machine and core count, cached
    in ``FACTORS_CACHE``; 1.0 for all when not cached and ``measure`` is False."""
    from cct.cache import read_json, update_json
    from cct.inference.runner import conv_engine
    from cct.runtime.partition import cpu_cores

    key = f"cores{cpu_cores()}"
    cached = read_json(FACTORS_CACHE).get("forward_factors", {}).get(key)
    if cached and all(p in cached for p in PRIMITIVES):
        return {p: float(cached[p]) for p in PRIMITIVES}
    if not measure:
        return {p: 1.0 for p in PRIMITIVES}
    rng = np.random.default_rng(0)
    logs: dict[str, list[float]] = {p: [] for p in PRIMITIVES}
    for g in _PROBES:
        est = estimate_convolution(g, "float32", rates=rates)
        x = rng.random((g.num, g.in_channels) + g.in_shape, dtype=np.float32)
        w = rng.random((g.out_channels, g.in_channels) + g.kernel, dtype=np.float32)
        y = np.empty((g.num, g.out_channels) + g.out_shape, np.float32)
        for p in PRIMITIVES:
            if p not in est:
                continue
            eng = conv_engine(p)
            eng.configure(g, np.float32)
            eng.forward(x, w, None, y)
            best = math.inf
            for _ in range(2):
                t = time.perf_counter()
                eng.forward(x, w, None, y)
                best = min(best, time.perf_counter() - t)
            logs[p].append(math.log(best / max(est[p].forward_seconds, 1e-9)))
    factors = {p: math.exp(sum(v) / len(v)) if v else 1.0 for p, v in logs.items()}
    update_json(FACTORS_CACHE, {"forward_factors": {key: factors}})
    return factors


@dataclass
class _Context:
    spec: NetSpec
    out_shape: tuple[int, ...]
    budget: int
    fixed: int
    engines: tuple[str, ...]
    rates: Any
    src_itemsize: int
    stream: float
    factors: dict[str, float] = field(default_factory=dict)
    estimates: dict[ConvGeometry, dict[str, Estimate]] = field(default_factory=dict)
    scratch: dict[tuple[str, ConvGeometry], int] = field(default_factory=dict)
    rewritten: dict[tuple[bool, ...], list[Any]] = field(default_factory=dict)
    usable: dict[tuple[Any, ...], list[str]] = field(default_factory=dict)

    def estimate(self, g: ConvGeometry) -> dict[str, Estimate]:
        e = self.estimates.get(g)
        if e is None:
            e = self.estimates[g] = {k: replace(v, forward_seconds=v.forward_seconds * self.factors.get(k, 1.0))
                                     for k, v in estimate_convolution(g, "float32", rates=self.rates).items()
                                     if k in self.engines}
        return e

    def layers(self, mpf: tuple[bool, ...]) -> list[Any]:
        """The rewritten layers (the Input excluded) for ``mpf`` — their names, types and blobs only."""
        got = self.rewritten.get(mpf)
        if got is None:
            got = self.rewritten[mpf] = self.spec.rewrite(mpf, 1, self.spec.fov)[1:]
        return got

    def applicable(self, g: ConvGeometry) -> list[str]:
        """The allowed primitives that can run ``g`` (without pricing them; it depends on the kernel only)."""
        from cct.engines.fft import FFTEngine
        from cct.engines.lowering import strategy_fallback

        key = (g.kernel, g.stride, g.num_spatial_axes)
        got = self.usable.get(key)
        if got is not None:
            return got
        out = self.usable[key] = []
        for v in self.engines:
            family, _, kind = v.partition(" ")
            if family == "lowering" and strategy_fallback(int(kind), g) is None:
                out.append(v)
            elif family == "fft" and FFTEngine.supports(g)[0] and (kind == "full" or g.num_spatial_axes > 1):
                out.append(v)
        return out

    def conv_scratch(self, primitive: str, g: ConvGeometry) -> int:
        key = (primitive, g)
        v = self.scratch.get(key)
        if v is None:
            v = self.scratch[key] = conv_memory(primitive, g)
        return v


def stream_rate() -> float:
    """Bytes per second of a large element-wise numpy operation on this machine (read + write counted)."""
    global _STREAM
    if _STREAM is None:
        a = np.ones(1 << 22, dtype=np.float32)
        b = np.empty_like(a)
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            np.maximum(a, 0, out=b)
            best = min(best, time.perf_counter() - t)
        _STREAM = 2 * a.nbytes / max(best, 1e-9)
    return _STREAM


_STREAM: float | None = None


def _tile_bytes(spec: NetSpec, plan_tile: Sequence[int], shifts: int) -> int:
    tile = 4 * spec.out_channels * math.prod(plan_tile)
    return tile * (3 if shifts > 1 else 2)  # tiles being filled (a carried partial one) and the written copy


def _evaluate(ctx: _Context, mpf: tuple[bool, ...], batch: int, J: tuple[int, ...], fastest: bool,
              limit: float | None = None) -> Plan | None:
    """The plan for one configuration: per convolution the fastest primitive (``fastest``) or the least-memory
    one whose layer fits ``limit`` (default: the budget); None when some layer fits with none."""
    spec = ctx.spec
    limit = ctx.budget if limit is None else limit
    n = spec.run_input(mpf, J)
    try:
        shapes = spec.shapes(mpf, batch, n)
    except CctError:
        return None
    params = ctx.layers(mpf)
    shifts = len(spec.shifts(mpf))
    P = spec.pooling
    tile = tuple(p * j for p, j in zip(P, J))
    out = shapes[spec.output_blob]
    tiles_in_flight = _tile_bytes(spec, tile, shifts)
    read = ctx.src_itemsize * spec.in_channels * math.prod(n)
    fixed = ctx.fixed + (tiles_in_flight if shifts > 1 else 0)
    held = sum(layer_scratch(lp, shapes, None)[1] for lp in params if lp.type != "Convolution")
    peak, at = 0, ""
    primitives: dict[str, str] = {}
    seconds = 0.0
    rows: list[tuple[str, str]] = []
    for lp, base in zip(params, live_bytes(spec, params, shapes)):
        if lp.type == "Convolution":
            g = conv_geometry(lp, shapes[lp.bottom[0]])
            need = {v: ctx.conv_scratch(v, g) for v in ctx.applicable(g)}
            fits = [v for v in need if fixed + held + base + need[v] <= limit]
            if not fits:
                return None
            if fastest:
                est = ctx.estimate(g)
                choice = min((v for v in fits if v in est), key=lambda v: est[v].forward_seconds)
                layer_s = est[choice].forward_seconds
            else:
                choice, layer_s = min(fits, key=need.__getitem__), 0.0
            primitives[lp.name] = choice
            scratch = need[choice]
            seconds += layer_s
            x = shapes[lp.bottom[0]]
            rows.append((lp.name, f"{lp.name} ({g.in_channels}->{g.out_channels}, {cube(g.kernel)}, in "
                                  f"{cube(x.spatial)} x{x.batch}): {choice} {format_bytes(scratch)} "
                                  f"{layer_s:.3g} s"))
        else:
            scratch = layer_scratch(lp, shapes, None)[0]
            seconds += _layer_seconds(lp, shapes, ctx.stream)
            if lp.type in (MPF_TYPE, "Pooling"):
                x, y = shapes[lp.bottom[0]], shapes[lp.top[0]]
                kind = "mpf" if lp.type == MPF_TYPE else "pool"
                rows.append((lp.name, f"{lp.name}: {kind} {cube(pool_kernel(lp, len(x.spatial)))} (batch "
                                      f"{x.batch} -> {y.batch})"))
        total = fixed + held + base + scratch
        if total > peak:
            peak, at = total, lp.name
    # after the run: the output, the tiles being filled and the written copy; before it: the patch being read
    peak = max(peak, ctx.fixed + held + 4 * out.count + tiles_in_flight,
               fixed + held + 4 * shapes[spec.input_blob].count + read)
    if peak > limit:
        return None
    items = math.prod(-(-o // t) for o, t in zip(ctx.out_shape, tile))
    runs = -(-items * shifts // batch)
    voxels = math.prod(ctx.out_shape)
    io = (items * shifts * read + 2 * 4 * voxels * spec.out_channels) / ctx.stream
    return Plan(mpf, batch, J, n, tile, shifts, primitives, seconds, io, runs, items, voxels, int(peak), at, rows)


def _layer_seconds(lp: Any, shapes: Mapping[str, BlobShape], stream: float) -> float:
    """Memory-traffic time of a layer that is not a convolution."""
    y = shapes[lp.top[0]]
    if lp.type == MPF_TYPE:
        x = shapes[lp.bottom[0]]
        return 4 * x.count * (2 * len(x.spatial) + 1) / stream
    passes = _PASSES.get(lp.type, 3)
    return passes * 4 * y.count / stream


def _largest_fitting(ctx: _Context, mpf: tuple[bool, ...], batch: int, jmax: Sequence[int]) -> int:
    """The largest isotropic ``J`` (clipped per axis to ``jmax``) whose run fits with least-memory primitives."""
    def fits(j: int) -> bool:
        return _evaluate(ctx, mpf, batch, _clip(j, jmax), fastest=False) is not None
    hi = max(jmax)
    if fits(hi):
        return hi
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _clip(j: int, jmax: Sequence[int]) -> tuple[int, ...]:
    return tuple(max(1, min(j, m)) for m in jmax)


def candidates(spec: NetSpec, out_shape: Sequence[int], budget: int, engine: str = "auto",
               batches: Sequence[int] = BATCHES, mpf_choices: Sequence[tuple[bool, ...]] | None = None,
               weights_bytes: int = 0, src_itemsize: int = 4, rates: Any = None,
               factors: Mapping[str, float] | None = None) -> tuple[list[Plan], _Context]:
    """Every plan the search considers (see the module docstring), best predicted first.  ``rates`` None: this
    machine's calibrated rates and :func:`forward_factors` (measured if not cached); given ``rates``: those,
    with ``factors`` (default: the cached ones, else 1)."""
    if engine not in ENGINES:
        raise CctError(f"-engine {engine}: expected auto, lowering or fft")
    if rates is None:
        rates = _machine_rates()
        if factors is None:
            factors = forward_factors(rates)
    if factors is None:
        factors = forward_factors(rates, measure=False)
    out_shape = tuple(int(v) for v in out_shape)
    ctx = _Context(spec, out_shape, int(budget), int(weights_bytes) + HDF5_CACHE_BYTES, ENGINES[engine], rates,
                   src_itemsize, stream_rate(), dict(factors))
    P = spec.pooling
    jmax = tuple(-(-o // p) for o, p in zip(out_shape, P))
    if mpf_choices is None:
        mpf_choices = list(itertools.product((True, False), repeat=len(spec.pools)))
    plans: dict[tuple[Any, ...], Plan] = {}
    screened: list[tuple[float, tuple[bool, ...], int, int]] = []
    for mpf in mpf_choices:
        items = math.prod(-(-o // p) for o, p in zip(out_shape, P)) * len(spec.shifts(mpf))
        for batch in batches:
            if batch > 1 and batch > items:
                continue
            top = _largest_fitting(ctx, tuple(mpf), batch, jmax)
            plan = _evaluate(ctx, tuple(mpf), batch, _clip(top, jmax), fastest=True) if top else None
            if plan is not None:
                plans.setdefault(plan.key(), plan)
                screened.append((plan.throughput, tuple(mpf), batch, top))
    # refine the most promising configurations over the patch sizes just below their largest
    for _, mpf, batch, top in sorted(screened, reverse=True)[:REFINE]:
        js = set(range(max(1, top - NEAR_LIMIT + 1), top))
        for t in range(1, max(jmax) + 1):  # the smallest J giving each tile count
            j = max(-(-m // t) for m in jmax)
            if j < top:
                js.add(j)
        for j in sorted(js):
            plan = _evaluate(ctx, mpf, batch, _clip(j, jmax), fastest=True)
            if plan is not None:
                plans.setdefault(plan.key(), plan)
    return sorted(plans.values(), key=lambda p: -p.throughput), ctx


def _machine_rates() -> Any:
    from cct.engines.autotune import machine_rates

    return machine_rates(calibrate_if_missing=True)


def plan_inference(spec: NetSpec, out_shape: Sequence[int], budget: int, engine: str = "auto",
                   mode: str = "auto", measure: Callable[[Plan], float] | None = None, weights_bytes: int = 0,
                   src_itemsize: int = 4, rates: Any = None, batches: Sequence[int] = BATCHES,
                   report: Callable[[str], None] | None = None, factors: Mapping[str, float] | None = None) -> Plan:
    """The plan for a dense output of ``out_shape`` under ``budget`` bytes (see the module docstring);
    ``mode`` ``"auto"`` (predicted) or ``"measure"`` (``measure(plan)`` → seconds per run, for the
    ``MEASURE_TOP`` best predicted).  ``report`` receives the planner's lines (default: the log)."""
    if mode not in ("auto", "measure"):
        raise CctError(f"-plan {mode}: expected auto or measure")
    say = report or (lambda line: log.info("%s", line))
    plans, ctx = candidates(spec, out_shape, budget, engine, batches, weights_bytes=weights_bytes,
                            src_itemsize=src_itemsize, rates=rates, factors=factors)
    if not plans:
        raise _too_small(spec, budget, ctx)
    best = plans[0]
    shown = plans[:MEASURE_TOP]
    if mode == "measure":
        if measure is None:
            raise CctError("-plan measure needs a way to run candidates")
        for p in shown:
            p.measured_seconds = measure(p)
        best = max(shown, key=lambda p: p.measured_throughput or 0.0)
    nm = sum(best.mpf)
    frag = spec.fragments(best.mpf)
    pools = f"{len(spec.pools)} pooling -> " + (f"MPF x{frag}" if nm == len(spec.pools) else
                                               f"MPF x{frag} ({nm} of {len(spec.pools)}), {best.shifts} shifts")
    say(f"planner: net {spec.name}, FOV {dims(spec.fov)}, {pools if spec.pools else 'no pooling'}, batch "
        f"{best.batch}, budget {format_bytes(budget)}")
    for p in shown:
        measured = "" if p.measured_seconds is None else \
            f", measured {p.measured_seconds:.3g} s ({p.measured_throughput:,.0f} vox/s)"
        say(f"candidate input {cube(p.run_input)} -> output {cube(p.tile)}{_describe_mode(spec, p)}: "
            f"{p.seconds:.3g} s, {p.throughput:,.0f} vox/s, peak {format_bytes(p.memory)}{measured}")
    vol = tuple(o + f - 1 for o, f in zip(out_shape, spec.fov))
    say(f"chosen input {dims(best.run_input)} -> output {dims(best.tile)}, {best.tiles} tiles for volume "
        f"{cube(vol)}, peak {format_bytes(best.memory)} of {format_bytes(budget)} "
        f"({100.0 * best.memory / budget:.1f}%), predicted {best.throughput:,.0f} vox/s"
        + ("" if best.measured_throughput is None else f", measured {best.measured_throughput:,.0f} vox/s"))
    for _, row in best.layer_rows:
        say(row)
    return best


def _describe_mode(spec: NetSpec, p: Plan) -> str:
    parts = []
    if not all(p.mpf):
        parts.append(f"{sum(p.mpf)}/{len(p.mpf)} MPF")
    if p.batch > 1:
        parts.append(f"batch {p.batch}")
    return f" ({', '.join(parts)})" if parts else ""


def _too_small(spec: NetSpec, budget: int, ctx: _Context) -> CctError:
    """The one-line error for a budget below every valid run: the configuration needing the least memory
    (each pooling layer either way, batch 1, the smallest valid patch, least-memory primitives)."""
    least: Plan | None = None
    for mpf in itertools.product((True, False), repeat=len(spec.pools)):
        p = _evaluate(ctx, tuple(mpf), 1, (1,) * spec.num_spatial, fastest=False, limit=math.inf)
        if p is not None and (least is None or p.memory < least.memory):
            least = p
    if least is None:
        return CctError(f"memory budget {format_bytes(budget)}: no valid patch for net {spec.name}")
    variant = least.primitives.get(least.memory_at)
    where = f"at layer {least.memory_at}" + (f" ({variant})" if variant else "")
    mib = -(-least.memory // 2**20)
    return CctError(f"memory budget {format_bytes(budget)} is too small for net {spec.name}: the smallest valid "
                    f"patch (input {cube(least.run_input)}, output {cube(least.tile)}) needs "
                    f"{format_bytes(least.memory)} {where}; use -memory_budget >= {mib} MiB")
