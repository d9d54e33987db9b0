"""The Winograd engine: F(2x2,3x3) and F(4x4,3x3) forward, data and weight gradients against the lowering
engine (the project's comparison rule in float32, to 1e-10 in float64), across paddings, groups, odd sizes,
chunks and partitions; a layer's numerical gradient through it; what it refuses; and how ``conv_engine``
``winograd`` and ``auto`` choose it."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import cct.layers.conv  # noqa: F401  (registers the layers)
from cct.compare.tolerance import assert_close
from cct.config import settings
from cct.engines import ConvGeometry, choice, winograd
from cct.engines.lowering import LoweringEngine, Workspace, shared_workspace
from cct.engines.winograd import TILES, WinogradEngine
from cct.errors import CctError
from tests.helpers import check_gradient_through_engine, run_batch_in_one_range, run_batch_in_ranges

GEOMETRIES = [  # N, C, O, group, H, W, pad
    (3, 4, 6, 1, 7, 9, 1),     # output 7x9: partial tiles on both axes
    (2, 6, 4, 2, 5, 5, 0),     # groups, no padding: 3x3 output
    (5, 3, 3, 1, 8, 8, 2),     # pad 2: 10x10 output, the data gradient runs unpadded
    (1, 2, 2, 1, 3, 3, 1),     # one image, one tile
    (4, 8, 8, 2, 13, 13, 1),   # CaffeNet's conv4/conv5 shape, scaled down
    (2, 3, 5, 1, 4, 11, 0),    # 2x9 output: one tile row
    (2, 4, 4, 1, 10, 10, 1),   # 10x10 output... and 8x8 with pad 0 below: whole tiles
    (2, 4, 4, 1, 10, 10, 0),
]


def _operands(n, c, o, grp, h, w, pad, dtype, seed=0):
    g = ConvGeometry(n, c, o, grp, (h, w), (3, 3), (1, 1), (pad, pad), (1, 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((o, c // grp, 3, 3)).astype(dtype)
    b = rng.standard_normal(o).astype(dtype)
    dy = rng.standard_normal((n, o) + g.out_shape).astype(dtype)
    return g, x, wt, b, dy


def _run(eng, g, x, w, b, dy):
    eng.configure(g, x.dtype)
    y = np.full_like(dy, np.nan)
    eng.forward(x, w, b, y)
    dx, dw = np.full_like(x, np.nan), np.ones_like(w)  # dw accumulates onto ones
    eng.backward(x, dy, w, dx, dw)
    return y, dx, dw


@pytest.mark.parametrize("transforms", ["compiled", "numpy"])
@pytest.mark.parametrize("weights", ["winograd", "lowering"])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dims", GEOMETRIES)
def test_matches_the_lowering_engine(tile, dims, weights, transforms, monkeypatch):
    """Forward, data and weight gradients; the weight gradient either way the engine may measure faster (its
    own transposed Winograd sums, or the lowering engine's); the tiles' transforms by the compiled kernels
    (tile by tile, the output's cut, bias and ReLU in their pass) or by numpy's matrix products."""
    from cct import native
    from cct.engines import measured

    if transforms == "compiled" and native.kernels() is None:
        pytest.skip("compiled kernels not built")
    if transforms == "numpy":
        monkeypatch.setattr(winograd, "native", SimpleNamespace(kernels_for=lambda *arrays: None))
    monkeypatch.setattr(measured, "measured_choice", lambda kind, key, ways: weights)
    for dtype in (np.float32, np.float64):
        g, x, w, b, dy = _operands(*dims, dtype)
        ref = _run(LoweringEngine(1, workspace=Workspace()), g, x, w, b, dy)
        eng = WinogradEngine(tile)
        got = _run(eng, g, x, w, b, dy)
        assert eng._wgrad_method == weights and ("weight gradient by lowering" in eng.describe()) == (
            weights == "lowering")
        for name, ours, theirs in zip(("y", "dx", "dw"), got, ref):
            if dtype == np.float64:
                np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10, err_msg=name)
            else:
                assert_close(ours, theirs, f"{name} F({tile}x{tile},3x3) {dims}", reference="lowering")


@pytest.mark.parametrize("min_tiles,chunk", [(1, 1), (20, 3)])
def test_chunks_and_partitions_give_the_same_result(monkeypatch, min_tiles, chunk):
    """A budget of under one image: chunks of one image, or of as many as hold ``MIN_CHUNK_TILES`` tiles (9 per
    image here: 20 tiles take 3 images)."""
    g, x, w, b, dy = _operands(7, 4, 6, 2, 9, 9, 1, np.float64, seed=3)
    whole = _run(WinogradEngine(4), g, x, w, b, dy)
    settings.set("lowering_max_mb", 0.001)
    monkeypatch.setattr(winograd, "MIN_CHUNK_TILES", min_tiles)
    settings.set("partitions", 2)
    eng = WinogradEngine(4)
    sizes = []
    conv, grads = eng._conv, eng._gradient_tiles
    monkeypatch.setattr(eng, "_conv", lambda part, x, *a: (sizes.append(len(x)), conv(part, x, *a))[1])
    monkeypatch.setattr(eng, "_gradient_tiles", lambda part, dy, *a: (sizes.append(len(dy)), grads(part, dy, *a))[1])
    split = _run(eng, g, x, w, b, dy)
    assert eng.batch_partitions() == 2 and max(sizes) == chunk and len(sizes) > 3
    for a, c in zip(whole, split):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)


def test_the_weight_gradients_position_products_split_over_the_cores_bit_for_bit(monkeypatch):
    """The a² positions' GEMMs over a round's tiles, and the kernel-side transform over blocks of output channels,
    split over the cores: bit for bit what one thread makes; one accumulator, in the lowering engine's
    accumulator slot of the shared workspace (none per partition)."""
    g, x, w, b, dy = _operands(6, 12, 6, 2, 9, 9, 1, np.float32, seed=5)  # 3 output, 6 input channels a group
    monkeypatch.setattr(winograd, "MIN_CHUNK_TILES", 1)
    monkeypatch.setattr(winograd, "TRANSFORM_BACK_CHANNELS", 1)  # the kernel-side transform in blocks of 1 channel
    ranges = []

    def dw_with(run):
        monkeypatch.setattr(winograd, "run_batch", run)
        eng = WinogradEngine(2)
        eng.configure(g, np.float32)
        dw = np.full_like(w, 0.25)
        with settings.override(partitions=3):
            eng._weight_grad(x, dy, dw)
        assert "dw_acc" in eng._workspace.part(0) and all("dw_acc" not in eng._workspace.part(p) for p in (1, 2))
        return dw

    split = dw_with(run_batch_in_ranges(3, ranges))  # first: a sum left out would not find the whole sum's values
    np.testing.assert_array_equal(split.view(np.uint32), dw_with(run_batch_in_one_range).view(np.uint32))
    # 2 groups x 16 positions' GEMMs (one round), then 3 blocks of output channels a group, each in 3 ranges
    assert ranges == [(0, 11), (11, 22), (22, 32), (0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("groups,positions,og,cores,cuts", [
    (1, 36, 384, 16, 4),   # 36 GEMMs on 16 cores: 3 on the busiest where the mean is 2.25; quarters: 9 each
    (1, 36, 384, 2, 1),    # 18 each
    (2, 36, 192, 16, 2),   # 72 on 16: 5 against 4.5; halves 9 each (quarters of 48 channels: also 9, more calls)
    (1, 16, 48, 6, 1),     # 48 channels: no cuts under 32 channels
    (1, 36, 64, 16, 2),
])
def test_the_weight_gradients_gemms_are_cut_to_balance_the_cores(groups, positions, og, cores, cuts):
    blocks = winograd._position_blocks(groups, positions, og, cores)
    assert len(blocks) == groups * positions * cuts
    for gi in range(groups):
        for xi in range(positions):  # each group's positions cover the output channels once, in order
            edges = [(o0, o1) for g_, x_, o0, o1 in blocks if (g_, x_) == (gi, xi)]
            assert edges[0][0] == 0 and edges[-1][1] == og and all(a[1] == b[0] for a, b in zip(edges, edges[1:]))


def test_the_weight_gradient_adds_into_a_strided_gradient_too(monkeypatch):
    """The kernel-side transform adds each range of output channels into its rows of ``dw`` in place (a view of
    them): a ``dw`` that is a strided view gets the same values as a contiguous one, and nothing around it."""
    from cct.engines import measured

    monkeypatch.setattr(measured, "measured_choice", lambda kind, key, ways: "winograd")
    g, x, w, b, dy = _operands(3, 4, 6, 2, 8, 8, 1, np.float64, seed=6)
    _, _, ref = _run(LoweringEngine(1, workspace=Workspace()), g, x, w, b, dy)
    for strided in (False, True):
        eng = WinogradEngine(4)
        eng.configure(g, x.dtype)
        wide = np.ones(w.shape[:-1] + (6,), dtype=w.dtype)
        dw = wide[..., ::2] if strided else np.ones_like(w)  # every other column: a strided view; ones like _run's
        eng.backward(x, dy, w, None, dw)
        np.testing.assert_allclose(dw, ref, rtol=1e-10, atol=1e-10)
        assert not strided or (wide[..., 1::2] == 1).all()


def test_the_padding_border_is_rewritten_after_another_user_of_the_workspace():
    """The zero border lives in the thread's shared workspace, which other engines overwrite."""
    g, x, w, b, dy = _operands(2, 3, 4, 1, 6, 6, 1, np.float32, seed=4)
    eng = WinogradEngine(2)
    first = _run(eng, g, x, w, b, dy)
    for part in shared_workspace(np.float32).parts:
        for buf in part.values():
            buf[...] = np.nan
    again = _run(eng, g, x, w, b, dy)
    for a, c in zip(first, again):
        np.testing.assert_array_equal(a, c)


def test_a_layer_through_the_engine_passes_the_numerical_gradient_check():
    x = np.random.default_rng(5).standard_normal((2, 3, 6, 5))
    check_gradient_through_engine("winograd", 'type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 '
                                  'pad: 1 group: 1 weight_filler { type: "gaussian" std: 0.5 } '
                                  'bias_filler { type: "gaussian" std: 0.5 } }', x)


@pytest.mark.parametrize("geometry,why", [
    (ConvGeometry(1, 2, 2, 1, (8, 8), (5, 5), (1, 1), (2, 2), (1, 1)), "3x3 kernels (5x5 here)"),
    (ConvGeometry(1, 2, 2, 1, (8, 8), (3, 3), (2, 2), (1, 1), (1, 1)), "stride 1"),
    (ConvGeometry(1, 2, 2, 1, (8, 8), (3, 3), (1, 1), (1, 1), (2, 2)), "undilated"),
    (ConvGeometry(1, 2, 2, 1, (8, 8), (3, 3), (1, 1), (3, 3), (1, 1)), "padding up to 2"),
    (ConvGeometry(1, 2, 2, 1, (8, 8, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)), "2-D convolutions (3-D"),
])
def test_refuses_what_it_cannot_compute(geometry, why):
    ok, reason = WinogradEngine.supports(geometry)
    assert not ok and why in reason
    with pytest.raises(CctError, match="winograd convolution engine does not apply"):
        WinogradEngine().configure(geometry)
    assert WinogradEngine.estimates(geometry) == []
    assert choice.choose_conv_engine(geometry, choice="winograd") == ("lowering", f"not winograd: {reason}")
    with pytest.raises(ValueError, match="tile"):
        WinogradEngine(3)


def test_forced_winograd_runs_where_it_applies_and_lowering_elsewhere():
    g3 = ConvGeometry(2, 4, 4, 1, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1))
    assert choice.choose_conv_engine(g3, choice="winograd") == ("winograd", "")
    assert choice.choose_conv_engine(g3, xp=object(), choice="winograd")[1].startswith("not winograd: ")
    eng = choice.SelectedEngine("winograd")
    eng.configure(g3)
    assert eng.name == "winograd" and eng.describe().startswith("winograd F(4x4,3x3)")


BIG_3 = ConvGeometry(64, 256, 384, 1, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1))


def test_auto_measures_winograd_on_big_layers_and_takes_the_fastest(monkeypatch):
    """The machine's rates pinned to the defaults: calibrated in a noisy minute, the models could leave Winograd
    no chance on this layer and it would not be measured (the outcome would be the machine's)."""
    from cct.engines.cost_model import DEFAULT_RATES

    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: DEFAULT_RATES)
    calls = []

    def measured(g, dtype, strategy, predicted, fft=True, winograd=False):
        calls.append((fft, winograd))
        return {"lowering": 0.30, "fft lifted": 0.50, "winograd 4": 0.20, "winograd 2": 0.25}

    monkeypatch.setattr(choice, "autotune_conv_engine", measured)
    name, reason = choice.choose_conv_engine(BIG_3)
    assert name == "winograd 4" and calls and calls[0][1] is True
    assert reason.startswith("engine autotuned: lowering 300 ms") and "winograd 4 200 ms" in reason
    eng = choice.SelectedEngine("auto")
    eng.configure(BIG_3)
    assert eng.name == "winograd" and eng.inner.tile == 4


def test_auto_does_not_measure_winograd_where_its_model_leaves_it_no_chance(monkeypatch):
    """VGG16's conv1_1 at 8 images: 3 input channels leave the Winograd transforms all the work (predicted 195 ms
    against the lowering's 79 at the default rates): not worth a measurement of the fast autotune's budget."""
    from cct.engines.cost_model import DEFAULT_RATES

    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: DEFAULT_RATES)
    calls = []

    def measured(g, dtype, strategy, predicted, fft=True, winograd=False):
        calls.append(winograd)
        return {"lowering": 0.30, **({"winograd 4": 0.40, "winograd 2": 0.60} if winograd else {})}

    monkeypatch.setattr(choice, "autotune_conv_engine", measured)
    conv1_1 = ConvGeometry(8, 3, 64, 1, (224, 224), (3, 3), (1, 1), (1, 1), (1, 1))
    t_low = min(choice.predicted_seconds(conv1_1, DEFAULT_RATES).values())
    assert t_low >= choice.AUTOTUNE_MIN_SECONDS  # big enough to measure, but ...
    assert choice.predicted_winograd_seconds(conv1_1, np.float32, DEFAULT_RATES) / choice.FAST_MEASURE_WINDOW > t_low
    assert choice.choose_conv_engine(conv1_1)[0] == "lowering" and calls == []  # nothing measured
    choice.choose_conv_engine(BIG_3)
    assert calls[-1] is True  # CaffeNet's conv3: measured
    settings.set("autotune", True)  # -autotune full measures wherever the engine applies
    choice.choose_conv_engine(conv1_1)
    assert calls[-1] is True


def test_the_model_counts_the_compiled_transforms_as_passes_over_memory():
    """With the compiled kernels the tiles' transforms cost their passes over memory (the moved input, the tiles'
    a² values written and read back, y), without them Kronecker GEMMs on gathered copies: the same channel GEMMs,
    less time around them — and still more than the lowering's on a layer whose 3 input channels leave the
    transforms the work (VGG16's conv1_1)."""
    from cct.engines.cost_model import DEFAULT_RATES

    conv4_2 = ConvGeometry(8, 512, 512, 1, (28, 28), (3, 3), (1, 1), (1, 1), (1, 1))
    conv1_1 = ConvGeometry(8, 3, 64, 1, (224, 224), (3, 3), (1, 1), (1, 1), (1, 1))
    settings.set("partitions", 2)
    for g in (conv4_2, conv1_1):
        settings.set("native", False)
        numpy_body = {e.variant: e.seconds for e in WinogradEngine.estimates(g, np.float32, DEFAULT_RATES)}
        settings.set("native", True)
        compiled = {e.variant: e.seconds for e in WinogradEngine.estimates(g, np.float32, DEFAULT_RATES)}
        assert all(compiled[k] < numpy_body[k] for k in numpy_body)
    assert min(compiled.values()) > min(choice.predicted_seconds(conv1_1, DEFAULT_RATES).values())


def test_auto_prefers_the_more_accurate_tile_when_it_is_as_fast(monkeypatch):
    monkeypatch.setattr(choice, "autotune_conv_engine",
                        lambda *a, **k: {"lowering": 0.30, "winograd 4": 0.200, "winograd 2": 0.205})
    assert choice.choose_conv_engine(BIG_3)[0] == "winograd 2"
    eng = choice.SelectedEngine("auto")
    eng.configure(BIG_3)
    assert eng.name == "winograd" and eng.inner.tile == 2 and eng.describe().startswith("winograd F(2x2,3x3)")


def test_auto_keeps_small_layers_on_the_lowering_engine_and_autotune_off_measures_nothing(monkeypatch):
    """A small layer keeps the lowering engine's sums, unmeasured; with autotune off the models decide (Winograd
    where predicted MODEL_WINOGRAD_MARGIN faster: tests/engines/test_conv_engine_choice.py), nothing measured.
    The machine's rates pinned to the defaults: a calibration would make the choice the machine's."""
    from dataclasses import replace

    from cct.engines import autotune
    from cct.engines.cost_model import DEFAULT_RATES

    def fail(*a, **k):
        raise AssertionError("measured")

    rates = replace(DEFAULT_RATES)
    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: rates)
    monkeypatch.setattr(autotune, "machine_rates", lambda *a, **k: rates)
    monkeypatch.setattr(choice, "autotune_conv_engine", fail)
    small = ConvGeometry(2, 3, 4, 1, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1))
    assert choice.choose_conv_engine(small) == ("lowering", "")
    settings.set("autotune", False)
    name, reason = choice.choose_conv_engine(BIG_3)
    assert reason.startswith("engine by cost model") and "winograd" in reason
    assert choice.choose_conv_engine(small) == ("lowering", "")


def test_autotune_measures_both_tiles(monkeypatch):
    from cct.engines import autotune

    g = ConvGeometry(2, 8, 8, 1, (10, 10), (3, 3), (1, 1), (1, 1), (1, 1))
    measured = autotune.autotune_conv_engine(g, fft=False, winograd=True)
    assert set(measured) == {"lowering", "winograd 2", "winograd 4"} and all(t > 0 for t in measured.values())
    assert autotune.autotune_conv_engine(g, fft=False, winograd=True) == measured  # cached
