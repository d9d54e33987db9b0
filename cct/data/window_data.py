"""``WindowData``: warped image windows for detection fine-tuning (Caffe's ``WindowDataLayer``, R-CNN).

``window_data_param.source`` is a window file of records::

    # <image_index>
    <image path>            (read from root_folder + path)
    <channels>
    <height>
    <width>
    <num_windows>
    <class> <overlap> <x1> <y1> <x2> <y2>     (num_windows lines)

A window with ``overlap >= fg_threshold`` is foreground (its class must be > 0); one with
``overlap < bg_threshold`` is background (label 0).  Each batch is ``batch_size - int(batch_size *
fg_fraction)`` background windows followed by the foreground ones, each drawn uniformly with
replacement from the layer's own stream, then mirrored at random when ``transform_param.mirror``.
A window is cut from its image (read in colour) — enlarged by ``context_pad`` and, with
``crop_mode: "square"``, made square, clipped to the image with the clipped part left as zero padding —
and warped to ``transform_param.crop_size`` (required) with OpenCV's bilinear resize.  Values are
``(pixel - mean) * window_data_param.scale``; the mean is the centre ``crop_size`` square of
``transform_param.mean_file`` (at the padded position) or ``mean_value`` per channel.
Tops: ``data`` ``(batch_size, channels, crop_size, crop_size)`` and ``label`` ``(batch_size,)``.
"""
from __future__ import annotations

import math

import numpy as np

from cct import log
from cct.blob import Blob
from cct.data.base import Batch, PrefetchingDataLayer, reuse
from cct.data.image import COLOR, decode_image, resize_linear
from cct.data.transformer import load_mean_file
from cct.errors import CctError, ParamError
from cct.layers.registry import register
from cct.rng import get_rng

_F = np.float32


def _c_round(x: float) -> int:
    """C's ``round``: halves away from zero."""
    x = float(x)
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


def read_window_file(path: str, fg_threshold: float, bg_threshold: float):
    """Images ``[(path, (channels, height, width))]`` and fg/bg windows
    ``[(image_index, label, overlap, x1, y1, x2, y2)]`` of a window file."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            tokens = f.read().split()
    except OSError as e:
        raise CctError(f"window_data_param.source: Failed to open window file {path} ({e.strerror})") \
            from None
    if not tokens:
        raise CctError(f"window_data_param.source: {path}: Window file is empty")
    images, fg, bg = [], [], []
    pos = 0

    def take(kind, what):
        nonlocal pos
        if pos >= len(tokens):
            raise CctError(f"{path}: the file ends where {what} was expected")
        tok = tokens[pos]
        pos += 1
        try:
            return kind(tok)
        except ValueError:
            raise CctError(f"{path}: '{tok}' is not a valid {what}") from None

    fg_t, bg_t = _F(fg_threshold), _F(bg_threshold)
    while pos < len(tokens):
        if tokens[pos] != "#":
            raise CctError(f"{path}: expected '#' to start an image record, found '{tokens[pos]}'")
        pos += 1
        image_index = take(int, "image index")
        image_path = take(str, "image path")
        size = (take(int, "channels"), take(int, "height"), take(int, "width"))
        if image_index != len(images):
            raise CctError(f"{path}: image index {image_index} out of sequence (expected {len(images)})")
        images.append((image_path, size))
        num_windows = take(int, "number of windows")
        for _ in range(num_windows):
            label = take(int, "class")
            overlap = _F(take(float, "overlap"))
            x1, y1, x2, y2 = (take(int, "window coordinate") for _ in range(4))
            if overlap >= fg_t:
                if label <= 0:
                    raise CctError(f"{path}: image {image_index}: a foreground window needs a class > 0 "
                                   f"(got {label})")
                fg.append((image_index, label, overlap, x1, y1, x2, y2))
            elif overlap < bg_t:
                bg.append((image_index, 0, _F(0), x1, y1, x2, y2))
        if image_index % 100 == 0:
            log.info("num: %d %s %d %d %d windows to process: %d", image_index, image_path, *size,
                     num_windows)
    return images, fg, bg


class WindowProducer:
    """Samples and warps one batch of windows (runs in the prefetch thread)."""

    def __init__(self, layer_param, images, fg, bg, channels: int, rng: np.random.Generator):
        p = layer_param.window_data_param
        tp = layer_param.transform_param
        self.source = p.source
        self.root = p.root_folder
        self.images, self.fg, self.bg = images, fg, bg
        self.channels = channels
        self.rng = rng
        self.batch_size = int(p.batch_size)
        self.crop = int(tp.crop_size)
        self.mirror = bool(tp.mirror)
        self.scale = _F(p.scale)
        self.context_pad = int(p.context_pad)
        self.square = p.crop_mode == "square"
        self.num_fg = int(_F(self.batch_size) * _F(p.fg_fraction))
        self.mean: np.ndarray | None = None
        self.mean_values = np.asarray(tp.mean_value, dtype=np.float32)
        self.cache: list[bytes] | None = None

    def _rand(self) -> int:
        return int(self.rng.integers(1 << 32))

    def _image(self, index: int) -> np.ndarray:
        path = self.root + self.images[index][0]
        if self.cache is not None:
            img = decode_image(self.cache[index], COLOR)
        else:
            try:
                with open(path, "rb") as f:
                    img = decode_image(f.read(), COLOR)
            except OSError:
                img = None
        if img is None:
            raise CctError(f"{self.source}: Could not open or find file {path}")
        return img

    def warp(self, window, do_mirror: bool, out: np.ndarray) -> None:
        """Write one window into ``out`` ``(C, crop, crop)`` (zero where padded)."""
        index, _, _, x1, y1, x2, y2 = window
        img = self._image(index)
        rows, cols = img.shape[:2]
        crop = self.crop
        crop_w = crop_h = crop
        pad_w = pad_h = 0
        if self.context_pad > 0 or self.square:
            context_scale = _F(crop) / _F(crop - 2 * self.context_pad)
            half_height = _F((y2 - y1 + 1) / 2.0)
            half_width = _F((x2 - x1 + 1) / 2.0)
            center_x = _F(x1) + half_width
            center_y = _F(y1) + half_height
            if self.square:
                if half_height > half_width:
                    half_width = half_height
                else:
                    half_height = half_width
            x1 = _c_round(center_x - half_width * context_scale)
            x2 = _c_round(center_x + half_width * context_scale)
            y1 = _c_round(center_y - half_height * context_scale)
            y2 = _c_round(center_y + half_height * context_scale)
            unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
            pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
            pad_x2, pad_y2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
            x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
            scale_x = _F(crop) / _F(unclipped_w)
            scale_y = _F(crop) / _F(unclipped_h)
            crop_w = _c_round(_F(x2 - x1 + 1) * scale_x)
            crop_h = _c_round(_F(y2 - y1 + 1) * scale_y)
            pad_x1 = _c_round(_F(pad_x1) * scale_x)
            pad_x2 = _c_round(_F(pad_x2) * scale_x)
            pad_y1 = _c_round(_F(pad_y1) * scale_y)
            pad_h = pad_y1
            pad_w = pad_x2 if do_mirror else pad_x1
            crop_h = min(crop_h, crop - pad_h)
            crop_w = min(crop_w, crop - pad_w)
        if not (0 <= x1 <= x2 < cols and 0 <= y1 <= y2 < rows) or crop_w <= 0 or crop_h <= 0:
            raise CctError(f"{self.source}: window ({window[3]}, {window[4]}, {window[5]}, {window[6]}) of "
                           f"image {self.images[index][0]} lies outside the {cols}x{rows} image")
        warped = resize_linear(img[y1:y2 + 1, x1:x2 + 1], crop_w, crop_h)
        if do_mirror:
            warped = warped[:, ::-1]
        if warped.shape[2] != self.channels:
            raise CctError(f"{self.source}: image {self.images[index][0]} has {warped.shape[2]} channels, "
                           f"the layer {self.channels}")
        chw = warped.transpose(2, 0, 1)
        dst = out[:, pad_h:pad_h + crop_h, pad_w:pad_w + crop_w]
        if self.mean is not None:
            off = (self.mean.shape[2] - crop) // 2
            m = self.mean[:, off + pad_h:off + pad_h + crop_h, off + pad_w:off + pad_w + crop_w]
            np.subtract(chw, m, out=dst, dtype=np.float32)
        elif len(self.mean_values):
            np.subtract(chw, self.mean_values[:, None, None], out=dst, dtype=np.float32)
        else:
            dst[...] = chw
        if self.scale != 1:
            np.multiply(dst, self.scale, out=dst)

    def next_batch(self, recycled: Batch | None) -> Batch:
        b = self.batch_size
        batch = reuse(recycled, (b, self.channels, self.crop, self.crop), (b,))
        batch.data[...] = 0
        item = 0
        for pool, count in ((self.bg, b - self.num_fg), (self.fg, self.num_fg)):
            for _ in range(count):
                if not pool:
                    kind = "foreground" if pool is self.fg else "background"
                    raise CctError(f"{self.source}: no {kind} windows to sample from")
                window = pool[self._rand() % len(pool)]
                do_mirror = self.mirror and self._rand() % 2 == 1
                self.warp(window, do_mirror, batch.data[item])
                batch.label[item] = window[1]
                item += 1
        return batch

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]

    def close(self) -> None:
        pass


@register("WindowData")
class WindowDataLayer(PrefetchingDataLayer):
    """Caffe's ``WindowData`` layer: exactly two tops, data and label."""

    exact_num_top = 2

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.window_data_param
        tp = self.layer_param.transform_param
        log.info("Window data layer:\n  foreground (object) overlap threshold: %s\n  background (non-object) "
                 "overlap threshold: %s\n  foreground sampling fraction: %s", log.fmt(p.fg_threshold),
                 log.fmt(p.bg_threshold), log.fmt(p.fg_fraction))
        if tp.crop_size <= 0:
            raise ParamError("transform_param.crop_size", "WindowData needs a crop_size > 0")
        if p.batch_size <= 0:
            raise ParamError("window_data_param.batch_size", "a positive batch_size is required")
        images, fg, bg = read_window_file(p.source, p.fg_threshold, p.bg_threshold)
        log.info("Number of images: %d", len(images))
        hist: dict[int, int] = {0: len(bg)}
        for w in fg:
            hist[w[1]] = hist.get(w[1], 0) + 1
        for k in sorted(hist):
            log.info("class %d has %d samples", k, hist[k])
        log.info("Amount of context padding: %d", p.context_pad)
        log.info("Crop mode: %s", p.crop_mode)
        channels = images[-1][1][0]
        crop, b = int(tp.crop_size), int(p.batch_size)
        rng = np.random.default_rng(int(get_rng().integers(1 << 63)))
        producer = WindowProducer(self.layer_param, images, fg, bg, channels, rng)
        for index, w in enumerate(fg + bg):
            if not 0 <= w[0] < len(images):
                raise CctError(f"{p.source}: window {index} refers to image {w[0]}, which is not listed")
        if p.cache_images:
            producer.cache = []
            for path, _ in images:
                try:
                    with open(p.root_folder + path, "rb") as f:
                        producer.cache.append(f.read())
                except OSError:
                    raise CctError(f"{p.source}: Could not open or find file {p.root_folder + path}") \
                        from None
        top[0].reshape(b, channels, crop, crop)
        log.info("output data size: %d,%d,%d,%d", b, channels, crop, crop)
        top[1].reshape(b)
        if tp.HasField("mean_file"):
            if len(tp.mean_value):
                raise ParamError("transform_param.mean_file",
                                 "Cannot specify mean_file and mean_value at the same time")
            log.info("Loading mean file from: %s", tp.mean_file)
            mean = load_mean_file(tp.mean_file)
            mean = mean[0] if mean.ndim == 4 and mean.shape[0] == 1 else mean
            off = (mean.shape[-1] - crop) // 2
            if mean.ndim != 3 or mean.shape[0] != channels or off < 0 or mean.shape[1] < off + crop:
                raise CctError(f"transform_param.mean_file: the mean in {tp.mean_file} has shape "
                               f"{'x'.join(map(str, mean.shape))}; WindowData needs {channels} channels "
                               f"of at least {crop}x{crop}")
            producer.mean = mean
        if len(tp.mean_value) not in (0, 1, channels):
            raise ParamError("transform_param.mean_value",
                             f"Specify either 1 mean_value or as many as channels: {channels}")
        if len(tp.mean_value) == 1:
            producer.mean_values = np.repeat(producer.mean_values, channels)
        self.start_prefetch(producer, int(self.layer_param.data_param.prefetch))
