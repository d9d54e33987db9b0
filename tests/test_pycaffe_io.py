"""pycaffe's ``caffe.io``: proto/datum conversions, image loading/resizing, oversampling, Transformer."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from cct.io import convert, transformer
from cct.io.convert import (
    array_to_blobproto,
    array_to_datum,
    arraylist_to_blobprotovector_str,
    blobproto_to_array,
    blobprotovector_str_to_arraylist,
    datum_to_array,
)
from cct.io.transformer import Transformer, load_image, oversample, resize_image
from cct.proto import caffe_pb2

RNG = np.random.default_rng(1234)


# ---- BlobProto / Datum ---------------------------------------------------------------------------
def test_blobproto_round_trip_any_rank_with_diff():
    arr = RNG.standard_normal((2, 3, 4, 5, 6)).astype(np.float32)
    diff = RNG.standard_normal(arr.shape).astype(np.float32)
    blob = array_to_blobproto(arr, diff)
    assert list(blob.shape.dim) == [2, 3, 4, 5, 6]
    assert not blob.HasField("num")
    back = blobproto_to_array(blob)
    assert back.dtype == np.float64 and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)
    np.testing.assert_array_equal(blobproto_to_array(blob, return_diff=True), diff)


def test_blobproto_legacy_4d_fields_win():
    blob = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3)
    blob.data.extend(range(6))
    blob.shape.dim.extend([6])  # ignored: a legacy field is set
    assert blobproto_to_array(blob).shape == (1, 2, 1, 3)
    # serialized file form (e.g. a mean.binaryproto written by compute_image_mean)
    parsed = caffe_pb2.BlobProto.FromString(blob.SerializeToString())
    np.testing.assert_array_equal(blobproto_to_array(parsed).ravel(), np.arange(6))


def test_blobprotovector_round_trip_and_pycaffe_spelling():
    arrays = [RNG.random((1, 2, 3)), RNG.random((4,)), np.zeros((2, 2, 2, 2))]
    serialized = arraylist_to_blobprotovector_str(arrays)
    assert isinstance(serialized, bytes)
    assert convert.arraylist_to_blobprotovecor_str(arrays) == serialized
    back = blobprotovector_str_to_arraylist(serialized)
    assert [b.shape for b in back] == [a.shape for a in arrays]
    for a, b in zip(arrays, back):
        np.testing.assert_allclose(b, a.astype(np.float32))


def test_datum_uint8_goes_to_data_bytes():
    arr = RNG.integers(0, 256, (3, 4, 5)).astype(np.uint8)
    datum = array_to_datum(arr, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 4, 5, 7)
    assert datum.data == arr.tobytes() and len(datum.float_data) == 0
    back = datum_to_array(datum)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, arr)
    back[0, 0, 0] = 1  # a writable array, like pycaffe's np.fromstring copy


def test_datum_float_goes_to_float_data_and_label_is_optional():
    arr = RNG.standard_normal((2, 3, 1)).astype(np.float32)
    datum = array_to_datum(arr)
    assert not datum.HasField("label") and len(datum.data) == 0
    assert len(datum.float_data) == 6
    back = datum_to_array(datum)
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize("shape", [(3, 4), (1, 2, 3, 4)])
def test_datum_needs_3d(shape):
    with pytest.raises(ValueError, match="Incorrect array shape."):
        array_to_datum(np.zeros(shape))


# ---- load_image ----------------------------------------------------------------------------------
def _save(tmp_path, array, mode, name="im.png"):
    path = tmp_path / name
    Image.fromarray(array, mode=mode).save(path)
    return str(path)


def test_load_rgb(tmp_path):
    rgb = RNG.integers(0, 256, (7, 9, 3)).astype(np.uint8)
    im = load_image(_save(tmp_path, rgb, "RGB"))
    assert im.dtype == np.float32 and im.shape == (7, 9, 3)
    np.testing.assert_allclose(im, rgb / 255.0, rtol=1e-6)
    grey = load_image(_save(tmp_path, rgb, "RGB"), color=False)
    assert grey.shape == (7, 9, 1)
    np.testing.assert_allclose(grey[:, :, 0], (rgb / 255.0) @ [0.2125, 0.7154, 0.0721], rtol=1e-6)


def test_load_grey_tiles_to_three_channels(tmp_path):
    grey = RNG.integers(0, 256, (5, 6)).astype(np.uint8)
    path = _save(tmp_path, grey, "L")
    color = load_image(path)
    assert color.shape == (5, 6, 3)
    for c in range(3):
        np.testing.assert_allclose(color[:, :, c], grey / 255.0, rtol=1e-6)
    intensity = load_image(path, color=False)
    assert intensity.shape == (5, 6, 1)
    np.testing.assert_allclose(intensity[:, :, 0], grey / 255.0, rtol=1e-6)


def test_load_rgba_drops_alpha(tmp_path):
    rgba = RNG.integers(0, 256, (4, 5, 4)).astype(np.uint8)
    im = load_image(_save(tmp_path, rgba, "RGBA"))
    assert im.shape == (4, 5, 3)
    np.testing.assert_allclose(im, rgba[:, :, :3] / 255.0, rtol=1e-6)
    grey = load_image(_save(tmp_path, rgba, "RGBA"), color=False)  # composited on white, then luma
    alpha = rgba[:, :, 3:] / 255.0
    rgb = (1 - alpha) + alpha * rgba[:, :, :3] / 255.0
    np.testing.assert_allclose(grey[:, :, 0], rgb @ [0.2125, 0.7154, 0.0721], rtol=1e-5)


def test_load_16bit_and_palette_and_jpeg(tmp_path):
    deep = RNG.integers(0, 65536, (3, 4)).astype(np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(deep).save(path)
    np.testing.assert_allclose(load_image(str(path), color=False)[:, :, 0], deep / 65535.0, rtol=1e-6)
    pal = Image.fromarray(RNG.integers(0, 256, (6, 6, 3)).astype(np.uint8)).convert("P")
    pal.save(tmp_path / "pal.png")
    np.testing.assert_allclose(load_image(str(tmp_path / "pal.png")),
                               np.asarray(pal.convert("RGB")) / 255.0, rtol=1e-6)
    jpg = _save(tmp_path, RNG.integers(0, 256, (8, 8, 3)).astype(np.uint8), "RGB", "im.jpg")
    im = load_image(jpg)
    assert im.shape == (8, 8, 3) and 0 <= im.min() and im.max() <= 1


# ---- resize_image --------------------------------------------------------------------------------
def _bilinear_upsample(im: np.ndarray, out_hw) -> np.ndarray:
    """Oracle for enlarging: pixel-centre aligned bilinear, mirrored at the border (skimage's resize)."""
    def axis_weights(n_in, n_out):
        src = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
        src = np.abs(src)  # mirror about the first and the last pixel centre
        src = np.where(src > n_in - 1, 2 * (n_in - 1) - src, src)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, src - lo
    ylo, yhi, fy = axis_weights(im.shape[0], out_hw[0])
    xlo, xhi, fx = axis_weights(im.shape[1], out_hw[1])
    fy, fx = fy[:, None, None], fx[None, :, None]
    rows_lo, rows_hi = im[ylo], im[yhi]
    top = rows_lo[:, xlo] * (1 - fx) + rows_lo[:, xhi] * fx
    bottom = rows_hi[:, xlo] * (1 - fx) + rows_hi[:, xhi] * fx
    return top * (1 - fy) + bottom * fy


@pytest.mark.parametrize("channels", [1, 3])
def test_resize_enlarge_is_bilinear_on_normalised_image(channels):
    im = (RNG.random((5, 7, channels)) * 300 - 50).astype(np.float32)
    out = resize_image(im, (12, 16))
    assert out.dtype == np.float32 and out.shape == (12, 16, channels)
    lo, hi = im.min(), im.max()
    expected = _bilinear_upsample((im - lo) / (hi - lo), (12, 16)) * (hi - lo) + lo
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_resize_shrink_is_smoothed_and_stays_in_range():
    im = RNG.random((40, 30, 3)).astype(np.float32)
    out = resize_image(im, (10, 15))
    assert out.shape == (10, 15, 3) and out.dtype == np.float32
    assert im.min() <= out.min() and out.max() <= im.max()
    assert out.std() < im.std()  # anti-aliasing averages neighbours
    np.testing.assert_allclose(out.mean(), im.mean(), atol=0.02)


def test_resize_constant_image_and_same_size():
    out = resize_image(np.full((4, 4, 3), 0.25, dtype=np.float64), (2, 9))
    assert out.dtype == np.float32 and out.shape == (2, 9, 3)
    assert np.all(out == np.float32(0.25))
    im = RNG.random((6, 5, 1)).astype(np.float32)
    np.testing.assert_allclose(resize_image(im, (6, 5)), im, rtol=1e-6)


def test_resize_other_channel_counts_use_ndimage_zoom():
    im = RNG.random((6, 8, 4)).astype(np.float32)
    out = resize_image(im, (9, 4), interp_order=1)
    np.testing.assert_array_equal(out, ndimage.zoom(im, (1.5, 0.5, 1), order=1).astype(np.float32))


def test_resize_matches_scikit_image_when_installed():
    skt = pytest.importorskip("skimage.transform")
    for shape, dims, order in [((20, 30, 3), (11, 13), 1), ((9, 9, 1), (20, 5), 1), ((9, 9, 3), (17, 21), 3)]:
        im = (RNG.random(shape) * 4 - 1).astype(np.float32)
        lo, hi = im.min(), im.max()
        expected = skt.resize((im - lo) / (hi - lo), dims, order=order) * (hi - lo) + lo
        np.testing.assert_allclose(resize_image(im, dims, order), expected, rtol=1e-5, atol=1e-6)


# ---- oversample ----------------------------------------------------------------------------------
def test_oversample_corners_centre_mirrors():
    images = [RNG.random((6, 8, 2)).astype(np.float32) for _ in range(2)]
    crops = oversample(images, (4, 4))
    assert crops.shape == (20, 4, 4, 2) and crops.dtype == np.float32
    for n, im in enumerate(images):
        expected = [im[:4, :4], im[:4, 4:], im[2:, :4], im[2:, 4:], im[1:5, 2:6]]
        for k, e in enumerate(expected):
            np.testing.assert_array_equal(crops[10 * n + k], e)
            np.testing.assert_array_equal(crops[10 * n + 5 + k], e[:, ::-1])


# ---- Transformer ---------------------------------------------------------------------------------
def _transformer(shape=(1, 3, 4, 5)):
    return Transformer({"data": shape})


def test_preprocess_steps_in_order_and_deprocess_inverts():
    t = _transformer()
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    mean = np.array([10.0, 20.0, 30.0])
    t.set_mean("data", mean)
    t.set_input_scale("data", 0.5)
    im = RNG.random((4, 5, 3)).astype(np.float32)
    keep = im.copy()
    out = t.preprocess("data", im)
    expected = (im.transpose(2, 0, 1)[[2, 1, 0]] * 255 - mean[:, None, None]) * 0.5
    assert out.dtype == np.float32 and out.shape == (3, 4, 5)
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    np.testing.assert_array_equal(im, keep)  # input untouched
    back = t.deprocess("data", out[np.newaxis])
    assert back.shape == (4, 5, 3)
    np.testing.assert_allclose(back, im, rtol=1e-5, atol=1e-6)


def test_preprocess_resizes_to_blob_size():
    t = _transformer()
    t.set_transpose("data", (2, 0, 1))
    im = RNG.random((8, 10, 3)).astype(np.float64)
    out = t.preprocess("data", im)
    assert out.dtype == np.float32 and out.shape == (3, 4, 5)
    np.testing.assert_allclose(out, resize_image(im.astype(np.float32), (4, 5)).transpose(2, 0, 1))


def test_channel_swap_inverse_is_argsort():
    t = _transformer()
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (1, 2, 0))
    im = RNG.random((4, 5, 3)).astype(np.float32)
    np.testing.assert_allclose(t.deprocess("data", t.preprocess("data", im)), im)


def test_mean_elementwise_and_2d():
    t = _transformer()
    mean = RNG.random((3, 4, 5))
    t.set_mean("data", mean)
    im = RNG.random((4, 5, 3)).astype(np.float32)
    t.set_transpose("data", (2, 0, 1))
    np.testing.assert_allclose(t.preprocess("data", im), im.transpose(2, 0, 1) - mean, rtol=1e-5, atol=1e-6)
    grey = Transformer({"g": (2, 1, 4, 5)})
    grey.set_mean("g", np.ones((4, 5)))
    assert grey.mean["g"].shape == (4, 5)


def test_mean_of_other_size_is_resized():
    t = _transformer((1, 3, 4, 6))
    mean = RNG.random((3, 8, 12)) * 100 + 50
    t.set_mean("data", mean)
    resized = t.mean["data"]
    assert resized.shape == (3, 4, 6)
    lo, hi = mean.min(), mean.max()
    expected = resize_image(((mean - lo) / (hi - lo)).transpose(1, 2, 0), (4, 6)).transpose(2, 0, 1)
    np.testing.assert_allclose(resized, expected * (hi - lo) + lo, rtol=1e-5)


def test_errors_are_pycaffes():
    t = _transformer()
    with pytest.raises(Exception, match=r"^nope is not one of the net inputs: \{'data': \(1, 3, 4, 5\)\}$"):
        t.preprocess("nope", np.zeros((4, 5, 3)))
    with pytest.raises(Exception, match="Transpose order needs to have the same number of dimensions"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(Exception, match="Channel swap needs to have the same number of dimensions"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="Mean channels incompatible with input."):
        t.set_mean("data", np.zeros(4))
    with pytest.raises(ValueError, match="Mean shape invalid"):
        t.set_mean("data", np.zeros((1, 3, 4, 5)))
    with pytest.raises(ValueError, match="Mean shape incompatible with input shape."):
        t.set_mean("data", np.zeros((2, 4, 5)))
    assert issubclass(transformer.TransformerError, Exception)


def test_deprocess_single_channel_keeps_channel_axis():
    t = Transformer({"g": (2, 1, 3, 4)})
    t.set_transpose("g", (2, 0, 1))
    t.set_raw_scale("g", 255)
    t.set_mean("g", np.array([100.0]))
    im = RNG.random((3, 4, 1)).astype(np.float32)
    blob = t.preprocess("g", im)
    assert blob.shape == (1, 3, 4)
    np.testing.assert_allclose(t.deprocess("g", blob), im, atol=1e-6)
