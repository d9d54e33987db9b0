"""The FFT convolution engine: equal to the lowering engine (forward, backward data, backward weights) in 1-, 2-
and 3-D with groups, padding and dilation; gradient checks through Convolution/Deconvolution; pruned vs
unpruned transforms; memoization and its invalidation; strided layers; applicability."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers.conv  # noqa: F401  (registers the layers)
from cct.config import settings
from cct.engines import ConvGeometry
from cct.engines.fft import FFTEngine, fft_transform_size
from cct.engines.fft_plan import FFTPlan, positions, transform_size
from cct.engines.lowering import LoweringEngine
from cct.errors import CctError
from cct.gradient_check import check_gradient, layer_param
from cct.layers.conv import Convolution, Deconvolution

GEOMETRIES = [
    ConvGeometry(2, 3, 4, 1, (6, 5), (3, 3), (1, 1), (0, 0), (1, 1)),
    ConvGeometry(2, 4, 6, 2, (7, 6), (3, 2), (1, 1), (1, 2), (1, 1)),
    ConvGeometry(1, 2, 4, 1, (7, 7), (3, 3), (1, 1), (2, 2), (2, 2)),
    ConvGeometry(1, 2, 3, 1, (4, 4), (3, 3), (1, 1), (4, 4), (1, 1)),       # pad > kernel: out > in + pad
    ConvGeometry(3, 6, 4, 2, (10,), (4,), (1,), (3,), (2,)),
    ConvGeometry(1, 2, 4, 1, (9, 8, 7), (3, 3, 3), (1, 1, 1), (1, 0, 2), (2, 1, 1)),
    ConvGeometry(2, 4, 4, 4, (5, 6, 4), (2, 3, 1), (1, 1, 1), (0, 1, 0), (1, 1, 3)),
    ConvGeometry(2, 3, 5, 1, (6, 6, 6), (5, 5, 5), (1, 1, 1), (2, 2, 2), (1, 1, 1)),
    # strided: computed as the stride-1 convolution
    ConvGeometry(2, 3, 4, 1, (9, 8), (3, 3), (2, 3), (1, 0), (1, 1)),
    ConvGeometry(2, 2, 3, 1, (7, 8, 9), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)),
    ConvGeometry(1, 4, 2, 2, (11, 10), (3, 2), (3, 2), (2, 1), (2, 1)),
]
IDS = [f"{len(g.in_shape)}d-k{'x'.join(map(str, g.kernel))}-p{'x'.join(map(str, g.pad))}-"
       f"d{'x'.join(map(str, g.dilation))}-s{'x'.join(map(str, g.stride))}-g{g.group}" for g in GEOMETRIES]


def _data(g: ConvGeometry, dtype=np.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((g.num, g.in_channels) + g.in_shape).astype(dtype)
    w = rng.standard_normal((g.out_channels, g.in_channels // g.group) + g.kernel).astype(dtype)
    b = rng.standard_normal(g.out_channels).astype(dtype)
    dy = rng.standard_normal((g.num, g.out_channels) + g.out_shape).astype(dtype)
    return x, w, b, dy


def _run(eng, g, x, w, b, dy):
    eng.configure(g, x.dtype)
    y = np.full(dy.shape, np.nan, dtype=x.dtype)
    eng.forward(x, w, b, y)
    dx = np.full(x.shape, np.nan, dtype=x.dtype)
    dw = np.ones_like(w)  # weight gradients accumulate
    eng.backward(x, dy, w, dx, dw)
    return y, dx, dw - 1


def _close(a, b, rtol):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max()))


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-4), (np.float64, 1e-10)])
@pytest.mark.parametrize("g", GEOMETRIES, ids=IDS)
def test_equals_lowering(g, dtype, rtol):
    x, w, b, dy = _data(g, dtype)
    ref = _run(LoweringEngine(1), g, x, w, b, dy)
    for kw in ({"lift": False}, {"lift": True}, {"memoize": False}, {"pruned": False, "lift": True}):
        for got, want in zip(_run(FFTEngine(**kw), g, x, w, b, dy), ref):
            assert got.dtype == dtype
            _close(got, want, rtol)


def test_separate_passes_and_deconvolution_step():
    """backward_data / backward_weights called alone, and forward_and_backward_weights (Deconvolution)."""
    g = GEOMETRIES[1]
    x, w, b, dy = _data(g, np.float64)
    low, fft = LoweringEngine(1), FFTEngine()
    for eng in (low, fft):
        eng.configure(g, np.float64)
    outs = []
    for eng in (low, fft):
        dx = eng.backward_data(dy, w, np.zeros_like(x))
        dw = eng.backward_weights(x, dy, np.zeros_like(w))
        y, dw2 = np.zeros_like(dy), np.zeros_like(w)
        eng.forward_and_backward_weights(x, w, y, dy, dw2)
        outs.append((dx, dw, y, dw2))
    for got, want in zip(outs[1], outs[0]):
        _close(got, want, 1e-10)


@pytest.mark.parametrize("params,shape", [
    ("num_output: 3 kernel_size: 3 pad: 1", (2, 2, 5, 6)),
    ("num_output: 4 kernel_size: [3, 2] pad: [0, 1] dilation: [1, 2] group: 2", (1, 4, 6, 7)),
    ("num_output: 2 kernel_size: 3 pad: 1", (1, 2, 4, 5, 4)),
    ("num_output: 4 kernel_size: [2, 3, 2] dilation: [2, 1, 1] pad: [1, 0, 1] group: 2", (1, 2, 5, 4, 4)),
    ("num_output: 3 kernel_size: 3 pad: 1 stride: 2", (1, 2, 5, 6, 5)),
])
@pytest.mark.parametrize("memoize,lift", [(True, False), (True, True), (False, True)])
def test_gradient_convolution(params, shape, memoize, lift):
    x = np.random.default_rng(1).standard_normal(shape)
    text = (f'type: "Convolution" convolution_param {{ {params} weight_filler {{ type: "gaussian" std: 0.5 }} '
            f'bias_filler {{ type: "gaussian" std: 0.5 }} }}')
    layer = Convolution(layer_param(text), FFTEngine(memoize=memoize, lift=lift))
    report = check_gradient(layer, [x], rtol=1e-6, atol=1e-8)
    assert report.checked > 0


@pytest.mark.parametrize("stride", [1, 2])
def test_gradient_deconvolution_3d(stride):
    x = np.random.default_rng(2).standard_normal((1, 2, 3, 4, 3))
    text = (f'type: "Deconvolution" convolution_param {{ num_output: 2 kernel_size: 3 pad: 1 stride: {stride} '
            'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')
    for lift in (False, True):
        check_gradient(Deconvolution(layer_param(text), FFTEngine(lift=lift)), [x], rtol=1e-6, atol=1e-8)


def test_layer_with_two_bottoms_equals_lowering():
    rng = np.random.default_rng(3)
    bottoms = [rng.standard_normal((2, 3, 5, 6, 4)).astype(np.float32) for _ in range(2)]
    text = ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 '
            'weight_filler { type: "gaussian" std: 0.5 } }')
    from cct.gradient_check import setup_layer

    runs = [setup_layer(Convolution(layer_param(text), eng), bottoms, 2) for eng in (LoweringEngine(1),
                                                                                     FFTEngine())]
    runs[1].layer.blobs[0].data[...] = runs[0].layer.blobs[0].data
    tops = [r.forward() for r in runs]
    for r in runs:
        for t in r.top:
            t.diff[...] = 1.0
        r.layer.backward_layer(r.top, [True, True], r.bottom)
    for a, b in zip(tops[1], tops[0]):
        _close(a, b, 1e-4)
    for a, b in zip(runs[1].bottom + runs[1].layer.blobs, runs[0].bottom + runs[0].layer.blobs):
        _close(a.diff, b.diff, 1e-4)


# ---- memoization ---------------------------------------------------------------------------------
def test_memoized_spectra_are_reused_and_invalidated():
    g = GEOMETRIES[5]
    x, w, b, dy = _data(g, np.float64)
    eng = FFTEngine(memoize=True)
    eng.configure(g, np.float64)
    y = np.zeros_like(dy)
    eng.forward(x, w, b, y)
    kept = eng.workspace_bytes()
    assert kept > 0
    eng.forward(x, w, b, y)
    assert eng.reuses == {"x": 1, "w": 1, "dy": 0}  # unchanged operands: their spectra are kept
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    eng.backward(x, dy, w, dx, dw)
    assert eng.reuses == {"x": 2, "w": 2, "dy": 0}  # the forward's transforms
    assert eng.workspace_bytes() == kept  # the output gradient's spectrum, used twice within the call, not kept
    eng.forward(x, w, b, y)
    assert eng.reuses["x"] == 2 and eng.reuses["w"] == 2  # a training step's backward dropped everything
    # separate gradient calls keep the output gradient's spectrum for each other; in-place changes between the
    # passes are seen: a solver update of w, a new batch written into x
    w -= 0.1
    x[0, 0, 0, 0, 0] += 1.0
    dx2, dw2 = np.zeros_like(x), np.zeros_like(w)
    eng.backward_weights(x, dy, dw2)
    eng.backward_data(dy, w, dx2)
    assert eng.reuses == {"x": 2, "w": 2, "dy": 1}  # only dy is unchanged
    assert eng.workspace_bytes() > kept
    ref = LoweringEngine(1)
    ref.configure(g, np.float64)
    rdx, rdw = np.zeros_like(x), np.zeros_like(w)
    ref.backward(x, dy, w, rdx, rdw)
    _close(dx2, rdx, 1e-10)
    _close(dw2, rdw, 1e-10)
    eng.invalidate()
    assert eng.workspace_bytes() == 0


@pytest.mark.parametrize("lift", [False, True])
def test_large_kernel_spectra_are_transformed_again_not_kept(monkeypatch, lift):
    """Kernel spectra over KEPT_KERNEL_MAX_BYTES are not kept between the passes: the backward transforms the
    kernel again (same numbers), the input's spectrum is still reused, and the engine's estimate of what it keeps
    is what it kept."""
    import cct.engines.fft as fft_module

    g = GEOMETRIES[5]
    x, w, b, dy = _data(g, np.float64)
    results, kept = [], []
    for cap in (1 << 40, 0):
        monkeypatch.setattr(fft_module, "KEPT_KERNEL_MAX_BYTES", cap)
        eng = FFTEngine(memoize=True, lift=lift)
        eng.configure(g, np.float64)
        y, dx, dw = np.zeros_like(dy), np.zeros_like(x), np.zeros_like(w)
        eng.forward(x, w, b, y)
        est = FFTEngine.estimate(g, 8)["lifted" if lift else "full"]["memo_bytes"]
        assert eng.workspace_bytes() == est
        kept.append(est)
        eng.backward(x, dy, w, dx, dw)
        assert eng.reuses == {"x": 1, "w": 1 if cap else 0, "dy": 0}
        results.append((y, dx, dw))
    assert kept[0] > kept[1] > 0  # the kernel's spectra, then the input's alone
    for a, b_ in zip(*results):
        np.testing.assert_array_equal(a, b_)


def test_swapped_values_are_a_change():
    """The content fingerprint weights positions: a permutation of the same values is not a hit."""
    g = GEOMETRIES[0]
    x, w, b, dy = _data(g, np.float64)
    eng = FFTEngine()
    eng.configure(g, np.float64)
    eng.forward(x, w, None, np.zeros_like(dy))
    x[0, 0, [0, 1]] = x[0, 0, [1, 0]]
    dw = np.zeros_like(w)
    eng.backward_weights(x, dy, dw)
    assert eng.reuses["x"] == 0


def test_memoize_off(monkeypatch):
    monkeypatch.setenv("CCT_FFT_MEMOIZE", "0")
    eng = FFTEngine()
    assert not eng.memoize
    g = GEOMETRIES[0]
    x, w, b, dy = _data(g)
    _run(eng, g, x, w, b, dy)
    assert eng.workspace_bytes() == 0 and eng.reuses == {"x": 0, "w": 0, "dy": 0}
    monkeypatch.delenv("CCT_FFT_MEMOIZE")
    assert FFTEngine().memoize and not FFTEngine(memoize=False).memoize


@pytest.mark.parametrize("lift,kernel_block", [(False, (3, 3, 3, 4, 3)), (True, (3, 3, 4, 3, 3))])
def test_kernel_transformed_once_per_batch(monkeypatch, lift, kernel_block):
    """One input and one kernel transform per forward whatever the batch size (the kernel spectrum is
    shared by every image); the backward transforms only the output gradient."""
    g = ConvGeometry(5, 3, 4, 1, (6, 6, 5), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1))
    x, w, b, dy = _data(g)
    eng = FFTEngine(lift=lift)
    eng.configure(g, np.float32)
    calls = []
    original = FFTPlan.forward
    monkeypatch.setattr(FFTPlan, "forward", lambda self, a, *args: calls.append(a.shape) or original(self, a, *args))
    eng.forward(x, w, b, np.zeros_like(dy))
    assert len(calls) == 2 and calls[1] == kernel_block  # (*kernel, O, Cg) or lifted (*kernel[1:], O, k0, Cg)
    eng.backward(x, dy, w, np.zeros_like(x), np.zeros_like(w))
    assert len(calls) == 3


# ---- applicability -------------------------------------------------------------------------------
def test_applicability():
    g = ConvGeometry(1, 2, 2, 1, (8, 8), (3, 3), (2, 2), (1, 1), (1, 1))
    assert FFTEngine.supports(g) == (True, "")  # strided: as its stride-1 convolution
    assert FFTEngine.unit_stride(g).stride == (1, 1) and FFTEngine.unit_stride(GEOMETRIES[0]) is GEOMETRIES[0]
    assert FFTEngine.estimate(g) == FFTEngine.estimate(FFTEngine.unit_stride(g))
    with pytest.raises(CctError, match="CPU"):
        FFTEngine().configure(g, np.float32, xp=object())
    with pytest.raises(CctError, match="no spatial axes"):
        FFTEngine().configure(ConvGeometry(2, 3, 4, 1, (), (), (), (), ()), np.float32)


def test_describe_and_estimate():
    g = ConvGeometry(1, 16, 16, 1, (30, 30, 30), (7, 7, 7), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    eng = FFTEngine()
    assert eng.configure(g, np.float32) and not eng.configure(g, np.float32)
    est = FFTEngine.estimate(g)
    assert est["full"]["memo_bytes"] == 30 * 30 * 16 * 8 * (16 + 256)  # the input's and the kernel's spectra
    assert est["lifted"]["memo_bytes"] == 30 * 16 * 8 * (16 * 24 * 7 + 256 * 7)
    eng_run = FFTEngine()
    eng_run.configure(g, np.float32)
    x, w, b, dy = _data(g)
    eng_run.forward(x, w, None, np.zeros_like(dy))
    eng_run.backward(x, dy, w, np.zeros_like(x), np.zeros_like(w))
    assert eng_run.workspace_bytes() == est["lifted"]["memo_bytes"]
    assert est["choice"] == "lifted" and eng.lifted  # one image, 7^3: the first axis is lifted
    assert est["lifted"]["transform_flops"] < est["full"]["transform_flops"]
    assert eng.describe() == "fft 30x30 over axes 1.., direct over axis 0 (7 taps; pruned, memoized)"
    full = FFTEngine(lift=False)
    full.configure(g, np.float32)
    assert full.describe() == "fft 30x30x30 (pruned, memoized)"
    assert FFTEngine.estimate(ConvGeometry(1, 2, 2, 1, (9,), (3,), (1,), (0,), (1,)))["choice"] == "full"
    many = ConvGeometry(32, 8, 8, 1, (24, 24, 24), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    est = FFTEngine.estimate(many)
    assert est["choice"] == "full" and est["full"]["seconds"] < est["lifted"]["seconds"]  # many images, 3^3


def test_the_full_layouts_products_cost_as_gemms_over_a_batch():
    """The unlifted products have a row per image: near a flat rate for a few images, but over a batch they are
    GEMMs — CaffeNet's conv2 at 64 images ran its full layout in 0.16 s where the flat rate alone predicted
    0.97 s (so it was never measured); a one-image 3-D layer keeps the flat rate."""
    from cct.engines.fft import PRODUCT_FLOPS_PER_S

    conv2 = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))
    est = FFTEngine.estimate(conv2)
    assert est["full"]["seconds"] < 0.5 * est["full"]["product_flops"] / PRODUCT_FLOPS_PER_S
    assert est["choice"] == "full"
    one = ConvGeometry(1, 16, 16, 1, (30, 30, 30), (7, 7, 7), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    est = FFTEngine.estimate(one)
    assert est["full"]["seconds"] >= est["full"]["product_flops"] / PRODUCT_FLOPS_PER_S


# ---- plans ---------------------------------------------------------------------------------------
def test_transform_sizes_are_fast_and_large_enough():
    def factors_in(t, primes):
        for p in primes:
            while t % p == 0:
                t //= p
        return t == 1

    for n in range(1, 200):
        assert transform_size(n) >= n and factors_in(transform_size(n), (2, 3, 5, 7, 11))
        assert transform_size(n, real=True) >= n and factors_in(transform_size(n, real=True), (2, 3, 5))
    assert transform_size(13) == 14 and transform_size(13, real=True) == 15
    g = ConvGeometry(1, 1, 1, 1, (30, 11, 4), (7, 3, 3), (1, 1, 1), (0, 2, 4), (1, 3, 1))
    # in + pad = 30; in + pad = 13 -> 14; out = 4 + 8 - 3 + 1 = 10 > in + pad = 8 on the real axis
    assert fft_transform_size(g) == (30, 14, 10)


@pytest.mark.parametrize("step", [(1, 1, 1), (2, 1, 3)])
def test_pruned_transforms_equal_full_ones(step):
    rng = np.random.default_rng(4)
    block = rng.standard_normal((3, 2, 3, 4, 2))  # spatial (3, 2, 3), batch (4, 2)
    size = (9, 8, 10)
    padded = np.zeros(size + (4, 2))
    padded[tuple(slice(0, (n - 1) * s + 1, s) for n, s in zip(block.shape[:3], step))] = block
    want = np.fft.rfftn(padded, axes=(0, 1, 2))
    for pruned in (True, False):
        spec = FFTPlan(size, pruned).forward(block, step)
        np.testing.assert_allclose(spec, want, rtol=1e-12, atol=1e-12)
        where = [positions(1, 3, -2, 9), positions(2, 5, 1, 8), np.array([9, 0, 4])]
        got = FFTPlan(size, pruned).inverse(spec.copy(), where)
        full = np.fft.irfftn(want, s=size, axes=(0, 1, 2))
        ref = full[np.ix_([1, 8, 6], [2, 3, 4, 5, 6], [9, 0, 4])]
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_positions():
    assert positions(2, 3, 1, 10) == slice(2, 5, 1)
    assert positions(2, 3, -1, 10) == slice(2, None, -1)
    assert positions(3, 2, -1, 10) == slice(3, 1, -1)
    np.testing.assert_array_equal(positions(0, 3, -1, 10), [0, 9, 8])
    np.testing.assert_array_equal(positions(8, 3, 1, 10), [8, 9, 0])


def test_memo_budget_turns_memoization_off_and_says_so(monkeypatch):
    g = ConvGeometry(1, 4, 4, 1, (10, 10, 10), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1))
    x, w, b, dy = _data(g)
    monkeypatch.setenv("CCT_FFT_MEMO_MB", "0.001")
    eng = FFTEngine()
    ref = _run(LoweringEngine(1), g, x, w, b, dy)
    for got, want in zip(_run(eng, g, x, w, b, dy), ref):
        _close(got, want, 1e-4)
    assert eng.workspace_bytes() == 0 and "not memoized:" in eng.describe() and "> CCT_FFT_MEMO_MB 0" in eng.describe()
    monkeypatch.delenv("CCT_FFT_MEMO_MB")
    eng = FFTEngine()
    _run(eng, g, x, w, b, dy)
    assert eng.workspace_bytes() > 0 and "memoized" in eng.describe() and "not" not in eng.describe()


@pytest.mark.parametrize("partitions,per_image", [(1, True), (2, True), (2, False)])
def test_layout_moves_equal_the_transposed_copies(partitions, per_image, monkeypatch):
    """The engine's moves between (N, C, *spatial) and spatial-first (or, lifted, the first spatial axis after the
    others, zero rows around it) — image by image on one partition or split
    over two, or (small arrays) as one copy; from a contiguous or strided signal, into a contiguous or strided
    output — are the plain transposed copies, value for value."""
    from cct.engines import fft

    settings.set("partitions", partitions)
    monkeypatch.setattr(fft, "MOVE_PER_IMAGE_MIN", 0 if per_image else 1 << 30)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((5, 6, 4, 3)).astype(np.float32)
    np.testing.assert_array_equal(fft._spatial_first(a), np.moveaxis(a, (0, 1), (2, 3)))
    spatial, (G, N, C) = (4, 3), (2, 5, 3)
    signal = rng.standard_normal(spatial + (G, N, C)).astype(np.float32)
    expected = signal.transpose(3, 2, 4, 0, 1).reshape(N, G * C, *spatial)
    for sig in (signal, np.asfortranarray(signal)):
        out = np.empty((N, G * C) + spatial, np.float32)
        fft.FFTEngine._write(sig, out, spatial)
        np.testing.assert_array_equal(out, expected)
        wide = np.zeros((N, G * C, 6, 5), np.float32)
        fft.FFTEngine._write(sig, wide[:, :, 1:5, 1:4], spatial)  # a strided output
        np.testing.assert_array_equal(wide[:, :, 1:5, 1:4], expected)
    for shape, pad in (((5, 6, 4, 3), 2), ((5, 6, 4, 3), 0), ((3, 2, 4, 3, 5), 1)):  # the lifted layout's operands
        a = rng.standard_normal(shape).astype(np.float32)
        nd = a.ndim - 2
        moved = np.moveaxis(a, (0, 1, 2), (nd, nd + 1, nd - 1))  # (*rest, s0, N, C)
        padded = np.pad(moved, [(0, 0)] * (nd - 1) + [(pad, pad), (0, 0), (0, 0)])
        np.testing.assert_array_equal(fft._lifted_first(a, pad), padded)


@pytest.mark.parametrize("size,block_shape,step,where", [
    ((9, 8), (3, 2), (1, 1), [positions(1, 3, -2, 9), positions(2, 5, 1, 8)]),  # narrow: few rows, few positions
    ((10, 7), (4, 3), (2, 3), [np.array([9, 0, 4]), positions(6, 3, 1, 7)]),
    ((9, 8), (7, 5), (1, 1), [positions(2, 6, 1, 9), positions(7, 4, -1, 8)]),  # wide ones
    ((12, 10), (5, 4), (2, 2), [positions(11, 7, 1, 12), np.array([1, 9, 0])]),  # narrow block, wide positions
    ((12,), (5,), (2,), [positions(3, 6, 1, 12)]),
    ((11,), (4,), (1,), [np.array([10, 0, 5, 2])]),
])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_transforms_by_dft_matrices_equal_numpys(size, block_shape, step, where, dtype):
    """One- and two-axis transforms run as DFT matrix products (``MATRIX_DFT_MAX``): the spectrum of a (dilated)
    block and the signal at the wanted positions are numpy's ``rfftn``/``irfftn`` ones (odd and even sizes:
    with and without a Nyquist bin; blocks and positions narrow and wide along the first axis)."""
    plan = FFTPlan(size)
    assert plan.by_matrices(dtype) and not FFTPlan(size, pruned=False).by_matrices(dtype)
    rng = np.random.default_rng(5)
    block = rng.standard_normal(block_shape + (4, 3)).astype(dtype)
    padded = np.zeros(size + (4, 3))
    padded[tuple(slice(0, (n - 1) * s + 1, s) for n, s in zip(block_shape, step))] = block
    axes = tuple(range(len(size)))
    want = np.fft.rfftn(padded, axes=axes)
    spec = plan.forward(block, step)
    assert spec.shape == plan.spectrum_shape + (4, 3) and spec.dtype == np.result_type(dtype, np.complex64)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(spec, want, rtol=tol, atol=tol * np.abs(want).max())
    signal = rng.standard_normal(size + (4, 3))
    ref = signal[np.ix_(*[np.arange(n)[w] for n, w in zip(size, where)])]
    got = plan.inverse(np.fft.rfftn(signal, axes=axes).astype(spec.dtype), where)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(signal).max())


@pytest.mark.parametrize("size,block_shape", [((9, 8), (3, 2)), ((9, 8), (7, 5)), ((12,), (5,)),
                                              ((9, 8, 10), (3, 2, 3))])
def test_batch_first_transforms_equal_the_spatial_first_ones(size, block_shape):
    """A batch-first block (:meth:`FFTPlan.forward_batch_first`) gives the spectrum of its spatial-first copy,
    and the inverse writes the same signal batch-first into a given array whatever its strides (a transposed
    view here) — by DFT matrix products where they apply, through ``scipy.fft`` (three axes) otherwise."""
    rng = np.random.default_rng(6)
    nd = len(size)
    plan = FFTPlan(size)
    block = rng.standard_normal((4, 3) + block_shape)
    spatial_first = np.ascontiguousarray(np.moveaxis(block, (0, 1), (nd, nd + 1)))
    spec = plan.forward_batch_first(block)
    np.testing.assert_allclose(spec, plan.forward(spatial_first), rtol=1e-12, atol=1e-12)
    for dtype in (np.float64, np.float32):  # the conjugate spectrum: exactly the conjugate (as values)
        b = block.astype(dtype)
        conj = plan.forward_batch_first(b, conjugate=True)
        np.testing.assert_array_equal(conj.view(b.dtype), np.conjugate(plan.forward_batch_first(b)).view(b.dtype))
    where = [positions(1, n - 2, 1, n) for n in size]
    signal = plan.inverse(spec.copy(), where)
    into = np.full((3, 4) + signal.shape[:nd], np.nan).transpose((1, 0) + tuple(range(2, 2 + nd)))
    assert plan.inverse(spec.copy(), where, out=into) is into
    np.testing.assert_allclose(into, np.moveaxis(signal, tuple(range(nd)), tuple(range(2, 2 + nd))), rtol=1e-12,
                               atol=1e-12)
