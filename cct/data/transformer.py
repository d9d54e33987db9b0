"""Caffe's ``DataTransformer``: crop, mirror, mean subtraction and scaling of ``(C, H, W)`` images.

For every image, in this order (``data_transformer.cpp``):

1. ``mirror = transform_param.mirror and Rand(2)`` — drawn whenever ``mirror`` is set, TEST phase too;
2. with ``crop_size``: TRAIN → ``h_off = Rand(H - crop + 1)``, ``w_off = Rand(W - crop + 1)``
   (uniform; the draws for a batch are made together);
   TEST → the centre ``((H - crop) // 2, (W - crop) // 2)``;
3. ``out[c, h, w'] = (x[c, h + h_off, w + w_off] - mean) * scale`` with ``w' = crop - 1 - w`` when
   mirrored, else ``w``; ``mean`` is the mean_file value at the *uncropped* source position, or
   ``mean_value[c]`` (one value for all channels, or one per channel), or nothing.

Arithmetic is float32 exactly as Caffe's (subtract, then multiply), so outputs match bit for bit.
``Rand`` comes from the transformer's own generator, seeded from :func:`cct.rng.get_rng` by
:meth:`DataTransformer.init_rand` (created only when mirror, or crop in TRAIN, needs it).  A batch is
transformed with one crop copy per image and whole-batch float operations.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cct import log
from cct.blob import blob_from_proto
from cct.errors import CctError, ParamError
from cct.proto import caffe_pb2 as pb
from cct.rng import get_rng


def load_mean_file(path: str) -> np.ndarray:
    """A mean.binaryproto (one BlobProto) as a float32 array of its shape."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CctError(f"transform_param.mean_file: cannot read {path} ({e.strerror})") from None
    proto = pb.BlobProto()
    try:
        proto.ParseFromString(raw)
    except Exception:
        raise CctError(f"transform_param.mean_file: {path} is not a BlobProto (.binaryproto)") from None
    try:
        return np.asarray(blob_from_proto(proto).data, dtype=np.float32)
    except CctError as e:
        raise CctError(f"transform_param.mean_file: {path}: {e}") from None


class DataTransformer:
    """Applies a ``TransformationParameter`` to images of one phase."""

    def __init__(self, param: pb.TransformationParameter, phase: int):
        self.param = param
        self.phase = phase
        self.crop_size = int(param.crop_size)
        self.mirror = bool(param.mirror)
        self.scale = np.float32(param.scale)
        self.mean_file = param.mean_file if param.HasField("mean_file") else None
        self.mean: np.ndarray | None = None
        self.mean_values = np.asarray(param.mean_value, dtype=np.float32)
        if param.force_color and param.force_gray:
            raise ParamError("transform_param.force_color", "cannot set both force_color and force_gray")
        if self.mean_file is not None:
            if len(self.mean_values):
                raise ParamError("transform_param.mean_file",
                                 "Cannot specify mean_file and mean_value at the same time")
            log.info("Loading mean file from: %s", self.mean_file)
            mean = load_mean_file(self.mean_file)
            # A legacy (1, C, H, W) mean serves (C, H, W) images.
            self.mean = mean[0] if mean.ndim == 4 and mean.shape[0] == 1 else mean
        self.rng: np.random.Generator | None = None

    @property
    def needs_rand(self) -> bool:
        return self.mirror or (self.phase == pb.TRAIN and self.crop_size > 0)

    def init_rand(self) -> None:
        """Caffe's ``InitRand``: a private stream seeded from the global one, if one is needed."""
        self.rng = np.random.default_rng(int(get_rng().integers(1 << 63))) if self.needs_rand else None

    # ---- shapes ------------------------------------------------------------------------------
    def rand_state(self) -> dict | None:
        """The state of the mirror/crop stream (None when the transformer draws nothing)."""
        return None if self.rng is None else self.rng.bit_generator.state

    def restore_rand(self, state: dict | None) -> None:
        if state is not None and self.rng is not None:
            self.rng.bit_generator.state = state

    def infer_shape(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """Output ``(C, H', W')`` for an input image of shape ``(C, H, W)``."""
        c, h, w = shape
        if self.crop_size:
            if h < self.crop_size or w < self.crop_size:
                raise CctError(f"transform_param.crop_size {self.crop_size} is larger than the image "
                               f"({h}x{w})")
            return c, self.crop_size, self.crop_size
        return c, h, w

    def check(self, shape: Sequence[int]) -> None:
        """Caffe's CHECKs on one image: mean shape and mean_value count."""
        c = shape[0]
        if self.mean is not None and tuple(self.mean.shape) != tuple(shape):
            raise CctError(f"transform_param.mean_file: the mean in {self.mean_file} has shape "
                           f"{'x'.join(map(str, self.mean.shape))} but the data has shape "
                           f"{'x'.join(map(str, shape))} (C x H x W)")
        if len(self.mean_values) not in (0, 1, c):
            raise ParamError("transform_param.mean_value",
                             f"Specify either 1 mean_value or as many as channels: {c} "
                             f"(got {len(self.mean_values)})")

    # ---- transform ---------------------------------------------------------------------------
    def draw(self, shapes: Sequence[Sequence[int]] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The random choices for images of the given ``(C, H, W)`` shapes (a sequence, or an ``(n, 3)`` integer
        array): mirror flags and crop offsets ``h_off``, ``w_off`` (one array each)."""
        n = len(shapes)
        if isinstance(shapes, np.ndarray):
            hw = shapes[:, 1:]
        else:
            hw = np.array([s[1:] for s in shapes], dtype=np.int64).reshape(n, 2)
        mirror = np.zeros(n, dtype=bool)
        if self.mirror:
            if self.rng is None:
                self.init_rand()
            mirror = self.rng.integers(2, size=n) == 1
        offs = np.zeros((n, 2), dtype=np.int64)
        if self.crop_size:
            if self.phase == pb.TRAIN:
                if self.rng is None:
                    self.init_rand()
                offs = self.rng.integers(0, np.maximum(hw - self.crop_size + 1, 1))
            else:
                offs = (hw - self.crop_size) // 2
        return mirror, offs[:, 0], offs[:, 1]

    def transform_batch(self, images: Sequence[np.ndarray], out: np.ndarray,
                        names: Sequence[str] | None = None) -> None:
        """Transform ``images`` (each ``(C, H, W)``, uint8 or float32; or one ``(N, C, H, W)`` array) into
        ``out`` ``(N, C, H', W')`` float32, ``len(images) == N``; each image may have its own H, W when
        cropping.  ``names`` (e.g. database keys) label the images in error messages."""
        _, oc, oh, ow = out.shape
        mean = self.mean
        crop = self.crop_size
        first: dict[tuple[int, ...], int] = {}  # each distinct shape checked once, on its first image
        if isinstance(images, np.ndarray):
            first[images.shape[1:]] = 0
        else:
            for i, im in enumerate(images):
                first.setdefault(im.shape, i)
        for i in first.values():
            im = images[i]
            try:
                self.check(im.shape)
                if crop and (im.shape[1] < crop or im.shape[2] < crop):
                    raise CctError(f"transform_param.crop_size {crop} is larger than the image "
                                   f"({im.shape[1]}x{im.shape[2]})")
                if (im.shape[0] != oc) or (not crop and im.shape[1:] != (oh, ow)):
                    raise CctError(f"image of shape {'x'.join(map(str, im.shape))} in a batch of "
                                   f"{oc}x{oh}x{ow} images (a batch takes its shape from its first image)")
            except CctError as e:
                if names is not None:
                    raise CctError(f"{names[i]}: {e}") from None
                raise
        whole = isinstance(images, np.ndarray)
        shapes = np.broadcast_to(np.array(images.shape[1:], dtype=np.int64), (len(images), 3)) if whole \
            else [im.shape for im in images]
        mirrors, h_offs, w_offs = self.draw(shapes)
        staged = None
        if mean is None:
            floats = images.dtype != np.uint8 if whole else any(im.dtype != np.uint8 for im in images)
            staged = np.empty(out.shape, dtype=np.float32 if floats else np.uint8)
        if staged is not None and not crop and not mirrors.any():
            if whole:
                np.copyto(staged, images)
            else:
                np.stack(images, out=staged)  # one copy of the whole batch
            images = ()
        for i, im in enumerate(images):
            do_mirror, h_off, w_off = bool(mirrors[i]), int(h_offs[i]), int(w_offs[i])
            src = im[:, h_off:h_off + crop, w_off:w_off + crop] if crop else im
            if do_mirror:
                src = src[:, :, ::-1]
            if mean is not None:
                m = mean[:, h_off:h_off + crop, w_off:w_off + crop] if crop else mean
                if do_mirror:
                    m = m[:, :, ::-1]
                np.subtract(src, m, out=out[i], dtype=np.float32)
            else:
                staged[i] = src
        if staged is not None:
            if len(self.mean_values):
                mv = self.mean_values if len(self.mean_values) == oc else np.repeat(self.mean_values, oc)
                np.subtract(staged, mv[None, :, None, None], out=out, dtype=np.float32)
            else:
                out[...] = staged
        if self.scale != 1:
            np.multiply(out, self.scale, out=out)

    def transform(self, image: np.ndarray) -> np.ndarray:
        """One image → a new ``(C, H', W')`` float32 array."""
        out = np.empty((1,) + self.infer_shape(image.shape), dtype=np.float32)
        self.transform_batch([image], out)
        return out[0]
