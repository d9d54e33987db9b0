"""Image files as Caffe reads them through OpenCV, with Pillow and numpy.

Arrays are OpenCV's layout: ``(H, W, C)`` uint8 with colour channels in **BGR(A)** order, ``C`` in
{1, 3, 4} (possibly a strided view; ``np.ascontiguousarray`` it where a packed array is needed).
Read modes follow ``cv::imread``/``cv::imdecode`` flags:

* ``COLOR`` (``IMREAD_COLOR``): always 3 channels; grey is replicated, alpha dropped, 16-bit
  samples keep their high byte;
* ``GRAY`` (``IMREAD_GRAYSCALE``): 1 channel; a colour JPEG gives libjpeg's luma (Y) plane, a colour
  PNG libpng's truncating ``(9797 R + 19234 G + 3737 B) >> 15``, other formats OpenCV's
  ``cvtColor`` rounding ``(4899 R + 9617 G + 1868 B + 2^13) >> 14``;
* ``UNCHANGED`` (``IMREAD_UNCHANGED``, Caffe's "native" decode): the file's own channels.

:func:`resize_linear` is ``cv::resize(..., INTER_LINEAR)`` for uint8 images, bit for bit: pixel
centres aligned (``sx = (dx + 0.5) * src/dst - 0.5``, clamped at the borders), 11-bit fixed-point
weights ``round(2048 * (1 - f)), round(2048 * f)``, the horizontal pass in integers, and the vertical
pass as ``((b0 * (r0 >> 4)) >> 16) + ((b1 * (r1 >> 4)) >> 16) + 2) >> 2``.  (Pillow's own bilinear
resize antialiases when shrinking and would give different pixels.)
"""
from __future__ import annotations

import io
import os

import numpy as np

COLOR, GRAY, UNCHANGED = 1, 0, -1

_COEF_BITS = 11
_COEF_SCALE = 1 << _COEF_BITS


def _pil():
    from PIL import Image

    return Image


def decode_image(buf: bytes, flag: int = COLOR) -> np.ndarray | None:
    """Decode encoded image bytes (``cv::imdecode``); ``None`` when they are not a readable image."""
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(buf))
        fmt = img.format
        if flag == GRAY and fmt == "JPEG" and img.mode in ("RGB", "YCbCr"):
            img.draft("L", None)  # libjpeg's own grey output: the Y plane, as OpenCV gets it
        img.load()
    except Exception:
        return None
    return _to_array(img, fmt, flag)


def read_image_file(path: str, flag: int = COLOR) -> np.ndarray | None:
    """``cv::imread``: ``None`` for a missing or undecodable file."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError:
        return None
    return decode_image(buf, flag)


def _high_byte(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint8:
        return a
    return (a.astype(np.uint32) >> 8).astype(np.uint8)


def _to_array(img, fmt: str | None, flag: int) -> np.ndarray:
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        raw = np.asarray(img)
        grey16 = raw.astype(np.uint16) if raw.dtype != np.uint16 else raw
        if flag == UNCHANGED:
            return grey16[:, :, None]
        g8 = _high_byte(grey16)
        return g8[:, :, None] if flag == GRAY else np.repeat(g8[:, :, None], 3, axis=2)
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        mode = img.mode
    elif mode == "PA":
        img = img.convert("RGBA")
        mode = img.mode
    elif mode in ("CMYK", "YCbCr", "1", "F", "RGBX", "HSV", "LAB"):
        img = img.convert("L" if mode in ("1", "F") else "RGB")
        mode = img.mode
    if mode == "LA":
        if flag == UNCHANGED:
            la = np.asarray(img)
            return np.dstack([la[:, :, 0]] * 3 + [la[:, :, 1]])
        img = img.convert("L")
        mode = "L"
    a = np.asarray(img)
    if mode == "L":
        g = a[:, :, None]
        if flag == COLOR:
            return np.repeat(g, 3, axis=2)
        return np.ascontiguousarray(g)
    # RGB or RGBA.  BGR is returned as a reversed-channel view: consumers copy it once anyway.
    if flag == GRAY:
        return _rgb_to_gray(a[:, :, :3], fmt)[:, :, None]
    if flag == COLOR or mode == "RGB":
        return a[:, :, 2::-1]
    return a[:, :, [2, 1, 0, 3]]


def _rgb_to_gray(rgb: np.ndarray, fmt: str | None) -> np.ndarray:
    r, g, b = (rgb[:, :, i].astype(np.int32) for i in range(3))
    if fmt == "PNG":
        grey = (9797 * r + 19234 * g + 3737 * b) >> 15
        same = (r == g) & (r == b)
        return np.where(same, r, grey).astype(np.uint8)
    return ((4899 * r + 9617 * g + 1868 * b + (1 << 13)) >> 14).astype(np.uint8)


# ---- resize -------------------------------------------------------------------------------------
def _linear_taps(src: int, dst: int, clamp_weights: bool) -> tuple[np.ndarray, ...]:
    """Source indices (i0, i1) and fixed-point weights (w0, w1) of OpenCV's INTER_LINEAR.

    Out-of-range taps read the border pixel.  Horizontally OpenCV also moves the whole weight onto
    the border pixel (``clamp_weights``); vertically it keeps the computed pair of weights."""
    scale = 1.0 / (dst / src)
    d = np.arange(dst, dtype=np.float64)
    f = ((d + 0.5) * scale - 0.5).astype(np.float32)
    i0 = np.floor(f).astype(np.int64)
    f = (f - i0.astype(np.float32)).astype(np.float32)
    if clamp_weights:
        low = i0 < 0
        f[low] = 0
        i0[low] = 0
        high = i0 >= src - 1
        f[high] = 0
        i0[high] = src - 1
    i1 = np.clip(i0 + 1, 0, src - 1)
    i0 = np.clip(i0, 0, src - 1)
    w0 = np.rint((np.float32(1) - f) * np.float32(_COEF_SCALE)).astype(np.int64)
    w1 = np.rint(f * np.float32(_COEF_SCALE)).astype(np.int64)
    return i0, i1, w0, w1


def resize_linear(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """``cv::resize(img, Size(width, height))`` (INTER_LINEAR) of an ``(H, W[, C])`` uint8 image."""
    if img.dtype != np.uint8:
        raise TypeError("resize_linear expects a uint8 image")
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img.copy()
    squeeze = img.ndim == 2
    a = img[:, :, None] if squeeze else img
    x0, x1, a0, a1 = _linear_taps(w, width, True)
    y0, y1, b0, b1 = _linear_taps(h, height, False)
    rows = np.unique(np.concatenate([y0, y1]))
    src = a[rows].astype(np.int64)
    hor = src[:, x0] * a0[None, :, None] + src[:, x1] * a1[None, :, None]
    pos = np.searchsorted(rows, y0), np.searchsorted(rows, y1)
    r0 = hor[pos[0]] >> 4
    r1 = hor[pos[1]] >> 4
    out = (((b0[:, None, None] * r0) >> 16) + ((b1[:, None, None] * r1) >> 16) + 2) >> 2
    out = np.clip(out, 0, 255).astype(np.uint8)
    return out[:, :, 0] if squeeze else out


def read_image(path: str, height: int = 0, width: int = 0, is_color: bool = True) -> np.ndarray | None:
    """Caffe's ``ReadImageToCVMat``: imread in colour or grey, resized when both sizes are > 0."""
    img = read_image_file(path, COLOR if is_color else GRAY)
    if img is None:
        return None
    if height > 0 and width > 0:
        img = resize_linear(img, width, height)
    return img


# ---- encode -------------------------------------------------------------------------------------
_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "jpe": "JPEG", "png": "PNG", "bmp": "BMP",
            "tif": "TIFF", "tiff": "TIFF", "ppm": "PPM", "pgm": "PPM", "pbm": "PPM"}


def encode_image(img: np.ndarray, ext: str) -> bytes:
    """``cv::imencode('.' + ext, img)``: JPEG at OpenCV's default quality 95, PNG lossless."""
    Image = _pil()
    fmt = _FORMATS.get(ext.lower().lstrip("."))
    if fmt is None:
        raise ValueError(f"unsupported image encoding '{ext}'")
    if img.ndim == 2 or img.shape[2] == 1:
        pil = Image.fromarray(np.ascontiguousarray(img.reshape(img.shape[:2])), "L")
    elif img.shape[2] == 3:
        pil = Image.fromarray(np.ascontiguousarray(img[:, :, ::-1]), "RGB")
    else:
        pil = Image.fromarray(np.ascontiguousarray(img[:, :, [2, 1, 0, 3]]), "RGBA")
    out = io.BytesIO()
    kwargs = {"quality": 95} if fmt == "JPEG" else {}
    pil.save(out, format=fmt, **kwargs)
    return out.getvalue()


def extension(path: str) -> str:
    """Lower-case extension without the dot ('' if none)."""
    return os.path.splitext(path)[1].lower().lstrip(".")
