"""The three lowerings against a direct reference and against each other: forward, backward data, backward
weights (accumulating), the fused Deconvolution step, fallbacks, partitions and chunking."""
from __future__ import annotations

import gc
import threading
import types
import weakref

import numpy as np
import pytest

from cct.config import settings
from cct.engines import ConvGeometry, lowering
from cct.engines.lowering import LoweringEngine, Workspace, strategy_fallback
from tests.engines import reference as ref
from tests.helpers import BODIES, run_batch_in_one_range, run_batch_in_ranges, select_body

# (geometry, expected effective strategy for requested 1, 2, 3)
CASES = [
    (ConvGeometry(2, 3, 4, 1, (6, 5), (3, 3), (1, 1), (0, 0), (1, 1)), (1, 2, 3)),
    (ConvGeometry(2, 4, 6, 1, (7, 6), (3, 3), (1, 1), (1, 1), (1, 1)), (1, 2, 3)),
    (ConvGeometry(2, 3, 5, 1, (5, 7), (3, 2), (1, 1), (2, 1), (1, 1)), (1, 2, 3)),
    (ConvGeometry(1, 2, 4, 1, (7, 7), (3, 3), (1, 1), (2, 2), (2, 2)), (1, 2, 3)),
    (ConvGeometry(2, 6, 6, 3, (4, 5), (2, 2), (1, 1), (0, 0), (1, 1)), (1, 2, 3)),
    (ConvGeometry(2, 3, 4, 1, (6, 7), (3, 3), (1, 2), (1, 1), (1, 1)), (1, 2, 1)),
    (ConvGeometry(2, 3, 4, 1, (7, 6), (3, 3), (2, 2), (1, 1), (1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 3, 5, 1, (4, 3), (1, 1), (1, 1), (0, 0), (1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 4, 6, 2, (5, 6, 4), (2, 3, 1), (1, 1, 2), (1, 0, 1), (2, 1, 1)), (1, 2, 1)),
    (ConvGeometry(1, 2, 3, 1, (4, 5, 4), (2, 2, 3), (1, 1, 1), (1, 0, 1), (1, 2, 1)), (1, 2, 3)),
    (ConvGeometry(2, 3, 4, 1, (9,), (3,), (1,), (1,), (2,)), (1, 1, 3)),
    (ConvGeometry(1, 2, 3, 1, (3, 3), (3, 3), (1, 1), (2, 2), (2, 2)), (1, 2, 3)),
    (ConvGeometry(1, 2, 2, 1, (2, 2), (3, 3), (1, 1), (3, 3), (3, 3)), (1, 2, 3)),
    (ConvGeometry(3, 4, 2, 2, (5, 4), (3, 2), (1, 1), (1, 0), (1, 1)), (1, 2, 3)),
    # strided lowered axes go through stride phases: whole phase cycles and a remainder, stride > kernel
    (ConvGeometry(2, 3, 4, 1, (27, 27), (11, 11), (4, 4), (0, 0), (1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 3, 4, 1, (13, 12), (2, 2), (3, 3), (0, 0), (1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 2, 3, 1, (6, 20, 17), (2, 5, 3), (1, 2, 3), (0, 1, 2), (1, 1, 1)), (1, 2, 1)),
    # images of >= DIRECT_MIN_COLS output cells: type 1 images first runs one GEMM per image into the output
    (ConvGeometry(2, 3, 2, 1, (12, 13), (3, 3), (1, 1), (1, 1), (1, 1)), (1, 2, 3)),
    # pointwise (1x1 kernels, no padding): the GEMMs read x (or, strided, its subsample) and write y where they lie —
    # groups, 3-D (dilation has no effect on a one-cell kernel), images of >= DIRECT_MIN_COLS cells, a stride; then
    # a padded 1x1 kernel: lowered as any other
    (ConvGeometry(3, 4, 6, 2, (5, 6), (1, 1), (1, 1), (0, 0), (1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 3, 4, 1, (3, 4, 5), (1, 1, 1), (1, 1, 1), (0, 0, 0), (2, 1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 3, 4, 1, (12, 13), (1, 1), (1, 1), (0, 0), (1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 3, 4, 1, (7, 6), (1, 1), (2, 2), (0, 0), (1, 1)), (1, 1, 1)),
    (ConvGeometry(2, 3, 4, 1, (4, 5), (1, 1), (1, 1), (1, 1), (1, 1)), (1, 1, 1)),
]
# 1x1 kernels without padding: the pointwise bodies (strided: on a subsample of the input)
POINTWISE = [c for c in CASES if all(k == 1 for k in c[0].kernel) and not any(c[0].pad)]
IDS = [f"case{i}" for i in range(len(CASES))]


def _data(g: ConvGeometry, seed: int = 0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((g.num, g.in_channels) + g.in_shape).astype(dtype)
    w = rng.standard_normal((g.out_channels, g.in_channels // g.group) + g.kernel).astype(dtype)
    b = rng.standard_normal(g.out_channels).astype(dtype)
    dy = rng.standard_normal((g.num, g.out_channels) + g.out_shape).astype(dtype)
    return x, w, b, dy


def _run_engine(eng: LoweringEngine, x, w, b, dy):
    y = np.full(dy.shape, np.nan, dtype=x.dtype)
    eng.forward(x, w, b, y)
    dx = np.full(x.shape, np.nan, dtype=x.dtype)
    dw = np.ones_like(w)  # gradients accumulate
    eng.backward(x, dy, w, dx, dw)
    return y, dx, dw - 1


@pytest.mark.parametrize("images_last", [None, False, True], ids=["cols", "images-first", "images-last"])
@pytest.mark.parametrize("strategy", [1, 2, 3])
@pytest.mark.parametrize("g,expected", CASES, ids=IDS)
def test_lowering_matches_direct_reference(g, expected, strategy, images_last, monkeypatch):
    if images_last is not None:  # type 1's column order forced either way (by default: by the image size)
        monkeypatch.setattr(lowering, "images_last_order", lambda lay: images_last and lay.f < len(lay.inF + lay.outL))
    x, w, b, dy = _data(g)
    eng = LoweringEngine(strategy)
    eng.configure(g, np.float64)
    assert eng.strategy == expected[strategy - 1]
    assert eng.reason.startswith("fallback") == (eng.strategy != strategy)
    if images_last is not None:
        assert eng._lay().images_last == (images_last and eng.strategy < 3 and eng._lay().f < g.num_spatial_axes)
    y, dx, dw = _run_engine(eng, x, w, b, dy)
    np.testing.assert_allclose(y, ref.conv_forward(g, x, w, b), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, ref.conv_backward_data(g, dy, w), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw, ref.conv_backward_weights(g, x, dy), rtol=1e-10, atol=1e-10)
    # the separate entry points and the fused Deconvolution step agree with the combined backward
    dx2, dw2 = eng.backward_data(dy, w, np.empty_like(x)), eng.backward_weights(x, dy, np.zeros_like(w))
    np.testing.assert_allclose(dx2, dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw2, dw, rtol=1e-12, atol=1e-12)
    y3, dw3 = np.empty_like(dy), np.zeros_like(w)
    eng.forward_and_backward_weights(x, w, y3, dy, dw3)
    np.testing.assert_allclose(y3, ref.conv_forward(g, x, w), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw3, dw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("way", ["images", "batched"])
@pytest.mark.parametrize("layout", ["kxm", "mxk"])
@pytest.mark.parametrize("parts,budget", [(1, 1 << 30), (2, 1 << 30), (3, 1)])
@pytest.mark.parametrize("g", [c[0] for c in POINTWISE], ids=[f"pointwise{i}" for i in range(len(POINTWISE))])
def test_pointwise_layers_read_and_write_the_blobs_where_they_lie(monkeypatch, g, parts, budget, layout, way):
    """A 1x1 kernel without padding lowers nothing: the forward, both gradients (accumulating, in either weight
    layout) and the fused Deconvolution step are the reference's, in partitions and chunks, without a lowering or a
    col2im — image by image on the arrays where they lie, with no copy at all, or ``batched`` (as measured faster)
    over a chunk's images through channel-first copies of the input and the gradient;
    an output that is not contiguous takes the lowering, with the same values."""
    from cct.engines import measured

    monkeypatch.setattr(lowering, "WEIGHT_LAYOUT_MIN_FLOPS", 0)
    monkeypatch.setattr(lowering, "POINTWISE_BATCH_MAX_COLS", 1 << 30)
    monkeypatch.setattr(measured, "measured_choice",
                        lambda kind, key, ways: way if kind == "pointwise_gemms" else layout)
    x, w, b, dy = _data(g, 7)
    expected = (ref.conv_forward(g, x, w, b), ref.conv_backward_data(g, dy, w), ref.conv_backward_weights(g, x, dy))
    eng = LoweringEngine(1, max_lowered_bytes=budget, workspace=Workspace())
    eng.configure(g, np.float64)
    assert eng._lay().pointwise
    lowered = []
    for step in ("_lower", "_grad_yt", "_col2im", "_input_channels_first"):
        real = getattr(eng, step)
        monkeypatch.setattr(eng, step, lambda *a, _real=real, _step=step, **k: lowered.append(_step) or _real(*a, **k))
    with settings.override(partitions=parts):
        assert len(eng._chunks(g.num, 8)) == min(parts, g.num)
        for got, want in zip(_run_engine(eng, x, w, b, dy), expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
        y, dw = np.empty_like(dy), np.zeros_like(w)
        eng.forward_and_backward_weights(x, w, y, dy, dw)
        np.testing.assert_allclose(y, ref.conv_forward(g, x, w), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(dw, expected[2], rtol=1e-10, atol=1e-10)
        assert sorted(set(lowered)) == (["_grad_yt", "_input_channels_first"] if way == "batched" else [])
        lowered.clear()
        strided = np.full((g.num, 2 * g.out_channels) + g.out_shape, np.nan)[:, ::2]
        eng.forward(x, w, b, strided)
        np.testing.assert_allclose(strided, expected[0], rtol=1e-10, atol=1e-10)
        assert "_lower" in lowered


def test_pointwise_layers_measure_image_by_image_against_batched_gemms(monkeypatch, tmp_path):
    """Below POINTWISE_BATCH_MAX_COLS output cells a pointwise layer measures, per direction, its GEMMs image by
    image against one GEMM over a chunk's images — the two ways being the engine's own methods run on stand-ins
    in every partition — and runs the faster; each choice is measured once; wider outputs, small GEMMs and other
    array modules run image by image without measuring."""
    from cct.engines import measured

    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lowering, "WEIGHT_LAYOUT_MIN_FLOPS", 0)
    asked = []

    def choice(kind, key, ways):
        asked.append((kind, key))
        if kind != "pointwise_gemms":
            return next(iter(ways))
        for run in ways.values():  # both ways run on their stand-ins
            run()
        return "batched"
    monkeypatch.setattr(measured, "measured_choice", choice)
    g = ConvGeometry(4, 6, 5, 1, (9, 9), (1, 1), (2, 2), (0, 0), (1, 1))  # strided: 5x5 outputs of a subsample
    x, w, b, dy = _data(g, 9)
    eng = LoweringEngine(1, workspace=Workspace())
    eng.configure(g, np.float64)
    with settings.override(partitions=2):
        for _ in range(2):
            for got, want in zip(_run_engine(eng, x, w, b, dy), (ref.conv_forward(g, x, w, b),
                                                                 ref.conv_backward_data(g, dy, w),
                                                                 ref.conv_backward_weights(g, x, dy))):
                np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
        eng.backward(x, dy, w, None, np.zeros_like(w))
    pointwise = [key for kind, key in asked if kind == "pointwise_gemms"]
    assert [k.split("-")[1] for k in pointwise] == ["forward", "backward", "weights"]  # once each
    assert all(k.endswith("-float64-p2") and "-c25-i81-n2-" in k for k in pointwise)
    asked.clear()
    monkeypatch.setattr(lowering, "POINTWISE_BATCH_MAX_COLS", 25)
    wide = LoweringEngine(1, workspace=Workspace())
    wide.configure(g, np.float64)
    _run_engine(wide, x, w, b, dy)
    assert not any(kind == "pointwise_gemms" for kind, _ in asked)


@pytest.fixture
def panels_chosen(monkeypatch, tmp_path):
    """The panel GEMMs measured (both ways run on their stand-ins) and chosen, for products of any size; yields the
    (kind, key) of every measured choice asked for and the names of the compiled kernels called.  Skips where they
    do not run (no AVX-512F, or no compiled kernels)."""
    from cct import native
    from cct.engines import measured

    if not native.panel_gemms():
        pytest.skip("the panel GEMMs run on AVX-512F or AVX2 with FMA, with the compiled kernels")
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lowering, "PANEL_MIN_FLOPS", 0)
    asked, calls = [], []

    def choice(kind, key, ways):
        asked.append((kind, key))
        if kind != "panel_gemm":
            return next(iter(ways))
        for run in ways.values():
            run()
        return "panels"
    monkeypatch.setattr(measured, "measured_choice", choice)
    spy = _Spy(native.kernels(), calls)
    monkeypatch.setattr(native, "kernels", lambda: spy)
    return asked, calls


@pytest.mark.parametrize("g", [ConvGeometry(3, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1)),
                               ConvGeometry(2, 4, 6, 2, (24, 23), (3, 3), (1, 1), (1, 1), (1, 1))],
                         ids=["strided", "groups"])
def test_type1_images_by_the_compiled_panel_gemm(panels_chosen, g):
    """Type 1 on images of >= IMAGES_LAST_MAX_COLS output cells (one GEMM per image) measures, once per geometry,
    BLAS's per-image GEMM against the compiled panel GEMMs — both ways the engine's chunk forward on stand-ins —
    and where the panels win forward runs them (one group: each image lowered span by span into the panels;
    groups: ``panel_gemm`` on each image's lowered matrix), the bias added as each tile is stored: the reference's
    values (float32, the library's comparison rule), the same bits in any partitions and chunks (each value a sum
    over the lowered rows in order).  Not measured where forward keeps its lowered matrix for backward, nor for
    float64, nor (unlike here) for products under ``PANEL_MIN_FLOPS``."""
    from cct.compare.tolerance import assert_close

    asked, calls = panels_chosen
    x, w, b, dy = (a.astype(np.float32) for a in _data(g, 3))
    want = ref.conv_forward(g, x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    outs = []
    for parts, budget in ((1, None), (2, None), (3, 1)):
        eng = LoweringEngine(1, max_lowered_bytes=budget, workspace=Workspace())
        eng.configure(g, np.float32)
        with settings.override(partitions=parts):
            y = np.full(dy.shape, np.nan, np.float32)
            assert eng._direct_forward(y)
            eng.forward(x, w, b, np.empty_like(y))  # measures (on stand-ins) the first time
            calls.clear()
            eng.forward(x, w, b, y)
            chunks = len([r for part in eng._chunks(g.num, 4) for r in part])
        # one group: each chunk lowered span by span into the panels; groups: each image's lowered matrix
        assert (calls.count("panel_conv_forward"), calls.count("panel_gemm")) == \
            ((chunks, 0) if g.group == 1 else (0, g.num * g.group))
        assert_close(y, want, "forward by panels", reference="float64 definition")
        outs.append(y)
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])
    assert eng.describe() == "lowering 1 (forced); panel GEMM: forward"
    panels = [key for kind, key in asked if kind == "panel_gemm"]
    assert len(panels) == 3  # each engine asks once (the cache answers later calls)
    assert all(key.startswith(f"panel-fwd-c{g.in_channels}-i{g.in_shape[0]}x{g.in_shape[1]}-o{g.out_channels}-"
                              f"g{g.group}-") for key in panels)
    asked.clear()
    kept = LoweringEngine(1, workspace=Workspace())  # a training engine keeps a small layer's lowered matrix
    kept.configure(g, np.float32)
    kept.backward(x, dy, w, None, np.zeros_like(w))
    kept.forward(x, w, b, np.empty_like(dy))
    doubles = LoweringEngine(1, workspace=Workspace())
    doubles.configure(g, np.float64)
    doubles.forward(*(a.astype(np.float64) for a in (x, w, b)), np.empty(dy.shape))
    assert not any(kind == "panel_gemm" and not key.startswith("panel-wgrad-") for kind, key in asked)


@pytest.mark.parametrize("strategy, in_shape", [(1, (47, 45)), (2, (47, 45)), (1, (13, 11))],
                         ids=["type1", "type2", "images-last"])
def test_one_image_is_lowered_over_the_partitions_by_its_channels(monkeypatch, strategy, in_shape):
    """A batch of one image (one batch partition) has its lowering split by ranges of channels over the partitions,
    each range into its own rows of the lowered matrix: the same matrix, and the layer's results, as one call."""
    from cct import native

    if native.kernels() is None:
        pytest.skip("the split is the compiled lowering's")
    calls = []
    monkeypatch.setattr(native, "kernels", lambda: _Spy(native._built, calls))
    g = ConvGeometry(1, 7, 6, 1, in_shape, (3, 3), (2, 1), (1, 1), (1, 1))  # 24 x 45 cells: images first; 7 x 11 last
    x, w, b, dy = _data(g, 4)
    outs = []
    for parts in (1, 3):
        eng = LoweringEngine(strategy, workspace=Workspace())
        eng.configure(g, np.float64)
        with settings.override(partitions=parts):
            calls.clear()
            col = eng._lower(eng.workspace.part(0), x).copy()
            assert calls.count("lowering") == parts
            y = np.empty_like(dy)
            eng.forward(x, w, b, y)
        outs.append((col, y))
    for a, b_ in zip(*outs):
        np.testing.assert_array_equal(a, b_)


def test_one_image_runs_the_panels_over_its_output_cells_on_every_partition(panels_chosen):
    """A batch of one image (inference) has one batch partition: its panel forward splits the image's output cells
    over the partitions instead (runs of whole tiles, one ``panel_conv_forward`` call each), with the bits of one
    call — each cell the same sum whichever run it is in."""
    from cct.compare.tolerance import assert_close

    _, calls = panels_chosen
    g = ConvGeometry(1, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1))  # 23 x 24 cells: 18 tiles, the last part
    x, w, b, dy = (a.astype(np.float32) for a in _data(g, 3))
    outs = []
    for parts in (1, 4):
        eng = LoweringEngine(1, workspace=Workspace())
        eng.configure(g, np.float32)
        with settings.override(partitions=parts):
            eng.forward(x, w, b, np.empty_like(dy))
            calls.clear()
            y = np.full(dy.shape, np.nan, np.float32)
            eng.forward(x, w, b, y)
        assert calls.count("panel_conv_forward") == parts
        outs.append(y)
    want = ref.conv_forward(g, x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    assert_close(outs[0], want, "forward by panels", reference="float64 definition")
    np.testing.assert_array_equal(outs[1], outs[0])


def test_the_panel_forward_floor_counts_a_chunk_of_images(panels_chosen, monkeypatch):
    """``PANEL_MIN_FLOPS`` is per chunk of images: a layer whose single image's product is under it is measured
    where a chunk of several images is over it (MobileNet's conv1), not where its chunks hold one image."""
    asked, _ = panels_chosen
    g = ConvGeometry(4, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1))
    per_image = 2.0 * 14 * 3 * 25 * 23 * 24  # 14 outputs, 3 x 5 x 5 lowered rows, 23 x 24 cells
    monkeypatch.setattr(lowering, "PANEL_MIN_FLOPS", 1.5 * per_image)
    x, w, b, _ = (a.astype(np.float32) for a in _data(g, 3))
    for parts, measured in ((1, True), (4, False)):  # chunks of 4 images, then of one
        asked.clear()
        eng = LoweringEngine(1, workspace=Workspace())
        eng.configure(g, np.float32)
        with settings.override(partitions=parts):
            eng.forward(x, w, b, np.empty((4, 14) + g.out_shape, np.float32))
        assert any(kind == "panel_gemm" for kind, _ in asked) == measured


@pytest.mark.parametrize("g", [ConvGeometry(3, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1)),
                               ConvGeometry(2, 5, 13, 1, (30, 31), (3, 3), (1, 1), (2, 1), (2, 1)),
                               ConvGeometry(2, 4, 25, 1, (28, 26), (4, 4), (1, 1), (1, 2), (1, 1))],
                         ids=["strided", "row-dilation", "k-of-two-panels"])
@pytest.mark.parametrize("with_dx", [False, True])
def test_type1_weight_gradient_by_the_compiled_panels(panels_chosen, g, with_dx):
    """Where measured faster (both ways run on stand-ins, once per geometry), type 1's weight gradient of images
    first, one group, runs on the compiled kernel that lowers each image span by span into the panel GEMM's panels:
    the reference's gradient (accumulated onto what dw held), in any partitions and chunks, with the data gradient
    beside it computed as before; not asked for groups, float64 or a dilation along the columns, nor (unlike here)
    below ``PANEL_MIN_FLOPS`` a chunk."""
    from cct.compare.tolerance import assert_close

    asked, calls = panels_chosen
    x, w, b, dy = (a.astype(np.float32) for a in _data(g, 4))
    want_dw = ref.conv_backward_weights(g, x.astype(np.float64), dy.astype(np.float64))
    want_dx = ref.conv_backward_data(g, dy.astype(np.float64), w.astype(np.float64))
    for parts, budget in ((1, None), (2, None), (3, 1)):
        eng = LoweringEngine(1, max_lowered_bytes=budget, workspace=Workspace())
        eng.configure(g, np.float32)
        with settings.override(partitions=parts):
            eng.backward(x, dy, w, None, np.zeros_like(w))  # measures (on stand-ins) the first time
            dw = np.ones_like(w)
            dx = np.full(x.shape, np.nan, np.float32) if with_dx else None
            calls.clear()
            eng.backward(x, dy, w, dx, dw)
            assert calls.count("panel_weight_grad") == len([r for part in eng._chunks(g.num, 4) for r in part])
        assert eng.describe().endswith("; panel GEMM: weight gradient")
        assert_close(dw - 1, want_dw, "weight gradient by panels", reference="float64 definition")
        if with_dx:
            assert_close(dx, want_dx, "data gradient beside it", reference="float64 definition")
    wgrad = [key for kind, key in asked if kind == "panel_gemm" and key.startswith("panel-wgrad-")]
    assert len(wgrad) == 3 and wgrad[0].startswith(f"panel-wgrad-c{g.in_channels}-i{g.in_shape[0]}x{g.in_shape[1]}-")
    asked.clear()
    for other in (ConvGeometry(2, 4, 6, 2, (24, 23), (3, 3), (1, 1), (1, 1), (1, 1)),
                  ConvGeometry(2, 3, 6, 1, (24, 23), (3, 3), (1, 1), (1, 1), (1, 2))):
        eng = LoweringEngine(1, workspace=Workspace())
        eng.configure(other, np.float32)
        xo, wo, _, dyo = (a.astype(np.float32) for a in _data(other, 5))
        eng.backward(xo, dyo, wo, None, np.zeros_like(wo))
    doubles = LoweringEngine(1, workspace=Workspace())
    doubles.configure(g, np.float64)
    doubles.backward(x.astype(np.float64), dy.astype(np.float64), None, None, np.zeros(w.shape))
    assert not any(key.startswith("panel-wgrad-") for _, key in asked)


def test_a_declined_panel_weight_gradient_is_summed_by_the_gemms(panels_chosen):
    """Where the kernel declines a chunk after all (nothing computed), the chunk's weight gradient is the GEMMs'
    into the zeroed accumulator: the reference's gradient still."""
    from cct import native
    from cct.compare.tolerance import assert_close

    g = ConvGeometry(3, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1))
    x, w, _, dy = (a.astype(np.float32) for a in _data(g, 8))
    native.kernels().panel_weight_grad = lambda *args: False
    eng = LoweringEngine(1, max_lowered_bytes=1, workspace=Workspace())
    eng.configure(g, np.float32)
    dw = np.ones_like(w)
    with settings.override(partitions=2):
        eng.backward(x, dy, w, None, dw)
    assert eng._panel_weight_grad(dy, eng._chunks(g.num, 4))
    assert_close(dw - 1, ref.conv_backward_weights(g, x.astype(np.float64), dy.astype(np.float64)),
                 "weight gradient", reference="float64 definition")


def test_panels_take_only_contiguous_arrays(panels_chosen):
    """An input that is not contiguous (a strided view) takes the lowering and BLAS, forward and weight gradient,
    with the reference's values (the kernels would reject it)."""
    from cct.compare.tolerance import assert_close

    _, calls = panels_chosen
    g = ConvGeometry(2, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1))
    x, w, b, dy = (a.astype(np.float32) for a in _data(g, 9))
    strided = np.repeat(x, 2, axis=1)[:, ::2]
    eng = LoweringEngine(1, workspace=Workspace())
    eng.configure(g, np.float32)
    eng.forward(x, w, b, np.empty_like(dy))  # measured: the panels chosen
    eng.backward(x, dy, w, None, np.zeros_like(w))
    assert eng.describe() == "lowering 1 (forced); panel GEMM: forward, weight gradient"
    calls.clear()
    y, dw = np.empty_like(dy), np.ones_like(w)
    eng.forward(strided, w, b, y)
    eng.backward(strided, dy, w, None, dw)
    x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
    assert_close(y, ref.conv_forward(g, x64, w64, b64), "forward", reference="float64 definition")
    assert_close(dw - 1, ref.conv_backward_weights(g, x64, dy64), "weight gradient", reference="float64 definition")
    assert not [c for c in calls if c.startswith("panel_")]


def test_no_panel_gemms_without_avx512(monkeypatch, tmp_path):
    """On a CPU without AVX-512F (or without the compiled kernels) type 1 measures nothing and runs BLAS: the
    reference's forward and weight gradient, no panel kernel called."""
    from cct import native
    from cct.compare.tolerance import assert_close
    from cct.engines import measured

    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lowering, "PANEL_MIN_FLOPS", 0)
    monkeypatch.setattr(native, "panel_gemms", lambda: False)
    asked = []
    monkeypatch.setattr(measured, "measured_choice", lambda kind, key, ways: asked.append(kind) or next(iter(ways)))
    calls = []
    compiled = native.kernels()
    if compiled is not None:
        monkeypatch.setattr(native, "kernels", lambda: _Spy(compiled, calls))
    g = ConvGeometry(2, 3, 14, 1, (47, 49), (5, 5), (2, 2), (1, 1), (1, 1))
    x, w, b, dy = (a.astype(np.float32) for a in _data(g, 6))
    eng = LoweringEngine(1, workspace=Workspace())
    eng.configure(g, np.float32)
    y, dw = np.empty_like(dy), np.zeros_like(w)
    eng.forward(x, w, b, y)
    eng.backward(x, dy, w, None, dw)
    x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
    assert_close(y, ref.conv_forward(g, x64, w64, b64), "forward", reference="float64 definition")
    assert_close(dw, ref.conv_backward_weights(g, x64, dy64), "weight gradient", reference="float64 definition")
    assert "panel_gemm" not in asked and not [c for c in calls if c.startswith("panel_")]
    assert eng.describe() == "lowering 1 (forced)"


class _Spy:
    """The compiled kernels, counting the calls made through them."""

    def __init__(self, kernels, calls):
        self._kernels, self._calls = kernels, calls

    def __getattr__(self, name):
        fn = getattr(self._kernels, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            self._calls.append(name)
            return fn(*args, **kwargs)
        return call


@pytest.mark.parametrize("g", [c[0] for c in POINTWISE], ids=[f"pointwise{i}" for i in range(len(POINTWISE))])
def test_pointwise_layers_on_another_array_module(monkeypatch, g):
    """The pointwise bodies on an array module other than numpy (a stand-in delegating to numpy, as cupy would
    be seen): stacked GEMM calls forward and for the data gradient, the weight gradient by one GEMM over the
    channel-first copies — the reference's values, in chunks (one partition, as on a device, whatever the
    setting)."""
    import types

    other = types.ModuleType("other")
    other.__dict__.update({k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    monkeypatch.setattr(lowering, "get_array_module", lambda *a: other)
    x, w, b, dy = _data(g, 8)
    with settings.override(partitions=2):
        eng = LoweringEngine(1, max_lowered_bytes=1, workspace=Workspace())
        eng.configure(g, np.float64)
        y, dx, dw = _run_engine(eng, x, w, b, dy)
    np.testing.assert_allclose(y, ref.conv_forward(g, x, w, b), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, ref.conv_backward_data(g, dy, w), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw, ref.conv_backward_weights(g, x, dy), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("g,expected", CASES, ids=IDS)
def test_lowerings_agree_in_float32(g, expected):
    x, w, b, dy = _data(g, 1, np.float32)
    outs = []
    for s in (1, 2, 3):
        eng = LoweringEngine(s)
        eng.configure(g, np.float32)
        outs.append(_run_engine(eng, x, w, b, dy))
    for other in outs[1:]:
        for a, c in zip(outs[0], other):
            np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-5)


def test_fallback_reasons():
    assert strategy_fallback(2, CASES[6][0]) == "stride 2"
    assert strategy_fallback(3, CASES[6][0]) == "stride 2x2"
    assert strategy_fallback(3, CASES[5][0]) == "stride 1x2"
    assert strategy_fallback(3, CASES[7][0]) == "1x1 kernel"
    assert strategy_fallback(2, CASES[10][0]) == "1 spatial axis"
    eng = LoweringEngine(3)
    eng.configure(CASES[6][0])
    assert eng.describe() == "lowering 1 (fallback: stride 2x2)"
    with pytest.raises(ValueError, match="does not apply"):
        eng.set_strategy(2)


@pytest.mark.parametrize("images_last", [False, True], ids=["images-first", "images-last"])
def test_the_strategies_differ_in_their_work(images_last, monkeypatch):
    """Really different paths: type 3 lowers nothing (its 'col' is the input), type 1 replicates k² times, type 2
    k times; types 2 and 3 multiply into a buffer of every lifted offset's products — except type 2 with the
    images innermost, whose GEMMs add each offset's products into the output rows it reaches."""
    monkeypatch.setattr(lowering, "images_last_order", lambda lay: images_last and lay.f < len(lay.inF + lay.outL))
    g = ConvGeometry(2, 8, 4, 1, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1))
    x, w, b, dy = _data(g, 2, np.float32)
    sizes = {}
    for s in (1, 2, 3):
        eng = LoweringEngine(s, workspace=Workspace())
        eng.configure(g, np.float32)
        eng.forward(x, w, b, np.empty_like(dy))
        sizes[s] = (eng._ws[0]["col"].size, eng._ws[0]["z"].size if "z" in eng._ws[0] else None)
    assert sizes[1] == (8 * 9 * 2 * 81, 4 * 2 * 81)
    assert sizes[2] == (8 * 3 * 2 * 81, None if images_last else 3 * 4 * 2 * 81)
    assert sizes[3] == (8 * 2 * 81, 9 * 4 * 2 * 81)


@pytest.mark.parametrize("strategy", [1, 2, 3])
def test_partitions_and_chunks_equal_whole_batch(strategy):
    g = ConvGeometry(5, 4, 6, 2, (6, 5), (3, 2), (1, 1), (1, 0), (1, 2))
    x, w, b, dy = _data(g, 3)
    results = []
    for parts, budget in ((1, 1 << 30), (2, 1 << 30), (3, 1), (1, 1)):
        settings.set("partitions", parts)
        eng = LoweringEngine(strategy, max_lowered_bytes=budget, workspace=Workspace())
        eng.configure(g, np.float64)
        assert len(eng._chunks(g.num, 8)) == parts
        results.append(_run_engine(eng, x, w, b, dy))
        if parts > 1:
            assert len(eng._ws) == parts  # one workspace per partition
    for other in results[1:]:
        for a, c in zip(results[0], other):
            np.testing.assert_allclose(c, a, rtol=1e-12, atol=1e-12)


def test_a_partition_lowers_at_most_its_cache_share_on_the_host():
    """On the host a partition's chunk stays within PART_LOWERED_MAX_BYTES (still in the core's caches when the
    GEMMs read it) whatever the budget; a device's lowering runs as one partition with the whole budget."""
    from cct.engines.lowering import PART_LOWERED_MAX_BYTES, partition_lowered_bytes

    settings.set("partitions", 2)
    g = ConvGeometry(64, 384, 256, 2, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1))  # CaffeNet's conv5
    eng = LoweringEngine(2, max_lowered_bytes=64 << 20, workspace=Workspace())
    eng.configure(g, np.float32)
    per_image = 384 * 3 * 13 * 13 * 4  # type 2: 760 KiB lowered per image
    host = eng._chunks(g.num, 4)
    device = eng._chunks(g.num, 4, xp=types.ModuleType("device"))  # a module other than numpy
    assert [len(p) for p in host] == [4, 4] and all(b - a == PART_LOWERED_MAX_BYTES // per_image == 8
                                                    for p in host for a, b in p)
    assert device == [[(0, 64)]]  # one partition on a device, with the whole budget (64 MiB: all 64 images)
    assert partition_lowered_bytes(64 << 20, 2) == PART_LOWERED_MAX_BYTES
    assert partition_lowered_bytes(64 << 20, 2, host=False) == 32 << 20
    assert partition_lowered_bytes(4 << 20, 2) == 2 << 20


def test_a_device_lowers_the_whole_batch_at_once_unless_given_a_budget():
    """By default a device's arrays are lowered in chunks of cct.device.chunk_bytes (a kernel launch per step
    and chunk there): CaffeNet's conv1 (281 MiB lowered for 64 images) in one; on the host, or with a budget
    given, in chunks within it."""
    from cct.device import chunk_bytes

    device = types.ModuleType("device")
    assert chunk_bytes(np, 1 << 20) == 1 << 20 and chunk_bytes(device, 1 << 20) >= 512 << 20
    settings.set("partitions", 1)
    g = ConvGeometry(64, 3, 96, 1, (227, 227), (11, 11), (4, 4), (0, 0), (1, 1))
    eng = LoweringEngine(1, workspace=Workspace())
    eng.configure(g, np.float32, device)
    assert eng._chunks(g.num, 4) == [[(0, 64)]]  # the configured module's
    assert len(eng._chunks(g.num, 4, xp=np)[0]) > 1
    given = LoweringEngine(1, max_lowered_bytes=32 << 20, workspace=Workspace())
    given.configure(g, np.float32, device)
    assert len(given._chunks(g.num, 4)[0]) == 10  # 7 images of 4.2 MiB a chunk


def test_workspace_bytes_and_reuse():
    g = ConvGeometry(2, 3, 4, 1, (6, 5), (3, 3), (1, 1), (1, 1), (1, 1))
    x, w, b, dy = _data(g, 4, np.float32)
    eng = LoweringEngine(2, workspace=Workspace())
    eng.configure(g, np.float32)
    assert eng.workspace_bytes() == 0
    y = np.empty_like(dy)
    eng.forward(x, w, b, y)
    used = eng.workspace_bytes()
    col = eng._ws[0]["col"]
    assert used >= col.nbytes > 0
    eng.forward(x, w, b, y)
    assert eng._ws[0]["col"] is col and eng.workspace_bytes() == used


# layers of different shapes, paddings and lowerings, run one after the other as a net runs them
NET = [ConvGeometry(4, 3, 8, 1, (12, 12), (5, 5), (1, 1), (2, 2), (1, 1)),
       ConvGeometry(4, 8, 6, 2, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1)),
       ConvGeometry(4, 6, 5, 1, (12, 12), (3, 3), (2, 2), (0, 0), (1, 1)),
       ConvGeometry(4, 5, 4, 1, (5, 5), (3, 3), (1, 1), (2, 2), (2, 2))]


@pytest.mark.parametrize("strategy", [1, 2, 3])
def test_layers_share_one_workspace(strategy):
    """One workspace for all engines of a thread: sized by the largest layer, not the sum; a slot another
    layer left dirty (the padded input's border, the GEMM buffer) never leaks into results.  Run in a thread
    of its own, whose shared workspace no earlier test has grown."""
    errors = []

    def run() -> None:
        try:
            _layers_share_one_workspace(strategy)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _layers_share_one_workspace(strategy: int) -> None:
    data = [_data(g, 10 + i) for i, g in enumerate(NET)]
    private, shared = [], []
    for g in NET:
        eng = LoweringEngine(strategy, workspace=Workspace())
        eng.configure(g, np.float64)
        private.append(eng)
        eng = LoweringEngine(strategy)
        eng.configure(g, np.float64)
        shared.append(eng)
    for _ in range(2):  # the second round finds every slot written by the other layers
        for eng, ref_eng, (x, w, b, dy) in zip(shared, private, data):
            for a, c in zip(_run_engine(eng, x, w, b, dy), _run_engine(ref_eng, x, w, b, dy)):
                np.testing.assert_array_equal(a, c)
    space = shared[0].workspace
    assert all(e.workspace is space for e in shared) and space is lowering.shared_workspace(np.float64)
    total = sum(e.workspace_bytes() for e in private)
    assert max(e.workspace_bytes() for e in private) <= space.nbytes() < total
    assert shared[0].workspace_bytes() == space.nbytes()
    # float32 arrays use their own shared workspace (no reallocation back and forth); other threads theirs
    assert lowering.shared_workspace(np.float32) is not space
    other = []
    thread = threading.Thread(target=lambda: other.append(lowering.shared_workspace(np.float64)))
    thread.start()
    thread.join()
    assert other[0] is not space


def test_shared_workspace_lives_as_long_as_its_engines():
    g = NET[0]
    x, w, b, dy = _data(g, 20, np.float32)
    refs = []

    def run() -> None:  # in a thread of its own: nothing else uses that thread's workspace
        eng = LoweringEngine(1)
        eng.configure(g, np.float32)
        _run_engine(eng, x, w, b, dy)
        assert eng.workspace_bytes() > 0
        refs.append(weakref.ref(eng.workspace))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    gc.collect()
    assert refs and refs[0]() is None


def test_matmul_accumulate_adds_in_place() -> None:
    from cct.engines.gemm import matmul_accumulate

    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float64):
        a, b = rng.standard_normal((6, 4)).astype(dtype), rng.standard_normal((4, 3)).astype(dtype)
        out = rng.standard_normal((6, 3)).astype(dtype)
        expected = out + a @ b
        buffer = out
        matmul_accumulate(out, a, b)
        assert out is buffer
        np.testing.assert_allclose(out, expected, rtol=1e-6)
        matmul_accumulate(out, np.asfortranarray(a), b[:, ::-1][:, ::-1])  # other layouts
        np.testing.assert_allclose(out, expected + a @ b, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_accumulate_takes_every_layout(dtype) -> None:
    """Row- and column-major operands, views with a leading dimension wider than the rows, transposed
    views, vectors, empty products and layouts no BLAS can take (reversed, every other column, a
    column-major ``out``) all add ``a @ b`` into ``out`` itself."""
    from cct.engines.gemm import matmul_accumulate

    rng = np.random.default_rng(6)
    big = rng.standard_normal((9, 12)).astype(dtype)
    cases = [
        (big[:5, :4], big[1:5, 4:7]),                    # sub-blocks: leading dimension 12
        (big[:4, :5].T, big[5:8, :4].T),                # transposed views
        (np.asfortranarray(big[:5, :4]), np.asfortranarray(big[:4, :3])),
        (big[:5, ::2][:, :4], big[:4, :3]),              # every other column: no unit stride
        (big[::-1][:5, :4], big[:4, :3]),                # reversed rows
        (big[:5, :1], big[:1, :3]),                      # an outer product
        (big[:1, :4], big[:4, :1]),                      # a dot product
        (big[:5, :0], big[:0, :3]),                      # k = 0: nothing to add
    ]
    for a, b in cases:
        for out in (rng.standard_normal((a.shape[0], b.shape[1])).astype(dtype),
                    np.asfortranarray(rng.standard_normal((a.shape[0], b.shape[1])).astype(dtype)),
                    rng.standard_normal((a.shape[0] + 2, b.shape[1] + 3)).astype(dtype)[1:-1, 2:-1]):
            expected = out + a.astype(np.float64) @ b.astype(np.float64)
            buffer = out
            matmul_accumulate(out, a, b)
            assert out is buffer
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(params=BODIES)
def gemm_call(request, monkeypatch) -> str:
    """The call into numpy's BLAS through the compiled kernels' ``gemm_accumulate``, or through ctypes."""
    return select_body(request, monkeypatch)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_blas_gemm_takes_strided_and_transposed_operands(dtype, gemm_call) -> None:
    """The beta = 1 gemm of numpy's own BLAS (what ``matmul_accumulate`` runs), called through the compiled
    kernels or through ctypes, on the layouts it accepts, and a refusal, leaving ``out`` alone, on those it
    cannot take."""
    from cct.engines.gemm import _CblasGemm

    gemm = _CblasGemm()
    assert (gemm.compiled is not None) == (gemm_call == "compiled")
    if np.dtype(dtype) not in gemm.functions:
        pytest.skip("numpy's BLAS exports no cblas gemm here")
    rng = np.random.default_rng(7)
    big = rng.standard_normal((9, 12)).astype(dtype)
    out_big = rng.standard_normal((9, 12)).astype(dtype)
    taken = [(big[:5, :4], big[1:5, 4:7], out_big[:5, :3]),
             (big[:4, :5].T, big[5:8, :4].T, out_big[2:7, 5:8]),
             (np.asfortranarray(big[:5, :4]), big[:4, :3].copy(), np.zeros((5, 3), dtype)),
             (big[:1, :4], big[:4, :1], np.zeros((1, 1), dtype))]
    for a, b, out in taken:
        expected = out.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
        assert gemm(out, a, b)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    other = np.float64 if dtype == np.float32 else np.float32
    refused = [(big[:5, ::2][:, :4], big[:4, :3], np.zeros((5, 3), dtype)),
               (big[:5, :4], big[:4, :3], np.zeros((3, 5), dtype).T),
               (big[:5, :4].astype(np.float16), big[:4, :3], np.zeros((5, 3), dtype)),
               (big[:5, :4].astype(other), big[:4, :3], np.zeros((5, 3), dtype)),
               (big[:5, :4], big[:4, :3].astype(np.dtype(dtype).newbyteorder()), np.zeros((5, 3), dtype)),
               (big[:5, :4, None], big[:4, :3], np.zeros((5, 3), dtype)),
               (big[:5, :4], big[:3, :3], np.zeros((5, 3), dtype)),  # shapes that do not chain
               (big[:5, :4], big[:4, :3], np.zeros((5, 2), dtype))]
    for a, b, out in refused:
        assert not gemm(out, a, b)
        assert not out.any()


@pytest.mark.parametrize("strategy", [1, 2, 3])
def test_backward_reuses_forwards_lowering_only_for_unchanged_input(strategy, monkeypatch):
    """Small layers keep forward's lowered matrix for the weight gradient; an input changed in place after
    forward is lowered again, so the gradients always equal a fresh engine's."""
    g = ConvGeometry(3, 4, 5, 1, (5, 4), (3, 3), (1, 1), (1, 1), (1, 1))
    x, w, b, dy = _data(g, 5, np.float32)
    eng = LoweringEngine(strategy, workspace=Workspace())
    eng.configure(g, np.float32)
    eng.forward(x, w, b, np.empty_like(dy))
    assert not eng._kept  # nothing kept before the engine has computed a weight gradient (inference)
    eng.backward(x, dy, w, None, np.zeros_like(w))
    eng.forward(x, w, b, np.empty_like(dy))
    assert eng._kept  # the lowered matrix was kept
    calls = []
    lower = eng._lower
    monkeypatch.setattr(eng, "_lower", lambda *a, **k: calls.append(1) or lower(*a, **k))
    dw = np.zeros_like(w)
    eng.backward(x, dy, w, None, dw)
    assert not calls
    fresh = LoweringEngine(strategy, workspace=Workspace())
    fresh.configure(g, np.float32)
    dw_fresh = np.zeros_like(w)
    fresh.backward(x, dy, w, None, dw_fresh)
    np.testing.assert_array_equal(dw, dw_fresh)
    x[0, 0, 0, 0] += 1  # changed after forward: lowered again
    dw[...] = 0
    eng.backward(x, dy, w, None, dw)
    assert calls
    dw_fresh[...] = 0
    fresh.backward(x, dy, w, None, dw_fresh)
    np.testing.assert_array_equal(dw, dw_fresh)


def test_forward_keeps_no_lowered_matrix_smaller_than_its_input():
    """A strided 1x1 kernel lowers a quarter of its input: keeping it would copy the whole input each forward
    to save a cheaper lowering backward, so nothing is kept."""
    g = ConvGeometry(3, 4, 5, 1, (6, 6), (1, 1), (2, 2), (0, 0), (1, 1))
    x, w, b, dy = _data(g, 5, np.float32)
    eng = LoweringEngine(1, workspace=Workspace())
    eng.configure(g, np.float32)
    eng.backward(x, dy, w, None, np.zeros_like(w))
    eng.forward(x, w, b, np.empty_like(dy))
    assert not eng._kept


TYPE2 = [(case, i) for i, case in enumerate(CASES) if case[1][1] == 2]  # the geometries type 2 applies to


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("g,expected", [c for c, _ in TYPE2], ids=[IDS[i] for _, i in TYPE2])
def test_type2_forward_by_lifting_gemms_matches_reference(monkeypatch, g, expected, dtype):
    """Type 2 on the host with wide outputs adds each lifted kernel offset's GEMM into its output rows, and
    backward each offset's data-gradient GEMM into the input rows it reads, image by image
    (``FUSED_LIFT_MIN_COLS``; lowered here to every geometry): the same convolution and data gradient as the
    reference, with and without bias, in chunks and partitions."""
    monkeypatch.setattr(lowering, "FUSED_LIFT_MIN_COLS", 0)
    monkeypatch.setattr(lowering, "images_last_order", lambda lay: False)  # the fused GEMMs read images first
    called = []
    for name in ("_forward_lifting_gemms", "_data_grad_by_rows"):
        original = getattr(LoweringEngine, name)
        monkeypatch.setattr(LoweringEngine, name,
                            lambda self, *a, name=name, original=original: called.append(name) or original(self, *a))
    x, w, b, dy = _data(g, 3, dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == np.float64 else dict(rtol=1e-5, atol=1e-5)
    for bias in (b, None):
        for budget in (None, 1):  # one chunk, or a chunk per image
            eng = LoweringEngine(2, max_lowered_bytes=budget)
            eng.configure(g, dtype)
            y = np.full(dy.shape, np.nan, dtype=dtype)
            eng.forward(x, w, bias, y)
            np.testing.assert_allclose(y, ref.conv_forward(g, x, w, bias), **tol)
            dx = np.full(x.shape, np.nan, dtype=dtype)
            eng.backward(x, dy, w, dx, None)
            np.testing.assert_allclose(dx, ref.conv_backward_data(g, dy, w), **tol)
    assert set(called) == {"_forward_lifting_gemms", "_data_grad_by_rows"}


@pytest.mark.parametrize("layout", ["kxm", "mxk"])
@pytest.mark.parametrize("strategy", [1, 2, 3])
@pytest.mark.parametrize("g,expected", CASES, ids=IDS)
def test_weight_gradient_in_either_gemm_layout(monkeypatch, g, expected, strategy, layout):
    """The weight gradient's GEMM runs as ``col · dZᵀ`` or ``dZ · colᵀ``, whichever the machine measured faster
    for the shape (``WEIGHT_LAYOUT_MIN_FLOPS``; forced here): both are the reference's gradient, accumulated,
    in chunks and partitions, and in the fused Deconvolution step."""
    from cct.engines import measured

    monkeypatch.setattr(lowering, "WEIGHT_LAYOUT_MIN_FLOPS", 0)
    asked = []
    monkeypatch.setattr(measured, "measured_choice", lambda kind, key, ways: asked.append((kind, key)) or layout)
    x, w, b, dy = _data(g, 5)
    expected_dw = ref.conv_backward_weights(g, x, dy)
    for budget in (None, 1):
        eng = LoweringEngine(strategy, max_lowered_bytes=budget)
        eng.configure(g, np.float64)
        dw = np.ones_like(w)
        eng.backward(x, dy, w, None, dw)
        np.testing.assert_allclose(dw - 1, expected_dw, rtol=1e-10, atol=1e-10)
        y, dw2 = np.empty_like(dy), np.zeros_like(w)
        eng.forward_and_backward_weights(x, w, y, dy, dw2)
        np.testing.assert_allclose(dw2, expected_dw, rtol=1e-10, atol=1e-10)
    assert any(kind == "gemm_orientation" for kind, _ in asked)
    assert all(key.startswith("wgrad-") if kind == "gemm_orientation" else
               kind == "pointwise_gemms" and all(k == 1 for k in g.kernel) for kind, key in asked)


@pytest.mark.parametrize("layout", ["kxm", "mxk"])
@pytest.mark.parametrize("strategy", [1, 2])
def test_partitions_weight_gradients_are_summed_by_channel_ranges_in_partition_order(monkeypatch, strategy, layout):
    """The partitions' weight-gradient accumulators are summed over input channel ranges in the partitions
    themselves: every value's additions in partition order, bit for bit the sum made in one thread."""
    from cct.engines import measured

    monkeypatch.setattr(lowering, "WEIGHT_LAYOUT_MIN_FLOPS", 0)
    monkeypatch.setattr(measured, "measured_choice", lambda kind, key, ways: layout)
    g = ConvGeometry(6, 8, 6, 2, (7, 7), (3, 3), (1, 1), (1, 1), (1, 1))
    x, w, b, dy = _data(g, 2, np.float32)
    rows = []

    def dw_with(run):
        monkeypatch.setattr(lowering, "run_batch", run)
        eng = LoweringEngine(strategy, max_lowered_bytes=1)
        eng.configure(g, np.float32)
        dw = np.full_like(w, 0.25)
        with settings.override(partitions=3):
            eng.backward(x, dy, w, None, dw)
        return dw

    np.testing.assert_array_equal(dw_with(run_batch_in_one_range).view(np.uint32),
                                  dw_with(run_batch_in_ranges(3, rows)).view(np.uint32))
    assert len(rows) == 3 and rows[0][0] == 0 and rows[-1][1] > rows[0][1]

@pytest.mark.parametrize("g,expected", CASES, ids=IDS)
def test_col2im_into_the_gradient_adds_as_the_padded_buffer_does(monkeypatch, g, expected):
    """With unit strides along the lowered axes (images first) the data gradient's col2im adds each kernel offset
    straight into ``dx`` (the first offset reaching the image assigns): bit for bit the sums of the padded
    buffer's slice additions, the same offsets in the same order, in float32 (types 1 and 2): the numpy
    body's paths (the compiled kernels off)."""
    monkeypatch.setenv("CCT_NATIVE", "0")
    monkeypatch.setattr(lowering, "images_last_order", lambda lay: False)
    monkeypatch.setattr(lowering, "FLAT_COL2IM_MAX_WIDTH", 0)
    called = []
    original = LoweringEngine._col2im_into
    monkeypatch.setattr(LoweringEngine, "_col2im_into", lambda self, *a: called.append(1) or original(self, *a))
    rng = np.random.default_rng(5)
    nd = len(g.in_shape)
    for strategy in sorted({s for s in expected if lowering.lifted_axes(s, nd) < nd}):
        eng = LoweringEngine(strategy)
        eng.configure(g, np.float32)
        lay = eng._lay()
        col = rng.standard_normal(lay.col_shape(g.num)).astype(np.float32)
        dx = np.full((g.num, g.in_channels) + g.in_shape, np.nan, np.float32)
        eng._col2im(eng._space(dx).part(0), col, dx)
        f = lay.f
        padded = np.zeros((lay.C, g.num) + lay.inF + tuple(i + 2 * p for i, p in zip(g.in_shape[f:], lay.padL)),
                          np.float32)
        eng._col2im_slices(col, padded)
        inner = (slice(None),) * (2 + f) + tuple(slice(p, p + i) for i, p in zip(g.in_shape[f:], lay.padL))
        np.testing.assert_array_equal(dx, np.moveaxis(padded[inner], 0, 1))
    assert bool(called) == all(s == 1 for s in g.stride)


def _lowerings_2d() -> list:
    """(geometry, strategy, images last) of the 2-D cases, the images-last layout where it applies: kernels of
    several lowered offsets (lowering.images_last_order)."""
    shapes = [c for c, _ in CASES if len(c.in_shape) == 2] + [
        ConvGeometry(2, 3, 4, 1, (5, 2), (1, 1), (1, 3), (0, 0), (1, 1))]  # rows under a stride
    return [pytest.param(g, s, last, id="x".join(map(str, g.in_shape)) + f"-k{g.kernel[0]}s{g.stride[0]}p{g.pad[0]}"
                         f"d{g.dilation[0]}g{g.group}-type{s}" + ("-images-last" if last else ""))
            for g in shapes for s in (1, 2) for last in (False, True)
            if not last or lowering._Layout(g, 1 if strategy_fallback(s, g) else s).KL > 1]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("g,strategy,images_last", _lowerings_2d())
def test_compiled_lowering_is_bitwise_the_numpy_body(monkeypatch, g, dtype, strategy, images_last):
    """2-D lowering (type 1's im2col, type 2's rows) and its adjoint (col2im) by the compiled kernels
    (cct.native), the images first or innermost, give the numpy body's lowered matrix and sums, and so the same
    forward and gradients: padding, strides over and under the kernel, dilation, groups."""
    from cct import native

    if native.kernels() is None:
        pytest.skip("compiled kernels not built (no C compiler at install)")
    x, w, b, dy = _data(g, 4, dtype)
    calls = []

    class Counting:  # the compiled module, naming the lowering kernels' calls (im2col/col2im, _last)
        def __getattr__(self, name):
            fn = getattr(native._built, name)
            if name != "lowering":
                return fn
            return lambda *args: calls.append(("col2im" if args[3] else "im2col") + ("_last" if args[4] else "")) \
                or fn(*args)

    built = Counting()
    monkeypatch.setattr(native, "kernels", lambda: built if native.settings.get("native") else None)
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("CCT_NATIVE", setting)
        eng = LoweringEngine(strategy)
        eng.configure(g, dtype)
        ws = eng._space(x).part(0)
        lowered = eng._lower(ws, x, images_last=images_last).copy()
        summed = eng._col2im(ws, lowered * 0.5, np.empty_like(x), images_last=images_last)
        results.append((lowered, summed) + _run_engine(eng, x, w, b, dy))
        if setting == "1":
            # one image lowers as images first: for one image the two layouts are the same bytes
            last_im2col = "im2col_last" if g.num > 1 else "im2col"
            assert {last_im2col, "col2im_last"} <= set(calls) if images_last else {"im2col", "col2im"} <= set(calls)
            calls.clear()
    assert not [c for c in calls if "im2col" in c or "col2im" in c]  # the numpy body ran with the kernels off
    for a, c in zip(*results):
        np.testing.assert_array_equal(a, c)  # col2im: the same sums; a first block of -0.0 may sum to +0.0


@pytest.mark.parametrize("cores, expected_mb", [(1, 32), (2, 32), (5, 32), (6, 36), (16, 96)])
def test_default_chunk_budget_leaves_every_core_its_cache_sized_chunk(monkeypatch, cores, expected_mb):
    monkeypatch.setattr(lowering, "cpu_cores", lambda: cores)
    assert lowering.PART_LOWERED_MAX_BYTES == 6 << 20
    assert lowering.chunk_budget_bytes() == expected_mb << 20
    settings.set("lowering_max_mb", 8)  # a set budget is the whole budget, whatever the cores
    assert lowering.chunk_budget_bytes() == 8 << 20


def test_sixteen_partitions_lower_their_four_images_at_once(monkeypatch):
    """CaffeNet's conv4 (384 -> 384 channels, 2 groups, 13x13) on 16 cores: each partition's 4 images in one chunk,
    as on 2 cores (where chunks are capped at PART_LOWERED_MAX_BYTES), not 1-2 images of a 32 MiB total."""
    from cct.runtime import partition

    monkeypatch.setattr(lowering, "cpu_cores", lambda: 16)
    monkeypatch.setattr(partition, "cpu_cores", lambda: 16)
    settings.set("partitions", "auto")
    for strategy, images in ((1, 2), (2, 4)):
        engine = LoweringEngine(strategy)
        engine.configure(ConvGeometry(64, 384, 384, 2, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1)))
        chunks = engine._chunks(64, 4)
        assert len(chunks) == 16
        assert all(n1 - n0 == images for part in chunks for n0, n1 in part)


@pytest.mark.parametrize("shape", [(64, 20, 8, 8), (3, 5, 7), (64, 96, 55, 55)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bias_gradient_adds_every_image_and_cell(shape, dtype, monkeypatch):
    """``db += Σ dy`` over images and spatial cells: by the compiled row sums (a small gradient) or the BLAS's
    matrix-vector products (a large one, or without the kernels), within the comparison rule of the float64
    sums, added to what ``db`` held."""
    from cct.compare.tolerance import assert_close
    from cct.engines.base import ConvEngine

    dy = np.random.default_rng(3).standard_normal(shape).astype(dtype)
    want = 1.5 + dy.astype(np.float64).reshape(shape[0], shape[1], -1).sum(axis=(0, 2))
    for switch in ("1", "0"):
        monkeypatch.setenv("CCT_NATIVE", switch)
        db = np.full(shape[1], 1.5, dtype)
        assert ConvEngine.backward_bias(dy, db) is db
        assert_close(db, want, f"bias gradient (CCT_NATIVE={switch})", reference="float64 sums")
