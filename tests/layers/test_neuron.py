"""Neuron layers: forward against scalar references, gradients (also in place), parameter errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.elementwise import ZERO_ROW, relu_into
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from cct.layers.registry import create_layer
from cct.proto import caffe_pb2 as pb
from cct.rng import set_random_seed

RNG = np.random.default_rng(0)
SHAPE = (2, 3, 4, 5)


def rand(shape=SHAPE, lo=-2.0, hi=2.0) -> np.ndarray:
    return RNG.uniform(lo, hi, size=shape)


def away_from(x: np.ndarray, points, margin: float = 0.02) -> np.ndarray:
    """Move elements within ``margin`` of a kink point off it (keeps central differences clean)."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < margin
        x[near] = p + np.where(x[near] >= p, margin, -margin) * 2
    return x


def f32(v: float) -> float:
    """A prototxt float parameter as the layer sees it (proto floats are single precision)."""
    return float(np.float32(v))


def forward(proto: str, x: np.ndarray, in_place: bool = False, phase: int = pb.TRAIN,
            dtype=np.float64) -> np.ndarray:
    run = setup_layer(proto, [x], in_place=in_place, phase=phase, dtype=dtype)
    return run.forward()[0]


def elementwise(f, x: np.ndarray) -> np.ndarray:
    """Reference: apply a scalar function to every element (a plain loop)."""
    out = np.empty_like(x, dtype=np.float64)
    for i, v in np.ndenumerate(x):
        out[i] = f(float(v))
    return out


def assert_forward(proto: str, x: np.ndarray, f, rtol: float = 1e-7, atol: float = 1e-12) -> None:
    want = elementwise(f, x)
    np.testing.assert_allclose(forward(proto, x), want, rtol=rtol, atol=atol)
    np.testing.assert_allclose(forward(proto, x, in_place=True), want, rtol=rtol, atol=atol)
    y32 = forward(proto, x.astype(np.float32), dtype=np.float32)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, want, rtol=1e-4, atol=1e-5)


def backward(run, dy: np.ndarray) -> np.ndarray:
    run.top[0].diff[...] = dy
    run.layer.backward_layer(run.top, [True], run.bottom)
    return run.bottom[0].diff.copy()


# ---- ReLU ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slope", [0.0, 0.1, -0.3])
def test_relu_forward(slope):
    x = rand()
    x[0, 0, 0, :3] = 0.0
    proto = f'type: "ReLU" relu_param {{ negative_slope: {slope} }}'
    assert_forward(proto, x, lambda v: v if v > 0 else f32(slope) * v)


@pytest.mark.parametrize("slope", [0.0, 0.1, -0.3])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu_gradient(slope, in_place):
    x = away_from(rand(), [0.0])
    check_gradient(f'type: "ReLU" relu_param {{ negative_slope: {slope} }}', [x], in_place=in_place)


def test_relu_backward_at_zero_uses_slope():
    # Caffe: dx = dy * ((x > 0) + slope * (x <= 0)), so x == 0 takes the slope.
    x = np.array([[-1.0, 0.0, 2.0]])
    run = setup_layer('type: "ReLU" relu_param { negative_slope: 0.5 }', [x], dtype=np.float64)
    run.forward()
    np.testing.assert_array_equal(backward(run, np.ones_like(x)), [[0.5, 0.5, 1.0]])


def test_neuron_arity():
    with pytest.raises(ParamError, match="bottom"):
        setup_layer('type: "ReLU"', [rand(), rand()])


# ---- PReLU -----------------------------------------------------------------------------------------------
def prelu_reference(x: np.ndarray, slopes: np.ndarray, shared: bool) -> np.ndarray:
    y = np.empty_like(x)
    for i, v in np.ndenumerate(x):
        a = slopes.reshape(-1)[0] if shared else slopes[i[1]]
        y[i] = max(v, 0.0) + a * min(v, 0.0)
    return y


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 3), (2, 3, 2)])
@pytest.mark.parametrize("shared", [False, True])
def test_prelu_forward(shape, shared):
    x = rand(shape)
    proto = f'type: "PReLU" prelu_param {{ channel_shared: {str(shared).lower()} }}'
    run = setup_layer(proto, [x], dtype=np.float64)
    slopes = run.layer.blobs[0]
    assert slopes.shape == (() if shared else (shape[1],))
    np.testing.assert_array_equal(slopes.data, 0.25)  # Caffe's default filler
    slopes.data[...] = RNG.uniform(-1, 1, size=slopes.shape)
    np.testing.assert_allclose(run.forward()[0], prelu_reference(x, slopes.data, shared), rtol=1e-12)


def test_prelu_filler():
    run = setup_layer('type: "PReLU" prelu_param { filler { type: "constant" value: 0.7 } }', [rand()])
    np.testing.assert_allclose(run.layer.blobs[0].data, 0.7, rtol=1e-6)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_prelu_gradient(shared, in_place):
    proto = (f'type: "PReLU" prelu_param {{ channel_shared: {str(shared).lower()} '
             f'filler {{ type: "uniform" min: -0.8 max: 0.8 }} }}')
    check_gradient(proto, [away_from(rand(), [0.0])], in_place=in_place)


def test_prelu_param_gradient_accumulates():
    x = rand()
    run = setup_layer('type: "PReLU"', [x], dtype=np.float64)
    run.forward()
    dy = rand()
    run.top[0].diff[...] = dy
    run.layer.backward_layer(run.top, [False], run.bottom)
    once = run.layer.blobs[0].diff.copy()
    want = np.array([(dy[:, c] * np.minimum(x[:, c], 0)).sum() for c in range(SHAPE[1])])
    np.testing.assert_allclose(once, want, rtol=1e-12)
    run.layer.backward_layer(run.top, [False], run.bottom)
    np.testing.assert_allclose(run.layer.blobs[0].diff, 2 * once, rtol=1e-12)


def test_prelu_errors():
    with pytest.raises(ParamError, match="bottom"):
        setup_layer('type: "PReLU"', [rand((5,))])
    stored = 'type: "PReLU" blobs { shape { dim: 2 } data: 0.1 data: 0.2 }'
    with pytest.raises(ParamError, match="prelu_param.channel_shared"):
        setup_layer(stored, [rand()])  # 3 channels, 2 slopes
    run = setup_layer('type: "PReLU" blobs { shape { dim: 3 } data: 0.1 data: 0.2 data: 0.3 }', [rand()])
    np.testing.assert_allclose(run.layer.blobs[0].data, [0.1, 0.2, 0.3], rtol=1e-6)


# ---- ELU, Sigmoid, TanH, AbsVal, BNLL ------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [1.0, 0.5, -0.4])
def test_elu_forward(alpha):
    assert_forward(f'type: "ELU" elu_param {{ alpha: {alpha} }}', rand(),
                   lambda v: v if v > 0 else f32(alpha) * (math.exp(v) - 1))


@pytest.mark.parametrize("alpha", [1.0, 0.5, -0.4])
@pytest.mark.parametrize("in_place", [False, True])
def test_elu_gradient(alpha, in_place):
    check_gradient(f'type: "ELU" elu_param {{ alpha: {alpha} }}', [away_from(rand(), [0.0])],
                   in_place=in_place)


def test_sigmoid_tanh_forward():
    x = rand(lo=-8, hi=8)
    assert_forward('type: "Sigmoid"', x, lambda v: 1 / (1 + math.exp(-v)), rtol=1e-12)
    assert_forward('type: "TanH"', x, math.tanh, rtol=1e-12)


@pytest.mark.parametrize("kind", ["Sigmoid", "TanH", "BNLL"])
@pytest.mark.parametrize("in_place", [False, True])
def test_smooth_gradient(kind, in_place):
    check_gradient(f'type: "{kind}"', [rand(lo=-4, hi=4)], in_place=in_place)


def test_absval():
    x = away_from(rand(), [0.0])
    x[0, 0, 0, 0] = 0.0
    want = np.abs(x)
    np.testing.assert_array_equal(forward('type: "AbsVal"', x), want)
    run = setup_layer('type: "AbsVal"', [x], dtype=np.float64)
    run.forward()
    dy = rand()
    dx = backward(run, dy)
    assert dx[0, 0, 0, 0] == 0.0  # sign(0) = 0
    np.testing.assert_array_equal(dx, np.sign(x) * dy)
    check_gradient('type: "AbsVal"', [away_from(rand(), [0.0])])
    with pytest.raises(ParamError, match="in-place"):
        setup_layer('type: "AbsVal"', [x], in_place=True)


def test_bnll_forward_and_threshold():
    x = rand(lo=-6, hi=6)
    x[0, 0, 0, :4] = [-80.0, -40.0, 60.0, 100.0]
    assert_forward('type: "BNLL"', x, lambda v: max(v, 0.0) + math.log1p(math.exp(-abs(v))), rtol=1e-12)
    run = setup_layer('type: "BNLL"', [x], dtype=np.float64)
    run.forward()
    dy = rand()
    dx = backward(run, dy)
    e = np.exp(np.minimum(x, 50.0))  # Caffe's kBNLL_THRESHOLD
    np.testing.assert_allclose(dx, dy * e / (e + 1), rtol=1e-12)


# ---- Power, Exp, Log ----------------------------------------------------------------------------------
POWER_CASES = [  # (power, scale, shift, input range)
    (1.0, 1.0, 0.0, (-2, 2)),
    (1.0, 3.0, -1.0, (-2, 2)),
    (2.0, 0.5, 1.0, (-2, 2)),
    (2.0, 1.0, 0.0, (-2, 2)),
    (3.0, 2.0, 0.0, (0.2, 2)),
    (-1.5, 1.0, 0.0, (0.3, 2)),
    (0.5, 1.0, 2.5, (-2, 2)),
    (-2.0, 0.5, 3.0, (-2, 2)),
    (0.0, 2.0, 1.0, (-2, 2)),   # power 0: constant 1
    (2.5, 0.0, 1.5, (-2, 2)),   # scale 0: constant shift^power
]


def power_proto(power, scale, shift) -> str:
    return f'type: "Power" power_param {{ power: {power} scale: {scale} shift: {shift} }}'


@pytest.mark.parametrize("power,scale,shift,rng", POWER_CASES)
def test_power_forward(power, scale, shift, rng):
    assert_forward(power_proto(power, scale, shift), rand(lo=rng[0], hi=rng[1]),
                   lambda v: (f32(shift) + f32(scale) * v) ** f32(power), rtol=1e-12)


@pytest.mark.parametrize("power,scale,shift,rng", POWER_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_power_gradient(power, scale, shift, rng, in_place):
    check_gradient(power_proto(power, scale, shift), [rand(lo=rng[0], hi=rng[1])], in_place=in_place)


@pytest.mark.parametrize("power,scale", [(0.0, 2.0), (3.0, 0.0)])
def test_power_constant_backward_is_zero(power, scale):
    # Caffe: when power * scale == 0 the bottom diff is set to 0, not multiplied by the top diff.
    x = rand()
    run = setup_layer(power_proto(power, scale, 2.0), [x], dtype=np.float64)
    run.forward()
    np.testing.assert_array_equal(backward(run, np.full(SHAPE, np.nan)), 0.0)


EXP_CASES = [(-1.0, 1.0, 0.0), (-1.0, 0.5, 1.0), (2.0, 1.0, 0.0), (3.0, -0.7, 0.5), (0.5, 2.0, -1.0)]


@pytest.mark.parametrize("base,scale,shift", EXP_CASES)
def test_exp_forward(base, scale, shift):
    b = math.e if base == -1 else f32(base)
    assert_forward(f'type: "Exp" exp_param {{ base: {base} scale: {scale} shift: {shift} }}', rand(),
                   lambda v: b ** (f32(shift) + f32(scale) * v), rtol=1e-12)


@pytest.mark.parametrize("base,scale,shift", EXP_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_exp_gradient(base, scale, shift, in_place):
    check_gradient(f'type: "Exp" exp_param {{ base: {base} scale: {scale} shift: {shift} }}', [rand()],
                   in_place=in_place)


LOG_CASES = [(-1.0, 1.0, 0.0), (-1.0, 0.5, 1.5), (10.0, 1.0, 0.0), (2.0, 2.0, 0.5), (0.5, 3.0, 1.0)]


@pytest.mark.parametrize("base,scale,shift", LOG_CASES)
def test_log_forward(base, scale, shift):
    b = math.e if base == -1 else f32(base)
    assert_forward(f'type: "Log" log_param {{ base: {base} scale: {scale} shift: {shift} }}',
                   rand(lo=0.1, hi=3), lambda v: math.log(f32(shift) + f32(scale) * v) / math.log(b),
                   rtol=1e-12)


@pytest.mark.parametrize("base,scale,shift", LOG_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_log_gradient(base, scale, shift, in_place):
    check_gradient(f'type: "Log" log_param {{ base: {base} scale: {scale} shift: {shift} }}',
                   [rand(lo=0.1, hi=3)], in_place=in_place)


@pytest.mark.parametrize("kind", ["Exp", "Log"])
@pytest.mark.parametrize("base", [0.0, -2.0])
def test_exp_log_base_errors(kind, base):
    field = f"{kind.lower()}_param.base"
    with pytest.raises(ParamError, match=field):
        setup_layer(f'type: "{kind}" {kind.lower()}_param {{ base: {base} }}', [rand()])


def test_log_base_one_error():
    with pytest.raises(ParamError, match="log_param.base"):
        setup_layer('type: "Log" log_param { base: 1 }', [rand()])


# ---- Threshold, Clip, Swish ------------------------------------------------------------------------------
def test_threshold():
    x = rand()
    x[0, 0, 0, :2] = [0.3, 0.0]
    for t in (0.0, 0.3, -1.0):
        assert_forward(f'type: "Threshold" threshold_param {{ threshold: {t} }}', x,
                       lambda v, t=t: 1.0 if v > t else 0.0)
    run = setup_layer('type: "Threshold"', [x])
    run.forward()
    run.layer.backward_layer(run.top, [False], run.bottom)  # nothing requested: fine
    with pytest.raises(CctError, match="Threshold"):
        run.layer.backward_layer(run.top, [True], run.bottom)


def test_clip_forward():
    x = rand()
    x[0, 0, 0, :2] = [-0.5, 1.0]
    assert_forward('type: "Clip" clip_param { min: -0.5 max: 1 }', x, lambda v: max(-0.5, min(v, 1.0)))
    run = setup_layer('type: "Clip" clip_param { min: -0.5 max: 1 }', [x], dtype=np.float64)
    run.forward()
    dy = rand()
    np.testing.assert_array_equal(backward(run, dy), dy * ((x >= -0.5) & (x <= 1.0)))  # bounds pass dy


@pytest.mark.parametrize("in_place", [False, True])
def test_clip_gradient(in_place):
    check_gradient('type: "Clip" clip_param { min: -0.5 max: 1 }', [away_from(rand(), [-0.5, 1.0])],
                   in_place=in_place)


def test_clip_requires_min_max():
    with pytest.raises(ParamError, match="clip_param.max"):
        setup_layer('type: "Clip" clip_param { min: -0.5 }', [rand()])


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.5])
def test_swish_forward(beta):
    assert_forward(f'type: "Swish" swish_param {{ beta: {beta} }}', rand(lo=-5, hi=5),
                   lambda v: v / (1 + math.exp(-f32(beta) * v)), rtol=1e-12)


@pytest.mark.parametrize("beta", [1.0, 2.0])
@pytest.mark.parametrize("in_place", [False, True])
def test_swish_gradient(beta, in_place):
    check_gradient(f'type: "Swish" swish_param {{ beta: {beta} }}', [rand()], in_place=in_place)


# ---- Dropout -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.5, 0.2])
def test_dropout_train(ratio):
    x = rand((20, 50)) + 3.0  # no zeros in x, so a zero output means dropped
    set_random_seed(5)
    run = setup_layer(f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}', [x], dtype=np.float64)
    y = run.forward()[0]
    kept = y != 0
    scale = 1 / (1 - f32(ratio))
    np.testing.assert_allclose(y[kept], x[kept] * scale, rtol=1e-12)
    assert abs(kept.mean() - (1 - ratio)) < 0.05
    dy = rand((20, 50))
    np.testing.assert_allclose(backward(run, dy), dy * kept * scale, rtol=1e-12)  # the forward's mask
    set_random_seed(5)
    np.testing.assert_array_equal(run.forward()[0], y)  # the mask comes from the global stream
    y2 = run.forward()[0]
    assert not np.array_equal(y2 != 0, kept)  # and is redrawn at every forward


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ratio", [0.5, 0.3, 0.0, 0.9999999])
def test_dropout_mask_is_caffes_integer_rule_on_the_stream(dtype, ratio):
    """m = u > UINT_MAX * ratio (in the net's type), u the stream's 64-bit outputs as two 32-bit values each (an
    odd count uses half of the last); the largest ratios stay below 2^32 and drop nearly every value."""
    from cct.rng import get_rng

    x = (rand((7, 5)) + 3.0).astype(dtype)
    set_random_seed(9)
    state = get_rng().bit_generator.state
    run = setup_layer(f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}', [x], dtype=dtype)
    get_rng().bit_generator.state = state
    y = run.forward()[0]
    get_rng().bit_generator.state = state
    u = get_rng().bit_generator.random_raw(18).view(np.uint32)[:35].reshape(7, 5)
    threshold = int(dtype(4294967295.0) * dtype(f32(ratio)))
    np.testing.assert_array_equal(y != 0, u > threshold)
    assert (y != 0).any() == (ratio < 0.9)


def test_dropout_test_phase_is_identity():
    x = rand()
    for in_place in (False, True):
        run = setup_layer('type: "Dropout"', [x], phase=pb.TEST, in_place=in_place, dtype=np.float64)
        np.testing.assert_array_equal(run.forward()[0], x)
        dy = rand()
        np.testing.assert_array_equal(backward(run, dy), dy)


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_gradient(in_place):
    check_gradient('type: "Dropout" dropout_param { dropout_ratio: 0.3 }', [rand()], in_place=in_place)


def test_dropout_in_place_matches_out_of_place():
    x = rand()
    outs = []
    for in_place in (False, True):
        set_random_seed(11)
        run = setup_layer('type: "Dropout"', [x], in_place=in_place, dtype=np.float64)
        set_random_seed(3)
        y = run.forward()[0]
        outs.append((y, backward(run, np.ones(SHAPE))))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5])
def test_dropout_ratio_error(ratio):
    with pytest.raises(ParamError, match="dropout_param.dropout_ratio"):
        setup_layer(f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}', [rand()])


# ---- against real Caffe (float32, layer by layer on the neuron_zoo reference net) --------------------------
def check_against_caffe(layer_name: str, bottoms: list[str]) -> None:
    """Run one layer of ``nets/neuron_zoo`` on Caffe's bottoms (``bottoms``: the blob names after split
    insertion) and compare its top, its bottom diffs for Caffe's top diff, and its parameter diffs."""
    from google.protobuf import text_format

    from tests.reference import assert_close, reference_dir

    folder = reference_dir("nets", "neuron_zoo")
    net = text_format.Parse((folder / "net.prototxt").read_text(), pb.NetParameter())
    param = next(lay for lay in net.layer if lay.name == layer_name)
    param.phase = pb.TRAIN
    z = np.load(folder / "train.npz")
    run = setup_layer(create_layer(param), [z[f"data/{b}"] for b in bottoms], dtype=np.float32)
    for j, blob in enumerate(run.layer.blobs):
        blob.data[...] = z[f"param/{layer_name}/{j}"]
    top = param.top[0]
    assert_close(run.forward()[0], z[f"data/{top}"], f"{layer_name} top")
    run.top[0].diff[...] = z[f"diff/{top}"]
    run.layer.backward_layer(run.top, [True] * len(bottoms), run.bottom)
    for b, name in zip(run.bottom, bottoms):
        assert_close(b.diff, z[f"diff/{name}"], f"{layer_name} bottom diff {name}")
    for j, blob in enumerate(run.layer.blobs):
        assert_close(blob.diff, z[f"param_diff/{layer_name}/{j}"], f"{layer_name} param diff {j}")


@pytest.mark.parametrize("layer_name,bottom", [
    ("relu", "data_data_0_split_0"), ("leaky", "data_data_0_split_1"), ("prelu", "data_data_0_split_2"),
    ("elu", "data_data_0_split_3"), ("sigmoid", "data_data_0_split_4"), ("tanh", "data_data_0_split_5"),
    ("absval", "data_data_0_split_6"), ("bnll", "data_data_0_split_7"),
    ("power", "sigmoid_sigmoid_0_split_0"), ("log", "sigmoid_sigmoid_0_split_1"),
    ("exp", "tanh_tanh_0_split_0"),
])
def test_against_caffe(layer_name, bottom):
    check_against_caffe(layer_name, [bottom])


@pytest.mark.parametrize("size", [ZERO_ROW - 1, 3 * ZERO_ROW, 3 * ZERO_ROW + 17])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_into_is_bitwise_maximum_with_zero(size, dtype):
    """Against a row of zeros (whole rows, then the remainder) or the scalar: the same bits as ``max(x, 0)``,
    signed zeros, NaN and infinities included, in place or not, contiguous or not."""
    rng = np.random.default_rng(size)
    x = rng.standard_normal(size).astype(dtype)
    special = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf], dtype)
    x[rng.choice(size, 5 * 7, replace=False)] = np.repeat(special, 7)
    bits = np.uint32 if dtype == np.float32 else np.uint64
    expect = np.maximum(x, 0)
    out = np.empty_like(x)
    assert relu_into(x, out) is out
    np.testing.assert_array_equal(out.view(bits), expect.view(bits))
    wide = np.stack([x, x], axis=1)  # columns: not contiguous
    relu_into(wide[:, 0], wide[:, 1])
    np.testing.assert_array_equal(wide[:, 1].view(bits), expect.view(bits))
    relu_into(x, x)
    np.testing.assert_array_equal(x.view(bits), expect.view(bits))
