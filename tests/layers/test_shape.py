"""Shape layers: Concat, Slice, Split, Flatten, Reshape, Crop, Tile, Silence, Filter, BatchReindex."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.blob import Blob
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from tests.reference import assert_close, reference_dir

RNG = np.random.default_rng(3)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def run_backward(run, top_diffs, propagate_down=None) -> list[np.ndarray]:
    for t, d in zip(run.top, top_diffs):
        t.diff[...] = d
    for b in run.bottom:
        b.diff[...] = np.nan  # a bottom diff must be written, not accumulated
    prop = [True] * len(run.bottom) if propagate_down is None else propagate_down
    run.layer.backward_layer(run.top, prop, run.bottom)
    return [b.diff.copy() for b in run.bottom]


# ---- Concat ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("proto, axis", [
    ("", 1),
    ("concat_param { axis: -1 }", 3),
    ("concat_param { axis: 0 }", 0),
    ("concat_param { concat_dim: 2 }", 2),
])
def test_concat_forward_backward(proto, axis):
    shapes = []
    for n in (2, 3, 1):
        s = [2, 3, 4, 2]
        s[axis] = n
        shapes.append(tuple(s))
    xs = [rand(*s) for s in shapes]
    run = setup_layer(f'type: "Concat" {proto}', xs, dtype=np.float64)
    (y,) = run.forward()
    np.testing.assert_array_equal(y, np.concatenate(xs, axis=axis))
    td = rand(*y.shape)
    bds = run_backward(run, [td])
    np.testing.assert_array_equal(np.concatenate(bds, axis=axis), td)
    check_gradient(f'type: "Concat" {proto}', xs)


def test_concat_single_bottom_shares():
    x = rand(2, 3)
    run = setup_layer('type: "Concat"', [x], dtype=np.float64)
    assert run.top[0].shares_data_with(run.bottom[0])
    run.top[0].diff[...] = 7
    assert np.all(run.bottom[0].diff == 7)
    np.testing.assert_array_equal(run.forward()[0], x)


def test_concat_errors():
    with pytest.raises(ParamError, match="concat_param"):
        setup_layer('type: "Concat" concat_param { axis: 1 concat_dim: 1 }', [rand(2, 3), rand(2, 3)])
    with pytest.raises(ParamError, match="concat_param.axis"):
        setup_layer('type: "Concat" concat_param { axis: 4 }', [rand(2, 3), rand(2, 3)])
    with pytest.raises(ParamError, match="concat_param.concat_dim"):
        setup_layer('type: "Concat" concat_param { concat_dim: 2 }', [rand(2, 3), rand(2, 3)])
    with pytest.raises(CctError, match="same shape"):
        setup_layer('type: "Concat"', [rand(2, 3, 4), rand(2, 3, 5)])
    with pytest.raises(CctError, match="number of axes"):
        setup_layer('type: "Concat"', [rand(2, 3, 4), rand(2, 3)])


# ---- Slice ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("proto, axis, sizes", [
    ("slice_param { slice_point: 1 slice_point: 4 }", 1, [1, 3, 2]),
    ("", 1, [2, 2, 2]),
    ("slice_param { axis: -1 slice_point: 2 }", 3, [2, 2]),
    ("slice_param { slice_dim: 0 slice_point: 1 }", 0, [1, 3]),
])
def test_slice_forward_backward(proto, axis, sizes):
    x = rand(4, 6, 3, 4)
    run = setup_layer(f'type: "Slice" {proto}', [x], num_tops=len(sizes), dtype=np.float64)
    ys = run.forward()
    want = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    for y, w in zip(ys, want):
        np.testing.assert_array_equal(y, w)
    tds = [rand(*y.shape) for y in ys]
    (bd,) = run_backward(run, tds)
    np.testing.assert_array_equal(bd, np.concatenate(tds, axis=axis))
    check_gradient(f'type: "Slice" {proto}', [x], num_tops=len(sizes))


def test_slice_single_top_shares():
    run = setup_layer('type: "Slice"', [rand(2, 3)], num_tops=1, dtype=np.float64)
    assert run.top[0].shares_data_with(run.bottom[0])
    run.top[0].diff[...] = 3
    assert np.all(run.bottom[0].diff == 3)


def test_slice_errors():
    x = rand(2, 6)
    with pytest.raises(ParamError, match="slice_param"):
        setup_layer('type: "Slice" slice_param { axis: 1 slice_dim: 1 }', [x], num_tops=2)
    with pytest.raises(ParamError, match="slice_param.slice_point"):
        setup_layer('type: "Slice" slice_param { slice_point: 2 }', [x], num_tops=3)
    with pytest.raises(ParamError, match="slice_param.slice_point"):
        setup_layer('type: "Slice" slice_param { slice_point: 3 slice_point: 2 }', [x], num_tops=3)
    with pytest.raises(ParamError, match="slice_param.slice_point"):
        setup_layer('type: "Slice" slice_param { slice_point: 7 }', [x], num_tops=2)
    with pytest.raises(ParamError, match="evenly divide"):
        setup_layer('type: "Slice"', [x], num_tops=4)
    with pytest.raises(ParamError, match="slice_param.slice_dim"):
        setup_layer('type: "Slice" slice_param { slice_dim: 2 }', [x], num_tops=2)


# ---- Split ----------------------------------------------------------------------------------------
def test_split_shares_and_sums():
    x = rand(2, 3, 4)
    run = setup_layer('type: "Split"', [x], num_tops=3, dtype=np.float64)
    ys = run.forward()
    for t, y in zip(run.top, ys):
        assert t.shares_data_with(run.bottom[0])
        np.testing.assert_array_equal(y, x)
    tds = [rand(2, 3, 4) for _ in range(3)]
    (bd,) = run_backward(run, tds)
    np.testing.assert_allclose(bd, tds[0] + tds[1] + tds[2])
    check_gradient('type: "Split"', [x], num_tops=3)
    check_gradient('type: "Split"', [x], num_tops=1)


def test_split_not_in_place():
    with pytest.raises(ParamError, match="in-place"):
        setup_layer('type: "Split"', [rand(2, 3)], num_tops=1, in_place=True)


# ---- Flatten --------------------------------------------------------------------------------------
@pytest.mark.parametrize("proto, shape", [
    ("", (2, 60)),
    ("flatten_param { axis: 2 }", (2, 3, 20)),
    ("flatten_param { axis: 0 end_axis: 1 }", (6, 4, 5)),
    ("flatten_param { axis: -3 end_axis: -2 }", (2, 12, 5)),
    ("flatten_param { axis: 1 end_axis: 1 }", (2, 3, 4, 5)),
])
def test_flatten(proto, shape):
    x = rand(2, 3, 4, 5)
    run = setup_layer(f'type: "Flatten" {proto}', [x], dtype=np.float64)
    (y,) = run.forward()
    assert y.shape == shape
    np.testing.assert_array_equal(y, x.reshape(shape))
    assert run.top[0].shares_data_with(run.bottom[0])
    run.top[0].diff[...] = 2
    assert np.all(run.bottom[0].diff == 2)
    check_gradient(f'type: "Flatten" {proto}', [x])


def test_flatten_errors():
    with pytest.raises(ParamError, match="in-place"):
        setup_layer('type: "Flatten"', [rand(2, 3)], in_place=True)
    with pytest.raises(ParamError, match="flatten_param.axis"):
        setup_layer('type: "Flatten" flatten_param { axis: 3 }', [rand(2, 3)])
    with pytest.raises(ParamError, match="flatten_param.end_axis"):
        setup_layer('type: "Flatten" flatten_param { axis: 2 end_axis: 0 }', [rand(2, 3, 4)])


# ---- Reshape --------------------------------------------------------------------------------------
@pytest.mark.parametrize("proto, shape", [
    ("shape { dim: 0 dim: -1 }", (2, 60)),
    ("shape { dim: 0 dim: 3 dim: 0 dim: 0 }", (2, 3, 4, 5)),
    ("shape { dim: -1 dim: 5 }", (24, 5)),
    ("shape { dim: 6 dim: 2 dim: 10 }", (6, 2, 10)),
    ("axis: 1 num_axes: 2 shape { dim: 2 dim: -1 }", (2, 2, 6, 5)),
    ("axis: -1 shape { dim: 1 dim: 1 }", (2, 3, 4, 5, 1, 1)),
    ("axis: 0 num_axes: 0 shape { dim: 1 }", (1, 2, 3, 4, 5)),
    ("axis: -2 num_axes: 1 shape { dim: 5 dim: 1 }", (2, 3, 4, 5, 1)),
    ("axis: -3 num_axes: 1 shape { dim: 2 dim: 2 }", (2, 3, 2, 2, 5)),
    ("axis: 2 shape { dim: 0 dim: -1 }", (2, 3, 4, 5)),
])
def test_reshape(proto, shape):
    x = rand(2, 3, 4, 5)
    text = f'type: "Reshape" reshape_param {{ {proto} }}'
    run = setup_layer(text, [x], dtype=np.float64)
    (y,) = run.forward()
    assert y.shape == shape
    np.testing.assert_array_equal(y.reshape(-1), x.reshape(-1))
    assert run.top[0].shares_data_with(run.bottom[0])
    check_gradient(text, [x])


@pytest.mark.parametrize("proto, match", [
    ("shape { dim: -1 dim: -1 }", "-1"),
    ("shape { dim: 7 dim: -1 }", "divisible"),
    ("shape { dim: 7 dim: 3 }", "count"),
    ("axis: 3 shape { dim: 5 dim: 0 }", "no axis"),
    ("axis: 5 shape { dim: 1 }", "reshape_param.axis"),
    ("axis: 3 num_axes: 2 shape { dim: 5 }", "reshape_param.num_axes"),
    ("num_axes: -2 shape { dim: 5 }", "reshape_param.num_axes"),
    ("shape { dim: -3 }", "below -1"),
])
def test_reshape_errors(proto, match):
    with pytest.raises(ParamError, match=match):
        setup_layer(f'type: "Reshape" reshape_param {{ {proto} }}', [rand(2, 3, 4, 5)])


def test_reshape_not_in_place():
    with pytest.raises(ParamError, match="in-place"):
        setup_layer('type: "Reshape" reshape_param { shape { dim: -1 } }', [rand(2, 3)], in_place=True)


# ---- Crop -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("proto, window", [
    ("", (slice(None), slice(None), slice(0, 3), slice(0, 4))),
    ("crop_param { offset: 1 }", (slice(None), slice(None), slice(1, 4), slice(1, 5))),
    ("crop_param { offset: 2 offset: 0 }", (slice(None), slice(None), slice(2, 5), slice(0, 4))),
    ("crop_param { axis: 1 offset: 1 offset: 0 offset: 2 }", (slice(None), slice(1, 3), slice(0, 3),
                                                              slice(2, 6))),
    ("crop_param { axis: -1 offset: 3 }", (slice(None), slice(None), slice(None), slice(3, 7))),
    ("crop_param { axis: 0 }", (slice(0, 2), slice(0, 2), slice(0, 3), slice(0, 4))),
])
def test_crop(proto, window):
    x = rand(3, 4, 5, 7)
    ref = np.zeros((2, 2, 3, 4))
    run = setup_layer(f'type: "Crop" {proto}', [x, ref], dtype=np.float64)
    (y,) = run.forward()
    np.testing.assert_array_equal(y, x[window])
    td = rand(*y.shape)
    bd = run_backward(run, [td], [True, False])[0]
    expected = np.zeros_like(x)
    expected[window] = td
    np.testing.assert_array_equal(bd, expected)
    check_gradient(f'type: "Crop" {proto}', [x, ref], check_bottoms=[0])


def test_crop_top_shape_mixes_bottoms():
    run = setup_layer('type: "Crop" crop_param { axis: 2 }', [rand(3, 4, 5, 7), rand(1, 1, 2, 3)])
    assert run.top[0].shape == (3, 4, 2, 3)


def test_crop_errors():
    x, ref = rand(2, 3, 5, 5), rand(2, 3, 4, 4)
    with pytest.raises(ParamError, match="crop_param.offset"):
        setup_layer('type: "Crop" crop_param { offset: 2 }', [x, ref])
    with pytest.raises(ParamError, match="crop_param.offset"):
        setup_layer('type: "Crop" crop_param { offset: 0 offset: 0 offset: 0 }', [x, ref])
    with pytest.raises(ParamError, match="crop_param.offset"):
        setup_layer('type: "Crop"', [x, rand(2, 3, 6, 4)])
    with pytest.raises(ParamError, match="crop_param.axis"):
        setup_layer('type: "Crop" crop_param { axis: 4 }', [x, ref])


# ---- Tile -----------------------------------------------------------------------------------------
def tile_reference(x: np.ndarray, axis: int, tiles: int) -> np.ndarray:
    outer = int(np.prod(x.shape[:axis]))
    block = x.reshape(outer, -1)
    rows = [np.concatenate([block[o]] * tiles) for o in range(outer)]
    shape = list(x.shape)
    shape[axis] *= tiles
    return np.stack(rows).reshape(shape)


@pytest.mark.parametrize("axis, tiles", [(1, 3), (0, 2), (-1, 2), (2, 1)])
def test_tile(axis, tiles):
    x = rand(2, 3, 4)
    proto = f'type: "Tile" tile_param {{ axis: {axis} tiles: {tiles} }}'
    run = setup_layer(proto, [x], dtype=np.float64)
    (y,) = run.forward()
    np.testing.assert_array_equal(y, tile_reference(x, axis % 3, tiles))
    check_gradient(proto, [x])


def test_tile_errors():
    with pytest.raises(ParamError, match="tile_param.tiles"):
        setup_layer('type: "Tile"', [rand(2, 3)])
    with pytest.raises(ParamError, match="tile_param.tiles"):
        setup_layer('type: "Tile" tile_param { tiles: 0 }', [rand(2, 3)])
    with pytest.raises(ParamError, match="tile_param.axis"):
        setup_layer('type: "Tile" tile_param { tiles: 2 axis: 2 }', [rand(2, 3)])


# ---- Silence --------------------------------------------------------------------------------------
def test_silence():
    run = setup_layer('type: "Silence"', [rand(2, 3), rand(4)], num_tops=0, dtype=np.float64)
    assert run.forward() == []
    bds = run_backward(run, [], [True, False])
    np.testing.assert_array_equal(bds[0], 0)
    assert np.all(np.isnan(bds[1]))  # not propagated: untouched
    with pytest.raises(ParamError, match="bottom"):
        setup_layer('type: "Silence"', [], num_tops=0)


# ---- Filter ---------------------------------------------------------------------------------------
def test_filter_forward_backward():
    a, b = rand(5, 3, 2), rand(5, 4)
    sel = np.array([[1.0], [0.0], [0.5], [0.0], [-2.0]])
    run = setup_layer('type: "Filter"', [a, b, sel], num_tops=2, dtype=np.float64)
    assert run.top[0].shape == (5, 3, 2)  # the first reshape sizes the tops with the whole batch
    ya, yb = run.forward()
    keep = [0, 2, 4]
    np.testing.assert_array_equal(ya, a[keep])
    np.testing.assert_array_equal(yb, b[keep])
    tda, tdb = rand(3, 3, 2), rand(3, 4)
    bda, bdb, _ = run_backward(run, [tda, tdb], [True, True, False])
    want = np.zeros_like(a)
    want[keep] = tda
    np.testing.assert_array_equal(bda, want)
    want = np.zeros_like(b)
    want[keep] = tdb
    np.testing.assert_array_equal(bdb, want)
    with pytest.raises(CctError, match="selector"):
        run_backward(run, [tda, tdb], [True, True, True])
    assert run.layer.allow_force_backward(0) and not run.layer.allow_force_backward(2)
    check_gradient('type: "Filter"', [a, b, sel], num_tops=2, check_bottoms=[0, 1])


def test_filter_nothing_selected():
    run = setup_layer('type: "Filter"', [rand(3, 2), np.zeros((3, 1))], num_tops=1, dtype=np.float64)
    (y,) = run.forward()
    assert y.shape == (0, 2)
    (bd, _) = run_backward(run, [np.zeros((0, 2))], [True, False])
    np.testing.assert_array_equal(bd, 0)


def test_filter_errors():
    with pytest.raises(ParamError, match="top"):
        setup_layer('type: "Filter"', [rand(3, 2), rand(3, 2), np.ones((3, 1))], num_tops=1)
    with pytest.raises(CctError, match="singletons"):
        setup_layer('type: "Filter"', [rand(3, 2), np.ones((3, 2))], num_tops=1)
    with pytest.raises(CctError, match="first dimension"):
        setup_layer('type: "Filter"', [rand(4, 2), np.ones((3, 1))], num_tops=1)


# ---- BatchReindex ---------------------------------------------------------------------------------
def test_batch_reindex():
    x = rand(4, 2, 3)
    idx = np.array([2.0, 0.0, 2.0, 3.9, 1.0])  # truncated to int; repeated index 2
    run = setup_layer('type: "BatchReindex"', [x, idx], dtype=np.float64)
    (y,) = run.forward()
    assert y.shape == (5, 2, 3)
    for i, k in enumerate([2, 0, 2, 3, 1]):
        np.testing.assert_array_equal(y[i], x[k])
    td = rand(5, 2, 3)
    bd, _ = run_backward(run, [td], [True, False])
    want = np.zeros_like(x)
    for i, k in enumerate([2, 0, 2, 3, 1]):
        want[k] += td[i]
    np.testing.assert_allclose(bd, want)
    with pytest.raises(CctError, match="index"):
        run_backward(run, [td], [True, True])
    check_gradient('type: "BatchReindex"', [x, np.array([3.0, 3.0, 1.0])], check_bottoms=[0])


def test_batch_reindex_errors():
    with pytest.raises(CctError, match=r"\[0, 4\)"):
        setup_layer('type: "BatchReindex"', [rand(4, 2), np.array([4.0])]).forward()
    with pytest.raises(CctError, match=r"\[0, 4\)"):
        setup_layer('type: "BatchReindex"', [rand(4, 2), np.array([-1.0])]).forward()
    with pytest.raises(CctError, match="1-D"):
        setup_layer('type: "BatchReindex"', [rand(4, 2), np.zeros((2, 1))])


# ---- against Caffe's own numbers (nets/neuron_zoo: Slice -> Concat -> Reshape -> Tile) -------------
def test_neuron_zoo_shape_layers_match_caffe():
    ref = np.load(reference_dir("nets", "neuron_zoo") / "train.npz")

    def layer(proto: str, bottoms: list[str], tops: list[str]):
        run = setup_layer(proto, [ref[f"data/{b}"] for b in bottoms], num_tops=len(tops))
        for y, t in zip(run.forward(), tops):
            assert_close(y, ref[f"data/{t}"], f"{tops} data")
        for t, name in zip(run.top, tops):
            t.diff[...] = ref[f"diff/{name}"]
        run.layer.backward_layer(run.top, [True] * len(bottoms), run.bottom)
        return [b.diff.copy() for b in run.bottom]

    (bd,) = layer('type: "Slice" slice_param { axis: 1 slice_point: 1 slice_point: 4 }', ["softmax"],
                  ["s1", "s2", "s3"])
    assert_close(bd, ref["diff/softmax"], "slice bottom diff")
    cat_in = ["s3", "s1", "power", "exp", "log", "lrn_across", "lrn_within", "mvn", "mvn_nv", "scale", "bias",
              "e_sum", "e_prod", "e_max", "s2"]
    bds = layer('type: "Concat" concat_param { axis: 1 }', cat_in, ["cat"])
    for name, d in zip(cat_in, bds):
        assert_close(d, ref[f"diff/{name}"], f"concat diff to {name}")
    (bd,) = layer('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 dim: 4 } }', ["cat"], ["reshape"])
    assert_close(bd, ref["diff/cat"], "reshape bottom diff")
    (bd,) = layer('type: "Tile" tile_param { axis: 2 tiles: 2 }', ["reshape"], ["tile"])
    assert_close(bd, ref["diff/reshape"], "tile bottom diff")


def test_blob_sharing_survives_bottom_growth():
    """A Flatten top re-shares after its bottom is reshaped to a larger size (new memory)."""
    run = setup_layer('type: "Flatten"', [rand(2, 3, 2)], dtype=np.float64)
    bottom = run.bottom[0]
    bottom.reshape((4, 3, 2))
    bottom.data[...] = rand(4, 3, 2)
    run.layer.forward_layer(run.bottom, run.top)
    np.testing.assert_array_equal(run.top[0].data, bottom.data.reshape(4, 6))
    assert isinstance(run.top[0], Blob) and run.top[0].shares_data_with(bottom)
