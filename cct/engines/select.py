"""Which engine each convolution runs — lowering (and which lowering) or FFT — and how many batch
partitions: the process-wide settings, the per-layer choice, and its one-line description.

Settings (read from the environment at import, overridable with :func:`apply_engine_flags`, which the
command line calls with its ``-conv_engine`` / ``-lowering`` / ``-partitions`` flags; an invalid environment
value is an error when the setting is first used):

* ``CCT_CONV_ENGINE`` = ``lowering`` | ``fft`` | ``auto`` (default): the engine of convolution layers created
  afterwards (:class:`SelectedEngine`, :func:`choose_conv_engine`).  ``fft`` runs every convolution by FFT —
  a strided one as its stride-1 convolution, exact but at that cost —, and a layer the FFT engine cannot
  compute (arrays on a GPU, no spatial axes) is an error naming the layer; ``auto`` takes the lowering engine
  on those and on strided layers, and says why in the layer's log line;
* ``CCT_LOWERING`` = ``1`` | ``2`` | ``3`` | ``auto`` (default): force a lowering (a layer where it does not
  apply falls back to type 1 and says why) or choose per layer;
* ``CCT_PARTITIONS`` = ``N`` | ``auto`` (default): batch partitions (:mod:`cct.runtime.partition`);
* ``CCT_AUTOTUNE`` = ``auto`` (default) | ``1`` | ``0``: whether ``auto`` measures the candidates on the
  layer's geometry (forward + backward, at its first reshape; cached) — where the models leave a close call,
  for every layer, or never (the models alone).

Engine ``auto`` per layer (:func:`choose_conv_engine`, ZNN's layerwise autotuning): the lowering engine where
the FFT engine does not apply, the layer is strided, or the FFT engine cannot plausibly save
``PREFER_TYPE1_SECONDS`` (its model's prediction divided by ``FFT_WINDOW``); otherwise both engines measured
on the layer (:func:`autotune_conv_engine`) and the FFT engine taken when it is at least that much faster.

Lowering ``auto`` per layer:

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
``autotune.json``: rates keyed by core count and partition setting, measurements (lowerings; lowering vs fft)
by geometry, dtype and the same.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from cct.cache import cache_dir, read_json, update_json
from cct.engines import ConvEngine, ConvGeometry, create_conv_engine
from cct.engines.cost_model import DEFAULT_RATES, MachineRates, estimate_seconds, layer_costs
from cct.errors import CctError
from cct.runtime.partition import cpu_cores, partitions_setting, set_partitions

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
# auto engine choice: the FFT engine's prediction may be off by this factor (screening), ...
FFT_WINDOW = 2.0
# ... and measuring lowering vs fft runs at most this many (predicted) seconds of images per round
ENGINE_AUTOTUNE_SECONDS = 0.25
ENGINE_AUTOTUNE_ROUNDS = 3
# ... both FFT layouts (all axes transformed, or the first lifted) measured when predicted within this factor
FFT_LAYOUT_WINDOW = 1.5
CONV_ENGINE_CHOICES = ("lowering", "fft", "auto")
_lowering: int | str = "auto"
_lowering_source = "default"
_conv_engine = "auto"
_conv_engine_source = "default"
_autotune: bool | str = "auto"
_env_errors: dict[str, CctError] = {}  # invalid environment settings, raised when the setting is used
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
    _env_errors.pop("CCT_LOWERING", None)


def lowering_setting() -> tuple[int | str, str]:
    """(1 | 2 | 3 | "auto", where the setting came from)."""
    _raise_env_error("CCT_LOWERING")
    return _lowering, _lowering_source


def parse_conv_engine(value: str | None) -> str:
    v = "" if value is None else str(value).strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in CONV_ENGINE_CHOICES:
        return v
    raise CctError(f"conv_engine must be {', '.join(CONV_ENGINE_CHOICES[:-1])} or auto (got {value!r})")


def set_conv_engine(value: str | None, source: str = "set_conv_engine") -> None:
    """``lowering``, ``fft`` or ``auto`` (None: auto) for convolution layers created afterwards."""
    global _conv_engine, _conv_engine_source
    _conv_engine = parse_conv_engine(value)
    _conv_engine_source = source
    _env_errors.pop("CCT_CONV_ENGINE", None)


def conv_engine_setting() -> tuple[str, str]:
    """("lowering" | "fft" | "auto", where the setting came from)."""
    _raise_env_error("CCT_CONV_ENGINE")
    return _conv_engine, _conv_engine_source


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
    raise CctError(f"autotune must be auto, 1 or 0 (got {value!r})")


def set_autotune(enabled: bool | str, source: str = "set_autotune") -> None:
    """``True``: ``auto`` measures every layer; ``False``: never (the cost model alone); ``"auto"``: layers
    predicted to take ``AUTOTUNE_MIN_SECONDS`` or more."""
    global _autotune
    _autotune = parse_autotune(enabled)
    _env_errors.pop("CCT_AUTOTUNE", None)


def autotune_setting() -> bool | str:
    _raise_env_error("CCT_AUTOTUNE")
    return _autotune


def apply_engine_flags(lowering: str | None, partitions: str | None, conv_engine: str | None = None) -> None:
    """The command line's ``-lowering 1|2|3|auto``, ``-partitions N|auto`` and ``-conv_engine
    lowering|fft|auto`` (None: leave as is); the same process-wide settings as ``CCT_LOWERING`` /
    ``CCT_PARTITIONS`` / ``CCT_CONV_ENGINE``.  Applies to layers created afterwards (engine, lowering) and to
    every following forward/backward (partitions).  An invalid environment setting not overridden here is
    reported now."""
    if lowering is not None:
        set_lowering(lowering, "flag")
    if partitions is not None:
        set_partitions(partitions, "flag")
    if conv_engine is not None:
        set_conv_engine(conv_engine, "flag")
    for var in list(_env_errors):
        _raise_env_error(var)
    partitions_setting()


def _raise_env_error(var: str) -> None:
    error = _env_errors.get(var)
    if error is not None:
        raise error


def _init_from_env() -> None:
    """Read ``CCT_LOWERING``, ``CCT_CONV_ENGINE`` and ``CCT_AUTOTUNE``; an invalid value leaves the default in
    place and is raised when the setting is first used (a one-line error from the command line, not a
    failing import)."""
    for var, setter in (("CCT_LOWERING", set_lowering), ("CCT_CONV_ENGINE", set_conv_engine),
                        ("CCT_AUTOTUNE", set_autotune)):
        value = os.environ.get(var)
        try:
            setter(value, var if value else "default")
        except CctError as e:
            _env_errors[var] = CctError(f"{var}: {e}")


_init_from_env()


# ---- the per-layer choice ------------------------------------------------------------------------
def engine_for_layer(kind: str = "Convolution") -> SelectedEngine:
    """A new engine for a Convolution/Deconvolution layer, following the current engine and lowering settings
    (called by the layer creator functions; the engine that runs is chosen at each new geometry)."""
    choice, source = conv_engine_setting()
    strategy, lsource = lowering_setting()
    return SelectedEngine(choice, source, strategy, lsource)


class SelectedEngine(ConvEngine):
    """The engine a convolution layer owns: the lowering or the FFT engine (:attr:`inner`), chosen for each
    geometry at the layer's reshape by the ``conv_engine`` setting the layer was created with:

    * ``lowering`` — the lowering engine (with the ``lowering`` setting);
    * ``fft`` — the FFT engine (strided layers too, as their stride-1 convolution); a layer it cannot
      compute (arrays on a GPU, no spatial axes) is an error;
    * ``auto`` — :func:`choose_conv_engine`: the fastest measured of the lowering engine and the FFT
      engine's layouts on stride-1 layers where the FFT engine may save time; otherwise the lowering engine,
      with the reason in :meth:`describe`.

    Every engine call goes to :attr:`inner`; other attributes (``strategy``, ``reuses``, ...) are read from
    it too.  :attr:`reason` says why this engine runs ("" when the setting named it)."""

    def __init__(self, choice: str = "auto", source: str = "default", lowering: int | str = "auto",
                 lowering_source: str = "default"):
        super().__init__()
        self.choice, self.source = parse_conv_engine(choice), source
        self.lowering, self.lowering_source = parse_lowering(lowering), lowering_source
        self.inner: ConvEngine | None = None
        self.reason = ""
        self._key: tuple[Any, ...] | None = None

    @property  # type: ignore[override]
    def name(self) -> str:
        return self.inner.name if self.inner is not None else "unconfigured"

    def __getattr__(self, attr: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None or attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(inner, attr)

    def _engine(self) -> ConvEngine:
        if self.inner is None:
            raise RuntimeError("convolution engine used before configure()")
        return self.inner

    def configure(self, geometry: ConvGeometry, dtype: Any = None, xp: Any = None) -> bool:
        dtype = np.dtype(np.float32 if dtype is None else dtype)
        key = (geometry, dtype, xp if xp is not None else np)
        if key == self._key and self.inner is not None:
            return False
        choice, reason = choose_conv_engine(geometry, dtype, xp, self.choice, self.source, self.lowering)
        name, _, layout = choice.partition(" ")  # "fft lifted" / "fft full": a measured FFT layout
        changed = self.inner is None or self.inner.name != name or reason != self.reason
        if self.inner is None or self.inner.name != name:
            if name == "lowering":
                from cct.engines.lowering import LoweringEngine

                forced = self.lowering != "auto"
                self.inner = LoweringEngine(self.lowering, source=f"forced by {self.lowering_source}"
                                            if forced else "auto")
            else:
                self.inner = create_conv_engine(name)
        if name == "fft":  # the measured layout, or (None) the engine's own choice
            self.inner.requested_lift = (layout == "lifted") if layout else None
        self.reason = reason
        changed = self.inner.configure(geometry, dtype, xp) or changed
        self.geometry, self._key = geometry, key
        return changed

    def describe(self) -> str:
        text = self._engine().describe()
        return f"{text}; {self.reason}" if self.reason else text

    def workspace_bytes(self) -> int:
        return self.inner.workspace_bytes() if self.inner is not None else 0

    def batch_partitions(self) -> int:
        return self._engine().batch_partitions()

    def forward(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        return self._engine().forward(x, w, b, y)

    def backward(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        self._engine().backward(x, dy, w, dx, dw)

    def forward_and_backward_weights(self, x: Any, w: Any, y: Any | None, dy: Any, dw: Any | None) -> None:
        self._engine().forward_and_backward_weights(x, w, y, dy, dw)


def fft_applies(g: ConvGeometry, xp: Any = None) -> tuple[bool, str]:
    """(True, "") when the FFT engine can compute ``g`` on arrays of ``xp``, else (False, the reason)."""
    from cct.engines.fft import FFTEngine

    if xp is not None and xp is not np:
        return False, "the fft engine runs on the CPU and this layer's arrays are on a GPU"
    return FFTEngine.supports(g)


def predicted_fft_seconds(g: ConvGeometry, dtype: Any = np.float32) -> float:
    """The FFT engine's predicted forward+backward seconds for ``g`` (its own model; nothing measured)."""
    from cct.engines.fft import FFTEngine

    est = FFTEngine.estimate(g, np.dtype(dtype).itemsize, machine_rates())
    return float(est[est["choice"]]["seconds"])


def _lowering_prediction(g: ConvGeometry, lowering: int | str, rates: MachineRates | None = None) -> float:
    predicted = predicted_seconds(g, rates)
    if lowering != "auto" and lowering in predicted:
        return predicted[int(lowering)]
    return min(predicted.values())


def choose_conv_engine(g: ConvGeometry, dtype: Any = np.float32, xp: Any = None, choice: str = "auto",
                       source: str = "default", lowering: int | str = "auto") -> tuple[str, str]:
    """(engine name, reason) for geometry ``g`` under the ``conv_engine`` setting ``choice``.

    ``auto``: the lowering engine where the FFT engine does not apply (the reason names why) or where the two
    models (:func:`predicted_seconds`, :func:`predicted_fft_seconds`) leave the FFT engine no chance to save
    ``PREFER_TYPE1_SECONDS`` even at ``FFT_WINDOW`` times its prediction (small layers, most 2-D layers: they
    keep Caffe's summation order); otherwise both engines measured on the layer (:func:`autotune_conv_engine`,
    cached) and the FFT engine taken when it saves at least ``PREFER_TYPE1_SECONDS``.  With autotune off
    (``CCT_AUTOTUNE=0``) the predictions decide; with it forced on, every applicable layer is measured."""
    if choice == "lowering":
        return "lowering", ""
    ok, why = fft_applies(g, xp)
    if choice == "fft":
        if not ok:
            raise CctError(f"conv_engine fft (set by {source}) cannot run this layer: {why}; "
                           f"use conv_engine lowering or auto")
        return "fft", ""
    if not ok:
        return "lowering", f"not fft: {why}"
    if any(st != 1 for st in g.stride):  # fft would compute every stride-1 output and drop the rest
        st = g.stride[0] if len(set(g.stride)) == 1 else "x".join(map(str, g.stride))
        return "lowering", f"not fft: stride {st} > 1"
    t_fft = predicted_fft_seconds(g, dtype)
    t_low = _lowering_prediction(g, lowering)
    tune = autotune_setting()
    if tune is not True and t_low - t_fft / FFT_WINDOW < PREFER_TYPE1_SECONDS:
        return "lowering", ""  # the usual case (the layer's log line shows both predictions)
    if tune is False:
        t_low = _lowering_prediction(g, lowering, machine_rates(calibrate_if_missing=True))
        if t_low - t_fft >= max(PREFER_TYPE1_SECONDS, PREFER_TYPE1_FRACTION * t_low):
            return "fft", f"engine by cost model (lowering predicted {t_low * 1e3:.3g} ms)"
        return "lowering", f"engine by cost model (fft predicted {t_fft * 1e3:.3g} ms)"
    measured = autotune_conv_engine(g, dtype, lowering, max(t_low, t_fft))
    fft = min((k for k in measured if k.startswith("fft")), key=measured.__getitem__)
    name = fft if measured["lowering"] - measured[fft] >= PREFER_TYPE1_SECONDS else "lowering"
    return name, "engine autotuned: " + ", ".join(f"{k} {t * 1e3:.3g} ms" for k, t in measured.items())


def _partitions(g: ConvGeometry) -> int:
    from cct.runtime.partition import partitions_for

    return partitions_for(g.num, 2.0 * g.out_channels * (g.in_channels // g.group) * g.kernel_count * g.out_count)


def predicted_seconds(g: ConvGeometry, rates: MachineRates | None = None) -> dict[int, float]:
    """The cost model's forward+backward seconds of every applicable strategy (``rates``: this machine's if
    calibrated, else the defaults; nothing is measured here)."""
    from cct.engines.lowering import strategy_fallback

    rates = rates or machine_rates(calibrate_if_missing=False)
    parts = _partitions(g)
    return {s: estimate_seconds(layer_costs(g, s), rates, parts)
            for s in (1, 2, 3) if strategy_fallback(s, g) is None}


def predicted_engine_seconds(g: ConvGeometry, dtype: Any = np.float32) -> dict[str, float]:
    """Predicted forward+backward seconds of each applicable lowering (keys ``"1"``..``"3"``) and of the FFT
    engine (``"fft"``, where it applies): what a convolution layer logs at setup."""
    out = {str(s): t for s, t in predicted_seconds(g).items()}
    if fft_applies(g)[0]:
        out["fft"] = predicted_fft_seconds(g, dtype)
    return out


def choose_strategy(g: ConvGeometry, dtype: Any = np.float32) -> tuple[int, str]:
    """``auto``: (strategy, reason) for geometry ``g`` — see the module docstring for the rules."""
    predicted = predicted_seconds(g)
    if len(predicted) == 1:
        return 1, "cost model: only lowering 1 applies"
    tune = autotune_setting()
    if tune is True:
        measured = autotune(g, dtype)
        return min(measured, key=measured.__getitem__), "autotuned"
    best = min(predicted, key=predicted.__getitem__)
    if predicted[1] - predicted[best] < PREFER_TYPE1_SECONDS:
        return 1, "cost model"  # nothing measurable to gain: keep Caffe's summation order
    predicted = predicted_seconds(g, machine_rates(calibrate_if_missing=True))
    best = min(predicted, key=predicted.__getitem__)
    if tune == "auto" and predicted[best] >= AUTOTUNE_MIN_SECONDS:
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
    convolution, ``fft 36x36x36 (...), 12.5 MiB of kept spectra`` for an FFT one, ``2 partitions`` for a
    partitioned layer, ``""`` otherwise."""
    engine = getattr(layer, "engine", None)
    parts = getattr(layer, "last_partitions", None)
    text = engine.describe() if engine is not None and hasattr(engine, "describe") else ""
    if parts is None and getattr(engine, "geometry", None) is not None and hasattr(engine, "batch_partitions"):
        parts = engine.batch_partitions()
    if parts and parts > 1:
        text = f"{text}, {parts} partitions" if text else f"{parts} partitions"
    if getattr(engine, "name", "") == "fft":
        text += f", {engine.workspace_bytes() / 2**20:.1f} MiB of kept spectra"
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
    from cct.runtime.partition import run_partitions

    bodies = [make(p) for p in range(parts)]
    ranges = [(p, p + 1) for p in range(parts)]
    return lambda: run_partitions(ranges, lambda part, a, b: bodies[part]())


def calibrate(save: bool = True) -> MachineRates:
    """Measure the cost model's rates on this machine, with the partitions a big layer runs (well under a
    second), and cache them: the GEMM peak and its half-speed shapes, and the lowering engine's own
    lowering, col2im, lifting + unlifting and transposing on a probe layer larger than the caches."""
    from cct.engines.lowering import LoweringEngine, Workspace
    from cct.runtime.partition import partitions_for

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


def _measure_engines(engines: dict[Any, ConvEngine], g: ConvGeometry, dtype: Any, rounds: int,
                     settle: float = 0.0, decided: float = math.inf) -> dict[Any, float]:
    """Best seconds of one training step of ``g`` — forward, then backward (data and weights) — for each
    engine: every operand new each step (memoized FFT spectra dropped first: only the reuse within a step
    counts), after one warm-up step each (plans, workspaces, thread pools) and ``settle`` seconds' pause,
    ``rounds`` rounds interleaved so that machine noise hits all alike — fewer once the fastest engine is
    ``decided`` times faster than the next (a clear call)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((g.num, g.in_channels) + g.in_shape).astype(dtype)
    w = (0.1 * rng.standard_normal((g.out_channels, g.in_channels // g.group) + g.kernel)).astype(dtype)
    dy = rng.standard_normal((g.num, g.out_channels) + g.out_shape).astype(dtype)
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.zeros_like(w)

    def step(eng: ConvEngine) -> None:
        if hasattr(eng, "invalidate"):
            eng.invalidate()
        eng.forward(x, w, None, y)
        eng.backward(x, dy, w, dx, dw)

    for eng in engines.values():
        eng.configure(g, dtype)
        step(eng)
    if settle:
        time.sleep(settle)
    best = {name: float("inf") for name in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            t = time.perf_counter()
            step(eng)
            best[name] = min(best[name], time.perf_counter() - t)
        times = sorted(best.values())
        if len(times) > 1 and times[1] >= decided * times[0]:
            break
    return best


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
    engines = {}
    for s in wanted:
        engines[s] = LoweringEngine(s, workspace=Workspace())
    best = _measure_engines(engines, replace(g, num=n), dtype, AUTOTUNE_ROUNDS)
    result = {s: t / n for s, t in best.items()}
    _write_cache({"autotune": {key: {**cached, **{str(s): t for s, t in result.items()}}}})
    return result


def autotune_conv_engine(g: ConvGeometry, dtype: Any = np.float32, lowering: int | str = "auto",
                         predicted: float | None = None) -> dict[str, float]:
    """Seconds of one forward + backward (data and weights) of the whole layer ``g`` with the lowering engine
    (``lowering``, or the strategy ``auto`` picks) and with the FFT engine in its layouts whose predictions
    are within ``FFT_LAYOUT_WINDOW`` of each other (else the predicted one): ``{"lowering": s, "fft full": s,
    "fft lifted": s}``.

    Measured as a training iteration runs them (:func:`_measure_engines`: every operand new each step,
    ``ENGINE_AUTOTUNE_ROUNDS`` rounds interleaved after a warm-up and a short pause — the FFT and BLAS thread
    pools hand the cores over —, the best round).  A layer ``predicted`` (seconds) to take longer than
    ``ENGINE_AUTOTUNE_SECONDS`` is measured on fewer images and scaled to the batch — the FFT engine's kernel
    transforms, done once per batch, then count for more than in the layer, which favours the lowering
    engine on such layers.  Cached per geometry, dtype, thread setting and lowering."""
    from cct.engines.fft import FFTEngine
    from cct.engines.lowering import LoweringEngine, Workspace, strategy_fallback

    if lowering == "auto":
        strategy = choose_strategy(g, dtype)[0]
    else:
        strategy = int(lowering) if strategy_fallback(int(lowering), g) is None else 1
    key = f"{geometry_key(g, dtype)}-lowering{strategy}"
    cached = _read_cache().get("conv_engine", {}).get(key)
    if cached and "lowering" in cached and any(k.startswith("fft ") for k in cached):
        return {k: float(t) for k, t in cached.items()}
    if predicted is None:
        predicted = max(_lowering_prediction(g, strategy), predicted_fft_seconds(g, dtype))
    n = max(1, min(g.num, int(g.num * ENGINE_AUTOTUNE_SECONDS / max(predicted, 1e-9))))
    est = FFTEngine.estimate(g, np.dtype(dtype).itemsize, machine_rates())
    layouts = [k for k in ("full", "lifted") if k in est]
    if len(layouts) == 2 and max(est[k]["seconds"] for k in layouts) > FFT_LAYOUT_WINDOW * min(
            est[k]["seconds"] for k in layouts):
        layouts = [est["choice"]]  # a clear call: only the predicted layout
    engines: dict[str, ConvEngine] = {"lowering": LoweringEngine(strategy, workspace=Workspace())}
    engines.update({f"fft {k}": FFTEngine(lift=k == "lifted") for k in layouts})
    best = _measure_engines(engines, replace(g, num=n), dtype, ENGINE_AUTOTUNE_ROUNDS, settle=0.1, decided=2.0)
    result = {name: t * g.num / n for name, t in best.items()}
    _write_cache({"conv_engine": {key: result}})
    return result
