"""A convolution's forward with its output rectified — an in-place ReLU right after it, run as one step
(:mod:`cct.exec.fusion`) — gives exactly the bits of the forward and then the ReLU's ``maximum(y, 0)`` (NaN kept,
-0.0 to +0), on every engine and every way an engine writes its output: the panel GEMM's tiles at each vector
width, the compiled move into images first, an image's or a chunk's bias, the FFT's and Winograd's last passes,
and the generic pass after the forward; with the compiled kernels and with the numpy bodies."""
from __future__ import annotations

import numpy as np
import pytest

from cct import native
from cct.config import settings
from cct.engines import ConvGeometry, lowering
from cct.engines.depthwise import DepthwiseEngine
from cct.engines.fft import FFTEngine
from cct.engines.lowering import LoweringEngine, Workspace
from cct.engines.winograd import WinogradEngine
from tests.helpers import BODIES, at_vector_width, compiled_vector_widths, select_body

GEOMETRIES = {
    "padded": ConvGeometry(3, 4, 6, 1, (7, 6), (3, 3), (1, 1), (1, 1), (1, 1)),
    "strided": ConvGeometry(2, 3, 5, 1, (13, 12), (3, 3), (2, 2), (1, 1), (1, 1)),
    "groups": ConvGeometry(2, 6, 6, 3, (6, 5), (2, 2), (1, 1), (0, 0), (1, 1)),
    "3-D": ConvGeometry(2, 2, 3, 1, (4, 5, 4), (2, 2, 3), (1, 1, 1), (1, 0, 1), (1, 2, 1)),
    "big images": ConvGeometry(2, 3, 4, 1, (14, 13), (3, 3), (1, 1), (1, 1), (1, 1)),
    "pointwise": ConvGeometry(3, 4, 6, 2, (5, 6), (1, 1), (1, 1), (0, 0), (1, 1)),
}


@pytest.fixture(params=BODIES)
def body(request, monkeypatch):
    return select_body(request, monkeypatch)


def _data(g: ConvGeometry, dtype, bias: bool = True):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((g.num, g.in_channels) + g.in_shape).astype(dtype)
    w = rng.standard_normal((g.out_channels, g.in_channels // g.group) + g.kernel).astype(dtype)
    b = rng.standard_normal(g.out_channels).astype(dtype) if bias else None
    x[-1, 0] = np.nan  # the last image's first group: NaN outputs, which the ReLU keeps
    w[0] = 0  # the first output channel is its bias alone (or zeros): zeros of either sign, rectified to +0
    if b is not None:
        b[0] = -0.0
    return x, w, b


def _assert_rectified_bits(make, g: ConvGeometry, dtype, bias: bool = True) -> None:
    x, w, b = _data(g, dtype, bias)
    plain, fused = make(), make()
    for eng in (plain, fused):
        eng.configure(g, dtype)
    y = np.full((g.num, g.out_channels) + g.out_shape, 7.0, dtype)
    with np.errstate(invalid="ignore"):
        plain.forward(x, w, b, y)
        want = np.maximum(y, 0)
        got = np.full_like(y, 7.0)
        fused.forward_rectified(x, w, b, got)
    assert np.isnan(want).any() and (want == 0).any() and (want > 0).any()
    bits = f"u{np.dtype(dtype).itemsize}"
    np.testing.assert_array_equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("images_last", [None, True], ids=["own-order", "images-last"])
@pytest.mark.parametrize("strategy", [1, 2, 3])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_lowerings(body, monkeypatch, name, strategy, images_last, dtype, bias):
    if images_last is not None:
        monkeypatch.setattr(lowering, "images_last_order", lambda lay: lay.f < len(lay.inF + lay.outL))
    _assert_rectified_bits(lambda: LoweringEngine(strategy, workspace=Workspace()), GEOMETRIES[name], dtype, bias)


@pytest.mark.parametrize("strategy", [1, 2])
@pytest.mark.parametrize("parts", [1, 2])
def test_lowerings_in_partitions_and_chunks(body, parts, strategy):
    with settings.override(partitions=parts):
        _assert_rectified_bits(lambda: LoweringEngine(strategy, max_lowered_bytes=1, workspace=Workspace()),
                               GEOMETRIES["big images"], np.float32)


@pytest.mark.parametrize("width", compiled_vector_widths() or [0])
@pytest.mark.parametrize("name", ["strided", "groups"])
def test_panel_gemm_tiles(monkeypatch, tmp_path, width, name):
    """Type 1 on big images by the compiled panel GEMMs (one group: lowered span by span into the panels; groups:
    ``panel_gemm`` per image), each tile rectified as it is stored."""
    from cct.engines import measured

    if not native.panel_gemms() or width < 32:
        pytest.skip("the panel GEMMs run on AVX-512F or AVX2 with FMA, with the compiled kernels")
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lowering, "PANEL_MIN_FLOPS", 0)
    monkeypatch.setattr(measured, "measured_choice",
                        lambda kind, key, ways: "panels" if kind == "panel_gemm" else next(iter(ways)))
    g = {"strided": ConvGeometry(3, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1)),
         "groups": ConvGeometry(2, 4, 6, 2, (24, 23), (3, 3), (1, 1), (1, 1), (1, 1))}[name]
    with at_vector_width(width):
        for parts in (1, 2):
            with settings.override(partitions=parts):
                _assert_rectified_bits(lambda: LoweringEngine(1, workspace=Workspace()), g, np.float32)
    eng = LoweringEngine(1, workspace=Workspace())
    eng.configure(g, np.float32)
    x, w, b = _data(g, np.float32)
    eng.forward_rectified(x, w, b, np.empty((g.num, g.out_channels) + g.out_shape, np.float32))
    assert "panel GEMM: forward" in eng.describe()


@pytest.mark.parametrize("lift", [False, True], ids=["full", "lifted"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("name", ["padded", "3-D", "groups"])
def test_fft(name, bias, lift):
    _assert_rectified_bits(lambda: FFTEngine(lift=lift), GEOMETRIES[name], np.float32, bias)


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_winograd(bias, tile):
    g = ConvGeometry(3, 4, 6, 1, (11, 10), (3, 3), (1, 1), (1, 1), (1, 1))
    _assert_rectified_bits(lambda: WinogradEngine(tile), g, np.float32, bias)


def test_depthwise_by_the_generic_pass():
    if native.kernels() is None:
        pytest.skip("the depthwise engine runs on the compiled kernels")
    g = ConvGeometry(2, 4, 4, 4, (9, 8), (3, 3), (1, 1), (1, 1), (1, 1))
    _assert_rectified_bits(DepthwiseEngine, g, np.float32)
