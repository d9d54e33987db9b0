"""Convolution, Deconvolution, Im2col and the lowering engine against loop references."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import cct.layers.conv  # noqa: F401  (registers the layers)
from cct.engines import ConvGeometry, create_conv_engine
from cct.engines.depthwise import DepthwiseEngine
from cct.engines.fft import FFTEngine
from cct.engines.lowering import LoweringEngine
from cct.engines.winograd import WinogradEngine
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, layer_param, setup_layer

GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


def _pad_input(x: np.ndarray, pad) -> np.ndarray:
    return np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])


def ref_conv(x, w, b, stride, pad, dilation, group):
    """Direct loop convolution (N, C, *in) -> (N, O, *out)."""
    n_img, c = x.shape[:2]
    o_ch, cg = w.shape[:2]
    kernel = w.shape[2:]
    og = o_ch // group
    xp = _pad_input(x, pad)
    out = tuple((xp.shape[2 + i] - (dilation[i] * (k - 1) + 1)) // stride[i] + 1
                for i, k in enumerate(kernel))
    y = np.zeros((n_img, o_ch) + out)
    for n, o in itertools.product(range(n_img), range(o_ch)):
        g = o // og
        for p in itertools.product(*map(range, out)):
            s = 0.0 if b is None else b[o]
            for ci in range(cg):
                for k in itertools.product(*map(range, kernel)):
                    cell = tuple(pi * st + ki * d for pi, st, ki, d in zip(p, stride, k, dilation))
                    s += w[(o, ci) + k] * xp[(n, g * cg + ci) + cell]
            y[(n, o) + p] = s
    return y


def ref_deconv(x, w, b, stride, pad, dilation, group):
    """Direct scatter: each input cell adds x·W[c, o, k] at p*stride - pad + k*dilation."""
    n_img, c = x.shape[:2]
    og = w.shape[1]
    o_ch = og * group
    kernel = w.shape[2:]
    cg = c // group
    out = tuple(s * (i - 1) + d * (k - 1) + 1 - 2 * q
                for i, k, s, q, d in zip(x.shape[2:], kernel, stride, pad, dilation))
    full = tuple(o + 2 * q for o, q in zip(out, pad))
    y = np.zeros((n_img, o_ch) + full)
    for n, ci in itertools.product(range(n_img), range(c)):
        g = ci // cg
        for p in itertools.product(*map(range, x.shape[2:])):
            for oo in range(og):
                for k in itertools.product(*map(range, kernel)):
                    cell = tuple(pi * st + ki * d for pi, st, ki, d in zip(p, stride, k, dilation))
                    y[(n, g * og + oo) + cell] += x[(n, ci) + p] * w[(ci, oo) + k]
    y = y[(slice(None), slice(None)) + tuple(slice(q, q + o) for q, o in zip(pad, out))]
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * len(out))
    return y


def _run(text: str, bottoms, num_tops=None, seed=3):
    rng = np.random.default_rng(seed)
    run = setup_layer(text, bottoms, num_tops, dtype=np.float64)
    for blob in run.layer.blobs:
        blob.data[...] = rng.standard_normal(blob.shape)
    return run, run.forward()


# (prototxt conv params, bottom shape, stride, pad, dilation, group)
CONV_CASES = [
    ("num_output: 4 kernel_size: 3", (2, 3, 6, 5), (1, 1), (0, 0), (1, 1), 1),
    ("num_output: 4 kernel_size: 3 pad: 1 stride: 2", (2, 3, 7, 6), (2, 2), (1, 1), (1, 1), 1),
    ("num_output: 4 kernel_size: 3 dilation: 2 pad: 2", (1, 2, 7, 7), (1, 1), (2, 2), (2, 2), 1),
    ("num_output: 6 kernel_size: 2 group: 3 stride: 1", (2, 6, 4, 5), (1, 1), (0, 0), (1, 1), 3),
    ("num_output: 5 kernel_size: 1", (2, 3, 4, 3), (1, 1), (0, 0), (1, 1), 1),
    ("num_output: 4 kernel_size: 1 group: 2", (2, 4, 3, 3), (1, 1), (0, 0), (1, 1), 2),
    ("num_output: 3 kernel_size: 1 stride: 2 pad: 1", (1, 2, 5, 4), (2, 2), (1, 1), (1, 1), 1),
    ("num_output: 3 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0",
     (2, 2, 7, 5), (2, 1), (1, 0), (1, 1), 1),
    ("num_output: 4 kernel_size: [3, 2] stride: [1, 2] pad: [0, 1] dilation: [1, 2] group: 2",
     (1, 4, 6, 7), (1, 2), (0, 1), (1, 2), 2),
]


@pytest.mark.parametrize("params,shape,stride,pad,dilation,group", CONV_CASES)
def test_convolution_forward_matches_loops(params, shape, stride, pad, dilation, group):
    x = np.random.default_rng(0).standard_normal(shape)
    run, (y,) = _run(f'type: "Convolution" convolution_param {{ {params} }}', [x])
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    np.testing.assert_allclose(y, ref_conv(x, w, b, stride, pad, dilation, group), rtol=1e-10, atol=1e-10)


def test_convolution_no_bias_and_default_fillers():
    x = np.random.default_rng(1).standard_normal((2, 3, 5, 5))
    text = 'type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 bias_term: false }'
    run = setup_layer(text, [x], dtype=np.float64)
    assert len(run.layer.blobs) == 1 and run.layer.blobs[0].shape == (2, 3, 3, 3)
    assert not run.layer.blobs[0].data.any()  # Caffe's default filler: constant 0
    run.layer.blobs[0].data[...] = np.random.default_rng(2).standard_normal((2, 3, 3, 3))
    (y,) = run.forward()
    np.testing.assert_allclose(y, ref_conv(x, run.layer.blobs[0].data, None, (1, 1), (0, 0), (1, 1), 1),
                               rtol=1e-10, atol=1e-10)


def test_convolution_3d_per_axis_kernel_dilation_group():
    x = np.random.default_rng(4).standard_normal((2, 4, 5, 6, 4))
    params = ("num_output: 6 kernel_size: [2, 3, 1] dilation: [2, 1, 1] stride: [1, 2, 1] pad: [1, 0, 1] "
              "group: 2")
    run, (y,) = _run(f'type: "Convolution" convolution_param {{ {params} }}', [x])
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    assert w.shape == (6, 2, 2, 3, 1)
    np.testing.assert_allclose(y, ref_conv(x, w, b, (1, 2, 1), (1, 0, 1), (2, 1, 1), 2),
                               rtol=1e-10, atol=1e-10)
    check_gradient(f'type: "Convolution" convolution_param {{ {params} {GAUSS} }}', [x])


def test_convolution_axis_2():
    """Dims before the channel axis are batch-like."""
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5, 5))
    run, (y,) = _run('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 axis: 2 }', [x])
    assert y.shape == (2, 3, 2, 3, 3)
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    ref = ref_conv(x.reshape(6, 4, 5, 5), w, b, (1, 1), (0, 0), (1, 1), 1)
    np.testing.assert_allclose(y, ref.reshape(y.shape), rtol=1e-10, atol=1e-10)


def test_convolution_multiple_bottoms_share_weights():
    rng = np.random.default_rng(6)
    x0, x1 = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 4))
    run, (y0, y1) = _run('type: "Convolution" convolution_param { num_output: 3 kernel_size: 2 pad: 1 }',
                         [x0, x1], num_tops=2)
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    np.testing.assert_allclose(y0, ref_conv(x0, w, b, (1, 1), (1, 1), (1, 1), 1), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(y1, ref_conv(x1, w, b, (1, 1), (1, 1), (1, 1), 1), rtol=1e-10, atol=1e-10)
    check_gradient(f'type: "Convolution" convolution_param {{ num_output: 3 kernel_size: 2 pad: 1 {GAUSS} }}',
                   [x0, x1], num_tops=2)
    with pytest.raises(CctError, match="same shape"):
        setup_layer('type: "Convolution" convolution_param { num_output: 3 kernel_size: 2 }',
                    [x0, x1[:, :, :4]], num_tops=2)


@pytest.mark.parametrize("params,shape", [(c[0], c[1]) for c in CONV_CASES])
def test_convolution_gradient(params, shape):
    x = np.random.default_rng(7).standard_normal(shape)
    check_gradient(f'type: "Convolution" convolution_param {{ {params} {GAUSS} }}', [x])


DECONV_CASES = [
    ("num_output: 3 kernel_size: 3", (2, 2, 3, 4), (1, 1), (0, 0), (1, 1), 1),
    ("num_output: 4 kernel_size: 3 stride: 2 pad: 1", (2, 3, 3, 3), (2, 2), (1, 1), (1, 1), 1),
    ("num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 2", (1, 4, 3, 2), (2, 2), (1, 1), (1, 1), 2),
    ("num_output: 2 kernel_h: 2 kernel_w: 3 stride_h: 3 stride_w: 1 dilation: 2", (1, 2, 2, 3),
     (3, 1), (0, 0), (2, 2), 1),
    ("num_output: 6 kernel_size: 1 group: 3", (2, 3, 2, 3), (1, 1), (0, 0), (1, 1), 3),
]


@pytest.mark.parametrize("params,shape,stride,pad,dilation,group", DECONV_CASES)
def test_deconvolution_forward_and_gradient(params, shape, stride, pad, dilation, group):
    x = np.random.default_rng(8).standard_normal(shape)
    run, (y,) = _run(f'type: "Deconvolution" convolution_param {{ {params} }}', [x])
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    assert w.shape[:2] == (shape[1], run.layer.num_output // group)  # (C_in, num_output/group, k...)
    np.testing.assert_allclose(y, ref_deconv(x, w, b, stride, pad, dilation, group), rtol=1e-10, atol=1e-10)
    check_gradient(f'type: "Deconvolution" convolution_param {{ {params} {GAUSS} }}', [x])


def test_deconvolution_3d_and_two_bottoms():
    rng = np.random.default_rng(9)
    x0, x1 = rng.standard_normal((1, 2, 2, 3, 2)), rng.standard_normal((1, 2, 2, 3, 2))
    params = "num_output: 2 kernel_size: [2, 2, 3] stride: [2, 1, 1] pad: [0, 1, 1] group: 2"
    run, (y0, y1) = _run(f'type: "Deconvolution" convolution_param {{ {params} }}', [x0, x1], num_tops=2)
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    for x, y in ((x0, y0), (x1, y1)):
        np.testing.assert_allclose(y, ref_deconv(x, w, b, (2, 1, 1), (0, 1, 1), (1, 1, 1), 2),
                                   rtol=1e-10, atol=1e-10)
    check_gradient(f'type: "Deconvolution" convolution_param {{ {params} {GAUSS} }}', [x0, x1], num_tops=2)


def ref_im2col(x, kernel, stride, pad, dilation):
    xp = _pad_input(x, pad)
    out = tuple((xp.shape[2 + i] - (dilation[i] * (k - 1) + 1)) // stride[i] + 1
                for i, k in enumerate(kernel))
    n_img, c = x.shape[:2]
    cols = np.zeros((n_img, c) + tuple(kernel) + out)
    for k in itertools.product(*map(range, kernel)):
        for p in itertools.product(*map(range, out)):
            cell = tuple(pi * st + ki * d for pi, st, ki, d in zip(p, stride, k, dilation))
            cols[(slice(None), slice(None)) + k + p] = xp[(slice(None), slice(None)) + cell]
    return cols.reshape((n_img, -1) + out)


def test_im2col_forward_and_gradient():
    x = np.random.default_rng(10).standard_normal((2, 3, 5, 6))
    text = 'type: "Im2col" convolution_param { kernel_h: 3 kernel_w: 2 stride: 2 pad: 1 dilation: [1, 2] }'
    _, (y,) = _run(text, [x])
    np.testing.assert_array_equal(y, ref_im2col(x, (3, 2), (2, 2), (1, 1), (1, 2)))
    check_gradient(text, [x])
    x3 = np.random.default_rng(11).standard_normal((1, 2, 3, 4, 3))
    _, (y3,) = _run('type: "Im2col" convolution_param { kernel_size: 2 stride: [1, 2, 1] }', [x3])
    np.testing.assert_array_equal(y3, ref_im2col(x3, (2, 2, 2), (1, 2, 1), (0, 0, 0), (1, 1, 1)))


# ---- the engine ---------------------------------------------------------------------------------
def test_engine_partitions_and_buffer_reuse():
    """A tiny lowering budget splits the batch into partitions with identical results; buffers persist."""
    geo = ConvGeometry(5, 4, 6, 2, (6, 5), (3, 2), (2, 1), (1, 0), (1, 2))
    rng = np.random.default_rng(12)
    x = rng.standard_normal((5, 4, 6, 5))
    w, b = rng.standard_normal((6, 2, 3, 2)), rng.standard_normal(6)
    dy = rng.standard_normal((5, 6) + geo.out_shape)
    results = []
    for budget in (1 << 30, 1):
        eng = LoweringEngine(max_lowered_bytes=budget)
        eng.configure(geo)
        y = np.zeros((5, 6) + geo.out_shape)
        eng.forward(x, w, b, y)
        col = eng._ws[0]["col"]
        dx, dw = np.zeros_like(x), np.zeros_like(w)
        eng.backward(x, dy, w, dx, dw)
        eng.forward(x, w, b, y)
        assert eng._ws[0]["col"] is col  # allocated once per shape
        results.append((y, dx, dw))
    assert len(eng._partitions(8)) == 5  # budget 1 byte: one image per partition
    for a, c in zip(*results):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(results[0][0], ref_conv(x, w, b, (2, 1), (1, 0), (1, 2), 2), rtol=1e-10)


def test_engine_lookup_and_cudnn_engine_accepted():
    assert isinstance(create_conv_engine("lowering"), LoweringEngine)
    assert isinstance(create_conv_engine("fft"), FFTEngine)
    assert isinstance(create_conv_engine("winograd"), WinogradEngine)
    assert isinstance(create_conv_engine("depthwise"), DepthwiseEngine)
    with pytest.raises(CctError, match="known: depthwise, fft, lowering, winograd"):
        create_conv_engine("direct")
    x = np.random.default_rng(13).standard_normal((1, 2, 4, 4))
    for engine in ("CAFFE", "CUDNN", "DEFAULT"):
        text = f'type: "Convolution" convolution_param {{ num_output: 2 kernel_size: 3 engine: {engine} }}'
        run = setup_layer(text, [x])
        assert isinstance(run.layer.engine.inner, LoweringEngine)


def test_float32_matches_float64():
    x = np.random.default_rng(14).standard_normal((2, 3, 8, 8))
    text = f'type: "Convolution" convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 group: 1 {GAUSS} }}'
    run64 = setup_layer(text, [x], dtype=np.float64)
    run32 = setup_layer(text, [x], dtype=np.float32)
    run32.layer.blobs[0].data[...] = run64.layer.blobs[0].data
    run32.layer.blobs[1].data[...] = run64.layer.blobs[1].data
    (y64,), (y32,) = run64.forward(), run32.forward()
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-4, atol=1e-5)


# ---- parameter errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("params,field,match", [
    ("num_output: 2 kernel_size: 0", "convolution_param.kernel_size", "nonzero"),
    ("num_output: 2", "convolution_param.kernel_size", "specified 0 times"),
    ("num_output: 2 kernel_size: [3, 3, 3]", "convolution_param.kernel_size", "once per spatial"),
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", "convolution_param.kernel_h", "not both"),
    ("num_output: 2 kernel_h: 3", "convolution_param.kernel_size", "nonzero"),
    ("num_output: 2 kernel_size: 3 stride: 0", "convolution_param.stride", "nonzero"),
    ("num_output: 2 kernel_size: 3 stride_h: 2 stride: 1", "convolution_param.stride_h", "not both"),
    ("num_output: 2 kernel_size: 3 dilation: 0", "convolution_param.dilation", "> 0"),
    ("num_output: 0 kernel_size: 3", "convolution_param.num_output", "> 0"),
    ("num_output: 4 kernel_size: 3 group: 4", "convolution_param.group", "multiple of group"),
    ("num_output: 3 kernel_size: 3 group: 2", "convolution_param.group", "multiples of group"),
    ("num_output: 2 kernel_size: 7", "convolution_param.kernel_size", "kernel larger than padded input"),
    ("num_output: 2 kernel_size: 3 dilation: 3", "convolution_param.kernel_size", "extent 7"),
    ("num_output: 2 kernel_size: 3 axis: 4", "convolution_param.axis", "out of range"),
])
def test_convolution_param_errors(params, field, match):
    x = np.zeros((1, 2, 5, 6))
    with pytest.raises(ParamError, match=match) as e:
        setup_layer(f'type: "Convolution" convolution_param {{ {params} }}', [x])
    assert e.value.field == field


def test_deconvolution_output_must_be_positive():
    with pytest.raises(ParamError, match="output size"):
        setup_layer('type: "Deconvolution" convolution_param { num_output: 2 kernel_size: 2 pad: 1 }',
                    [np.zeros((1, 2, 1, 3))])


def test_preloaded_weight_shapes_are_checked():
    from cct.layers.registry import create_layer

    def param_with_blobs(shapes):
        p = layer_param('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 }')
        for shape in shapes:
            bp = p.blobs.add()
            bp.shape.dim.extend(shape)
            bp.data.extend([0.5] * int(np.prod(shape)))
        return p

    x = np.zeros((1, 3, 5, 5))
    ok = setup_layer(create_layer(param_with_blobs([(2, 3, 3, 3), (2,)])), [x])
    assert (ok.layer.blobs[0].data == 0.5).all()
    with pytest.raises(ParamError, match=r"Incorrect weight shape: expected 2 3 3 3 \(54\), got 2 3 3 2"):
        setup_layer(create_layer(param_with_blobs([(2, 3, 3, 2), (2,)])), [x])
    with pytest.raises(ParamError, match="Incorrect bias shape"):
        setup_layer(create_layer(param_with_blobs([(2, 3, 3, 3), (3,)])), [x])
    with pytest.raises(ParamError, match="number of weight blobs"):
        setup_layer(create_layer(param_with_blobs([(2, 3, 3, 3)])), [x])


def test_reshape_rejects_channel_change():
    run = setup_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 1 }',
                      [np.zeros((1, 3, 2, 2))])
    run.bottom[0].reshape((1, 4, 2, 2))
    with pytest.raises(CctError, match="incompatible"):
        run.layer.reshape(run.bottom, run.top)

