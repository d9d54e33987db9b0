"""Lowering vs FFT per layer: the ``conv_engine`` setting (flag, environment, Python), ``auto``'s rules and its
measured, cached autotune, the forced-FFT errors, and what a layer and ``cct time`` report."""
from __future__ import annotations

import contextlib
import json
import math
import re

import numpy as np
import pytest

import cct.layers.conv  # noqa: F401  (registers the layers)
from cct import cli
from cct.config import settings
from cct.engines import ConvGeometry, autotune, choice, measured
from cct.engines.fft import FFTEngine
from cct.engines.lowering import LoweringEngine
from cct.errors import CctError
from cct.gradient_check import setup_layer
from tests.helpers import use_flags
from tests.solvers.helpers import captured_log, messages

BIG_7 = ConvGeometry(1, 16, 16, 1, (30, 30, 30), (7, 7, 7), (1, 1, 1), (0, 0, 0), (1, 1, 1))
SMALL = ConvGeometry(2, 3, 4, 1, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1))
CONV = ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 %s '
        'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')


def _no_measuring(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("measured")

    monkeypatch.setattr(choice, "autotune_conv_engine", fail)


# ---- settings ------------------------------------------------------------------------------------
def test_setting_values_and_sources():
    assert (settings.get("conv_engine"), settings.source("conv_engine")) == ("auto", "default")
    for text, value in (("", "auto"), ("AUTO", "auto"), (" fft ", "fft"), ("lowering", "lowering"),
                        ("Winograd", "winograd")):
        settings.set("conv_engine", text)
        assert settings.get("conv_engine") == value
    with pytest.raises(CctError, match="conv_engine must be lowering, fft, winograd, depthwise or auto"):
        settings.set("conv_engine", "direct")
    use_flags(None, None, "fft")
    assert (settings.get("conv_engine"), settings.source("conv_engine")) == ("fft", "-conv_engine")
    assert choice.engine_for_layer().choice == "fft"


def test_invalid_environment_is_an_error_at_use_not_at_import(monkeypatch):
    monkeypatch.setenv("CCT_CONV_ENGINE", "fast")
    monkeypatch.setenv("CCT_LOWERING", "7")
    with pytest.raises(CctError, match="CCT_CONV_ENGINE: conv_engine must be"):
        settings.get("conv_engine")
    with pytest.raises(CctError, match="CCT_LOWERING: lowering must be"):
        settings.get("lowering")
    use_flags("1", None, "lowering")  # flags override both
    assert choice.engine_for_layer().choice == "lowering"


# ---- the per-layer rules -------------------------------------------------------------------------
def test_lowering_setting_never_considers_fft(monkeypatch):
    _no_measuring(monkeypatch)
    assert choice.choose_conv_engine(BIG_7, choice="lowering") == ("lowering", "")


def test_forced_fft_serves_strided_layers_and_refuses_what_it_cannot(monkeypatch):
    _no_measuring(monkeypatch)
    strided = ConvGeometry(1, 2, 2, 1, (8, 8), (3, 3), (2, 2), (1, 1), (1, 1))
    assert choice.choose_conv_engine(strided, choice="fft") == ("fft", "")
    no_axes = ConvGeometry(2, 3, 4, 1, (), (), (), (), ())
    with pytest.raises(CctError, match=r"conv_engine fft \(set by flag\) cannot run this layer: no spatial axes"):
        choice.choose_conv_engine(no_axes, choice="fft", source="flag")
    with pytest.raises(CctError, match="on a GPU"):
        choice.choose_conv_engine(SMALL, xp=object(), choice="fft")


def test_auto_falls_back_with_a_reason(monkeypatch):
    _no_measuring(monkeypatch)
    strided = ConvGeometry(1, 16, 16, 1, (30, 30, 30), (7, 7, 7), (2, 2, 2), (0, 0, 0), (1, 1, 1))
    assert choice.choose_conv_engine(strided) == ("lowering", "not fft: stride 2 > 1")
    assert choice.choose_conv_engine(BIG_7, xp=object())[1].startswith("not fft: the fft engine runs on the CPU")
    # a small layer: nothing to gain, not measured, Caffe's summation order kept
    assert choice.choose_conv_engine(SMALL) == ("lowering", "")


@pytest.mark.parametrize("fft_ms,lowering_ms,expected", [(40, 100, "fft"), (30, 20, "lowering"),
                                                           (99.5, 100, "lowering"), (98.5, 100, "lowering"),
                                                           (97, 100, "fft")])
def test_auto_takes_the_measured_faster_engine(monkeypatch, fft_ms, lowering_ms, expected):
    seen = []

    def measured(g, dtype, lowering, predicted, fft=True, winograd=False):
        seen.append(g)
        return {"fft": fft_ms / 1e3, "lowering": lowering_ms / 1e3}

    monkeypatch.setattr(choice, "autotune_conv_engine", measured)
    name, reason = choice.choose_conv_engine(BIG_7)
    assert seen == [BIG_7] and name == expected  # a saving under 2% keeps the lowering engine
    assert reason == f"engine autotuned: fft {fft_ms:.3g} ms, lowering {lowering_ms:.3g} ms"


def test_a_close_call_on_part_of_the_batch_is_measured_again_on_the_whole_batch(monkeypatch):
    """A few images' FFT spectra stay in the caches: per image the FFT engine looks faster on part of the batch
    than on all of it (CaffeNet's conv2), so a close call is measured again on the whole batch."""
    conv2 = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    sizes = []

    def measure(engines, g, dtype, rounds, settle=0.0):
        sizes.append((g.num, sorted(engines)))
        fft = 0.9 if g.num < conv2.num else 1.1  # ms per image, lowering 1.0; the lifted layout 20% slower
        return {name: (1.0 if name == "lowering" else fft * (1.2 if name == "fft lifted" else 1.0)) * g.num * 1e-3
                for name in engines}

    from dataclasses import replace

    from cct.engines.cost_model import DEFAULT_RATES

    rates = replace(DEFAULT_RATES)  # as calibrated (the models' errors are kept against a machine's own rates)
    monkeypatch.setattr(autotune, "machine_rates", lambda *a, **k: rates)
    monkeypatch.setattr(autotune, "_measure_engines", measure)
    settings.set("partitions", 1)
    result = autotune._measure_conv_engines(conv2, np.float32, 2, 1.0)  # 1 s predicted: part of the batch
    # part of the batch, a quarter of that part (the steps' once-per-call share), the lowering beaten there once
    # more, then the whole batch
    assert sizes[0][0] < conv2.num and sizes[1][0] == sizes[0][0] // 4 and sizes[2] == (sizes[0][0], ["lowering"])
    assert sizes[3][0] == conv2.num and "lowering" in sizes[3][1]
    assert all(result["lowering"] < t for name, t in result.items() if name.startswith("fft"))
    kept = measured._read_cache()["model_error"]  # the models' error: from the whole-batch times only
    assert [sorted(entry) for entry in kept.values()] == [sizes[3][1]]
    sizes.clear()  # a clear call on part of the batch is not measured again on the whole batch ...
    monkeypatch.setattr(autotune, "FULL_BATCH_WINDOW", 1.05)
    autotune._measure_conv_engines(conv2, np.float32, 2, 1.0)
    assert sizes[0][0] < conv2.num and sizes[2:] == [(sizes[0][0], ["lowering"])]  # ... the beaten lowering is


@pytest.mark.parametrize("partitions,fit,want", [(4, 1, [4, 16]), (4, 7, [4, 16]), (1, 7, [7, 1, 16]),
                                                 (2, 6, [6, 2, 16]), (3, 7, [6, 3, 16]), (8, 2, [8, 16]),
                                                 (12, 2, [16, 16]), (2, 7, [6, 2, 16]), (16, 1, [16, 16]),
                                                 (1, 15, [16, 16])])
def test_part_of_the_batch_is_an_image_per_partition_at_least(partitions, fit, want, monkeypatch):
    """Measured on part of the batch (``fit`` of 16 images fit the measuring time), every batch partition of the
    layer gets as many images, one at least, in the quarter measurement too (or that is skipped): on fewer images
    the engines run with fewer partitions than in the layer (VGG16's conv3_2 at 8 images measured on one image: the
    lowering 838 ms, F(4x4,3x3) 1181 scaled to the batch, where the layer ran them in 737 and 537 ms).  Most of the
    batch is the whole batch, with no quarter (part of it, a quarter and the whole again would cost more: ResNet-50's
    14x14 layers at 16 images measured on 15 images, then 3, then 16); its close call is measured again there."""
    g = ConvGeometry(16, 256, 256, 1, (14, 14), (3, 3), (1, 1), (1, 1), (1, 1))
    assert _sizes_measured(monkeypatch, g, partitions, autotune.ENGINE_AUTOTUNE_SECONDS * 16 / fit) == want


def _sizes_measured(monkeypatch, g, partitions, predicted, **candidates):
    """The batch sizes the engine autotune measures ``g`` on with ``partitions`` forced, the lowering 10% faster
    than every other candidate per image."""
    sizes = []

    def measure(engines, geometry, dtype, rounds, settle=0.0):
        sizes.append(geometry.num)
        return {name: (1.0 if name == "lowering" else 1.1) * geometry.num * 1e-3 for name in engines}

    monkeypatch.setattr(autotune, "_measure_engines", measure)
    settings.set("partitions", partitions)
    autotune._measure_conv_engines(g, np.float32, 2, predicted, **candidates)
    return sizes


@pytest.mark.parametrize("size,partitions,want", [(28, 2, [8, 8]), (28, 1, [3, 1, 8]), (56, 2, [2, 8]),
                                                  (56, 1, [1, 8]), (14, 4, [8, 8])])
def test_part_of_the_batch_holds_a_chunk_of_winograd_tiles_per_partition(size, partitions, want, monkeypatch):
    """With the Winograd engine among the candidates, every partition's share of the part measured holds a chunk
    of its tiles (MIN_CHUNK_TILES, or the partition's whole share): on fewer its channel GEMMs are shorter than
    in the layer — VGG16's conv4_2 (28x28) at 8 images in two partitions measured on one image each:
    F(4x4,3x3) 569 ms scaled to the batch, 308 in the layer.  A 28x28 image makes 49 tiles, three images a
    chunk (in two partitions most of the batch, so the whole of it); a 56x56 image makes 196."""
    from cct.engines.winograd import MIN_CHUNK_TILES

    assert MIN_CHUNK_TILES == 128  # the rows' image counts follow from it
    g = ConvGeometry(8, 512, 512, 1, (size, size), (3, 3), (1, 1), (1, 1), (1, 1))
    assert _sizes_measured(monkeypatch, g, partitions, autotune.ENGINE_AUTOTUNE_SECONDS * 8, fft=False,
                           winograd=True) == want


def test_when_not_all_close_calls_fit_the_fastest_are_measured_again_on_the_whole_batch(monkeypatch):
    """Candidates within the window whose whole-batch steps would take too long together: the fastest that fit
    the time are measured again on the whole batch, and there the one slower on part of the batch (its
    once-per-call work weighing more on fewer images) wins — CaffeNet's conv3 with AVX2 kernels."""
    g = ConvGeometry(64, 256, 384, 1, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1))
    sizes = []
    part = {"winograd 2": 0.206, "winograd 4": 0.213, "fft full": 0.220, "fft lifted": 0.225,
            "lowering": 0.252}  # seconds per 64 images
    whole = {"winograd 2": 0.193, "winograd 4": 0.187}

    def measure(engines, geometry, dtype, rounds, settle=0.0):
        sizes.append((geometry.num, sorted(engines)))
        table = whole if geometry.num == g.num else part
        return {name: table[name] * geometry.num / g.num for name in engines}

    monkeypatch.setattr(autotune, "_measure_engines", measure)
    settings.set("partitions", 1)
    result = autotune._measure_conv_engines(g, np.float32, 2, 1.0, fft=True, winograd=True)
    assert sizes[0][0] < g.num and sizes[2] == (sizes[0][0], ["lowering"])  # beaten: measured once more
    assert sizes[3] == (g.num, ["winograd 2", "winograd 4"])
    assert min(result, key=result.__getitem__) == "winograd 4"
    assert autotune._fastest_within(part, 0.6) == ["winograd 2", "winograd 4"]  # 0.419 s fit, 0.639 s do not
    assert autotune._fastest_within(part, 2.0) == sorted(part, key=part.__getitem__)
    assert autotune._fastest_within(part, 0.2) == []
    assert autotune._fastest_within({"lowering": 0.3, "fft full": 0.5}, 10.0) == ["lowering"]  # 0.5 is not close


def test_a_step_with_once_per_call_work_is_measured_on_the_whole_batch(monkeypatch):
    """On part of the batch a step's once-per-call work (the FFT's kernel transforms) is scaled with the images:
    CaffeNet's conv2 at 64 images, its full FFT layout 84 ms on 8 images and 284 ms on 64 (668 scaled), beside a
    layout whose time grows with the images.  The time on a quarter of the images tells the once-per-call part;
    the layout it puts ahead is measured on the whole batch, where it wins, even when the two do not both fit the
    whole-batch time."""
    g = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    step = {"fft full": (0.070, 0.0037), "fft lifted": (0.0, 0.0090), "lowering": (0.0, 0.0098)}  # s, s per image
    sizes = []

    def measure(engines, geometry, dtype, rounds, settle=0.0):
        sizes.append((geometry.num, sorted(engines)))
        return {name: step[name][0] + step[name][1] * geometry.num for name in engines}

    monkeypatch.setattr(autotune, "_measure_engines", measure)
    monkeypatch.setattr(autotune, "FULL_BATCH_SECONDS", 2.0)  # 0.33 s of single steps: the lifted layout won't fit
    # both FFT layouts measured, whatever this machine's rates make of their model
    monkeypatch.setattr(autotune, "FFT_LAYOUT_WINDOW", float("inf"))
    settings.set("partitions", 1)
    result = autotune._measure_conv_engines(g, np.float32, 1, 1.6)  # measured on 10 images: full looks slowest
    assert sizes[0] == (10, ["fft full", "fft lifted", "lowering"]) and sizes[1][0] == 2
    assert sizes[2] == (10, ["lowering"])  # beaten by the lifted layout on part of the batch: measured once more
    assert sizes[3] == (g.num, ["fft full"])
    assert result["fft full"] == pytest.approx(0.070 + 0.0037 * 64)
    assert min(result, key=result.__getitem__) == "fft full"
    part = {"fft full": 0.050 + 0.0037 * 10, "fft lifted": 0.090}  # on 10 images, and on 2
    line = autotune._once_per_call_estimate(part, {"fft full": 0.0574, "fft lifted": 0.018}, 10, 2, 64)
    assert line["fft full"] == pytest.approx(0.050 + 0.0037 * 64) and line["fft lifted"] == pytest.approx(0.576)


def test_the_lowering_is_measured_again_before_the_whole_batch_candidates_are_picked(monkeypatch):
    """CaffeNet's conv2 at 64 images measured on 6: the lowering's first time a spike, the FFT's full layout the
    fastest there but only by its time scaled with the images (its once-per-call work scaled too).  The lowering,
    beaten, is measured once more and wins part of the batch; the FFT, which the line through its times on 1 and 6
    images puts ahead, is then measured on the whole batch, where it wins (picked before the lowering's second
    measurement, the FFT was the fastest on part of the batch, not measured whole, and lost to that measurement)."""
    g = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    sizes = []

    def measure(engines, geometry, dtype, rounds, settle=0.0):
        sizes.append((geometry.num, sorted(engines)))
        spike = 1.5 if len(sizes) == 1 else 1.0
        return {name: 0.045 + 0.0055 * geometry.num if name.startswith("fft") else spike * 0.0095 * geometry.num
                for name in engines}

    monkeypatch.setattr(autotune, "_measure_engines", measure)
    monkeypatch.setattr(autotune, "FFT_LAYOUT_WINDOW", 0.0)  # the layout the model picks only
    settings.set("partitions", 1)
    predicted = g.num * autotune.ENGINE_AUTOTUNE_SECONDS / 6.5  # 6 images fit the measuring time
    result = autotune._measure_conv_engines(g, np.float32, 1, predicted)
    assert [n for n, _ in sizes] == [6, 1, 6, 64] and sizes[2][1] == ["lowering"]
    fft = min(result, key=result.__getitem__)
    assert fft.startswith("fft") and sizes[3][1] == [fft]
    assert result[fft] == pytest.approx(0.045 + 0.0055 * 64) and result["lowering"] == pytest.approx(0.608, 1e-3)


def test_a_beaten_lowering_engine_is_measured_again_and_keeps_its_better_time(monkeypatch):
    """Another engine needs a margin over the lowering engine; one spike in the lowering's single measurement
    would hand the layer over, so where another engine wins the lowering is measured once more (noise only adds
    time: the better of its two times counts)."""
    g = ConvGeometry(8, 16, 16, 1, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1))
    calls = []

    def measure(engines, geometry, dtype, rounds, settle=0.0):
        calls.append(sorted(engines))
        spike = 3.0 if len(calls) == 1 else 1.0  # the lowering's first measurement hit a busy moment
        return {name: (spike if name == "lowering" else 1.5) * geometry.num * 1e-3 for name in engines}

    monkeypatch.setattr(autotune, "_measure_engines", measure)
    monkeypatch.setattr(autotune, "FULL_BATCH_WINDOW", 1.05)
    result = autotune._measure_conv_engines(g, np.float32, 1, 1e-3)
    assert calls[-1] == ["lowering"] and result["lowering"] < min(t for k, t in result.items() if k != "lowering")


def test_a_close_call_between_lowerings_on_part_of_the_batch_is_decided_on_the_whole_batch(monkeypatch):
    """The lowerings are measured on a chunk's images per partition; those within LOWERING_WHOLE_WINDOW of the
    fastest there are measured again on the whole batch (when that is cheap enough), which decides: a chunk runs
    otherwise than the layer's chunks one after the other."""
    g = ConvGeometry(16, 32, 256, 1, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    calls = []

    def measure(engines, geometry, dtype, rounds, settle=0.0, warm=False):
        calls.append((sorted(engines), geometry.num))
        per_image = {1: 5.6, 2: 6.1, 3: 20.0} if geometry.num < g.num else {1: 5.4, 2: 5.1, 3: 20.0}  # ms
        return {s: per_image[s] * geometry.num * 1e-3 for s in engines}

    monkeypatch.setattr(autotune, "_measure_engines", measure)
    settings.set("partitions", 2)
    result = autotune._autotune_lowerings(g, np.float32, [1, 2, 3], None)
    assert calls[0][1] < g.num and calls[-1] == ([1, 2], g.num)  # lowering 3, 3.5x slower, not again
    assert min(result, key=result.__getitem__) == 2 and result[2] == pytest.approx(5.1e-3)
    calls.clear()
    monkeypatch.setattr(autotune, "LOWERING_WHOLE_SECONDS", 0.1)  # the whole batch too dear: the chunk decides
    assert min(autotune._autotune_lowerings(g, np.float32, [1, 2, 3], None).items(), key=lambda kv: kv[1])[0] == 1
    assert all(num < g.num for _, num in calls)


def test_a_close_call_between_lowerings_is_measured_again_in_the_other_order(monkeypatch):
    """One round of a few images decides the lowering in a net's fast measurement: the lowerings within
    LOWERING_RECHECK_WINDOW of the fastest are measured once more, warm, in the other order, each keeping its
    better time — a spike on the true winner no longer hands the layer to another lowering; a clear loser is
    not measured again."""
    g = ConvGeometry(8, 16, 16, 1, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1))
    calls = []

    def measure(engines, geometry, dtype, rounds, settle=0.0, warm=False):
        calls.append((list(engines), warm))
        first = {1: 1.0, 2: 1.5, 3: 3.0}  # ms per step; lowering 2's first step hit a busy moment
        again = {1: 1.1, 2: 0.9, 3: 3.0}
        return {s: (first if len(calls) == 1 else again)[s] * 1e-3 for s in engines}

    monkeypatch.setattr(autotune, "_measure_engines", measure)
    result = autotune._autotune_lowerings(g, np.float32, [1, 2, 3], None)
    assert calls[0] == ([1, 2, 3], False) and calls[1] == ([2, 1], True) and len(calls) == 2
    assert min(result, key=result.__getitem__) == 2
    assert result[1] == pytest.approx(result[2] * 1.0 / 0.9)  # lowering 1 keeps its better (first) time
    calls.clear()
    monkeypatch.setattr(autotune, "LOWERING_RECHECK_WINDOW", 1.2)  # a clear call: measured once
    assert min(autotune._autotune_lowerings(g, np.float32, [1, 2, 3], None).items(), key=lambda kv: kv[1])[0] == 1
    assert len(calls) == 1


def test_measured_steps_see_new_operands_and_keep_the_engines_memory():
    """Each measured step changes its operands in place, as training does, instead of dropping an engine's
    memo: freeing the FFT engine's spectra before every step made it measure 1.6x its time in training."""
    from cct.engines.base import ConvEngine as Base

    class Spy(Base):
        name = "spy"

        def __init__(self):
            super().__init__()
            self.seen = []

        def configure(self, geometry, dtype=None, xp=None):
            self.geometry = geometry
            return True

        def invalidate(self):
            raise AssertionError("memo dropped")

        def forward(self, x, w, b, y):
            self.seen.append((x.copy(), w.copy()))
            return y

        def backward(self, x, dy, w, dx, dw):
            self.seen[-1] += (dy.copy(),)

    spies = [Spy(), Spy()]
    g = ConvGeometry(2, 3, 4, 1, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1))
    autotune._measure_engines({"a": spies[0], "b": spies[1]}, g, np.float32, rounds=3)
    seen = spies[0].seen + spies[1].seen
    assert len(seen) == 8  # every step of either engine saw operands no earlier step saw
    for i, a in enumerate(seen):
        for b in seen[:i]:
            assert all(not np.array_equal(u, v) for u, v in zip(a, b))


def test_a_settled_block_counts_its_settling_steps_past_the_first(monkeypatch):
    """In a settled block every step past the first SETTLE_STEPS counts (the best of dozens for a fast layer,
    not of ``rounds``): one engine's steady steps hit by noise in the timed rounds still measure its fast
    steps, the first steps (pools and allocator adapting) never count.  A fake clock: each step takes the time
    its engine's script says."""
    from cct.engines.base import ConvEngine as Base

    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])

    class Scripted(Base):
        name = "scripted"

        def __init__(self, times):
            super().__init__()
            self.times = list(times)

        def configure(self, geometry, dtype=None, xp=None):
            self.geometry = geometry
            return True

        def forward(self, x, w, b, y):
            clock[0] += self.times.pop(0) if self.times else 0.010
            return y

        def backward(self, x, dy, w, dx, dw):
            pass

    settle = autotune.SETTLE_STEPS
    # a: 1 ms for the first steps (never counted), then 10 ms, one 4 ms settling step, 10 ms in the rounds
    a = Scripted([0.001] * settle + [0.010, 0.004] + [0.010] * 40)
    # b: slow first steps, then 6 ms
    b = Scripted([0.050] * settle + [0.006] * 80)
    g = ConvGeometry(2, 3, 4, 1, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1))
    best = autotune._measure_engines({"a": a, "b": b}, g, np.float32, rounds=2, settle=0.25)
    assert best == {"a": pytest.approx(0.004), "b": pytest.approx(0.006)}


def test_an_fft_layout_keeping_many_spectra_must_save_more(monkeypatch):
    """Measured alone, the FFT engine has the caches to itself; in a net its kept spectra compete with every
    other layer (CaffeNet's conv2: 7% faster alone, 25% slower in the net; with AVX2 kernels 26% faster alone,
    as fast in the net): above KEPT_BYTES of spectra it must save KEPT_FRACTION, else MEASURED_PREFER_FRACTION."""
    conv2 = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    small = ConvGeometry(1, 16, 16, 1, (30, 30, 30), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    assert choice._kept_bytes(conv2, np.float32, {"fft lifted": 0})["fft lifted"] > choice.KEPT_BYTES
    assert choice._kept_bytes(small, np.float32, {"fft lifted": 0})["fft lifted"] < choice.KEPT_BYTES
    settings.set("autotune", True)  # measure every applicable layer
    kept = 0.100 * (1 + choice.KEPT_FRACTION)
    for g, lowering, expected in ((conv2, 0.107, "lowering"), (conv2, kept - 0.003, "lowering"),
                                  (conv2, kept + 0.003, "fft lifted"),
                                  (small, 0.103, "fft lifted"), (small, 0.1015, "lowering")):
        monkeypatch.setattr(choice, "autotune_conv_engine",
                            lambda *a, lowering=lowering, **k: {"lowering": lowering, "fft lifted": 0.100})
        assert choice.choose_conv_engine(g)[0] == expected, (g, lowering)
    settings.set("fft_memoize", "0")  # nothing kept
    monkeypatch.setattr(choice, "autotune_conv_engine", lambda *a, **k: {"lowering": 0.107, "fft lifted": 0.100})
    assert choice.choose_conv_engine(conv2)[0] == "fft lifted"


def test_an_fft_layout_keeping_many_spectra_must_save_more_over_every_other_engine_too(monkeypatch):
    """CaffeNet's conv3 with AVX2 kernels (once with 98 MiB of spectra kept): the FFT measured as fast as Winograd
    F(4x4,3x3) and 1.45x the lowering engine's speed; it runs only where it also beats the Winograd engine by
    KEPT_FRACTION (here a conv3 with 256 outputs, whose 70 MiB of spectra are all kept)."""
    conv3 = ConvGeometry(64, 256, 256, 1, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1))
    assert choice._kept_bytes(conv3, np.float32, {"fft full": 0})["fft full"] > choice.KEPT_BYTES
    settings.set("autotune", True)
    fast = 0.169 / (1 + choice.KEPT_FRACTION)
    for t_fft, expected in ((0.169, "winograd 4"), (0.165, "winograd 4"), (fast + 0.002, "winograd 4"),
                            (fast - 0.002, "fft full")):
        monkeypatch.setattr(choice, "autotune_conv_engine", lambda *a, t_fft=t_fft, **k: {
            "lowering": 0.247, "fft full": t_fft, "winograd 2": 0.182, "winograd 4": 0.169})
        assert choice.choose_conv_engine(conv3)[0] == expected, t_fft


def test_a_net_keeps_many_spectra_on_the_usual_margin_within_its_budget(monkeypatch):
    """While a net is built, layers whose FFT keeps over KEPT_BYTES of spectra take it on the usual 5% margin as
    long as the net's KEPT_BUDGET_BYTES has room, in the order they are chosen; the layer that does not fit needs
    KEPT_FRACTION again.  Outside a net (no budget) the 40% margin holds."""
    conv2 = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    kept = choice._kept_bytes(conv2, np.float32, {"fft full": 0})["fft full"]
    assert choice.KEPT_BYTES < kept <= choice.KEPT_BUDGET_BYTES
    monkeypatch.setattr(choice, "KEPT_BUDGET_BYTES", kept + kept // 2)  # room for one such layer
    settings.set("autotune", True)
    monkeypatch.setattr(choice, "autotune_conv_engine",
                        lambda *a, **k: {"lowering": 0.215, "fft full": 0.172})  # 1.25x: between the margins
    assert choice.choose_conv_engine(conv2)[0] == "lowering"
    with autotune.measuring_session() as ledger:
        assert choice.choose_conv_engine(conv2)[0] == "fft full" and ledger.kept == kept
        assert choice.choose_conv_engine(conv2)[0] == "lowering" and ledger.kept == kept  # no room left
    monkeypatch.setattr(choice, "KEPT_BUDGET_BYTES", kept - 1)
    with autotune.measuring_session() as ledger:
        assert choice.choose_conv_engine(conv2)[0] == "lowering" and ledger.kept == 0


def test_the_models_alone_never_trade_many_spectra_for_a_predicted_gain():
    """Where nothing is measured (autotune off, or the net's budget spent) the predicted FFT time must beat the
    lowering's by the model's error, MODEL_FFT_MARGIN (20%; a measured one needs 5%), and an FFT keeping more than
    KEPT_BYTES of spectra between the passes is left to a measurement however fast predicted."""
    conv2 = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    small = ConvGeometry(1, 16, 16, 1, (30, 30, 30), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    for g, t_low, expected in ((conv2, 0.121, False), (conv2, 0.5, False), (small, 0.121, True),
                               (small, 0.119, False), (small, 0.107, False)):
        assert choice._fft_predicted_faster(g, np.float32, t_low, 0.100) == expected, (g, t_low)
    assert not choice._fft_predicted_faster(small, np.float32, 0.0015, 0.0010)  # saves under PREFER_TYPE1_SECONDS


def test_the_models_count_the_spectra_of_the_layout_the_engine_runs(monkeypatch):
    """A conv3 with 256 outputs at 64 images: the engine's model runs the full layout (70 MiB of spectra), whose
    lifted one would keep 51 MiB; the rule counts the full layout's, so however fast predicted the models keep the
    lowering.  (The default rates: a machine's calibrated ones, which an earlier test may have cached, can rank
    the layouts the other way — with AVX-512 kernels on a Zen 5 they did.)"""
    from cct.engines.cost_model import DEFAULT_RATES
    from cct.engines.fft import FFTEngine

    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: DEFAULT_RATES)
    conv3 = ConvGeometry(64, 256, 256, 1, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1))
    est = FFTEngine.estimate(conv3, 4, DEFAULT_RATES)
    assert est["choice"] == "full"
    assert est["full"]["memo_bytes"] > choice.KEPT_BYTES > est["lifted"]["memo_bytes"]
    assert not choice._fft_predicted_faster(conv3, np.float32, 0.5, 0.100)


def test_auto_runs_the_measured_fft_layout(monkeypatch):
    monkeypatch.setattr(choice, "autotune_conv_engine",
                        lambda *a, **k: {"lowering": 0.1, "fft full": 0.06, "fft lifted": 0.05})
    assert choice.choose_conv_engine(BIG_7)[0] == "fft lifted"
    eng = choice.SelectedEngine("auto")
    eng.configure(BIG_7)
    assert eng.name == "fft" and eng.inner.lifted and "fft lifted 50 ms" in eng.describe()
    monkeypatch.setattr(choice, "autotune_conv_engine",
                        lambda *a, **k: {"lowering": 0.1, "fft full": 0.04, "fft lifted": 0.05})
    eng = choice.SelectedEngine("auto")
    eng.configure(BIG_7)
    assert eng.name == "fft" and not eng.inner.lifted


def test_autotune_off_decides_by_the_models(monkeypatch):
    _no_measuring(monkeypatch)
    settings.set("autotune", False)
    name, reason = choice.choose_conv_engine(BIG_7)
    assert name.startswith("fft ") and reason.startswith("engine by cost model")


def test_where_the_models_decide_they_are_scaled_by_their_measured_error(monkeypatch):
    """Each whole-batch measurement keeps measured / predicted seconds per engine and layout; where the models alone
    decide (autotune off, or the net's budget spent), each prediction is scaled by the median of those kept on this
    machine and thread setting (within MODEL_ERROR_RANGE), the FFT layout chosen by the scaled predictions too."""
    from dataclasses import replace

    from cct.engines.cost_model import DEFAULT_RATES

    # as calibrated: a machine's own rates (the defaults; one partition copying as fast as all, so that the
    # figures below are the models' for the whole machine)
    rates = replace(DEFAULT_RATES, part_share=1.0)

    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: rates)
    monkeypatch.setattr(autotune, "machine_rates", lambda *a, **k: rates)
    _no_measuring(monkeypatch)
    settings.set("autotune", False)
    predicted = {e.variant: e.seconds for e in FFTEngine.estimates(BIG_7, np.float32, rates)}
    t_low = choice._lowering_prediction(BIG_7, "auto", rates)
    assert predicted["fft lifted"] < predicted["fft full"] < t_low / choice.MODEL_FFT_MARGIN  # 27, 56 and 94 ms
    assert autotune.model_errors() == {}
    name, reason = choice.choose_conv_engine(BIG_7)
    assert name == "fft lifted" and "scaled" not in reason

    def keep(g, **ratios):  # as the engine autotune keeps a layer's whole-batch times
        model = {e.variant: e.seconds for e in FFTEngine.estimates(g, np.float32, rates)
                 + LoweringEngine.estimates(g, np.float32, rates)}
        model["lowering"] = model["lowering 1"]
        autotune._record_model_error(g, np.float32, 1, {k.replace("_", " "): r * model[k.replace("_", " ")]
                                                        for k, r in ratios.items()})

    layers = [BIG_7] + [ConvGeometry(1, 16, 16, 1, (30 + i, 30, 30), (7, 7, 7), (1, 1, 1), (0, 0, 0), (1, 1, 1))
                        for i in (1, 2)]
    for g, lifted, full in zip(layers, (3.0, 2.5, 0.9), (0.55, 0.6, 0.7)):
        keep(g, fft_lifted=lifted, fft_full=full)
    measured._write_cache({"model_error": {"another-machine-v1": {"fft full": 0.1, "lowering": 0.1}}})
    errors = autotune.model_errors()
    assert errors["fft lifted"] == 2.0  # median 2.5, at most MODEL_ERROR_RANGE[1]
    assert errors["fft full"] == pytest.approx(0.6) and "lowering" not in errors
    name, reason = choice.choose_conv_engine(BIG_7)  # lifted 2 x 27 ms, full 0.6 x 56 ms: the full layout
    assert name == "fft full" and "fft full x0.60" in reason and "lifted" not in reason
    eng = choice.SelectedEngine("auto")
    eng.configure(BIG_7)
    assert eng.name == "fft" and not eng.inner.lifted
    for g in layers:  # each layer's entry replaced: both layouts 2.5x slower than modelled, the lowering 0.5x
        keep(g, fft_lifted=2.5, fft_full=2.5, lowering=0.5)
    assert choice.choose_conv_engine(BIG_7)[0] == "lowering"  # 47 ms against 2 x 27 ms


def test_autotune_measures_once_and_caches(monkeypatch):
    g = ConvGeometry(1, 4, 4, 1, (10, 10, 10), (5, 5, 5), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    first = autotune.autotune_conv_engine(g)
    assert "lowering" in first and {"fft full", "fft lifted"} & set(first) and all(t > 0 for t in first.values())
    cache = json.loads(measured.cache_path().read_text())["conv_engine"]
    assert len(cache) == 1 and next(iter(cache)).startswith(autotune.geometry_key(g, np.float32))

    def fail(*a, **k):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(FFTEngine, "forward", fail)
    monkeypatch.setattr(LoweringEngine, "forward", fail)
    assert autotune.autotune_conv_engine(g) == first


# ---- layers --------------------------------------------------------------------------------------
def test_layer_runs_the_chosen_engine_with_the_same_numbers():
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 6, 5)).astype(np.float32)
    runs = {}
    for engine in ("lowering", "fft"):
        use_flags(None, None, engine)
        runs[engine] = setup_layer(CONV % "stride: 2", [x])
        assert runs[engine].layer.engine.name == engine
    for a, b in zip(runs["lowering"].layer.blobs, runs["fft"].layer.blobs):
        b.data[...] = a.data
    (y_low,), (y_fft,) = runs["lowering"].forward(), runs["fft"].forward()
    np.testing.assert_allclose(y_fft, y_low, rtol=1e-4, atol=1e-5)
    text = choice.describe_layer_engine(runs["fft"].layer)
    assert text.startswith("fft ") and re.search(r"[KM]iB of kept spectra$", text)


def test_engine_follows_a_new_geometry():
    """auto picks again when the input shape changes; a forced fft layer that becomes unservable says so."""
    use_flags(None, None, "auto")
    run = setup_layer(CONV % "", [np.zeros((1, 3, 6, 6), np.float32)])
    assert run.layer.engine.name == "lowering"
    use_flags(None, None, "fft")
    run = setup_layer(CONV % "", [np.zeros((1, 3, 6, 6), np.float32)])
    assert run.layer.engine.name == "fft"
    eng = run.layer.engine
    assert eng.configure(ConvGeometry(1, 3, 4, 1, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1))) is True
    assert eng.geometry.in_shape == (8, 8) and eng.inner.geometry.in_shape == (8, 8)


# ---- the command line ----------------------------------------------------------------------------
def _net(tmp_path, body: str):
    model = tmp_path / "net.prototxt"
    model.write_text('layer { name: "d" type: "Input" top: "x" input_param { shape { %s } } }\n' % body[0]
                     + body[1])
    return str(model)


def _run(*args: str) -> tuple[int, str]:
    with captured_log() as buf:
        rc = cli.main(list(args))
    return rc, buf.getvalue()


def test_time_prints_the_fft_engine_and_its_memory(tmp_path):
    model = _net(tmp_path, ("dim: 1 dim: 2 dim: 8 dim: 9 dim: 7",
                            'layer { name: "c3" type: "Convolution" bottom: "x" top: "y" '
                            'convolution_param { num_output: 3 kernel_size: 3 stride: 2 } }\n'))
    rc, out = _run("time", "-model", model, "-iterations", "1", "-conv_engine", "fft")
    assert rc == 0
    assert re.search(r"\s+c3\tengine: fft \S+ .*of kept spectra", out)
    rc, out = _run("time", "-model", model, "-iterations", "1", "-conv_engine", "auto")
    assert rc == 0 and re.search(r"\s+c3\tengine: lowering 1 .*; not fft: stride 2 > 1", out)


def test_forced_fft_on_a_layer_it_cannot_run_is_one_line(tmp_path):
    model = _net(tmp_path, ("dim: 2 dim: 3", 'layer { name: "fc_as_conv" type: "Convolution" bottom: "x" '
                                             'top: "y" convolution_param { num_output: 4 } }\n'))
    rc, out = _run("time", "-model", model, "-iterations", "1", "-conv_engine", "fft")
    assert rc == 1 and "Traceback" not in out
    (fatal,) = messages(out, "F")
    assert "layer 'fc_as_conv' (Convolution): conv_engine fft (set by -conv_engine) cannot run this layer: " \
           "no spatial axes" in fatal
    rc, out = _run("time", "-model", model, "-conv_engine", "fastest")
    assert rc == 1 and messages(out, "F") == [
        "-conv_engine: conv_engine must be lowering, fft, winograd, depthwise or auto (got 'fastest')"]


def test_invalid_environment_is_one_line_from_the_command_line(tmp_path, monkeypatch):
    model = _net(tmp_path, ("dim: 1 dim: 2 dim: 6 dim: 6", ""))
    monkeypatch.setenv("CCT_PARTITIONS", "many")
    rc, out = _run("time", "-model", model, "-iterations", "1")
    assert rc == 1 and messages(out, "F") == ["CCT_PARTITIONS: partitions must be a positive integer or 'auto' "
                                              "(got 'many')"]
    rc, out = _run("time", "-model", model, "-iterations", "1", "-partitions", "1")
    assert rc == 0


# ---- the measuring budget (-autotune fast | full | off) -------------------------------------------------

def test_autotune_flag_values(monkeypatch):
    for value, expected in (("fast", "auto"), ("full", True), ("off", False), ("auto", "auto"), ("1", True)):
        settings.set("autotune", value, "-autotune")
        assert settings.get("autotune") == expected
    with pytest.raises(CctError, match=r"^-autotune: autotune must be fast, full or off \(got 'sometimes'\)"):
        settings.set("autotune", "sometimes", "-autotune")
    settings.reset()


def test_a_1x1_convolution_is_never_measured_against_fft(monkeypatch):
    _no_measuring(monkeypatch)
    g = ConvGeometry(8, 512, 128, 1, (28, 28), (1, 1), (1, 1), (0, 0), (1, 1))
    assert choice.choose_conv_engine(g) == ("lowering", "not fft: a 1x1 kernel")


def test_deferred_choices_run_largest_geometry_first_within_a_budget_of_their_size():
    """The ledger calls the put-off choices by their geometry's summed predicted seconds, largest first, every
    layer of a geometry together, with a budget of FAST_BUDGET_ITERATIONS times that sum where it exceeds
    FAST_BUDGET_SECONDS."""
    ledger = autotune.Ledger("fast", autotune.FAST_BUDGET_SECONDS)
    calls = []
    for key, seconds, name in (("a", 0.25, "a1"), ("b", 0.3, "b1"), ("a", 0.25, "a2"), ("c", 0.1, "c1")):
        ledger.defer(key, seconds, lambda name=name: calls.append(name))
    ledger.measure_deferred()
    assert calls == ["a1", "a2", "b1", "c1"] and ledger.deferred == {}  # a: 0.5 s, b: 0.3, c: 0.1
    assert ledger.budget == autotune.FAST_BUDGET_SECONDS  # 2 x 0.9 s is less
    ledger.defer("d", 2.0, lambda: calls.append("d1"))
    ledger.measure_deferred()
    assert calls[-1] == "d1" and ledger.budget == pytest.approx(autotune.FAST_BUDGET_ITERATIONS * 2.0)


@pytest.mark.parametrize("run,iterations", [(None, autotune.FAST_BUDGET_ITERATIONS),
                                            (100, autotune.FAST_BUDGET_ITERATIONS), (450000, 4500.0),
                                            (math.inf, math.inf)])
def test_a_net_built_for_a_long_run_measures_a_share_of_its_iterations(run, iterations):
    """A net built within ``expecting_iterations(n)`` (a solver's training net) may spend ``RUN_BUDGET_FRACTION``
    of n iterations of the layers awaiting a measurement, where that is more than the usual budget — saying so
    first where the measurements may take ``ANNOUNCED_SECONDS`` or more —; the nets built after the block get the
    usual one."""
    settings.set("autotune", "fast")
    block = autotune.expecting_iterations(run) if run is not None else contextlib.nullcontext()
    with captured_log() as buf, block, autotune.measuring_session() as ledger:
        ledger.defer("a", 2.0, lambda: None)
    assert ledger.iterations == pytest.approx(iterations)
    assert ledger.budget == pytest.approx(max(autotune.FAST_BUDGET_SECONDS, iterations * 2.0))
    said = [m for m in messages(buf.getvalue()) if m.startswith("Measuring the engines")]
    assert said == (["Measuring the engines of 1 layer geometry, largest first: about 24 s, cached for the next "
                     "runs"] if run in (450000, math.inf) else [])
    with autotune.expecting_iterations(math.inf), autotune.measuring_session() as idle:
        pass  # nothing awaiting a measurement: the budget stays finite
    assert idle.budget == autotune.FAST_BUDGET_SECONDS
    with autotune.measuring_session() as after:
        pass
    assert after.iterations == autotune.FAST_BUDGET_ITERATIONS
    settings.reset()


def test_a_solver_builds_its_training_net_for_max_iter_iterations(monkeypatch):
    """The solver's training net gets the budget of its ``max_iter`` (:func:`autotune.expecting_iterations`); its
    test nets the usual one."""
    from cct import solvers
    from tests.solvers.helpers import tiny_solver_param

    seen = []
    monkeypatch.setattr(autotune.Ledger, "measure_deferred", lambda self: seen.append(self.iterations))
    solvers.create_solver(tiny_solver_param(max_iter=300000, test_iter=[1], test_interval=100))
    assert seen == [pytest.approx(autotune.RUN_BUDGET_FRACTION * 300000), autotune.FAST_BUDGET_ITERATIONS]


def test_calibration_probes_take_turns_and_keep_their_best():
    """Each probe runs once untimed, then in every round an untimed call and a timed one, in turn; at least
    ``rounds`` rounds (and ``seconds``, capped at 4x the rounds); the best timed call counts."""
    order = []
    probes = {name: (lambda name=name: order.append(name)) for name in ("x", "y")}
    best = autotune._interleaved_best(probes, rounds=2, seconds=0.0)
    assert order == ["x", "y"] + ["x", "x", "y", "y"] * 2 and set(best) == {"x", "y"}
    assert all(0 <= t < 1 for t in best.values())
    order.clear()
    autotune._interleaved_best(probes, rounds=1, seconds=60.0)  # a long minimum: stops at 4 rounds
    assert len(order) == 2 + 4 * 4


def test_fast_autotune_measures_the_biggest_layers_first(monkeypatch):
    """The engine measurements a net's layers ask for while it is built wait until all of it is known, then go
    largest first: with a budget that pays for one, the second layer (4x the first's arithmetic) is measured and
    the first left to the models — each layer's engine line logged once, with its final choice."""
    monkeypatch.setattr(autotune, "FAST_BUDGET_SECONDS", 1e-9)
    monkeypatch.setattr(autotune, "FAST_BUDGET_ITERATIONS", 0.0)
    layers = ['layer { name: "in" type: "Input" top: "c0" '
              'input_param { shape { dim: 1 dim: 4 dim: 30 dim: 30 dim: 30 } } }']
    for i in (1, 2):
        layers.append(f'layer {{ name: "c{i}" type: "Convolution" bottom: "c{i - 1}" top: "c{i}" convolution_param '
                      f'{{ num_output: 16 kernel_size: 7 pad: 3 weight_filler {{ type: "xavier" }} }} }}')
    from cct.io.prototxt import parse_net_param
    from cct.pycaffe import Net

    settings.set("autotune", "fast")
    settings.set("lowering", 1)  # the engines' close calls only
    param = parse_net_param("\n".join(layers))
    param.state.phase = 1
    with captured_log() as buf:
        net = Net.from_param(param, "largest_first.prototxt")
    first, second = (layer.engine.describe() for layer in net.layers[1:])
    assert "engine autotuned" in second and "autotune budget spent" in first
    lines = [m for m in messages(buf.getvalue()) if m.startswith("Convolution layer c")]
    assert [m.split(":")[0] for m in lines] == ["Convolution layer c2", "Convolution layer c1"]
    assert "engine autotuned" in lines[0] and "autotune budget spent" in lines[1]
    settings.reset()


def test_a_net_run_on_a_gpu_chooses_its_engines_for_it_and_measures_nothing_on_the_host(monkeypatch):
    """A net whose executor runs its layers on a device (GPU mode: ``Executor.layer_array_module``) configures
    its convolutions while it is built as that device's copies will run: lowering 1, saying why, with no engine
    or lowering measured on the host (a layer the host would measure: the FFT's close call on BIG_7)."""
    import types

    from cct.exec.serial import SerialExecutor
    from cct.io.prototxt import parse_net_param
    from cct.pycaffe import Net

    device = types.ModuleType("device")

    class OnDevice(SerialExecutor):
        def layer_array_module(self):
            return device

    def fail(*a, **k):
        raise AssertionError("measured")

    monkeypatch.setattr(choice, "autotune_conv_engine", fail)
    monkeypatch.setattr(choice, "autotune", fail)
    settings.set("autotune", "full")
    param = parse_net_param('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 16 '
                            'dim: 30 dim: 30 dim: 30 } } } layer { name: "c" type: "Convolution" bottom: "x" '
                            'top: "y" convolution_param { num_output: 16 kernel_size: 7 } }')
    param.state.phase = 1
    net = Net.from_param(param, "on_device.prototxt", executor=OnDevice())
    assert net.layers[1].engine.describe() == (
        "lowering 1 (on a GPU: the cost model and the measurements are the CPU's); not fft: the fft engine runs on "
        "the CPU and this layer's arrays are on a GPU")
    with pytest.raises(AssertionError, match="measured"):  # the host's choice measures
        Net.from_param(param, "on_host.prototxt")
    settings.reset()


def test_fast_autotune_stops_measuring_when_the_nets_budget_is_spent(monkeypatch):
    """A net's measurements share one budget; past it, close calls go by the cost model — with the real
    measuring functions, not stand-ins, and a budget so small that only the first measurement happens."""
    monkeypatch.setattr(autotune, "FAST_BUDGET_SECONDS", 1e-9)
    monkeypatch.setattr(autotune, "FAST_BUDGET_ITERATIONS", 0.0)
    layers = ['layer { name: "in" type: "Input" top: "c0" '
              'input_param { shape { dim: 1 dim: 16 dim: 30 dim: 30 dim: 30 } } }']
    for i, outputs in ((1, 16), (2, 12)):  # two geometries: the second is not in the cache the first filled
        layers.append(f'layer {{ name: "c{i}" type: "Convolution" bottom: "c{i - 1}" top: "c{i}" convolution_param '
                      f'{{ num_output: {outputs} kernel_size: 7 pad: 3 weight_filler {{ type: "xavier" }} }} }}')
    net_text = "\n".join(layers)
    from cct.io.prototxt import parse_net_param
    from cct.pycaffe import Net

    settings.set("autotune", "fast")
    settings.set("lowering", 1)  # the engine's close call only (a lowerings' one would spend the budget first)
    param = parse_net_param(net_text)
    param.state.phase = 1
    with captured_log() as buf:
        net = Net.from_param(param, "budget.prototxt")
    text = buf.getvalue()
    engines = [layer.engine.describe() for layer in net.layers[1:]]
    assert "engine autotuned" in engines[0]  # measured: the budget was not spent yet
    assert "autotune budget spent" in engines[1]  # the same close call, now left to the models
    line = [m for m in messages(text) if m.startswith("Engine autotuning")]
    assert len(line) == 1 and line[0].startswith("Engine autotuning (fast): 1 layer(s) measured in ")
    assert "1 close call(s) left to the cost model" in line[0]
    settings.reset()


def test_where_the_models_decide_winograd_needs_its_margin(monkeypatch):
    """Where the models alone decide (autotune off, or the net's measuring budget spent), the Winograd engine runs
    where its model, scaled by its measured error here, is MODEL_WINOGRAD_MARGIN times faster than the lowering's
    (the default rates: VGG16's conv4_2 at 8 images, F(4x4,3x3) 347 ms against 833), the smaller tile where it is
    within WINOGRAD_TILE_WINDOW of the faster; not on a layer whose few input channels leave the transforms all
    the work (conv1_1: 301 against 141)."""
    from dataclasses import replace

    from cct.engines.cost_model import DEFAULT_RATES
    from cct.engines.winograd import WinogradEngine

    rates = replace(DEFAULT_RATES)  # as calibrated: a machine's own rates (equal to the defaults here)
    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: rates)
    monkeypatch.setattr(autotune, "machine_rates", lambda *a, **k: rates)
    _no_measuring(monkeypatch)
    settings.set("autotune", False)
    settings.set("partitions", 2)  # the models' partitions and chunks, whatever this machine's cores
    settings.set("lowering_max_mb", 32)
    settings.set("native", False)  # the model of the numpy transforms (the figures here), built or not
    conv4_2 = ConvGeometry(8, 512, 512, 1, (28, 28), (3, 3), (1, 1), (1, 1), (1, 1))
    conv1_1 = ConvGeometry(8, 3, 64, 1, (224, 224), (3, 3), (1, 1), (1, 1), (1, 1))
    model = {e.variant: e.seconds for e in WinogradEngine.estimates(conv4_2, np.float32, rates)}
    t_low = choice._lowering_prediction(conv4_2, "auto", rates)
    assert model["winograd 4"] * 2 < t_low < model["winograd 2"] * 2 * choice.MODEL_WINOGRAD_MARGIN
    name, reason = choice.choose_conv_engine(conv4_2)
    assert name == "winograd 4" and reason.startswith("engine by cost model") and "winograd 4" in reason
    assert choice.choose_conv_engine(conv1_1)[0] == "lowering"
    monkeypatch.setattr(choice, "MODEL_WINOGRAD_MARGIN", 1.01 * t_low / model["winograd 4"])
    assert choice.choose_conv_engine(conv4_2)[0] == "lowering"  # predicted faster, but not by the margin
    # a margin both tiles' models meet and neither meets slowed by 2 (with the real one, F(4x4,3x3) slowed by 2
    # sits at the margin's edge)
    monkeypatch.setattr(choice, "MODEL_WINOGRAD_MARGIN", 1.4)
    assert max(model.values()) * 1.4 < t_low < min(model.values()) * 2 * 1.4

    def slower(tile, *layers):  # measured on the whole batch twice as slow as modelled
        for g in layers:
            t = {e.variant: e.seconds for e in WinogradEngine.estimates(g, np.float32, rates)}[tile]
            autotune._record_model_error(g, np.float32, 1, {tile: 2 * t})

    others = [replace(conv4_2, num=n) for n in (4, 16)]
    slower("winograd 4", conv4_2)  # one layer: a spell of noise, not yet the model's error
    assert autotune.model_errors() == {"winograd 4": 1.0}
    assert choice.choose_conv_engine(conv4_2)[0] == "winograd 4"
    slower("winograd 4", *others)  # three: F(4x4,3x3) falls short of the margin, F(2x2,3x3) not
    assert autotune.model_errors() == {"winograd 4": pytest.approx(2.0)}
    name, reason = choice.choose_conv_engine(conv4_2)
    assert name == "winograd 2" and "winograd 4 x2.00" not in reason
    slower("winograd 2", conv4_2, *others)
    assert choice.choose_conv_engine(conv4_2)[0] == "lowering"
    # the net's measuring budget spent: the models decide the same way
    settings.set("autotune", None)  # the default, fast
    monkeypatch.setattr(choice, "autotune_conv_engine", lambda *a, **k: None)
    monkeypatch.setattr(choice, "autotune", lambda *a, **k: None)  # (the lowerings' close call too)
    name, reason = choice.choose_conv_engine(conv4_2)
    assert name == "lowering" and "autotune budget spent" in reason and "winograd 4 x2.00" in reason
