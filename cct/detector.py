"""pycaffe's ``caffe.Detector``: windowed detection (R-CNN style) by classifying image crops.

``detect_windows`` crops each (ymin, xmin, ymax, xmax) window (optionally with a context border, as
R-CNN's feature extraction: the window is enlarged so that ``context_pad`` pixels of the net input are
surrounding context, and what falls outside the image is filled with the mean), warps it to the net's input
size through the Transformer and classifies all windows with ``forward_all``.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from cct.classifier import input_transformer
from cct.errors import CctError
from cct.io.transformer import load_image, resize_image
from cct.pycaffe import TEST, Net


class Detector(Net):
    """Net for windowed detection over given windows (or Selective Search proposals).

    ``mean``, ``input_scale``, ``raw_scale``, ``channel_swap``: Transformer settings for the first input;
    ``context_pad``: pixels of context around each window in the net input (None/0: plain crop).
    """

    def __init__(self, model_file: str, pretrained_file: str | None, mean: np.ndarray | None = None,
                 input_scale: float | None = None, raw_scale: float | None = None,
                 channel_swap: Sequence[int] | None = None, context_pad: int | None = None):
        Net.__init__(self, model_file, TEST, weights=pretrained_file)
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows: Iterable[tuple[str, Sequence[Sequence[int]]]]) -> list[dict]:
        """Classify windows of images.  ``images_windows``: (image filename, list of windows) pairs, a
        window being (ymin, xmin, ymax, xmax).  Returns one ``{'window', 'prediction', 'filename'}`` dict
        per window, in order."""
        images_windows = [(fname, list(windows)) for fname, windows in images_windows]
        window_inputs = []
        for image_fname, windows in images_windows:
            image = load_image(image_fname).astype(np.float32)
            for window in windows:
                window_inputs.append(self.crop(image, window))
        in_ = self.inputs[0]
        in_hw = tuple(self.blobs[in_].data.shape[2:])
        caffe_in = np.zeros((len(window_inputs), window_inputs[0].shape[2]) + in_hw, dtype=np.float32)
        for ix, window_in in enumerate(window_inputs):
            caffe_in[ix] = self.transformer.preprocess(in_, window_in)
        out = self.forward_all(**{in_: caffe_in})
        predictions = out[self.outputs[0]]
        detections = []
        ix = 0
        for image_fname, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[ix], "filename": image_fname})
                ix += 1
        return detections

    def detect_selective_search(self, image_fnames: Iterable[str]) -> list[dict]:
        """Detect over Selective Search proposals; needs the ``selective_search_ijcv_with_python`` package
        (and MATLAB), as pycaffe."""
        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError:
            raise CctError("Detector.detect_selective_search needs the selective_search_ijcv_with_python "
                           "package (https://github.com/sergeyk/selective_search_ijcv_with_python), which is "
                           "not installed; compute windows yourself and call detect_windows") from None
        image_fnames = [os.path.abspath(f) for f in image_fnames]
        windows_list = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows_list))

    def crop(self, im: np.ndarray, window: Sequence[int]) -> np.ndarray:
        """Window (ymin, xmin, ymax, xmax) of the H×W×K image ``im``, with ``context_pad`` context if set
        (then the result is crop_size×crop_size×K, out-of-image parts filled with the crop mean)."""
        window = np.asarray(window)
        crop = im[int(window[0]):int(window[2]), int(window[1]):int(window[3])]
        if not self.context_pad:
            return crop
        box = window.astype(np.float64)
        crop_size = self.blobs[self.inputs[0]].width  # assumes a square input
        scale = crop_size / (1.0 * crop_size - self.context_pad * 2)
        half_h = (box[2] - box[0] + 1) / 2.0
        half_w = (box[3] - box[1] + 1) / 2.0
        centre = (box[0] + half_h, box[1] + half_w)
        box = np.round(np.tile(centre, 2) + scale * np.array((-half_h, -half_w, half_h, half_w)))
        full_h = box[2] - box[0] + 1
        full_w = box[3] - box[1] + 1
        scale_h = crop_size / full_h
        scale_w = crop_size / full_w
        pad_y = int(round(max(0, -box[0]) * scale_h))  # context that falls outside the image
        pad_x = int(round(max(0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0.0, [im_h, im_w, im_h, im_w])
        clip_h = box[2] - box[0] + 1
        clip_w = box[3] - box[1] + 1
        if not (clip_h > 0 and clip_w > 0):
            raise CctError(f"Detector.crop: window {tuple(window)} lies outside the {im_h}x{im_w} image")
        crop_h = int(round(clip_h * scale_h))
        crop_w = int(round(clip_w * scale_w))
        crop_h = min(crop_h, crop_size - pad_y)
        crop_w = min(crop_w, crop_size - pad_x)
        b = box.astype(int)
        context_crop = resize_image(im[b[0]:b[2], b[1]:b[3]], (crop_h, crop_w))
        crop = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
        crop[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context_crop
        return crop

    def configure_crop(self, context_pad: int | None) -> None:
        """Set ``crop_dims`` (H×W×K of the input) and ``context_pad``; with context, ``crop_mean`` is the
        mean in raw image space (un-transposed, un-swapped, divided by raw_scale) used to fill padding."""
        in_ = self.inputs[0]
        inv_transpose = np.argsort(self.transformer.transpose[in_])
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inv_transpose]
        self.context_pad = context_pad
        if not self.context_pad:
            return
        channel_order = self.transformer.channel_swap.get(in_)
        raw_scale = self.transformer.raw_scale.get(in_)
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
            return
        crop_mean = np.array(mean, dtype=np.float32).transpose(inv_transpose)
        if channel_order is not None:
            crop_mean = crop_mean[:, :, np.argsort(channel_order)]
        if raw_scale is not None:
            crop_mean /= raw_scale
        self.crop_mean = crop_mean
