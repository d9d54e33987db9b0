"""Which lowering each convolution runs, and how many batch partitions: the process-wide settings, the
per-layer choice, and its one-line description.

Settings (read from the environment at import, overridable with :func:`apply_engine_flags`, which the
command line calls with its ``-lowering`` / ``-partitions`` flags):

* ``CCT_LOWERING`` = ``1`` | ``2`` | ``3`` | ``auto`` (default): force a lowering (a layer where it does not
  apply falls back to type 1 and says why) or choose per layer;
* ``CCT_PARTITIONS`` = ``N`` | ``auto`` (default): batch partitions (:mod:`cct.parallel.partition`);
* ``CCT_AUTOTUNE`` = ``auto`` (default) | ``1`` | ``0``: whether ``auto`` measures the candidate lowerings on
  the layer's geometry (forward + backward on a slice of the batch, at its first reshape; cached) — for big
  layers only, for every layer, or never.

``auto`` per layer:

1. only type 1 applies (strided, 1x1, 1-D) → type 1;
2. the cost model (:mod:`cct.engines.cost_model`) predicts no lowering saves ``PREFER_TYPE1_SECONDS`` (1 ms)
   over type 1 → type 1, whose summation order is Caffe's: small layers gain nothing measurable, and float32
   results stay closest to Caffe's where a net amplifies rounding (a BatchNorm with tiny variances: the
   reference net batchnorm_block's TEST output moves by more than 1e-4 under any other summation order —
   even the exact float64 convolution does — so no other lowering can match it there);
3. the cost model with this machine's rates (:func:`calibrate`: measured once per machine in well under a
   second, cached) — GEMM speed as a function of shape, the engine's own copy and slice-add rates;
4. a layer predicted to take ``AUTOTUNE_MIN_SECONDS`` (50 ms) or more, where another lowering is predicted
   within ``AUTOTUNE_WINDOW`` (15%) of the best (a close call: the model's error is about that) → those
   candidates measured (:func:`autotune`: one chunk of the layer, cached per geometry), the fastest wins; a
   clear winner is taken as predicted;
5. a smaller layer → the prediction, but type 1 unless another is predicted ``PREFER_TYPE1_FRACTION`` (5%)
   faster.

The cache is one small JSON file, ``$CCT_CACHE_DIR`` or ``$XDG_CACHE_HOME/cct`` or ``~/.cache/cct``,
``autotune.json``: rates keyed by core count and partition setting, measurements by geometry, dtype and the
same.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from cct import log
from cct.cache import cache_dir, read_json, update_json
from cct.engines import ConvGeometry
from cct.engines.cost_model import DEFAULT_RATES, MachineRates, estimate_seconds, layer_costs
from cct.errors import CctError
from cct.parallel.partition import cpu_cores, partitions_setting, set_partitions

CACHE_FILE = "autotune.json"
# auto keeps type 1 unless another lowering is predicted to save at least this much (any layer) ...
PREFER_TYPE1_SECONDS = 1e-3
# ... and, where the model decides (no measurement), this fraction of the layer's time
PREFER_TYPE1_FRACTION = 0.05
# autotune="auto" measures layers predicted to take this long (forward + backward, whole batch) or more ...
AUTOTUNE_MIN_SECONDS = 0.05
# ... where the calibrated model finds another lowering within this factor of its best (a close call);
# only those candidates are measured
AUTOTUNE_WINDOW = 1.15
# measured images per partition: enough that the largest buffer of all partitions together exceeds this
# (out of the last-level cache, like the full layer) and that a GEMM has this many columns, at most a
# partition's chunk
AUTOTUNE_BYTES = 48 << 20
AUTOTUNE_COLUMNS = 1024
AUTOTUNE_ROUNDS = 2
_lowering: int | str = "auto"
_lowering_source = "default"
_autotune: bool | str = "auto"
_cache_lock = threading.Lock()
_rates_memo: dict[str, MachineRates] = {}
RATES_VERSION = 2  # of calibrate()'s probes: rates cached by another version are measured again


# ---- settings ------------------------------------------------------------------------------------
def parse_lowering(value: str | int | None) -> int | str:
    if value is None or str(value).strip().lower() in ("", "auto"):
        return "auto"
    s = str(value).strip()
    if s in ("1", "2", "3"):
        return int(s)
    raise CctError(f"lowering must be 1, 2, 3 or auto (got {value!r})")


def set_lowering(value: str | int | None, source: str = "set_lowering") -> None:
    global _lowering, _lowering_source
    _lowering = parse_lowering(value)
    _lowering_source = source


def lowering_setting() -> tuple[int | str, str]:
    """(1 | 2 | 3 | "auto", where the setting came from)."""
    return _lowering, _lowering_source


def parse_autotune(value: bool | str | None) -> bool | str:
    """True (measure every layer), False (never: the cost model alone) or "auto" (big layers)."""
    if isinstance(value, bool):
        return value
    v = "" if value is None else str(value).strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in ("1", "true", "yes", "on", "always"):
        return True
    if v in ("0", "false", "no", "off", "never"):
        return False
    raise CctError(f"CCT_AUTOTUNE must be auto, 1 or 0 (got {value!r})")


def set_autotune(enabled: bool | str) -> None:
    """``True``: ``auto`` measures every layer; ``False``: never (the cost model alone); ``"auto"``: layers
    predicted to take ``AUTOTUNE_MIN_SECONDS`` or more."""
    global _autotune
    _autotune = parse_autotune(enabled)


def autotune_setting() -> bool | str:
    return _autotune


def apply_engine_flags(lowering: str | None, partitions: str | None) -> None:
    """The command line's ``-lowering 1|2|3|auto`` and ``-partitions N|auto`` (None: leave as is); the same
    process-wide settings as ``CCT_LOWERING`` / ``CCT_PARTITIONS``.  Applies to layers created afterwards
    (lowering) and to every following forward/backward (partitions)."""
    if lowering is not None:
        set_lowering(lowering, "flag")
    if partitions is not None:
        set_partitions(partitions, "flag")


def _init_from_env() -> None:
    env = os.environ.get("CCT_LOWERING")
    set_lowering(env, "CCT_LOWERING" if env else "default")
    try:
        set_autotune(os.environ.get("CCT_AUTOTUNE"))
    except CctError as e:
        log.warning("%s; using auto", e)
        set_autotune("auto")


_init_from_env()


# ---- the per-layer choice ------------------------------------------------------------------------
def engine_for_layer(kind: str = "Convolution") -> Any:
    """A new lowering engine following the current setting (called by the layer creator functions)."""
    from cct.engines.lowering import LoweringEngine

    strategy, source = lowering_setting()
    return LoweringEngine(strategy, source=f"forced by {source}" if strategy != "auto" else "auto")


def _partitions(g: ConvGeometry) -> int:
    from cct.parallel.partition import partitions_for

    return partitions_for(g.num, 2.0 * g.out_channels * (g.in_channels // g.group) * g.kernel_count * g.out_count)


def predicted_seconds(g: ConvGeometry, rates: MachineRates | None = None) -> dict[int, float]:
    """The cost model's forward+backward seconds of every applicable strategy (``rates``: this machine's if
    calibrated, else the defaults; nothing is measured here)."""
    from cct.engines.lowering import strategy_fallback

    rates = rates or machine_rates(calibrate_if_missing=False)
    parts = _partitions(g)
    return {s: estimate_seconds(layer_costs(g, s), rates, parts)
            for s in (1, 2, 3) if strategy_fallback(s, g) is None}


def choose_strategy(g: ConvGeometry, dtype: Any = np.float32) -> tuple[int, str]:
    """``auto``: (strategy, reason) for geometry ``g`` — see the module docstring for the rules."""
    predicted = predicted_seconds(g)
    if len(predicted) == 1:
        return 1, "cost model: only lowering 1 applies"
    if _autotune is True:
        measured = autotune(g, dtype)
        return min(measured, key=measured.__getitem__), "autotuned"
    best = min(predicted, key=predicted.__getitem__)
    if predicted[1] - predicted[best] < PREFER_TYPE1_SECONDS:
        return 1, "cost model"  # nothing measurable to gain: keep Caffe's summation order
    predicted = predicted_seconds(g, machine_rates(calibrate_if_missing=True))
    best = min(predicted, key=predicted.__getitem__)
    if _autotune == "auto" and predicted[best] >= AUTOTUNE_MIN_SECONDS:
        close = [s for s, t in predicted.items() if t <= AUTOTUNE_WINDOW * predicted[best]]
        if len(close) > 1:
            measured = autotune(g, dtype, close)
            return min(measured, key=measured.__getitem__), "autotuned"
        return best, "cost model"
    if predicted[1] - predicted[best] < max(PREFER_TYPE1_SECONDS, PREFER_TYPE1_FRACTION * predicted[best]):
        best = 1  # a close call: keep type 1, Caffe's own summation order
    return best, "cost model"


def describe_layer_engine(layer: Any) -> str:
    """What ``cct time`` prints beside a layer: e.g. ``lowering 2 (cost model), 2 partitions`` for a
    convolution, ``2 partitions`` for a partitioned layer, ``""`` otherwise."""
    from cct.parallel.partition import partitions_for

    engine = getattr(layer, "engine", None)
    parts = getattr(layer, "last_partitions", None)
    text = engine.describe() if engine is not None and hasattr(engine, "describe") else ""
    geometry = getattr(engine, "geometry", None)
    if parts is None and geometry is not None:
        chunks = getattr(engine, "_chunks", None)
        parts = len(chunks(geometry.num, 4)) if chunks is not None else partitions_for(geometry.num)
    if parts and parts > 1:
        text = f"{text}, {parts} partitions" if text else f"{parts} partitions"
    return text


# ---- cache, calibration and autotune ---------------------------------------------------------------
def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    return read_json(CACHE_FILE)


def _write_cache(update: dict[str, Any]) -> None:
    update_json(CACHE_FILE, update)


def _threads_key() -> str:
    forced, _ = partitions_setting()
    return f"cores{cpu_cores()}-p{forced or 'auto'}"


def geometry_key(g: ConvGeometry, dtype: Any) -> str:
    return (f"n{g.num}-c{g.in_channels}-o{g.out_channels}-g{g.group}-in{'x'.join(map(str, g.in_shape))}"
            f"-k{'x'.join(map(str, g.kernel))}-s{'x'.join(map(str, g.stride))}-p{'x'.join(map(str, g.pad))}"
            f"-d{'x'.join(map(str, g.dilation))}-{np.dtype(dtype).name}-{_threads_key()}")


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


def _best_time(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _concurrent(parts: int, make: Any) -> Any:
    """A callable running ``make(part)()`` in every batch partition at once (as a layer's partitions run)."""
    from cct.parallel.partition import run_partitions

    bodies = [make(p) for p in range(parts)]
    ranges = [(p, p + 1) for p in range(parts)]
    return lambda: run_partitions(ranges, lambda part, a, b: bodies[part]())


def calibrate(save: bool = True) -> MachineRates:
    """Measure the cost model's rates on this machine, with the partitions a big layer runs (well under a
    second), and cache them: the GEMM peak and its half-speed shapes, and the lowering engine's own
    lowering, col2im, lifting + unlifting and transposing on a probe layer larger than the caches."""
    from cct.engines.lowering import LoweringEngine, Workspace
    from cct.parallel.partition import partitions_for

    parts = partitions_for(1 << 10)
    rng = np.random.default_rng(0)

    def rate(make: Any, work: float, repeat: int = 3) -> float:
        """``work`` per partition / the best time of all partitions running ``make(part)()`` at once."""
        fn = _concurrent(parts, make)
        fn()
        return parts * work / _best_time(fn, repeat)

    def gemm(m: int, k: int, n: int) -> float:
        def make(_p: int) -> Any:
            a = rng.standard_normal((m, k), dtype=np.float32)
            b = rng.standard_normal((k, n), dtype=np.float32)
            c = np.empty((m, n), dtype=np.float32)
            return lambda: np.matmul(a, b, out=c)
        return rate(make, 2.0 * m * k * n, 5)

    big, small = (256, 512, 2048), 16
    rate_big = gemm(*big)
    m0 = small * max(0.0, rate_big / gemm(small, big[1], big[2]) - 1)
    k0 = small * max(0.0, rate_big / gemm(big[0], small, big[2]) - 1)
    n0 = small * max(0.0, rate_big / gemm(big[0], big[1], small) - 1)
    peak = rate_big / (big[0] / (big[0] + m0) * big[1] / (big[1] + k0) * big[2] / (big[2] + n0))

    # per partition: 16 images of a 64 -> 64 channel 3x3 layer on 28x28 (lowered matrix 29 MB)
    g = ConvGeometry(16, 64, 64, 1, (28, 28), (3, 3), (1, 1), (1, 1), (1, 1))
    x = rng.standard_normal((g.num, g.in_channels) + g.in_shape, dtype=np.float32)
    dy = rng.standard_normal((g.num, g.out_channels) + g.out_shape, dtype=np.float32)
    cells = g.in_channels * g.kernel_count * g.num * g.out_count  # lowered elements (and col2im's)
    planes = g.out_channels * g.num * g.out_count                  # one output-sized array

    def engine(strategy: int) -> tuple[Any, dict[str, Any]]:
        eng = LoweringEngine(strategy, workspace=Workspace())
        eng.configure(g, np.float32)
        return eng, eng.workspace.part(0)

    def lower(_p: int) -> Any:
        eng, ws = engine(1)
        return lambda: eng._lower(ws, x)

    def col2im(_p: int) -> Any:
        eng, ws = engine(1)
        col, dx = eng._lower(ws, x).copy(), np.empty_like(x)
        return lambda: eng._col2im(ws, col, dx)

    def lift(_p: int) -> Any:
        eng, ws = engine(3)
        dz = eng._grad_z(ws, dy).copy()
        lay = eng._lay()
        z = dz.reshape((lay.G, lay.KF, lay.Og, g.num) + lay.inF + lay.outL)
        yt = np.empty((lay.G, lay.Og, g.num) + g.out_shape, dtype=np.float32)

        def run() -> None:
            eng._lift(z, yt)
            eng._grad_z(ws, dy)  # transposes dy (one plane) and unlifts it
        return run

    def transpose(_p: int) -> Any:
        eng, ws = engine(1)
        return lambda: eng._grad_z(ws, dy)

    t_rate = rate(transpose, planes)
    lifted = 2.0 * g.kernel_count * planes  # k² slices added (lift) and copied (unlift)
    lift_rate = lifted / max(lifted / rate(lift, lifted) - planes / t_rate, 1e-9)
    rates = MachineRates(peak, rate(lower, cells), lift_rate, t_rate, max(m0, 1.0), max(k0, 1.0), max(n0, 1.0),
                         rate(col2im, cells))
    _rates_memo[_rates_key()] = rates
    if save:
        _write_cache({"rates": {_rates_key(): asdict(rates)}})
    return rates


def _largest_buffer(g: ConvGeometry, strategy: int) -> int:
    """Elements per image of a strategy's biggest buffer: the lowered matrix or the GEMM result."""
    c = layer_costs(replace(g, num=1), strategy)
    fwd_rows, fwd_inner, fwd_cols = c.gemm_shapes[0]
    return c.groups * fwd_cols * max(fwd_rows, fwd_inner)


def autotune(g: ConvGeometry, dtype: Any = np.float32, candidates: Any = None,
             images: int | None = None) -> dict[int, float]:
    """Seconds per image of forward + backward (data and weights) of each applicable strategy (or of
    ``candidates``) on ``g``, measured with the layer's partitions on ``images`` images per partition
    (default: enough for ``AUTOTUNE_COLUMNS`` GEMM columns and for buffers of ``AUTOTUNE_BYTES`` in all —
    out of the caches, as the full layer's — at most one chunk of a partition: what the layer runs at a
    time), strategies interleaved, the best of ``AUTOTUNE_ROUNDS`` after a warm-up; cached per geometry,
    dtype and thread setting."""
    from cct.engines.lowering import LoweringEngine, Workspace, strategy_fallback

    wanted = [s for s in (candidates or (1, 2, 3)) if strategy_fallback(s, g) is None]
    key = geometry_key(g, dtype)
    cached = _read_cache().get("autotune", {}).get(key) or {}
    if all(str(s) in cached for s in wanted):
        return {s: float(cached[str(s)]) for s in wanted}
    probe = LoweringEngine(1, workspace=Workspace())
    probe.configure(g, dtype)
    itemsize = np.dtype(dtype).itemsize
    chunks = probe._chunks(g.num, itemsize)
    per_part = min(n1 - n0 for part in chunks for n0, n1 in part[:1])
    if images is None:
        per_image = max(_largest_buffer(g, s) for s in wanted) * itemsize
        images = max(-(-AUTOTUNE_COLUMNS // max(1, g.out_count)),
                     -(-AUTOTUNE_BYTES // (len(chunks) * max(1, per_image))))
    k = max(1, min(per_part, images))
    n = min(g.num, k * len(chunks))
    small = replace(g, num=n)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, g.in_channels) + g.in_shape).astype(dtype)
    w = (0.1 * rng.standard_normal((g.out_channels, g.in_channels // g.group) + g.kernel)).astype(dtype)
    dy = rng.standard_normal((n, g.out_channels) + g.out_shape).astype(dtype)
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)
    steps, engines = {}, {}
    for s in wanted:
        engines[s] = eng = LoweringEngine(s, workspace=Workspace())
        eng.configure(small, dtype)

        def step(eng: LoweringEngine = eng) -> None:
            eng.forward(x, w, None, y)
            eng.backward(x, dy, w, dx, dw)

        steps[s] = step
    for s in wanted:  # warm-up: allocates each workspace (the forward's buffers are the big ones)
        engines[s].forward(x, w, None, y)
    best = {s: float("inf") for s in wanted}
    for _ in range(AUTOTUNE_ROUNDS):  # interleaved, so that machine noise hits all alike; the best round
        for s in wanted:
            t = time.perf_counter()
            steps[s]()
            best[s] = min(best[s], time.perf_counter() - t)
    result = {s: t / n for s, t in best.items()}
    _write_cache({"autotune": {key: {**cached, **{str(s): t for s, t in result.items()}}}})
    return result
