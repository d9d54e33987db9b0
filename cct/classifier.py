"""pycaffe's ``caffe.Classifier``: a TEST-phase Net that classifies H×W×K images.

``predict`` resizes every image to ``image_dims``, takes either the 10 oversampled crops (4 corners +
centre, and their mirrors) or the centre crop of the net's input size, preprocesses them with the
:class:`~cct.io.transformer.Transformer` configured here (transpose (2, 0, 1), then the optional channel
swap, raw scale, mean and input scale), runs ``forward_all`` and returns the first output, averaged over
the 10 crops when oversampling.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cct.io.transformer import Transformer, oversample, resize_image
from cct.pycaffe import TEST, Net


class Classifier(Net):
    """Net for image class prediction by scaling, centre cropping or oversampling.

    ``image_dims``: (H, W) the images are resized to before cropping (default: the net's input H×W, i.e. a
    whole-image crop).  ``mean``, ``input_scale``, ``raw_scale``, ``channel_swap``: Transformer settings for
    the first net input.
    """

    def __init__(self, model_file: str, pretrained_file: str | None, image_dims: Sequence[int] | None = None,
                 mean: np.ndarray | None = None, input_scale: float | None = None,
                 raw_scale: float | None = None, channel_swap: Sequence[int] | None = None):
        Net.__init__(self, model_file, TEST, weights=pretrained_file)
        in_ = self.inputs[0]
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].data.shape[2:])
        if image_dims is None or len(image_dims) == 0:
            image_dims = self.crop_dims
        self.image_dims = image_dims

    def predict(self, inputs: Sequence[np.ndarray], oversample: bool = True) -> np.ndarray:
        """Class scores (N×C) for N H×W×K images; averaged over 10 crops when ``oversample``, else from
        the centre crop."""
        in_ = self.inputs[0]
        images = np.zeros((len(inputs), int(self.image_dims[0]), int(self.image_dims[1]), inputs[0].shape[2]),
                          dtype=np.float32)
        for ix, image in enumerate(inputs):
            images[ix] = resize_image(image, self.image_dims)
        if oversample:
            crops = _oversample(images, self.crop_dims)
        else:
            centre = np.array(self.image_dims) / 2.0
            half = self.crop_dims / 2.0
            box = (np.tile(centre, 2) + np.concatenate([-half, half])).astype(int)
            crops = images[:, box[0]:box[2], box[1]:box[3], :]
        caffe_in = np.zeros((len(crops), crops.shape[3], crops.shape[1], crops.shape[2]), dtype=np.float32)
        for ix, crop in enumerate(crops):
            caffe_in[ix] = self.transformer.preprocess(in_, crop)
        out = self.forward_all(**{in_: caffe_in})
        predictions = out[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions


_oversample = oversample  # ``predict``'s flag shadows the function's name inside it


def input_transformer(net: Net, mean: np.ndarray | None, input_scale: float | None, raw_scale: float | None,
                      channel_swap: Sequence[int] | None) -> Transformer:
    """pycaffe's set-up for a net's first input: H×W×K images in, (K, H, W) blobs out, with the optional
    mean, scales and channel swap."""
    in_ = net.inputs[0]
    transformer = Transformer({in_: net.blobs[in_].data.shape})
    transformer.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(in_, mean)
    if input_scale is not None:
        transformer.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(in_, channel_swap)
    return transformer
