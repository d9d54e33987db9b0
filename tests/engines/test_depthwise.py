"""The depthwise engine (one input channel per group): forward, data and weight gradients against the lowering
engine and against the direct references in float64, across kernel sizes, strides, paddings, dilations and
channel multipliers, both dtypes; the same bits however the planes and channels are split; a layer's numerical
gradient through it; what it refuses; and how ``conv_engine`` ``depthwise`` and ``auto`` choose it."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers.conv  # noqa: F401  (registers the layers)
from cct import native
from cct.compare.tolerance import assert_close
from cct.config import settings
from cct.engines import ConvGeometry, choice, depthwise
from cct.engines.depthwise import DepthwiseEngine
from cct.engines.lowering import LoweringEngine, Workspace
from cct.errors import CctError
from cct.gradient_check import check_gradient, setup_layer
from tests.engines import reference
from tests.helpers import check_gradient_through_engine, run_batch_in_one_range, run_batch_in_ranges, use_flags

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="the compiled kernels are not built")

GEOMETRIES = [  # N, C, multiplier, (H, W), kernel, stride, pad, dilation (each stride's sh x sw phases exercised)
    (3, 4, 1, (9, 11), (3, 3), (1, 1), (1, 1), (1, 1)),      # MobileNet's 3x3 layers, stride 1
    (2, 3, 1, (12, 12), (3, 3), (2, 2), (1, 1), (1, 1)),     # ... and stride 2
    (2, 2, 3, (7, 10), (3, 5), (1, 2), (2, 1), (1, 1)),      # three outputs per channel, other kernel and strides
    (2, 3, 2, (10, 9), (3, 3), (1, 1), (2, 2), (2, 2)),      # dilated: the data gradient gathers a fan of 2
    (1, 5, 1, (40, 37), (5, 5), (1, 1), (2, 2), (1, 1)),     # rows longer than a wide block, 5x5
    (2, 2, 1, (5, 5), (5, 5), (2, 2), (0, 0), (1, 1)),       # one output cell
    (2, 3, 1, (6, 6), (1, 1), (1, 1), (0, 0), (1, 1)),       # 1x1
    (2, 2, 1, (4, 19), (3, 3), (1, 3), (0, 3), (1, 1)),      # padding wider than the stride
    (2, 3, 1, (7, 8), (1, 1), (2, 2), (0, 0), (1, 1)),       # stride over a 1x1 kernel: dx phases no tap reaches
    (1, 2, 2, (11, 13), (3, 3), (3, 2), (1, 2), (2, 1)),     # stride 3 rows, 2 columns, dilated rows
    (1, 2, 1, (33, 35), (31, 31), (1, 1), (15, 15), (1, 1)),  # RepLKNet's 31x31 kernels: the largest taken
    (98, 2, 1, (5, 5), (3, 3), (1, 1), (1, 1), (1, 1)),      # 5x5 planes, 97 images a stack, then one (whose last
                                                             # block of weight-gradient products reads past it)
    (2, 3, 1, (30, 30), (3, 3), (1, 1), (1, 1), (1, 1)),     # planes too large to stack
]
STACKED, ALONE = GEOMETRIES[-2], GEOMETRIES[-1]


def _geometry(dims) -> ConvGeometry:
    n, c, m, shape, kernel, stride, pad, dil = dims
    return ConvGeometry(n, c, c * m, c, shape, kernel, stride, pad, dil)


def _operands(g: ConvGeometry, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((g.num, g.in_channels) + g.in_shape).astype(dtype)
    w = rng.standard_normal((g.out_channels, 1) + g.kernel).astype(dtype)
    b = rng.standard_normal(g.out_channels).astype(dtype)
    dy = rng.standard_normal((g.num, g.out_channels) + g.out_shape).astype(dtype)
    return x, w, b, dy


def _run(eng, g, x, w, b, dy):
    eng.configure(g, x.dtype)
    y = np.full_like(dy, np.nan)
    eng.forward(x, w, b, y)
    dx, dw = np.full_like(x, np.nan), np.ones_like(w)  # dw accumulates onto ones
    eng.backward(x, dy, w, dx, dw)
    return y, dx, dw


def _definition(g: ConvGeometry, x, w, b, dy):
    """y, dx and dw (plus ones, as _run) by the direct references, in float64."""
    x, w, b, dy = (a.astype(np.float64) for a in (x, w, b, dy))
    return (reference.conv_forward(g, x, w, b), reference.conv_backward_data(g, dy, w),
            1 + reference.conv_backward_weights(g, x, dy))


@pytest.mark.parametrize("dims", GEOMETRIES)
def test_matches_the_definition_and_the_lowering_engine(dims):
    g = _geometry(dims)
    for dtype in (np.float32, np.float64):
        x, w, b, dy = _operands(g, dtype)
        got = _run(DepthwiseEngine(), g, x, w, b, dy)
        want = _definition(g, x, w, b, dy)
        lowering = _run(LoweringEngine(1, workspace=Workspace()), g, x, w, b, dy)
        for name, ours, exact, theirs in zip(("y", "dx", "dw"), got, want, lowering):
            if dtype == np.float64:
                np.testing.assert_allclose(ours, exact, rtol=1e-11, atol=1e-11, err_msg=f"{name} {dims}")
            else:
                assert_close(ours, exact, f"{name} {dims}", reference="float64 definition")
                assert_close(ours, theirs, f"{name} {dims}", reference="lowering")


@pytest.mark.parametrize("dims", [GEOMETRIES[0], GEOMETRIES[1], GEOMETRIES[2], STACKED, ALONE])
def test_the_same_bits_however_planes_and_channels_are_split(dims, monkeypatch):
    """The forward and the data gradient split the planes, the weight gradient output channels: each value is
    summed in full by one thread in a fixed order, so any split (a stack of images cut short by it, too) gives the
    bits of one call."""
    g = _geometry(dims)
    x, w, b, dy = _operands(g, np.float32, seed=3)
    monkeypatch.setattr(depthwise, "run_batch", run_batch_in_one_range)
    whole = _run(DepthwiseEngine(), g, x, w, b, dy)
    for parts in (2, 3, 5):
        seen = []
        monkeypatch.setattr(depthwise, "run_batch", run_batch_in_ranges(parts, seen))
        split = _run(DepthwiseEngine(), g, x, w, b, dy)
        assert len(seen) > 3
        for a, c in zip(whole, split):
            np.testing.assert_array_equal(a.view(np.uint32), c.view(np.uint32))


@pytest.mark.parametrize("dims, stacked", [(GEOMETRIES[0], True), (ALONE, False)])
def test_the_kernel_writes_only_the_planes_and_channels_it_is_given(dims, stacked):
    """Plane p of the forward is (output channel, image) = divmod(p, n) where small planes are stacked (a channel's
    images one buffer), else (image, output channel) = divmod(p, o); the data gradient's likewise over the input
    channels."""
    g = _geometry(dims)
    x, w, b, dy = _operands(g, np.float32, seed=4)
    args = ((g.num, g.in_channels, g.out_channels) + g.in_shape + g.kernel + g.stride + g.pad + g.dilation
            + g.out_shape)
    k = native.kernels()

    def written(planes, count):
        cells = [(p % g.num, p // g.num) if stacked else divmod(p, count) for p in planes]  # (image, channel)
        mask = np.zeros((g.num, count), bool)
        mask[tuple(zip(*cells))] = True
        return mask

    y = np.full_like(dy, 7.0)
    k.depthwise(0, x, w, y, b, args, 2, 5)
    np.testing.assert_array_equal((y != 7).any(axis=(2, 3)), written(range(2, 5), g.out_channels))
    dx = np.full_like(x, 7.0)
    k.depthwise(1, dy, w, dx, None, args, 1, 4)
    np.testing.assert_array_equal((dx != 7).any(axis=(2, 3)), written(range(1, 4), g.in_channels))
    dw = np.zeros_like(w)
    k.depthwise(2, x, dy, dw, None, args, 1, 3)
    assert (dw[0] == 0).all() and (dw[3:] == 0).all() and (dw[1:3] != 0).all()
    with pytest.raises(ValueError, match="depthwise: unsupported geometry"):
        k.depthwise(0, x, w, y, b, args, 0, g.num * g.out_channels + 1)
    with pytest.raises(ValueError, match="depthwise: unsupported geometry"):
        k.depthwise(0, x, w, y, b, args[:13] + (args[13] + 1, args[14]), 0, 1)  # an output shape that does not fit
    with pytest.raises(ValueError, match="dy: expected"):
        k.depthwise(1, dy[:1], w, np.empty_like(x), None, args, 0, 1)


@pytest.mark.parametrize("dims, applies", [(ALONE, True), (GEOMETRIES[4], True), (GEOMETRIES[3], False),
                                           (STACKED, False), (GEOMETRIES[1], False), (GEOMETRIES[2], False)])
def test_both_gradients_in_one_pass_give_the_bits_of_the_two(dims, applies):
    """Stride 1, one output per channel, planes too large to stack: ``depthwise_backward`` computes dx and dw in
    one pass over each channel's planes (the output gradient laid out once for both), with the bits of the data
    and weight passes apart, however the channels are split; elsewhere (stacked planes, a stride, several outputs
    per channel) it says so and computes nothing."""
    g = _geometry(dims)
    args = ((g.num, g.in_channels, g.out_channels) + g.in_shape + g.kernel + g.stride + g.pad + g.dilation
            + g.out_shape)
    k = native.kernels()
    for dtype in (np.float32, np.float64):
        x, w, _, dy = _operands(g, dtype, seed=6)
        dx, dw = np.full_like(x, np.nan), np.ones_like(w)
        assert k.depthwise_backward(x, dy, w, dx, dw, args, 0, 0) is applies
        if not applies:
            assert k.depthwise_backward(x, dy, w, dx, dw, args, 0, g.in_channels) is False
            assert np.isnan(dx).all() and (dw == 1).all()
            continue
        apart_dx, apart_dw = np.full_like(x, np.nan), np.ones_like(w)
        k.depthwise(1, dy, w, apart_dx, None, args, 0, g.num * g.in_channels)
        k.depthwise(2, x, dy, apart_dw, None, args, 0, g.out_channels)
        for cuts in ([], [1], [1, 2]):
            dx, dw = np.full_like(x, np.nan), np.ones_like(w)
            points = [0] + [c for c in cuts if c < g.in_channels] + [g.in_channels]
            for c0, c1 in zip(points[:-1], points[1:]):
                assert k.depthwise_backward(x, dy, w, dx, dw, args, c0, c1) is True
            np.testing.assert_array_equal(dx, apart_dx)
            np.testing.assert_array_equal(dw, apart_dw)


def test_a_layer_through_the_engine_passes_the_numerical_gradient_check():
    x = np.random.default_rng(5).standard_normal((2, 3, 7, 6))
    check_gradient_through_engine("depthwise", 'type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 '
                                  'pad: 1 stride: 2 group: 3 weight_filler { type: "gaussian" std: 0.5 } '
                                  'bias_filler { type: "gaussian" std: 0.5 } }', x)


@pytest.mark.parametrize("geometry,why", [
    (ConvGeometry(1, 4, 4, 2, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1)), "one input channel per group"),
    (ConvGeometry(1, 4, 4, 1, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1)), "one input channel per group"),
    (ConvGeometry(1, 2, 2, 2, (8, 8, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)), "2-D convolutions (3-D"),
    (ConvGeometry(1, 2, 2, 2, (70, 70), (33, 1), (1, 1), (0, 0), (1, 1)), "kernels and strides of at most 32"),
    (ConvGeometry(1, 2, 2, 2, (70, 70), (1, 1), (33, 1), (0, 0), (1, 1)), "kernels and strides of at most 32"),
    (ConvGeometry(1, 2, 130, 2, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1)), "at most 64 outputs per input channel"),
])
def test_refuses_what_it_cannot_compute(geometry, why):
    ok, reason = DepthwiseEngine.supports(geometry)
    assert not ok and why in reason
    with pytest.raises(CctError, match="depthwise convolution engine does not apply"):
        DepthwiseEngine().configure(geometry)
    assert DepthwiseEngine.estimates(geometry) == []
    assert choice.choose_conv_engine(geometry, choice="depthwise") == ("lowering", f"not depthwise: {reason}")


def test_forced_depthwise_runs_where_it_applies_and_auto_takes_it_where_its_model_wins(monkeypatch):
    from cct.engines.cost_model import DEFAULT_RATES

    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: DEFAULT_RATES)
    mobilenet = ConvGeometry(16, 32, 32, 32, (112, 112), (3, 3), (1, 1), (1, 1), (1, 1))
    assert choice.choose_conv_engine(mobilenet, choice="depthwise") == ("depthwise", "")
    assert choice.choose_conv_engine(mobilenet, xp=object(), choice="depthwise")[1].startswith("not depthwise: ")
    name, reason = choice.choose_conv_engine(mobilenet)
    assert name == "depthwise" and reason.startswith("engine by cost model (depthwise ")
    eng = choice.SelectedEngine("auto")
    eng.configure(mobilenet)
    assert eng.name == "depthwise" and eng.describe().startswith("depthwise (compiled")
    monkeypatch.setattr(choice, "_lowering_prediction", lambda *a: 1e-9)  # a lowering predicted faster keeps it
    assert choice.choose_conv_engine(mobilenet)[0] == "lowering"
    monkeypatch.setenv("CCT_NATIVE", "0")  # without the compiled kernels: the lowering engine, with the reason
    ok, why = DepthwiseEngine.supports(mobilenet)
    assert not ok and "compiled kernels" in why
    assert choice.choose_conv_engine(mobilenet, choice="depthwise") == ("lowering", f"not depthwise: {why}")


def test_the_setting_takes_depthwise():
    settings.set("conv_engine", "depthwise")
    assert settings.get("conv_engine") == "depthwise"
    settings.reset()


def test_a_grouped_deconvolution_runs_through_it_too():
    """FCN's bilinear upsampling: a Deconvolution with one channel per group is the transpose of a depthwise
    convolution, so it runs on the engine (its forward the engine's data gradient over the stride phases): the
    numerical gradient check, and the lowering engine's forward."""
    use_flags(None, None, "depthwise")
    x = np.random.default_rng(6).standard_normal((2, 3, 4, 5))
    text = ('type: "Deconvolution" convolution_param { num_output: 3 kernel_size: 4 stride: 2 pad: 1 group: 3 '
            'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')
    check_gradient(text, [x])
    layer = setup_layer(text, [x], dtype=np.float64)
    assert layer.layer.engine.name == "depthwise"
    use_flags(None, None, "lowering")
    lowered = setup_layer(text, [x], dtype=np.float64)
    assert lowered.layer.engine.name == "lowering"
    for mine, theirs in zip(lowered.layer.blobs, layer.layer.blobs):
        mine.data[...] = theirs.data
    np.testing.assert_allclose(layer.forward()[0], lowered.forward()[0], rtol=1e-10, atol=1e-10)
