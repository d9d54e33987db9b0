"""Which engine each convolution runs — lowering (and which lowering), FFT or Winograd: the per-layer choice policy and
its one-line description.  The settings it follows are :mod:`cct.config`'s ``conv_engine``, ``lowering`` and
``autotune`` (``-conv_engine`` / ``CCT_CONV_ENGINE`` and the like), read when a layer is created; what it
measures, and the cache of measurements, is :mod:`cct.engines.autotune`'s; what it predicts, the engines' own
cost models (:func:`cct.engines.estimate_convolution`).

* ``conv_engine`` = ``lowering`` | ``fft`` | ``winograd`` | ``auto``: ``fft`` runs every convolution by FFT — a
  strided one as its stride-1 convolution, exact but at that cost —, and a layer the FFT engine cannot compute
  (arrays on a GPU, no spatial axes) is an error naming the layer; ``winograd`` runs the 3x3 stride-1 2-D layers
  by Winograd's F(4x4,3x3) and the others by lowering, saying why in their log lines; ``auto`` takes the
  lowering engine where neither applies (and on strided layers), and says why in the layer's log line;
* ``lowering`` = ``1`` | ``2`` | ``3`` | ``auto``: force a lowering (a layer where it does not apply falls back
  to type 1 and says why) or choose per layer;
* ``autotune`` = ``fast`` (``auto``) | ``full`` (``1``) | ``off`` (``0``): whether ``auto`` measures the
  candidates on the layer's geometry (forward + backward, at its first reshape; cached) — where the models leave
  a close call, within a budget per net (:data:`cct.engines.autotune.FAST_BUDGET_SECONDS`, or twice the predicted
  time of the layers awaiting a measurement where that is more, or for a solver's training net 1% of ``max_iter``
  times it, for ``cct time``'s net no limit; the largest layers measured first, the rest go by the calibrated
  models, scaled by their measured error), for every layer, or never (the models alone).

Engine ``auto`` per layer (:func:`choose_conv_engine`, ZNN's layerwise autotuning): the lowering engine where
the FFT engine does not apply, the layer is strided, or the FFT engine cannot plausibly save
``PREFER_TYPE1_SECONDS`` (its model's prediction divided by ``FAST_MEASURE_WINDOW``), and the Winograd engine does not
apply, the layer is too small to be worth measuring or the Winograd engine cannot plausibly save that either;
otherwise the candidates measured on the layer
(:func:`cct.engines.autotune.autotune_conv_engine`) and the fastest taken when the lowering engine takes over
``MEASURED_PREFER_FRACTION`` longer.

Lowering ``auto`` per layer (:func:`choose_strategy`):

1. only type 1 applies (strided, 1x1, 1-D), or the arrays are on a GPU (the models and measurements are the
   CPU's; a device lowers the whole batch at once, Caffe's own GPU algorithm with one GEMM) → type 1;
2. the cost model (:mod:`cct.engines.cost_model`) predicts no lowering saves ``PREFER_TYPE1_SECONDS`` (1 ms)
   over type 1 (with ``autotune`` fast, even at ``AUTOTUNE_WINDOW`` times its prediction) → type 1: small layers
   gain nothing measurable, and type 1 sums in Caffe's order, so its
   float32 results are the closest to Caffe's;
3. the cost model with this machine's rates (:func:`cct.engines.autotune.calibrate`: measured once per
   machine in about a second, cached) — GEMM speed as a function of shape, the engine's own copy and
   slice-add rates —, each lowering's prediction scaled by its error measured on earlier layers
   (:func:`cct.engines.autotune.model_errors`);
4. a layer predicted to take ``CLOSE_CALL_MIN_SECONDS`` (5 ms) or more, where another lowering is predicted
   within ``AUTOTUNE_WINDOW`` (3x) of the best (a close call: the model errs by up to that) → those
   candidates measured (:func:`cct.engines.autotune.autotune`: one chunk of the layer, cached per geometry),
   the fastest wins; a clear winner is taken as predicted;
5. a smaller layer → the prediction, but type 1 unless another is predicted ``PREFER_TYPE1_FRACTION`` (5%)
   faster.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import numpy as np

from cct.config import settings
from cct.engines import conv_engine_class, create_conv_engine
from cct.engines.autotune import autotune, autotune_conv_engine, machine_rates, model_errors, net_ledger
from cct.engines.base import ConvEngine, ConvGeometry, choosing_for_forward_only, forward_only, scoped_value
from cct.engines.cost_model import MachineRates, estimate_seconds, layer_costs
from cct.errors import CctError

# auto keeps type 1 unless another lowering is predicted to save at least this much (any layer) ...
PREFER_TYPE1_SECONDS = 1e-3
# ... and, where the model decides (no measurement), this fraction of the layer's time
PREFER_TYPE1_FRACTION = 0.05
# a measured engine choice keeps the lowering engine unless it takes over this fraction longer than another: a
# measurement's margin, smaller than a model's (on a 16->16 3^3 layer on 30^3 the lifted FFT measured 3.4% and
# 5% faster in two runs and the lowering, kept at a 5% margin, ran 5-10% slower than the FFT in the benchmark
# after each: auto missed the fastest choice by more than the 5% it is held to)
MEASURED_PREFER_FRACTION = 0.02
# autotune="auto" measures layers predicted to take this long (forward + backward, whole batch) or more ...
AUTOTUNE_MIN_SECONDS = 0.05
# ... and the lowerings' close calls from this long (two or three lowerings measured in a fraction of a second):
# the CcT sweep's layers at batch 16 take 40-45 ms on 2 cores, and at d/o = 4 the model put lowering 2 and 3 within
# 0.4% of each other where 3 ran 10% faster (AVX-512 kernels, once lowering became a compiled kernel); on 16 cores
# they take 20-40 ms, predicted 10-25: at d/o = 1/2 the model's lowering 2 ran 13% slower than lowering 1, unmeasured
# below 20 ms
CLOSE_CALL_MIN_SECONDS = 0.005
# ... where the calibrated model finds another lowering within this factor of its best (a close call);
# only those candidates are measured.  The model's error: within 10% on a 2-core AMD EPYC, but on a 2-core Intel
# Xeon (AVX-512 kernels) lowering 3 ran 1.15-1.54x its prediction on the CcT sweep (1 and 2: 0.9-1.25x), and at
# d/o = 8 it was predicted 1.42x faster than lowering 2 and ran 10% slower; on a 16-core Xeon at d/o = 32 (16
# images, one a partition) lowering 3 was predicted 26.6 ms against lowering 2's 69.3 and ran 61-68 ms against
# 52-59: a 2.6x error between the two, so the window is 3x (a candidate measured costs one chunk of the layer)
AUTOTUNE_WINDOW = 3.0
# auto engine choice with -autotune fast, where a measurement must be worth its time: the FFT and Winograd engines
# measured only where their prediction is within this factor of a gain (-autotune full measures them wherever they
# apply); the FFT model runs up to ~1.3x pessimistic on small 3-D layers (a 16->16 3^3 layer on 30^3: lifted FFT
# predicted 10.5 ms, ran 8.3 against lowering's 10.4) and a fresh calibration moves it by ~10%: at 1.3 such a layer
# was measured in some runs only.  (The Winograd model errs the other way: on a 2-core Intel Xeon F(4x4,3x3) ran
# 2-2.3x its prediction on CaffeNet's conv3 and VGG16's conv1_1 — whose 3 input channels leave the transforms all
# the work: predicted 195 ms against the lowering's 79, it took a fresh net's whole 5.2 s of autotuning —; with the
# kernels' transforms and the chunks' GEMMs counted, 1.05-1.37x: MODEL_WINOGRAD_MARGIN)
FAST_MEASURE_WINDOW = 1.5
# ... over this fraction for an engine that keeps more than KEPT_BYTES between a layer's passes (the FFT engine's
# spectra): measured alone it has the caches to itself, in a net it does not, and each pass allocates and faults
# in hundreds of MiB — CaffeNet's conv2 at 64 images, FFT against lowering: AVX-512 kernels, 7% faster alone, 25%
# slower in the net; AVX2 kernels, 26% faster alone (300 vs 406 ms), 1.5% slower in the net (414 vs 408 ms), and
# 300 MiB more RSS. Both are a 1.35x swing: below this margin the net would gain nothing for its memory. (Since the
# allocator keeps the FFT's arrays and its layout moves run image by image, the FFT does as well in the net as
# alone — CaffeNet's conv2 with AVX-512 kernels, 1.25x lowering's speed alone, ran the iteration 10% faster —: the
# margin now guards memory, and a net's first KEPT_BUDGET_BYTES of such spectra go on the usual margin.)
KEPT_FRACTION = 0.40
KEPT_BYTES = 64 << 20
# a net may keep this many bytes of such spectra (layers keeping over KEPT_BYTES each) on the usual margin, in the order
# they are chosen (with -autotune fast the measured ones largest first); beyond it KEPT_FRACTION holds: CaffeNet's conv2
# (67.5 MiB) on the FFT with AVX-512 kernels, 1.25x lowering's speed in the autotune, ran the iteration 10% faster with
# peak RSS 1.02x PyTorch's.  Since the short transforms are DFT matrix products (no scipy.fft copies as large as the
# spectra), conv2, conv3 and conv4 on the FFT (250 MiB) ran CaffeNet at 0.52x PyTorch's time with 1.065x its peak RSS
# (AVX-512 kernels; at 128 MiB conv2 alone, 0.61x and 1.04x); with AVX2 kernels all four (conv3 and conv4 40% faster)
# 0.44x with 1.055x.
KEPT_BUDGET_BYTES = 256 << 20
# where the models alone decide (autotune off, or the net's measuring budget spent), the FFT must be predicted
# faster than the lowering by this factor, not by the 5% a measurement must show: the FFT model errs by more than
# that — CaffeNet's conv3-conv5 (AVX2 kernels) predicted 6-11% faster measured 2-8% slower; on a 2-core Intel Xeon
# VGG16's conv3_1, conv4_2 and conv4_3 (8 images) predicted 5-10% faster on the lifted layout ran 1.15-2.3x slower
# than its model and 1.2-1.5x the lowering's time, while the lowering's model held within 10%
MODEL_FFT_MARGIN = 1.2
# auto takes the smaller Winograd tile (F(2x2,3x3): the more accurate) when it is measured within this factor of
# the larger's time
WINOGRAD_TILE_WINDOW = 1.03
# where the models alone decide, the Winograd engine must be predicted faster than the lowering by this factor: its
# model (the kernels' transforms and the chunks' GEMMs counted) ran 1.05-1.37x optimistic on VGG16's 3x3 layers at
# 8 images on a 2-core Intel Xeon (AVX-512 kernels; F(4x4,3x3): conv3_x 1.05, conv1_2 to conv2_2 1.16-1.21,
# conv4_x 1.15-1.23, the 14x14 conv5_x 1.37), and at this margin it took conv2_2, conv3_1 and conv4_x (measured
# 1.15-1.6x faster than the lowering) and left conv1_2, conv2_1 and conv5_x (0.93-0.98x) to the lowering
MODEL_WINOGRAD_MARGIN = 1.2


def engine_for_layer(kind: str = "Convolution") -> SelectedEngine:
    """A new engine for a Convolution/Deconvolution layer, following the current engine and lowering settings
    (called by the layer creator functions; the engine that runs is chosen at each new geometry)."""
    return SelectedEngine(settings.get("conv_engine"), settings.source("conv_engine"),
                          settings.get("lowering"), settings.source("lowering"))


class SelectedEngine(ConvEngine):
    """The engine a convolution layer owns: the lowering, FFT or Winograd engine (:attr:`inner`), chosen for each
    geometry at the layer's reshape by the ``conv_engine`` setting the layer was created with:

    * ``lowering`` — the lowering engine (with the ``lowering`` setting);
    * ``fft`` — the FFT engine (strided layers too, as their stride-1 convolution); a layer it cannot
      compute (arrays on a GPU, no spatial axes) is an error;
    * ``auto`` — :func:`choose_conv_engine`: the fastest measured of the lowering engine and the FFT
      engine's layouts on stride-1 layers where the FFT engine may save time; otherwise the lowering engine,
      with the reason in :meth:`describe`.

    Every engine call goes to :attr:`inner`; other attributes (``strategy``, ``reuses``, ...) are read from
    it too.  :attr:`reason` says why this engine runs ("" when the setting named it).  An engine created while a
    net that runs no backward is built (:func:`cct.engines.base.choosing_for_forward_only`) is chosen, at every
    geometry, by the forward's time alone (:attr:`forward_only`)."""

    def __init__(self, choice: str = "auto", source: str = "default", lowering: int | str = "auto",
                 lowering_source: str = "default"):
        super().__init__()
        if choice not in ("lowering", "fft", "winograd", "depthwise", "auto") or lowering not in (1, 2, 3, "auto"):
            raise ValueError(f"SelectedEngine({choice!r}, lowering={lowering!r})")
        self.choice, self.source = choice, source
        self.lowering, self.lowering_source = lowering, lowering_source
        self.inner: ConvEngine | None = None
        self.reason = ""
        self._key: tuple[Any, ...] | None = None
        self.forward_only = forward_only()

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
        with choosing_for_forward_only(self.forward_only):
            return self._configure(geometry, dtype, xp, key)

    def _configure(self, geometry: ConvGeometry, dtype: Any, xp: Any, key: tuple[Any, ...]) -> bool:
        choice, reason = choose_conv_engine(geometry, dtype, xp, self.choice, self.source, self.lowering)
        name, _, layout = choice.partition(" ")  # "fft lifted" / "winograd 2": a measured layout or tile
        tile = int(layout) if name == "winograd" and layout else None
        changed = self.inner is None or self.inner.name != name or reason != self.reason
        if self.inner is None or self.inner.name != name or (tile is not None and self.inner.tile != tile):
            self.inner = create_conv_engine(name) if tile is None else conv_engine_class(name)(tile)
            changed = True
        if name == "lowering":
            if self.lowering == "auto":
                self.inner.request(*choose_strategy(geometry, dtype, xp))
            else:
                self.inner.request(self.lowering, f"forced by {self.lowering_source}")
        if name == "fft":  # the measured layout, or (None) the engine's own choice
            self.inner.requested_lift = (layout == "lifted") if layout else None
        self.reason = reason
        changed = self.inner.configure(geometry, dtype, xp) or changed
        self.geometry, self._key = geometry, key
        return changed

    def choose_again(self, geometry: ConvGeometry, dtype: Any = None, xp: Any = None) -> bool:
        """:meth:`configure` choosing anew (a choice made while the net's measurements were put off:
        :meth:`cct.engines.autotune.Ledger.putting_off`)."""
        self._key = None
        return self.configure(geometry, dtype, xp)

    def describe(self) -> str:
        text = self._engine().describe()
        return f"{text}; {self.reason}" if self.reason else text

    def workspace_bytes(self) -> int:
        return self.inner.workspace_bytes() if self.inner is not None else 0

    def batch_partitions(self) -> int:
        return self._engine().batch_partitions()

    def forward(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        return self._engine().forward(x, w, b, y)

    def forward_rectified(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        return self._engine().forward_rectified(x, w, b, y)

    def backward(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        self._engine().backward(x, dy, w, dx, dw)

    def forward_and_backward_weights(self, x: Any, w: Any, y: Any | None, dy: Any, dw: Any | None) -> None:
        self._engine().forward_and_backward_weights(x, w, y, dy, dw)


_engines_for: ContextVar[Any] = ContextVar("cct_engines_for", default=None)


def engines_for(xp: Any) -> contextlib.AbstractContextManager[None]:
    """Within the block (``xp`` not None) layers configure their engines for arrays of ``xp``, whatever module
    their own blobs are on: a net built to run its layers on a GPU (Caffe's GPU mode, where the device's copies of
    the layers run the passes) chooses as they will, and measures nothing on the host."""
    return scoped_value(_engines_for, xp)


def configure_engine(engine: ConvEngine, geometry: ConvGeometry, dtype: Any, xp: Any,
                     report: Callable[[], None]) -> None:
    """A layer's ``engine.configure(geometry, dtype, xp)`` at its reshape (``xp``: the module of
    :func:`engines_for`, where a block sets one), calling ``report`` (the layer's line
    about its engine) when the choice changed.  While a net is built with the fast autotune, a measurement the
    choice asks for is put off until the whole net is known (:meth:`cct.engines.autotune.Ledger.putting_off`):
    the models choose for now, and the engine is chosen again — and reported then — when the ledger measures the
    net's layers, largest first (:meth:`~cct.engines.autotune.Ledger.measure_deferred`)."""
    xp = _engines_for.get() or xp
    ledger = net_ledger()
    if ledger is None or not ledger.defers() or not isinstance(engine, SelectedEngine):
        if engine.configure(geometry, dtype, xp):
            report()
        return
    with ledger.putting_off() as put_off:
        changed = engine.configure(geometry, dtype, xp)
    if not put_off():
        if changed:
            report()
        return

    def again() -> None:
        if engine.geometry == geometry:  # not reshaped to another geometry since
            engine.choose_again(geometry, dtype, xp)
            report()
    ledger.defer(f"{geometry}-{np.dtype(dtype)}", min(predicted_seconds(geometry).values()), again)


def fft_applies(g: ConvGeometry, xp: Any = None) -> tuple[bool, str]:
    """(True, "") when the FFT engine can compute ``g`` on arrays of ``xp``, else (False, the reason)."""
    from cct.engines.fft import FFTEngine

    if xp is not None and xp is not np:
        return False, "the fft engine runs on the CPU and this layer's arrays are on a GPU"
    return FFTEngine.supports(g)


def _decided(how: str) -> str:
    """``how`` a prediction or a measurement decided a layer's engine or lowering, naming the pass it weighed
    where that was the forward alone (a net that runs no backward): ``cost model, forward pass``."""
    return f"{how}, forward pass" if forward_only() else how


def predicted_fft_seconds(g: ConvGeometry, dtype: Any = np.float32, rates: MachineRates | None = None) -> float:
    """The FFT engine's predicted forward+backward seconds for ``g`` (the forward's while choosing for a net that
    runs no backward), its faster layout (its own model at ``rates``, default the machine's as cached; nothing
    measured)."""
    from cct.engines.fft import FFTEngine

    return min((e.chosen_seconds for e in FFTEngine.estimates(g, dtype, rates or machine_rates())),
               default=float("inf"))


def predicted_winograd_seconds(g: ConvGeometry, dtype: Any = np.float32, rates: MachineRates | None = None) -> float:
    """The Winograd engine's predicted forward+backward seconds for ``g`` (the forward's while choosing for a net
    that runs no backward), its faster tile (its own model at ``rates``, default the machine's as cached; nothing
    measured)."""
    from cct.engines.winograd import WinogradEngine

    return min(e.chosen_seconds for e in WinogradEngine.estimates(g, dtype, rates or machine_rates()))


def _lowering_prediction(g: ConvGeometry, lowering: int | str, rates: MachineRates | None = None) -> float:
    predicted = predicted_seconds(g, rates)
    if lowering != "auto" and lowering in predicted:
        return predicted[int(lowering)]
    return min(predicted.values())


def winograd_applies(g: ConvGeometry, xp: Any = None) -> tuple[bool, str]:
    """(True, "") when the Winograd engine can compute ``g`` on arrays of ``xp``, else (False, the reason)."""
    from cct.engines.winograd import WinogradEngine

    if xp is not None and xp is not np:
        return False, "the winograd engine runs on the CPU and this layer's arrays are on a GPU"
    return WinogradEngine.supports(g)


def depthwise_applies(g: ConvGeometry, xp: Any = None) -> tuple[bool, str]:
    """(True, "") when the depthwise engine can compute ``g`` on arrays of ``xp``, else (False, the reason)."""
    from cct.engines.depthwise import DepthwiseEngine

    return DepthwiseEngine.supports(g, xp)


def choose_conv_engine(g: ConvGeometry, dtype: Any = np.float32, xp: Any = None, choice: str = "auto",
                       source: str = "default", lowering: int | str = "auto") -> tuple[str, str]:
    """(engine name, reason) for geometry ``g`` under the ``conv_engine`` setting ``choice``.

    ``winograd``: the Winograd engine wherever it applies (3x3, stride 1, 2-D, CPU), the lowering engine elsewhere
    with the reason; ``depthwise`` likewise the depthwise engine (one input channel per group, 2-D, CPU with the
    compiled kernels).  ``auto``: on a layer the depthwise engine can run, it or the lowering engine, whichever the
    models predict faster (:func:`_depthwise_by_models`); elsewhere the candidates beside the lowering engine are
    the FFT engine, where it applies and the two models (:func:`predicted_seconds`, :func:`predicted_fft_seconds`)
    leave it a chance to save ``PREFER_TYPE1_SECONDS`` even at ``FAST_MEASURE_WINDOW`` times its prediction, and the
    Winograd engine, where it applies, the layer is predicted to take ``AUTOTUNE_MIN_SECONDS`` or more and the
    Winograd model leaves it the same chance (its transforms cost some float32 precision, so small layers keep the
    lowering engine's sums).  With no candidate the lowering engine runs (small layers, most strided ones: they keep
    Caffe's summation order); otherwise all are measured on the layer (:func:`autotune_conv_engine`, cached) and the
    fastest taken when the lowering engine takes over ``MEASURED_PREFER_FRACTION`` (2%) longer (``KEPT_FRACTION``,
    40%, for an FFT layout that keeps more than ``KEPT_BYTES`` of spectra between the passes, over the lowering and
    every other qualified engine, unless the net being built still has room for them in ``KEPT_BUDGET_BYTES``: the
    first such layers chosen spend it) — the smaller Winograd tile when it is within ``WINOGRAD_TILE_WINDOW`` of the
    larger (it is the more accurate).  With autotune off (``CCT_AUTOTUNE=0``), or the net's measuring budget spent,
    the models decide, each scaled by its error measured on this machine, the FFT and Winograd engines by a margin
    (:func:`_engine_by_models`; :func:`_fft_predicted_faster`: never for an FFT keeping more than ``KEPT_BYTES`` of
    spectra); with autotune forced on, every applicable layer is measured."""
    if choice == "lowering":
        return "lowering", ""
    dw_ok, dw_why = depthwise_applies(g, xp)
    if choice == "depthwise":
        return ("depthwise", "") if dw_ok else ("lowering", f"not depthwise: {dw_why}")
    wino_ok, wino_why = winograd_applies(g, xp)
    if choice == "winograd":
        return ("winograd", "") if wino_ok else ("lowering", f"not winograd: {wino_why}")
    ok, why = fft_applies(g, xp)
    if choice == "fft":
        if not ok:
            raise CctError(f"conv_engine fft (set by {source}) cannot run this layer: {why}; "
                           f"use conv_engine lowering or auto")
        return "fft", ""
    tune = settings.get("autotune")
    fft_why = ""
    if not ok:
        fft_why = f"not fft: {why}"
    elif any(st != 1 for st in g.stride):  # fft would compute every stride-1 output and drop the rest
        st = g.stride[0] if len(set(g.stride)) == 1 else "x".join(map(str, g.stride))
        fft_why = f"not fft: stride {st} > 1"
    elif all(k == 1 for k in g.kernel):  # a GEMM already: transforms can only add work
        fft_why = "not fft: a 1x1 kernel"
    # with a candidate beside lowering on a layer of some size, the models run at this machine's rates
    # (calibrated once, about 1 s)
    rates = machine_rates()
    t_low = _lowering_prediction(g, lowering, rates)
    if dw_ok:  # (one input channel per group: the FFT's and Winograd's transforms would do the work)
        return _depthwise_by_models(g, dtype, t_low, rates)
    if (not fft_why or wino_ok) and t_low >= PREFER_TYPE1_SECONDS:
        rates = machine_rates(calibrate_if_missing=True)
        t_low = _lowering_prediction(g, lowering, rates)
    # Winograd replaces the lowering's sums on layers of some size only (its transforms cost some precision)
    wino_sized = wino_ok and t_low >= AUTOTUNE_MIN_SECONDS
    wino = wino_ok and tune is not False and (tune is True or (
        wino_sized
        and t_low - predicted_winograd_seconds(g, dtype, rates) / FAST_MEASURE_WINDOW >= PREFER_TYPE1_SECONDS))
    fft = not fft_why
    t_fft = predicted_fft_seconds(g, dtype, rates) if fft else 0.0
    if fft and tune is not True:  # else the usual case: the layer's log line shows both predictions
        fft = t_low - t_fft / FAST_MEASURE_WINDOW >= PREFER_TYPE1_SECONDS
    if tune is False and (fft or wino_sized):
        return _engine_by_models(g, dtype, t_low, _decided("engine by cost model"), fft, wino_sized)
    if not fft and not wino:
        return "lowering", fft_why
    strategy = choose_strategy(g, dtype)[0] if lowering == "auto" else int(lowering)
    measured = autotune_conv_engine(g, dtype, strategy, max(t_low, t_fft), fft=fft, winograd=wino)
    if measured is None:  # the net's measuring budget is spent: the calibrated models decide
        return _engine_by_models(g, dtype, t_low, _decided("engine by cost model, autotune budget spent"), fft, wino)
    # a measured tie keeps the lowering engine (Caffe's summation order, no spectra or tiles to hold): another
    # engine qualifies when the lowering engine takes over MEASURED_PREFER_FRACTION longer (no absolute floor: a
    # layer measured at all is one where the models saw PREFER_TYPE1_SECONDS to gain, and a 16->16 3^3 layer's
    # FFT saving 13% of 7.6 ms is real), over KEPT_FRACTION when it keeps more than KEPT_BYTES between the passes
    kept = _kept_bytes(g, dtype, measured)
    ledger = net_ledger()  # the net being built spends KEPT_BUDGET_BYTES of large spectra on the usual margin
    heavy = {k for k in measured if kept.get(k, 0) > KEPT_BYTES
             and not (ledger and ledger.kept + kept[k] <= KEPT_BUDGET_BYTES)}
    qualified = {k: t for k, t in measured.items() if k != "lowering" and measured["lowering"] >= t * (
        1 + (KEPT_FRACTION if k in heavy else MEASURED_PREFER_FRACTION))}
    # what holds a layer's spectra for KEPT_FRACTION more speed over the lowering engine must show it over the
    # other qualified engines too (CaffeNet's conv3 with AVX2 kernels: the FFT measured as fast as Winograd
    # F(4x4,3x3), 1.45x lowering's speed, and ran as fast in the net with 98 MiB of spectra more)
    light = [t for k, t in qualified.items() if k not in heavy]
    if light:
        qualified = {k: t for k, t in qualified.items() if k not in heavy or min(light) >= t * (1 + KEPT_FRACTION)}
    name = min(qualified, key=qualified.__getitem__) if qualified else "lowering"
    tiles = sorted((k for k in qualified if k.startswith("winograd ")), key=lambda k: int(k.split()[1]))
    if name in tiles and qualified[tiles[0]] <= WINOGRAD_TILE_WINDOW * qualified[name]:
        name = tiles[0]
    if ledger and kept.get(name, 0) > KEPT_BYTES:
        ledger.kept += kept[name]
    return name, _decided("engine autotuned") + ": " + ", ".join(f"{k} {t * 1e3:.3g} ms" for k, t in measured.items())


def _depthwise_by_models(g: ConvGeometry, dtype: Any, t_low: float, rates: Any) -> tuple[str, str]:
    """(engine, reason) on a layer with one input channel per group: the depthwise engine where its model beats
    the lowering's (one tiny GEMM per group: 5-17x slower on MobileNet's layers at 16 images, 2 cores)."""
    from cct.engines.depthwise import DepthwiseEngine

    t_dw = DepthwiseEngine.estimates(g, dtype, rates)[0].chosen_seconds
    name = "depthwise" if t_dw < t_low else "lowering"
    return name, (_decided("engine by cost model")
                  + f" (depthwise {t_dw * 1e3:.3g} ms, lowering {t_low * 1e3:.3g} ms predicted)")


def _engine_by_models(g: ConvGeometry, dtype: Any, t_low: float, why: str, fft: bool = True,
                      winograd: bool = False) -> tuple[str, str]:
    """(engine, reason) where the models alone decide between the lowering engine (predicted ``t_low``), the FFT
    engine's layouts (``fft``) and the Winograd engine's tiles (``winograd``): each prediction scaled by its
    model's measured error on this machine (:func:`cct.engines.autotune.model_errors`: the engine autotune's
    whole-batch measurements so far); the faster FFT layout counts where :func:`_fft_predicted_faster` says it
    beats the lowering, the faster Winograd tile (the smaller within ``WINOGRAD_TILE_WINDOW``) where it is
    predicted ``MODEL_WINOGRAD_MARGIN`` times faster and ``PREFER_TYPE1_SECONDS`` sooner; the faster of those
    that count runs."""
    errors = model_errors()
    rates = machine_rates()
    low = t_low * errors.get("lowering", 1.0)
    predicted = {"lowering": low}
    counts: dict[str, float] = {}
    if fft:
        from cct.engines.fft import FFTEngine

        layouts = {e.variant: e.chosen_seconds * errors.get(e.variant, 1.0)
                   for e in FFTEngine.estimates(g, dtype, rates)}
        name = min(layouts, key=layouts.__getitem__)
        predicted[name] = layouts[name]
        if _fft_predicted_faster(g, dtype, low, layouts[name], name.split()[1]):
            counts[name] = layouts[name]
    if winograd:
        from cct.engines.winograd import WinogradEngine

        tiles = {e.variant: e.chosen_seconds * errors.get(e.variant, 1.0)
                 for e in WinogradEngine.estimates(g, dtype, rates)}
        name = min(tiles, key=tiles.__getitem__)
        smallest = min(tiles, key=lambda k: int(k.split()[1]))
        if tiles[smallest] <= WINOGRAD_TILE_WINDOW * tiles[name]:
            name = smallest
        predicted[name] = tiles[name]
        if low - tiles[name] >= PREFER_TYPE1_SECONDS and low >= tiles[name] * MODEL_WINOGRAD_MARGIN:
            counts[name] = tiles[name]
    chosen = min(counts, key=counts.__getitem__) if counts else "lowering"
    scaled = [f"{k} x{errors[k]:.2f}" for k in predicted if errors.get(k, 1.0) != 1.0]
    return chosen, f"{why} (" + ", ".join(f"{k} {t * 1e3:.3g} ms" for k, t in predicted.items()) + " predicted" + (
        f"; scaled by the models' measured error here: {', '.join(scaled)})" if scaled else ")")


def _fft_predicted_faster(g: ConvGeometry, dtype: Any, t_low: float, t_fft: float, layout: str | None = None) -> bool:
    """Whether the models' FFT time beats the lowering's by at least ``PREFER_TYPE1_SECONDS`` and by the factor
    ``MODEL_FFT_MARGIN`` (the model's error, larger than the 5% a measured FFT must show), and never where every
    FFT layout keeps more than ``KEPT_BYTES`` of spectra between the passes: that much memory only for a measured
    gain (CaffeNet at
    64 images with AVX2 kernels, a cold cache: the models put conv4 and conv5 on the FFT, predicted 40% faster
    and in the net 0.9-1.05x the alternatives, and with conv2's measured FFT the net held 2106 MiB, 1.19x
    PyTorch's; conv3-5 predicted 6-11% faster had measured 2-8% slower with 400 MiB more).  The layout counted is
    the one that would run (``layout``; default the engine model's choice), not the one keeping least."""
    from cct.engines.fft import FFTEngine

    est = FFTEngine.estimate(g, np.dtype(dtype).itemsize, machine_rates())
    if settings.get("fft_memoize") and est[layout or est["choice"]]["memo_bytes"] > KEPT_BYTES:
        return False
    return t_low - t_fft >= PREFER_TYPE1_SECONDS and t_low >= t_fft * MODEL_FFT_MARGIN


def _kept_bytes(g: ConvGeometry, dtype: Any, measured: dict[str, float]) -> dict[str, float]:
    """Bytes each measured FFT layout keeps between a layer's passes (its memoized spectra)."""
    if not any(k.startswith("fft ") for k in measured) or not settings.get("fft_memoize"):
        return {}
    from cct.engines.fft import FFTEngine

    est = FFTEngine.estimate(g, np.dtype(dtype).itemsize, machine_rates())
    return {f"fft {k}": float(est[k]["memo_bytes"]) for k in ("full", "lifted") if k in est}


def _partitions(g: ConvGeometry) -> int:
    from cct.runtime.partition import partitions_for_flops

    return partitions_for_flops(g.num, 2.0 * g.out_channels * (g.in_channels // g.group) * g.kernel_count
                                * g.out_count)


def predicted_seconds(g: ConvGeometry, rates: MachineRates | None = None) -> dict[int, float]:
    """The cost model's forward+backward seconds of every applicable strategy (``rates``: this machine's if
    calibrated, else the defaults; nothing is measured here)."""
    from cct.engines.lowering import lifts_per_image, strategy_fallback

    rates = rates or machine_rates(calibrate_if_missing=False)
    parts = _partitions(g)
    return {s: estimate_seconds(layer_costs(g, s, per_image_lifting=lifts_per_image(g, s)), rates, parts)
            for s in (1, 2, 3) if strategy_fallback(s, g) is None}


def predicted_engine_seconds(g: ConvGeometry, dtype: Any = np.float32) -> dict[str, float]:
    """Predicted forward+backward seconds of each applicable lowering (keys ``"1"``..``"3"``) and of the FFT
    engine (``"fft"``, where it applies): what a convolution layer logs at setup."""
    out = {str(s): t for s, t in predicted_seconds(g).items()}
    if fft_applies(g)[0]:
        out["fft"] = predicted_fft_seconds(g, dtype)
    return out


def choose_strategy(g: ConvGeometry, dtype: Any = np.float32, xp: Any = None) -> tuple[int, str]:
    """``auto``: (strategy, reason) for geometry ``g`` on arrays of ``xp`` — see the module docstring for the
    rules."""
    predicted = predicted_seconds(g)
    if len(predicted) == 1:
        return 1, "cost model: only lowering 1 applies"
    if xp is not None and xp is not np:
        return 1, "on a GPU: the cost model and the measurements are the CPU's"
    tune = settings.get("autotune")
    if tune is True:
        measured = autotune(g, dtype)
        if measured is not None:
            return min(measured, key=measured.__getitem__), _decided("autotuned")
    best = min(predicted, key=predicted.__getitem__)
    # nothing measurable to gain (where a close call would be measured: even at the model's error): keep Caffe's
    # summation order
    if predicted[1] - predicted[best] / (AUTOTUNE_WINDOW if tune == "auto" else 1.0) < PREFER_TYPE1_SECONDS:
        return 1, _decided("cost model")
    # at this machine's rates, each lowering's prediction scaled by its model's measured error here
    errors = model_errors()
    predicted = {s: t * errors.get(f"lowering {s}", 1.0)
                 for s, t in predicted_seconds(g, machine_rates(calibrate_if_missing=True)).items()}
    best = min(predicted, key=predicted.__getitem__)
    if tune == "auto" and predicted[best] >= CLOSE_CALL_MIN_SECONDS:
        close = [s for s, t in predicted.items() if t <= AUTOTUNE_WINDOW * predicted[best]]
        if len(close) > 1:
            measured = autotune(g, dtype, close)
            if measured is not None:
                return min(measured, key=measured.__getitem__), _decided("autotuned")
            return best, _decided("cost model, autotune budget spent")
        return best, _decided("cost model")
    if predicted[1] - predicted[best] < max(PREFER_TYPE1_SECONDS, PREFER_TYPE1_FRACTION * predicted[best]):
        best = 1  # a close call: keep type 1, Caffe's own summation order
    return best, _decided("cost model")


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
