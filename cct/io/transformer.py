"""pycaffe's image helpers: ``Transformer``, ``load_image``, ``resize_image``, ``oversample``.

Same contract as ``python/caffe/io.py`` without scikit-image:

* images are H×W×K float32 arrays in [0, 1] (RGB channel order) on the Python side; the net wants K×H×W
  (usually BGR, 0–255, mean subtracted), which :class:`Transformer` produces.
* :func:`load_image` decodes with Pillow and converts the way ``skimage.io.imread`` + ``img_as_float`` do.
* :func:`resize_image` reproduces ``skimage.transform.resize`` (scikit-image ≥ 0.19 defaults) with
  ``scipy.ndimage``: a Gaussian anti-aliasing pre-filter when shrinking (σ = max(0, (in/out − 1)/2) per axis,
  'mirror' boundary), then ``ndimage.zoom(order=interp_order, mode='mirror', grid_mode=True)`` (pixel-centre
  aligned), then clipping to the input range; float32 in, float32 out.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cct.errors import CctError

# scikit-image's rgb2gray weights (ITU-R BT.709 luma), used by load_image(color=False).
_GRAY_WEIGHTS = np.array([0.2125, 0.7154, 0.0721])


class TransformerError(CctError):
    """A Transformer misuse that pycaffe reports with a plain ``Exception``."""


class MeanShapeError(CctError, ValueError):
    """A mean whose shape does not fit the input (pycaffe raises ``ValueError``)."""


# ---- image IO ----------------------------------------------------------------------------------
def load_image(filename: str | os.PathLike[str], color: bool = True) -> np.ndarray:
    """Load an image file as float32 in [0, 1].

    ``color=True``: H×W×3 RGB (a grey image is repeated over 3 channels, alpha is dropped).
    ``color=False``: H×W×1 intensity (a colour image becomes Y = 0.2125 R + 0.7154 G + 0.0721 B, an RGBA one
    is first composited on white, as ``skimage.io.imread(as_gray=True)``).

    Integer pixels are scaled by their type's range (8 bit: /255, 16 bit: /65535); 1-bit images give 0/1;
    float ('F') images are taken as they are.
    """
    from PIL import Image

    with Image.open(filename) as pil:
        pil.load()
        img = _pil_to_float(pil)
    if img.ndim == 3 and img.shape[2] == 4:
        if color:
            img = img[:, :, :3]
        else:
            alpha = img[:, :, 3:]
            img = (1.0 - alpha) + alpha * img[:, :, :3]
    if img.ndim == 3 and not color:
        img = img @ _GRAY_WEIGHTS
    img = img.astype(np.float32)
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    return img


def _pil_to_float(pil: Any) -> np.ndarray:
    """A decoded Pillow image → float64 array, 2-D (grey) or H×W×3/4, scaled like ``img_as_float``."""
    mode = pil.mode
    if mode == "1":
        return np.asarray(pil, dtype=np.float64)
    if mode == "P":
        pil = pil.convert("RGBA" if "transparency" in pil.info else "RGB")
    elif mode == "PA":
        pil = pil.convert("RGBA")
    elif mode in ("LA", "La"):
        pil = pil.getchannel("L")  # grey + alpha: keep the grey, drop alpha (as for RGBA)
    elif mode not in ("L", "RGB", "RGBA", "F", "I") and not mode.startswith("I;16"):
        pil = pil.convert("RGB")  # CMYK, YCbCr, LAB, HSV, RGBX, RGBa …
    arr = np.asarray(pil)
    if arr.dtype == np.uint8:
        return arr / 255.0
    if arr.dtype.kind == "u" or arr.dtype == np.dtype(">u2"):
        return arr.astype(np.float64) / 65535.0
    if arr.dtype.kind == "i":  # mode 'I': 16-bit files decode to it; full int32 otherwise
        if arr.size and arr.min() >= 0 and arr.max() <= 65535:
            return arr / 65535.0
        return arr / float(np.iinfo(np.int32).max)
    return arr.astype(np.float64)


def _skimage_resize(image: np.ndarray, out_hw: tuple[int, int], order: int) -> np.ndarray:
    """``skimage.transform.resize(image, out_hw, order=order)`` (default mode/anti-aliasing/clip) for a
    float image; trailing axes beyond the first two are kept."""
    from scipy import ndimage  # imported on use: it costs ~0.3 s, and ``import cct`` exports this module
    out_shape = tuple(out_hw) + image.shape[2:]
    factors = np.divide(image.shape, out_shape)
    filtered = image
    if any(o < i for o, i in zip(out_shape, image.shape)):
        sigma = np.maximum(0, (factors - 1) / 2)
        filtered = ndimage.gaussian_filter(image, sigma, cval=0, mode="mirror")
    out = ndimage.zoom(filtered, [1 / f for f in factors], order=order, mode="mirror", cval=0,
                       grid_mode=True)
    np.clip(out, image.min(), image.max(), out=out)
    return out


def resize_image(im: np.ndarray, new_dims: Sequence[int], interp_order: int = 1) -> np.ndarray:
    """Resize an H×W×K image to ``new_dims`` = (height, width) → new_H×new_W×K float32.

    For K ∈ {1, 3}, as pycaffe: the image is mapped to [0, 1] by its min/max, resized (see module doc,
    spline order ``interp_order``, 1 = bilinear) and mapped back; a constant image gives that constant.
    For other K: ``scipy.ndimage.zoom(im, (new_H/H, new_W/W, 1), order=interp_order)`` as pycaffe.
    """
    im = np.asarray(im)
    out_hw = (int(new_dims[0]), int(new_dims[1]))
    if im.shape[-1] in (1, 3):
        im_min, im_max = im.min(), im.max()
        if not im_max > im_min:
            return np.full(out_hw + (im.shape[-1],), im_min, dtype=np.float32)
        im_std = (im - im_min) / (im_max - im_min)
        resized = _skimage_resize(im_std, out_hw, interp_order) * (im_max - im_min) + im_min
    else:
        from scipy import ndimage

        scale = tuple(np.array(out_hw, dtype=float) / np.array(im.shape[:2]))
        resized = ndimage.zoom(im, scale + (1,), order=interp_order)
    return resized.astype(np.float32)


def oversample(images: Sequence[np.ndarray], crop_dims: Sequence[int]) -> np.ndarray:
    """Ten crops of each H×W×K image: the 4 corners and the centre, then the same 5 mirrored left-right.

    Returns (10·N)×crop_h×crop_w×K float32, image by image (crops 0–4 unmirrored, 5–9 mirrored).
    """
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims)
    ch, cw = int(crop_dims[0]), int(crop_dims[1])
    centre = im_shape[:2] / 2.0
    boxes = [(i, j, i + ch, j + cw) for i in (0, int(im_shape[0]) - ch) for j in (0, int(im_shape[1]) - cw)]
    top_left = (centre - crop_dims / 2.0).astype(int)
    boxes.append((int(top_left[0]), int(top_left[1]), int(top_left[0]) + ch, int(top_left[1]) + cw))
    crops = np.empty((10 * len(images), ch, cw, int(im_shape[-1])), dtype=np.float32)
    ix = 0
    for im in images:
        for y0, x0, y1, x1 in boxes:
            crops[ix] = im[y0:y1, x0:x1, :]
            crops[ix + 5] = crops[ix, :, ::-1, :]
            ix += 1
        ix += 5
    return crops


# ---- preprocessing -----------------------------------------------------------------------------
class Transformer:
    """Converts H×W×K images to a net input's K×H×W layout and back.

    ``inputs`` maps input blob names to their shapes (N, K, H, W).  Per input, ``preprocess`` applies, in
    this order: cast to float32 → resize to the blob's H×W (if different) → transpose (e.g. (2, 0, 1)
    for H×W×K → K×H×W) → channel swap (e.g. (2, 1, 0) for RGB → BGR) → ``× raw_scale`` → ``− mean`` →
    ``× input_scale``.  ``deprocess`` undoes the steps in reverse order (except the resize).
    """

    def __init__(self, inputs: Mapping[str, Sequence[int]]):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose: dict[str, tuple[int, ...]] = {}
        self.channel_swap: dict[str, tuple[int, ...]] = {}
        self.raw_scale: dict[str, float] = {}
        self.mean: dict[str, np.ndarray] = {}
        self.input_scale: dict[str, float] = {}

    def _check_input(self, in_: str) -> None:
        if in_ not in self.inputs:
            raise TransformerError(f"{in_} is not one of the net inputs: {self.inputs}")

    def preprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """H'×W'×K image → K×H×W float32 array ready for the input blob ``in_`` (steps in the class doc).
        ``data`` itself is never modified."""
        self._check_input(in_)
        caffe_in = np.array(data, dtype=np.float32)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        transpose = self.transpose.get(in_)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        channel_swap = self.channel_swap.get(in_)
        if channel_swap is not None:
            caffe_in = caffe_in[list(channel_swap), :, :]
        raw_scale = self.raw_scale.get(in_)
        if raw_scale is not None:
            caffe_in *= raw_scale
        mean = self.mean.get(in_)
        if mean is not None:
            caffe_in -= mean
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            caffe_in *= input_scale
        return caffe_in

    def deprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`preprocess`: K×H×W (or 1×K×H×W) → H×W×K.

        Data of the input's K×H×W size is taken in that shape (so K = 1 works, where pycaffe's plain
        ``squeeze`` broke it); other data is squeezed, as pycaffe."""
        self._check_input(in_)
        decaf_in = np.array(data)
        item_shape = self.inputs[in_][1:]
        if decaf_in.size == int(np.prod(item_shape)) and len(item_shape) > 0:
            decaf_in = decaf_in.reshape(item_shape)
        else:
            decaf_in = decaf_in.squeeze()
        if decaf_in.dtype.kind != "f":
            decaf_in = decaf_in.astype(np.float32)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in /= input_scale
        mean = self.mean.get(in_)
        if mean is not None:
            decaf_in += mean
        raw_scale = self.raw_scale.get(in_)
        if raw_scale is not None:
            decaf_in /= raw_scale
        channel_swap = self.channel_swap.get(in_)
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        transpose = self.transpose.get(in_)
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_: str, order: Sequence[int]) -> None:
        """Axis order applied to the H×W×K image, e.g. (2, 0, 1) → K×H×W."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise TransformerError("Transpose order needs to have the same number of dimensions as the "
                                   "input.")
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_: str, order: Sequence[int]) -> None:
        """Channel order taken after the transpose (channels first), e.g. (2, 1, 0) for RGB → BGR."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise TransformerError("Channel swap needs to have the same number of dimensions as the input "
                                   "channels.")
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_: str, scale: float) -> None:
        """Multiply the raw image by ``scale`` before the mean (255 for models trained on 0–255 pixels)."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_: str, mean: np.ndarray) -> None:
        """Mean subtracted after the raw scale: a 1-D per-channel mean (K,) is broadcast over H×W; a K×H×W
        (or H×W) mean is subtracted elementwise.  A K×H'×W' mean of another size is resized to H×W (Caffe
        HEAD; 1.0 raised), its values mapped to [0, 1] by its min/max for the resize and back."""
        self._check_input(in_)
        mean = np.asarray(mean)
        shape = self.inputs[in_]
        if mean.ndim == 1:
            if mean.shape[0] != shape[1]:
                raise MeanShapeError("Mean channels incompatible with input.")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            ms = (1,) + mean.shape if mean.ndim == 2 else mean.shape
            if len(ms) != 3:
                raise MeanShapeError("Mean shape invalid")
            if ms != shape[1:]:
                if ms[0] != shape[1] and ms[0] != 1:
                    raise MeanShapeError("Mean shape incompatible with input shape.")
                mean = _resize_mean(mean.reshape(ms), shape[2:])
        self.mean[in_] = mean

    def set_input_scale(self, in_: str, scale: float) -> None:
        """Multiply by ``scale`` after the mean subtraction (raw_scale acts before it)."""
        self._check_input(in_)
        self.input_scale[in_] = scale


def _resize_mean(mean: np.ndarray, hw: Sequence[int]) -> np.ndarray:
    """K×H'×W' mean → K×H×W, resized on its min/max-normalised values (Caffe HEAD's ``set_mean``)."""
    m_min, m_max = mean.min(), mean.max()
    if not m_max > m_min:
        return np.full((mean.shape[0],) + tuple(hw), m_min, dtype=mean.dtype)
    normal = (mean - m_min) / (m_max - m_min)
    resized = resize_image(normal.transpose(1, 2, 0), hw).transpose(2, 0, 1)
    return resized * (m_max - m_min) + m_min
