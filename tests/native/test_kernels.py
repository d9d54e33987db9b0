"""The compiled kernels' module: built where it can be, switched by CCT_NATIVE, strict about its arguments.
(What they compute is tested against the numpy bodies with the layers and the lowering.)"""
from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from cct import native
from cct.errors import CctError
from tests.helpers import at_vector_width, compiled_vector_widths


def test_built_where_a_c_compiler_is():
    """An install with a C compiler and Python's headers builds the kernels (a broken build would otherwise pass
    unnoticed, every layer running its slower numpy body)."""
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")) or \
            not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no C compiler or Python headers here")
    assert native._built is not None, native.describe()


def test_cct_native_switches_them_off(monkeypatch):
    if native._built is None:
        pytest.skip("compiled kernels not built")
    monkeypatch.setenv("CCT_NATIVE", "1")
    assert native.kernels() is native._built and native.describe().startswith("compiled")
    monkeypatch.setenv("CCT_NATIVE", "0")
    assert native.kernels() is None and "CCT_NATIVE=0" in native.describe()
    monkeypatch.setenv("CCT_NATIVE", "maybe")
    with pytest.raises(CctError, match="CCT_NATIVE"):
        native.kernels()


def test_vector_width_runs_the_kernels_built_per_width_at_any_width_the_cpu_has():
    """The kernels built once per register width run at the CPU's widest by default; vector_width(n) picks a
    narrower one (the tests compare each against the numpy bodies; ``cct device_query`` names it), 0 goes back to
    the widest, and a width that is not 16, 32 or 64 bytes, or wider than the CPU's, is refused."""
    if native._built is None:
        pytest.skip("compiled kernels not built")
    k = native._built
    widest = k.vector_width()
    assert widest in (16, 32, 64)
    try:
        assert k.vector_width(16) == widest and k.vector_width() == 16
        if native.kernels() is not None:  # not turned off (CCT_NATIVE=0)
            assert native.describe().startswith("compiled, SSE vectors")  # what cct device_query shows
        assert k.vector_width(0) == 16 and k.vector_width() == widest
        with pytest.raises(ValueError, match="expected 16, 32 or 64"):
            k.vector_width(24)
        if widest < 64:
            with pytest.raises(ValueError, match="widest vectors"):
                k.vector_width(2 * widest)
        assert k.vector_width() == widest
    finally:
        k.vector_width(0)


def test_the_kernels_build_is_part_of_the_machine_key(monkeypatch):
    """Speeds measured of the kernels (a panel GEMM against BLAS) are cached per build: the module carries its
    source's digest, which the machine key names (another build: every speed measured again)."""
    import hashlib
    import types

    from cct.device import query

    if native._built is None:
        pytest.skip("kernels not built")
    source = Path(native.__file__).with_name("_kernels.c").read_bytes()
    assert native._built.SOURCE == hashlib.sha1(source).hexdigest()[:12]
    key = query.machine_key()
    assert key.endswith(f"|kernels {native._built.SOURCE}")
    monkeypatch.setattr(native, "_built", types.SimpleNamespace(SOURCE="another"))
    assert query.machine_key() == key[:key.rindex("|")] + "|kernels another"
    monkeypatch.setattr(native, "_built", None)
    assert query.machine_key().endswith("|no kernels")


def test_takes_numpy_float_arrays_of_one_dtype_contiguous():
    a = np.zeros((2, 3), np.float32)
    assert native.takes(a, np.ones(4, np.float32))
    assert native.takes(np.zeros(3))
    assert not native.takes(a, np.zeros(3))           # dtypes differ
    assert not native.takes(a.T)                       # not C-contiguous
    assert not native.takes(np.zeros(3, np.int32))     # not a float
    assert not native.takes(a.tolist())                # not an array


@pytest.fixture
def kernels():
    if native._built is None:
        pytest.skip("compiled kernels not built")
    return native._built


def test_arguments_are_checked_before_any_memory_is_touched(kernels):
    """Geometries, dtypes and buffer sizes that do not fit are errors, not reads or writes out of bounds."""
    x = np.zeros((1, 1, 4, 4), np.float32)
    y = np.zeros((1, 1, 2, 2), np.float32)
    codes = np.arange(1, 5, dtype=np.uint8)
    good = (1, 2, 4, 4, 2, 2, 2, 2, 2, 2, 0, 0, 1, 1)
    kernels.max_pool_forward(good, x, y, None, None, codes)
    with pytest.raises(ValueError, match="geometry"):
        kernels.max_pool_forward(good[:-1], x, y, None, None, codes)
    with pytest.raises(ValueError, match="ymax"):
        kernels.max_pool_forward((1, 2, 4, 4, 3, 3, 2, 2, 2, 2, 0, 0, 1, 1), x, y, None, None, codes)
    with pytest.raises(TypeError, match="float32 or float64"):
        kernels.max_pool_forward(good, x.astype(np.int16), y, None, None, codes)
    with pytest.raises(ValueError, match="unsupported"):
        kernels.max_pool_forward((1, 2, 4, 4, 2, 2, 2, 2, 0, 2, 0, 0, 1, 1), x, y, None, None, codes)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.max_pool_forward(good, x, np.zeros((1, 1, 2, 4), np.float32)[..., ::2], None, None, codes)
    size = np.full(4, 4, np.float32)
    kernels.ave_pool_forward(good, x, size, y)
    kernels.ave_pool_backward(good, y, 1 / size, x, False)
    with pytest.raises(ValueError, match="^size:"):
        kernels.ave_pool_forward(good, x, size[:3], y)
    with pytest.raises(ValueError, match="^dx:"):
        kernels.ave_pool_backward(good, y, 1 / size, x[..., :3].copy(), True)
    with pytest.raises(ValueError, match="^y:"):  # global pooling's own loops check the same
        kernels.ave_pool_forward((2, 2, 4, 4, 1, 1, 4, 4, 1, 1, 0, 0, 1, 1), np.zeros(32, np.float32), size[:1],
                                 np.zeros(1, np.float32))
    col = np.zeros((1, 2, 2, 1, 3, 3), np.float32)
    lowering = (1, 1, 4, 4, 2, 2, 1, 1, 0, 0, 1, 1, 3, 3)
    kernels.lowering(x, col, lowering, False, False)
    with pytest.raises(ValueError, match="col"):
        kernels.lowering(x, col[:, :1], lowering, False, False)
    with pytest.raises(ValueError, match="dx"):
        kernels.lowering(col, x[:, :, :3], lowering, True, False)
    with pytest.raises(ValueError, match="geometry"):
        kernels.lowering(x, col, lowering + (1,), False, True)




@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu_backward_is_numpys_masked_product(kernels, dtype, in_place):
    """``dx = dy * (x > 0)``, bit for bit numpy's: NaN and ±inf gradients where x is not above 0 give NaN, negative
    ones -0, NaN inputs mask; ``dx`` may be ``dy`` (an in-place ReLU)."""
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, -3.0, 7.5], dtype)
    x = np.repeat(special, len(special))
    dy = np.tile(special, len(special))
    want = np.multiply(dy, x > 0)
    dx = dy if in_place else np.full_like(dy, 5.0)
    kernels.relu_backward(x, dy, dx)
    bits = np.uint32 if dtype is np.float32 else np.uint64
    np.testing.assert_array_equal(dx.view(bits), want.view(bits))
    with pytest.raises(ValueError, match="dx: expected"):
        kernels.relu_backward(x, dy, dx[:-1])

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("l1", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", [0.0, 0.004])
def test_sgd_update_makes_the_numpy_bodys_operations(kernels, dtype, l1, normalize, decay):
    """The SGD step on values that round differently under any other order or fusion, and on ±0, ±inf and NaN
    (numpy's sign: 0 for ±0, NaN kept): the bits of the numpy sequence."""
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, -3.0, 7.5], dtype)
    w = np.concatenate([special, rng.standard_normal(1000).astype(dtype) * 1e3, special[::-1]])
    g = np.concatenate([special[::-1], rng.standard_normal(1000).astype(dtype), special])
    h = np.concatenate([special[3:], special[:3], rng.standard_normal(1000).astype(dtype), special])
    # the solver's scalars are float32 values
    norm, dec, rate, mom = np.float32(1) / np.float32(3), np.float32(decay), np.float32(0.02), np.float32(0.9)
    ew, eg, eh = w.copy(), g.copy(), h.copy()
    with np.errstate(all="ignore"):
        if normalize:
            eg *= norm
        if dec:
            eg += (np.sign(ew) if l1 else ew) * dec
        eg *= rate
        eh *= mom
        eh += eg
        eg[...] = eh
        ew -= eg
    kernels.sgd_update(w, g, h, normalize, norm, dec, l1, rate, mom)
    bits = np.uint32 if dtype is np.float32 else np.uint64
    for got, want in ((w, ew), (g, eg), (h, eh)):
        np.testing.assert_array_equal(got.view(bits), want.view(bits))


def test_sgd_update_checks_its_buffers(kernels):
    w = np.zeros(8, np.float32)
    kernels.sgd_update(w, np.zeros(8, np.float32), np.zeros(8, np.float32), False, 1.0, 0.0, False, 0.1, 0.9)
    with pytest.raises(ValueError, match="h: expected 8"):
        kernels.sgd_update(w, np.zeros(8, np.float32), np.zeros(7, np.float32), False, 1.0, 0.0, False, 0.1, 0.9)
    with pytest.raises(ValueError, match="g: expected"):
        kernels.sgd_update(w, np.zeros(8, np.float64), np.zeros(8, np.float32), False, 1.0, 0.0, False, 0.1, 0.9)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.sgd_update(w, np.zeros(16, np.float32)[::2], np.zeros(8, np.float32), False, 1.0, 0.0, False,
                           0.1, 0.9)

def _rows(dtype, rows: int = 6, cells: int = 37, seed: int = 0):
    """Values that round differently under another order or fusion, with ±0, ±inf, NaN and a tiny one."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(rows * cells) * 1e3).astype(dtype)
    v[:8] = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, -3.0, 7.5], dtype)
    return v.reshape(rows, cells)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [False, True])
def test_channel_rows_make_the_numpy_bodys_operations(kernels, dtype, in_place):
    """BatchNorm's and Scale's elementwise passes, row r on channel r % channels: the bits of the numpy steps the
    layers run without the kernels (cct/layers/normalization.py, scale.py), in place or not, with the second
    output each may write."""
    x, other = _rows(dtype), _rows(dtype, seed=1)
    mean, std = np.array([0.5, -2.0, 3.0], dtype), np.array([0.25, 3.0, 1e-3], dtype)
    a, b = np.array([1.5, -0.3, 2.0], dtype), np.array([-1.0, 0.125, 7.0], dtype)
    per_row = (slice(None), None)

    def channel(v):
        return np.tile(v, 2)[per_row]

    bits = np.uint32 if dtype is np.float32 else np.uint64
    with np.errstate(all="ignore"):
        cases = [
            ("normalize_rows", (mean, std), (x - channel(mean)) / channel(std), True),
            ("normalize_rows", (None, std), x / channel(std), False),
            ("scale_rows", (a, b), x * channel(a) + channel(b), True),
            ("scale_rows", (a, None), x * channel(a), False),
        ]
        for name, (v1, v2), want, second in cases:
            out = x.copy() if in_place else np.full_like(x, 5.0)
            extra = np.full_like(x, 5.0) if second else None
            getattr(kernels, name)(out if in_place else x, v1, v2, out, extra, x.shape[1])
            np.testing.assert_array_equal(out.view(bits), want.view(bits))
            if extra is not None:  # normalize: the kept copy of its output; scale: its input saved
                np.testing.assert_array_equal(extra.view(bits), (want if name == "normalize_rows" else x).view(bits))
        want = (x - (other * channel(a) + channel(b))) / channel(std)
    out = x.copy() if in_place else np.full_like(x, 5.0)
    kernels.normalize_backward_rows(out if in_place else x, other, a, b, std, out, x.shape[1])
    np.testing.assert_array_equal(out.view(bits), want.view(bits))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_sums_and_moments(kernels, dtype):
    """Per row: the sum and the sum of products (double-precision lanes), the mean and the sum of squared
    deviations from it (rounded to the dtype): the float64 values within its rounding."""
    a, b = _rows(dtype, 5, 1003, 2)[:, 1:], _rows(dtype, 5, 1003, 3)[:, 1:]
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    sums, dots, mean, m2 = (np.empty(5, dtype) for _ in range(4))
    kernels.row_sums(a, b, sums, dots, a.shape[1])
    kernels.row_moments(a, mean, m2, a.shape[1])
    rtol = 1e-6 if dtype is np.float32 else 1e-12
    np.testing.assert_allclose(sums, a64.sum(axis=1), rtol=rtol)
    np.testing.assert_allclose(dots, (a64 * b64).sum(axis=1), rtol=rtol)
    np.testing.assert_allclose(mean, a64.mean(axis=1), rtol=rtol)
    np.testing.assert_allclose(m2, ((a64 - a64.mean(axis=1, keepdims=True)) ** 2).sum(axis=1), rtol=rtol)
    only = np.full(5, 9.0, dtype)
    kernels.row_sums(a, None, only, None, a.shape[1])
    np.testing.assert_array_equal(only, sums)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [False, True])
def test_batchnorm_and_scale_forward_kernel_makes_the_two_layers_bits(kernels, dtype, in_place):
    """The fused BatchNorm -> Scale forward against the kernels of each layer run one after the other: the
    normalized copy and the scaled output, bit for bit."""
    x = _rows(dtype)
    mean, std = np.array([0.5, -2.0, 3.0], dtype), np.array([0.25, 3.0, 1e-3], dtype)
    k, bias = np.array([1.5, -0.3, 2.0], dtype), np.array([-1.0, 0.125, 7.0], dtype)
    cells = x.shape[1]
    bits = np.uint32 if dtype is np.float32 else np.uint64
    with np.errstate(all="ignore"):
        for bv in (bias, None):
            want_copy, want = np.empty_like(x), np.empty_like(x)
            kernels.normalize_rows(x, mean, std, want_copy, None, cells)
            kernels.scale_rows(want_copy, k, bv, want, None, cells)
            out, copy = (x.copy() if in_place else np.full_like(x, 5.0)), np.full_like(x, 5.0)
            kernels.normalize_scale_rows(out if in_place else x, mean, std, k, bv, out, copy, cells)
            np.testing.assert_array_equal(copy.view(bits), want_copy.view(bits))
            np.testing.assert_array_equal(out.view(bits), want.view(bits))


def test_channel_rows_check_their_buffers(kernels):
    x, v = np.zeros((4, 6), np.float32), np.ones(2, np.float32)
    with pytest.raises(ValueError, match="rows of 5 cells"):
        kernels.normalize_rows(x, v, v, x, None, 5)
    with pytest.raises(ValueError, match="cells must be positive"):
        kernels.row_sums(x, None, np.zeros(4, np.float32), None, 0)
    with pytest.raises(ValueError, match="mean: expected 4"):
        kernels.row_moments(x, np.zeros(3, np.float32), np.zeros(4, np.float32), 6)
    with pytest.raises(ValueError, match="bias: expected 2"):
        kernels.scale_rows(x, v, np.ones(1, np.float32), x, None, 6)
    with pytest.raises(ValueError, match="out: expected 24"):
        kernels.normalize_backward_rows(x, x, v, v, v, x[:2], 6)
    with pytest.raises(ValueError, match="std: expected"):
        kernels.normalize_rows(x, v, v.astype(np.float64), x, None, 6)


def test_a_module_of_another_api_version_is_not_called(monkeypatch):
    """A compiled module left beside the sources by a build of other sources is ignored, and said so."""
    import importlib
    import sys
    import types

    stale = types.ModuleType("cct.native._kernels")
    stale.API_VERSION = native.API_VERSION - 1
    monkeypatch.setitem(sys.modules, "cct.native._kernels", stale)
    monkeypatch.setattr(native, "_kernels", stale, raising=False)
    try:
        importlib.reload(native)
        assert native.kernels() is None and "reinstall" in native.describe()
    finally:
        monkeypatch.undo()
        importlib.reload(native)
    assert native._stale is False


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, cols, cells", [(1, 1, 1), (7, 5, 7), (130, 67, 10), (64, 200, 64), (3, 129, 1)])
def test_transpose_is_numpys_move_plus_bias(kernels, dtype, rows, cols, cells):
    """dst (cols, rows) = src (rows, cols) transposed, + bias[i // cells] on source row i: numpy's values bit for
    bit, across tile edges."""
    rng = np.random.default_rng(7)
    src = rng.standard_normal((rows, cols)).astype(dtype)
    bias = rng.standard_normal(-(-rows // cells)).astype(dtype)
    dst = np.full((cols, rows), np.nan, dtype)
    kernels.transpose(src, dst, rows, cols, None, 1)
    np.testing.assert_array_equal(dst, src.T)
    kernels.transpose(src, dst, rows, cols, bias, cells)
    np.testing.assert_array_equal(dst, src.T + np.repeat(bias, cells)[:rows])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_transpose_and_add_bias_rectify_as_numpys_maximum(kernels, dtype, with_bias):
    """With ``rectify`` (an in-place ReLU after a convolution) the values written are numpy's maximum(., 0) of what
    was written without it — NaN kept, -0.0 to +0 — bit for bit; ``add_bias`` adds a channel's bias to its rows in
    place as numpy's ``y += bias`` (without a bias, nothing is added: -0.0 stays -0.0 unless rectified)."""
    rng = np.random.default_rng(11)
    images, channels, cells = 3, 5, 13
    src = rng.standard_normal((channels * cells, images)).astype(dtype)
    src[3, 1], src[7, 2], src[8, 0] = np.nan, -0.0, 0.0
    bias = rng.standard_normal(channels).astype(dtype) if with_bias else None
    bits = f"u{np.dtype(dtype).itemsize}"
    plain, rectified = (np.full((images, channels * cells), 5.0, dtype) for _ in range(2))
    kernels.transpose(src, plain, channels * cells, images, bias, cells)
    kernels.transpose(src, rectified, channels * cells, images, bias, cells, True)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(rectified.view(bits), np.maximum(plain, 0).view(bits))
    y = src.T.reshape(images, channels, cells).copy()
    want = y + bias.reshape(1, channels, 1) if with_bias else y.copy()
    for rectify in (False, True):
        got = y.copy()
        kernels.add_bias(got, bias, channels, cells, rectify)
        with np.errstate(invalid="ignore"):
            expected = np.maximum(want, 0) if rectify else want
        np.testing.assert_array_equal(got.view(bits), expected.view(bits))
    with pytest.raises(ValueError, match="whole images"):
        kernels.add_bias(np.zeros(7, dtype), None, 2, 3)
    with pytest.raises(ValueError, match="bias: expected 5"):
        kernels.add_bias(np.zeros(30, dtype), np.zeros(4, dtype), 5, 3)


def _winograd_matrices(m):
    from cct.engines.winograd import _TRANSFORMS

    bt, _, at = (np.array(t, dtype=np.float64) for t in _TRANSFORMS[m])
    return bt, at


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("channels", [1, 16, 37])
def test_winograd_tiles_are_the_engines_transforms(kernels, dtype, m, channels):
    """``winograd_tiles``: each a x a input tile's Bᵀ d B (tiles stepping by m, overlapping by 2), and with
    ``gradient`` each m x m tile's A dY Aᵀ, tile by tile (n·th·tw, a², C) — the engine's matrices (its
    ``_TRANSFORMS``: the kernel's constants must be the same), as float64 sums of the same products, within a few
    units of the last place (the sums run in another order than a matrix product's)."""
    rng = np.random.default_rng(m * 100 + channels)
    a, n, th, tw = m + 2, 2, 3, 2
    bt, at = _winograd_matrices(m)
    eps = np.finfo(dtype).eps
    for gradient, t, cells in ((False, bt, a), (True, at.T, m)):
        rows, cols = (th - 1) * m + cells + 1, (tw - 1) * m + cells  # a spare row: the tiles need not fill src
        src = rng.standard_normal((n, rows, cols, channels)).astype(dtype)
        dst = np.full((n * th * tw, a * a, channels), np.nan, dtype)
        kernels.winograd_tiles(src, dst, (n, rows, cols, channels, th, tw, m), gradient)
        want = np.empty(dst.shape)
        for img in range(n):
            for i in range(th):
                for j in range(tw):
                    d = src[img, i * m:i * m + cells, j * m:j * m + cells].astype(np.float64)  # (cells, cells, C)
                    v = np.einsum("ik,klc,jl->ijc", t, d, t)
                    want[(img * th + i) * tw + j] = v.reshape(a * a, channels)
        scale = np.abs(src).max() * np.abs(t).sum(axis=1).max() ** 2
        np.testing.assert_allclose(dst, want, rtol=0, atol=8 * eps * scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_winograd_untile_is_the_output_transform_cut_with_bias_and_relu(kernels, dtype, m, with_bias):
    """``winograd_untile``: y (n, O, ho, wo) = each tile's Aᵀ M A, the last row and column of tiles cut to the
    output, plus the bias; with ``rectify`` numpy's maximum of exactly those values (NaN kept, -0.0 to +0)."""
    rng = np.random.default_rng(m + 10 * with_bias)
    a, n, channels, ho, wo = m + 2, 2, 19, 2 * m + 1, 3 * m
    th, tw = -(-ho // m), -(-wo // m)
    _, at = _winograd_matrices(m)
    src = rng.standard_normal((n * th * tw, a * a, channels)).astype(dtype)
    src[0, :, 3] = np.nan
    bias = rng.standard_normal(channels).astype(dtype) if with_bias else None
    y = np.full((n, channels, ho, wo), 7.0, dtype)
    kernels.winograd_untile(src, y, bias, (n, channels, ho, wo, th, tw, m))
    full = np.empty((n, channels, th * m, tw * m))
    for img in range(n):
        for i in range(th):
            for j in range(tw):
                mm = src[(img * th + i) * tw + j].astype(np.float64).reshape(a, a, channels)
                full[img, :, i * m:(i + 1) * m, j * m:(j + 1) * m] = np.einsum("ri,ijc,sj->crs", at, mm, at)
    want = full[:, :, :ho, :wo] + (bias.reshape(1, -1, 1, 1) if with_bias else 0)
    scale = np.nanmax(np.abs(src)) * np.abs(at).sum(axis=1).max() ** 2 + (np.abs(bias).max() if with_bias else 0)
    np.testing.assert_allclose(y, want, rtol=0, atol=8 * np.finfo(dtype).eps * scale)
    assert np.isnan(y[0, 3, :m, :m]).all()
    rectified = np.full_like(y, 7.0)
    kernels.winograd_untile(src, rectified, bias, (n, channels, ho, wo, th, tw, m), True)
    bits = f"u{np.dtype(dtype).itemsize}"
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(rectified.view(bits), np.maximum(y, 0).view(bits))


def test_winograd_kernels_check_their_arguments(kernels):
    src = np.zeros((1, 6, 6, 3), np.float32)
    dst = np.zeros((1, 36, 3), np.float32)
    kernels.winograd_tiles(src, dst, (1, 6, 6, 3, 1, 1, 4))
    with pytest.raises(ValueError, match="m must be 2 or 4"):
        kernels.winograd_tiles(src, dst, (1, 6, 6, 3, 1, 1, 3))
    with pytest.raises(ValueError, match="the tiles fit"):
        kernels.winograd_tiles(src, np.zeros((2, 36, 3), np.float32), (1, 6, 6, 3, 1, 2, 4))
    with pytest.raises(ValueError, match="dst: expected 108"):
        kernels.winograd_tiles(src, dst[:, :35], (1, 6, 6, 3, 1, 1, 4))
    with pytest.raises(ValueError, match="geometry"):
        kernels.winograd_tiles(src, dst, (1, 6, 6, 3, 1, 1))
    y = np.zeros((1, 3, 4, 4), np.float32)
    kernels.winograd_untile(dst, y, None, (1, 3, 4, 4, 1, 1, 4))
    with pytest.raises(ValueError, match="cover the output"):
        kernels.winograd_untile(dst, y, None, (1, 3, 4, 4, 2, 1, 2))
    with pytest.raises(ValueError, match="bias: expected 3"):
        kernels.winograd_untile(dst, y, np.zeros(2, np.float32), (1, 3, 4, 4, 1, 1, 4))
    with pytest.raises(ValueError, match="y: expected 48"):
        kernels.winograd_untile(dst, np.zeros((1, 3, 4, 3), np.float32), None, (1, 3, 4, 4, 1, 1, 4))


def test_transpose_checks_its_buffers(kernels):
    src = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="dst: expected 24"):
        kernels.transpose(src, np.zeros(23, np.float32), 4, 6, None, 1)
    with pytest.raises(ValueError, match="bias: expected 2"):
        kernels.transpose(src, np.zeros(24, np.float32), 4, 6, np.zeros(1, np.float32), 2)
    with pytest.raises(ValueError, match="cells positive"):
        kernels.transpose(src, np.zeros(24, np.float32), 4, 6, None, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_tests_every_value(kernels, dtype):
    """inf, -inf and NaN (in any place) are not finite; the largest finite value, subnormals and -0 are."""
    info = np.finfo(dtype)
    fine = np.array([0.0, -0.0, info.max, -info.max, info.tiny / 4, 1.0] * 7, dtype)
    assert kernels.all_finite(fine) and kernels.all_finite(fine[:0])
    for bad in (np.inf, -np.inf, np.nan, -np.nan):
        for at in (0, 17, fine.size - 1):
            x = fine.copy()
            x[at] = bad
            assert not kernels.all_finite(x), (bad, at)


@pytest.mark.parametrize("m,k,n", [(96, 363, 300), (12, 40, 32), (13, 7, 33), (5, 1, 3), (25, 600, 95), (30, 0, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_is_the_product(kernels, m, k, n, with_bias):
    """y = w @ x (+ bias per row) on float32 views unit-strided along their rows wherever they lie (rows of y, w and
    x apart by more than their width): every tile shape at the edges (rows not a multiple of 12, columns not of 32,
    a column block of several panels), an empty sum; the values outside y's view untouched; each value a sum over
    k whatever columns a call covers (the same bits computed on a split of the columns)."""
    if not native.panel_gemms():
        pytest.skip("the panel GEMMs run on AVX-512F or AVX2 with FMA")
    from cct.compare.tolerance import assert_close

    rng = np.random.default_rng(m * 7 + k)
    w = rng.standard_normal((m, k + 3), dtype=np.float32)[:, :k]
    x = rng.standard_normal((k, n + 5), dtype=np.float32)[:, :n]
    bias = rng.standard_normal(m, dtype=np.float32) if with_bias else None
    full = np.full((m, n + 2), 7.0, np.float32)
    y = full[:, :n]
    assert kernels.panel_gemm(y, w, x, bias)
    exact = w.astype(np.float64) @ x.astype(np.float64) + (0 if bias is None else bias.astype(np.float64)[:, None])
    assert_close(y, exact, "panel_gemm", reference="float64 product")
    assert (full[:, n:] == 7.0).all()
    split = np.empty_like(y)
    for j0, j1 in ((0, n // 3), (n // 3, n)):
        assert kernels.panel_gemm(split[:, j0:j1], w, x[:, j0:j1], bias)
    np.testing.assert_array_equal(split, y)


def test_panel_gemm_declines_what_it_does_not_take(kernels):
    """False, nothing written, for float64, a view strided along its rows and shapes that do not chain; a
    non-array argument is an error."""
    if not native.panel_gemms():
        pytest.skip("the panel GEMMs run on AVX-512F or AVX2 with FMA")
    w, x = np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)
    y = np.zeros((4, 5), np.float32)
    assert not kernels.panel_gemm(y.astype(np.float64), w.astype(np.float64), x.astype(np.float64), None)
    assert not kernels.panel_gemm(y, w, np.ones((3, 10), np.float32)[:, ::2], None)
    assert not kernels.panel_gemm(y, w, np.ones((4, 5), np.float32), None)
    assert not kernels.panel_gemm(y, w, x, np.ones(3, np.float32))
    assert (y == 0).all()
    with pytest.raises(TypeError):
        kernels.panel_gemm(y, w, [[1.0]], None)


def test_panel_weight_grad_declines_what_it_does_not_take(kernels):
    """The panels' weight gradient: False, dw untouched, for a dilation along the columns, a dw whose columns are not
    the lowered rows, and float64; buffers smaller than the geometry says are an error."""
    if not native.panel_gemms():
        pytest.skip("the panel GEMMs run on AVX-512F or AVX2 with FMA")
    x, dy = np.ones((1, 2, 6, 6), np.float32), np.ones((1, 3, 4, 4), np.float32)
    dw = np.zeros((3, 18), np.float32)
    geometry = (1, 2, 6, 6, 3, 3, 1, 1, 0, 0, 1, 1, 4, 4)
    assert kernels.panel_weight_grad(x, dy, dw, geometry)
    np.testing.assert_array_equal(dw, np.full((3, 18), 16.0, np.float32))
    dw[...] = 0
    assert not kernels.panel_weight_grad(x, np.ones((1, 3, 4, 2), np.float32), dw,
                                         (1, 2, 6, 6, 3, 3, 1, 1, 0, 0, 1, 2, 4, 2))
    assert not kernels.panel_weight_grad(x, dy, np.zeros((3, 17), np.float32), geometry)
    assert not kernels.panel_weight_grad(x.astype(np.float64), dy.astype(np.float64), dw.astype(np.float64), geometry)
    assert (dw == 0).all()
    with pytest.raises(ValueError):
        kernels.panel_weight_grad(x[:, :1].copy(), dy, dw, geometry)


def test_panel_kernels_make_the_same_bits_at_every_vector_width(kernels):
    """The panel kernels are built for AVX-512F and for AVX2 with FMA over the same packed operands, each value
    the same fused multiply-adds in the same order: at every width this CPU runs (``vector_width``) the product,
    the forward lowered into the panels and the weight gradient are the same bits; at 16 bytes they decline."""
    if not native.panel_gemms():
        pytest.skip("the panel GEMMs run on AVX-512F or AVX2 with FMA")
    rng = np.random.default_rng(3)
    w, x = rng.standard_normal((25, 363), dtype=np.float32), rng.standard_normal((363, 301), dtype=np.float32)
    bias = rng.standard_normal(25, dtype=np.float32)
    n, c, o, (h, wd), oh, ow = 2, 3, 14, (23, 25), 11, 12
    geometry = (n, c, h, wd, 5, 5, 2, 2, 1, 1, 1, 1, oh, ow)
    xc = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    wc = rng.standard_normal((o, c * 25), dtype=np.float32)
    dy = rng.standard_normal((n, o, oh, ow), dtype=np.float32)
    results = []
    for width in [wd_ for wd_ in compiled_vector_widths() if wd_ >= 32]:
        with at_vector_width(width):
            y, yc, dw = np.empty((25, 301), np.float32), np.empty((n, o, oh, ow), np.float32), np.ones_like(wc)
            assert kernels.panel_gemm(y, w, x, bias)
            assert kernels.panel_conv_forward(xc, wc, bias[:o], yc, geometry)
            assert kernels.panel_weight_grad(xc, dy, dw, geometry)
        results.append((y, yc, dw))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    with at_vector_width(16):
        y = np.zeros((25, 301), np.float32)
        assert not kernels.panel_gemm(y, w, x, bias) and not y.any()


@pytest.mark.parametrize("geometry", [
    # n, c, o, (h, w), kernel, stride, pad, dilation: spans cut inside output rows, rows past o, wide kernels
    (2, 3, 96, (35, 37), (11, 11), (4, 4), (0, 0), (1, 1)),
    (2, 3, 14, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1)),
    (1, 5, 13, (30, 31), (3, 3), (1, 1), (1, 1), (2, 1)),
    (1, 40, 20, (20, 20), (3, 3), (1, 1), (2, 2), (1, 3)),
    (1, 3, 25, (70, 71), (7, 7), (2, 3), (3, 1), (1, 1)),
])
def test_panel_conv_forward_is_the_convolution(kernels, geometry):
    """The forward lowered span by span into the panels: the float64 definition's values (bias added) for strides,
    padding and dilation along either axis."""
    if not native.panel_gemms():
        pytest.skip("the panel GEMMs run on AVX-512F or AVX2 with FMA")
    from cct.compare.tolerance import assert_close
    from cct.engines import ConvGeometry
    from tests.engines import reference as ref

    n, c, o, size, kernel, stride, pad, dilation = geometry
    g = ConvGeometry(n, c, o, 1, size, kernel, stride, pad, dilation)
    rng = np.random.default_rng(o)
    x = rng.standard_normal((n, c) + size, dtype=np.float32)
    w = rng.standard_normal((o, c) + kernel, dtype=np.float32)
    bias = rng.standard_normal(o, dtype=np.float32)
    y = np.full((n, o) + g.out_shape, np.nan, np.float32)
    lowered = (n, c) + size + kernel + stride + pad + dilation + g.out_shape
    assert kernels.panel_conv_forward(x, w.reshape(o, -1), bias, y, lowered)
    exact = ref.conv_forward(g, x.astype(np.float64), w.astype(np.float64), bias.astype(np.float64))
    assert_close(y, exact, "panel_conv_forward", reference="float64 definition")
    assert not kernels.panel_conv_forward(x, w.reshape(o, -1)[:, 1:], bias, y, lowered)  # not c*kh*kw columns
    with pytest.raises(ValueError):
        kernels.panel_conv_forward(x, w.reshape(o, -1), bias, y[:, 1:].copy(), lowered)
    cells = y[0, 0].size  # a range of each image's output cells: those written, the others left
    part = np.full_like(y, np.nan).reshape(n, o, cells)
    assert kernels.panel_conv_forward(x, w.reshape(o, -1), bias, part, lowered, 3, cells - 2)
    np.testing.assert_array_equal(part[..., 3:cells - 2], y.reshape(n, o, cells)[..., 3:cells - 2])
    assert np.isnan(part[..., :3]).all() and np.isnan(part[..., cells - 2:]).all()
    for first, last in ((-1, 4), (5, 4), (0, cells + 1)):
        with pytest.raises(ValueError):
            kernels.panel_conv_forward(x, w.reshape(o, -1), bias, part, lowered, first, last)
