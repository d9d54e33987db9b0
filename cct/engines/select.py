"""Which lowering each convolution runs, and how many batch partitions: the process-wide settings, the
per-layer choice, and its one-line description.

Settings (read from the environment at import, overridable with :func:`apply_engine_flags`, which the
command line calls with its ``-lowering`` / ``-partitions`` flags):

* ``CCT_LOWERING`` = ``1`` | ``2`` | ``3`` | ``auto`` (default): force a lowering (a layer where it does not
  apply falls back to type 1 and says why) or choose per layer;
* ``CCT_PARTITIONS`` = ``N`` | ``auto`` (default): batch partitions (:mod:`cct.parallel.partition`);
* ``CCT_AUTOTUNE`` = ``1``: ``auto`` measures the candidate lowerings on the layer's geometry (a few images,
  forward + backward) at its first reshape instead of trusting the cost model alone; results are cached.

``auto`` without autotune takes the strategy the cost model (:mod:`cct.engines.cost_model`) predicts
fastest — unless type 1 is predicted within 5% or 1 ms of it: then type 1, whose summation order is Caffe's
(float32 results closest to Caffe's where a net amplifies rounding, e.g. BatchNorm with tiny variances) —
with the machine rates measured by :func:`calibrate` if cached for this thread count, else the
defaults.  The cache is one small JSON file, ``$CCT_CACHE_DIR`` or ``$XDG_CACHE_HOME/cct`` or
``~/.cache/cct``, ``autotune.json``, keyed by geometry, dtype and thread count.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from cct import log
from cct.engines import ConvGeometry
from cct.engines.cost_model import DEFAULT_RATES, MachineRates, estimate_seconds, layer_costs
from cct.errors import CctError
from cct.parallel.partition import cpu_cores, partitions_setting, set_partitions

CACHE_FILE = "autotune.json"
# auto keeps type 1 unless another lowering is predicted faster by more than both of these
PREFER_TYPE1_SECONDS = 1e-3
PREFER_TYPE1_FRACTION = 0.05
_lowering: int | str = "auto"
_lowering_source = "default"
_autotune = False
_cache_lock = threading.Lock()


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


def set_autotune(enabled: bool) -> None:
    global _autotune
    _autotune = bool(enabled)


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
    set_autotune(os.environ.get("CCT_AUTOTUNE", "0").strip() not in ("", "0", "false", "no"))


_init_from_env()


# ---- the per-layer choice ------------------------------------------------------------------------
def engine_for_layer(kind: str = "Convolution") -> Any:
    """A new lowering engine following the current setting (called by the layer creator functions)."""
    from cct.engines.lowering import LoweringEngine

    strategy, source = lowering_setting()
    return LoweringEngine(strategy, source=f"forced by {source}" if strategy != "auto" else "auto")


def predicted_seconds(g: ConvGeometry, rates: MachineRates | None = None) -> dict[int, float]:
    """The cost model's forward+backward seconds of every applicable strategy."""
    from cct.engines.lowering import strategy_fallback

    rates = rates or machine_rates()
    return {s: estimate_seconds(layer_costs(g, s), rates) for s in (1, 2, 3) if strategy_fallback(s, g) is None}


def choose_strategy(g: ConvGeometry, dtype: Any = np.float32) -> tuple[int, str]:
    """``auto``: (strategy, reason) for geometry ``g`` — measured (autotune, cached) or the cost model."""
    predicted = predicted_seconds(g)
    if len(predicted) == 1:
        return 1, "cost model: only lowering 1 applies"
    if _autotune:
        measured = autotune(g, dtype)
        best = min(measured, key=measured.__getitem__)
        return best, "autotuned"
    best = min(predicted, key=predicted.__getitem__)
    if predicted[1] - predicted[best] < max(PREFER_TYPE1_SECONDS, PREFER_TYPE1_FRACTION * predicted[best]):
        best = 1  # a close call: keep type 1, Caffe's own summation order (the closest numbers to Caffe's)
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
    base = os.environ.get("CCT_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "cct")
    return Path(base) / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(update: dict[str, Any]) -> None:
    with _cache_lock:
        data = _read_cache()
        for section, entries in update.items():
            data.setdefault(section, {}).update(entries)
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write the autotune cache %s: %s", path, e)


def _threads_key() -> str:
    forced, _ = partitions_setting()
    return f"cores{cpu_cores()}-p{forced or 'auto'}"


def geometry_key(g: ConvGeometry, dtype: Any) -> str:
    return (f"n{g.num}-c{g.in_channels}-o{g.out_channels}-g{g.group}-in{'x'.join(map(str, g.in_shape))}"
            f"-k{'x'.join(map(str, g.kernel))}-s{'x'.join(map(str, g.stride))}-p{'x'.join(map(str, g.pad))}"
            f"-d{'x'.join(map(str, g.dilation))}-{np.dtype(dtype).name}-{_threads_key()}")


def machine_rates() -> MachineRates:
    """Rates measured by :func:`calibrate` for this thread count, if cached; else the defaults."""
    entry = _read_cache().get("rates", {}).get(_threads_key())
    if not entry:
        return DEFAULT_RATES
    try:
        return MachineRates(**entry)
    except TypeError:
        return DEFAULT_RATES


def _best_time(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def calibrate(save: bool = True) -> MachineRates:
    """Measure the cost model's rates on this machine (about half a second) and cache them."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((768, 768), dtype=np.float32)
    c = np.empty_like(a)
    gemm = 2 * 768**3 / _best_time(lambda: np.matmul(a, a, out=c))
    x = rng.standard_normal((8, 64, 30, 30), dtype=np.float32)
    st = x.strides
    win = np.lib.stride_tricks.as_strided(x, (8, 64, 28, 28, 3, 3), st + st[2:])
    col = np.empty((64, 3, 3, 8, 28, 28), dtype=np.float32)
    lower = col.size / _best_time(lambda: np.copyto(col, win.transpose(1, 4, 5, 0, 2, 3)))
    z = rng.standard_normal((3, 64, 8, 30, 28), dtype=np.float32)
    yt = np.zeros((64, 8, 28, 28), dtype=np.float32)

    def lift() -> None:
        for k in range(3):
            yt[...] += z[k][:, :, k:k + 28]

    lift_rate = 3 * yt.size / _best_time(lift)
    out = np.empty((8, 64, 28, 28), dtype=np.float32)
    transpose = out.size / _best_time(lambda: np.copyto(out, np.moveaxis(yt, 0, 1)))
    rates = MachineRates(gemm, lower, lift_rate, transpose)
    if save:
        _write_cache({"rates": {_threads_key(): rates.__dict__}})
    return rates


def autotune(g: ConvGeometry, dtype: Any = np.float32, images: int = 4) -> dict[int, float]:
    """Seconds per image of forward + backward for every applicable strategy on ``g`` (measured on
    ``images`` images, best of 2; cached per geometry, dtype and threads)."""
    from cct.engines.lowering import LoweringEngine, strategy_fallback

    key = geometry_key(g, dtype)
    cached = _read_cache().get("autotune", {}).get(key)
    if cached:
        return {int(s): float(t) for s, t in cached.items()}
    n = max(1, min(g.num, images))
    small = ConvGeometry(n, g.in_channels, g.out_channels, g.group, g.in_shape, g.kernel, g.stride, g.pad,
                         g.dilation)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, g.in_channels) + g.in_shape).astype(dtype)
    w = rng.standard_normal((g.out_channels, g.in_channels // g.group) + g.kernel).astype(dtype)
    dy = rng.standard_normal((n, g.out_channels) + g.out_shape).astype(dtype)
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)
    result: dict[int, float] = {}
    for s in (1, 2, 3):
        if strategy_fallback(s, g):
            continue
        eng = LoweringEngine(s)
        eng.configure(small, dtype)

        def step(eng: LoweringEngine = eng) -> None:
            eng.forward(x, w, None, y)
            eng.backward(x, dy, w, dx, dw)

        step()  # warm-up: allocates the workspace
        result[s] = _best_time(step, 2) / n
    _write_cache({"autotune": {key: {str(s): t for s, t in result.items()}}})
    return result
