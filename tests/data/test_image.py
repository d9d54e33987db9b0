"""Image decoding/encoding/resizing with OpenCV's semantics (checked against cv2 when it is installed)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from cct.data import image as im
from cct.data.datum import DatumError, array_to_datum, datum_to_array, decode_datum_native
from cct.proto import caffe_pb2 as pb


def png_bytes(arr: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, format="PNG")
    return buf.getvalue()


RGB = np.random.default_rng(0).integers(0, 256, (7, 9, 3), dtype=np.uint8)


def test_decode_is_bgr_and_modes():
    buf = png_bytes(RGB, "RGB")
    np.testing.assert_array_equal(im.decode_image(buf, im.COLOR), RGB[:, :, ::-1])
    np.testing.assert_array_equal(im.decode_image(buf, im.UNCHANGED), RGB[:, :, ::-1])
    grey = im.decode_image(buf, im.GRAY)
    assert grey.shape == (7, 9, 1)
    g = png_bytes(RGB[:, :, 0], "L")
    assert im.decode_image(g, im.UNCHANGED).shape == (7, 9, 1)
    np.testing.assert_array_equal(im.decode_image(g, im.COLOR), np.repeat(RGB[:, :, :1], 3, axis=2))
    rgba = np.dstack([RGB, RGB[:, :, 0]])
    assert im.decode_image(png_bytes(rgba, "RGBA"), im.UNCHANGED).shape == (7, 9, 4)
    assert im.decode_image(png_bytes(rgba, "RGBA"), im.COLOR).shape == (7, 9, 3)
    assert im.decode_image(b"not an image") is None


def test_encode_round_trip():
    for ext in ("png", "bmp"):
        np.testing.assert_array_equal(im.decode_image(im.encode_image(RGB, ext), im.COLOR), RGB)
    jpg = im.decode_image(im.encode_image(RGB, "jpg"), im.COLOR)
    assert jpg.shape == RGB.shape
    with pytest.raises(ValueError):
        im.encode_image(RGB, "xyz")


def test_resize_linear_properties():
    a = np.random.default_rng(1).integers(0, 256, (8, 10, 3), dtype=np.uint8)
    np.testing.assert_array_equal(im.resize_linear(a, 10, 8), a)
    # Exact 2x shrink: OpenCV's bilinear weights are 1/2, 1/2: rounded 2x2 averages.
    blocks = a.reshape(4, 2, 5, 2, 3).astype(int).sum(axis=(1, 3))
    np.testing.assert_array_equal(im.resize_linear(a, 5, 4), (blocks + 2) >> 2)
    const = np.full((5, 7), 77, np.uint8)
    np.testing.assert_array_equal(im.resize_linear(const, 13, 3), np.full((3, 13), 77, np.uint8))
    assert im.resize_linear(a, 3, 17).shape == (17, 3, 3)


def test_resize_linear_known_values():
    # 1x2 -> 1x4: sx = (dx + 0.5) / 2 - 0.5 = -0.25, 0.25, 0.75, 1.25 -> clamped at the borders.
    a = np.array([[0, 200]], np.uint8)
    np.testing.assert_array_equal(im.resize_linear(a, 4, 1), [[0, 50, 150, 200]])


def test_datum_conversions():
    d = array_to_datum(RGB[:, :, ::-1], 3)
    assert (d.channels, d.height, d.width, d.label, d.encoded) == (3, 7, 9, 3, False)
    np.testing.assert_array_equal(datum_to_array(d), RGB[:, :, ::-1].transpose(2, 0, 1))
    f = pb.Datum(channels=1, height=2, width=2, float_data=[1.5, 2, 3, 4])
    np.testing.assert_array_equal(datum_to_array(f), np.array([[[1.5, 2], [3, 4]]], np.float32))
    e = pb.Datum(data=png_bytes(RGB, "RGB"), encoded=True, label=1)
    assert datum_to_array(e, im.GRAY).shape == (1, 7, 9)
    assert decode_datum_native(e) and not e.encoded and (e.channels, e.height, e.width) == (3, 7, 9)
    with pytest.raises(DatumError, match="neither data nor float_data"):
        datum_to_array(pb.Datum(channels=1, height=1, width=1))
    with pytest.raises(DatumError, match="bytes for shape"):
        datum_to_array(pb.Datum(channels=1, height=2, width=2, data=b"abc"))


def test_matches_opencv_when_available():
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(2)
    for t in range(60):
        h, w, dh, dw = (int(x) for x in rng.integers(1, 50, 4))
        a = rng.integers(0, 256, (h, w, 3 if t % 2 else 1), dtype=np.uint8)[:, :, :3 if t % 2 else 1]
        a = a if t % 2 else a[:, :, 0]
        np.testing.assert_array_equal(im.resize_linear(a, dw, dh), cv2.resize(a, (dw, dh)))
    smooth = cv2.GaussianBlur(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8), (5, 5), 1.5)
    for buf in (im.encode_image(smooth, "jpg"), im.encode_image(smooth, "png")):
        for flag in (im.COLOR, im.GRAY, im.UNCHANGED):
            ref = cv2.imdecode(np.frombuffer(buf, np.uint8), flag)
            np.testing.assert_array_equal(im.decode_image(buf, flag), ref.reshape(ref.shape[:2] + (-1,)))
