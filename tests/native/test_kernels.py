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
    col = np.zeros((1, 2, 2, 1, 3, 3), np.float32)
    lowering = (1, 1, 4, 4, 2, 2, 1, 1, 0, 0, 1, 1, 3, 3)
    kernels.im2col(x, col, lowering)
    with pytest.raises(ValueError, match="col"):
        kernels.im2col(x, col[:, :1], lowering)
    with pytest.raises(ValueError, match="dx"):
        kernels.col2im(col, x[:, :, :3], lowering)
    with pytest.raises(ValueError, match="geometry"):
        kernels.im2col(x, col, lowering + (1,))




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
