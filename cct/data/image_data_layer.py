"""``ImageData``: batches of image files named in a list file (Caffe's ``ImageDataLayer``).

``image_data_param.source`` lists ``<path> <label>`` per line, split at the last space; each path is
read from ``root_folder + path`` (plain concatenation) in colour (3-channel BGR) or grey
(``is_color: false``), resized to ``new_height`` × ``new_width`` when both are set (OpenCV's bilinear
resize, see :mod:`cct.data.image`), then transformed.  Tops: ``data`` ``(batch_size, C, H', W')``
(shape of each batch's first image) and ``label`` ``(batch_size,)``.  ``shuffle`` permutes the list
with the layer's own stream at setup and at every wrap; ``rand_skip`` starts at a random line below it.
"""
from __future__ import annotations

import re

import numpy as np

from cct import log
from cct.blob import Blob
from cct.data.base import Batch, PrefetchingDataLayer, reuse
from cct.data.image import read_image
from cct.data.transformer import DataTransformer
from cct.errors import CctError, ParamError
from cct.layers.registry import register
from cct.rng import get_rng

_ATOI = re.compile(r"\s*([+-]?\d+)")


def atoi(text: str) -> int:
    """C's ``atoi``: a leading integer, 0 when there is none."""
    m = _ATOI.match(text)
    return int(m.group(1)) if m else 0


def read_list_file(source: str, field: str) -> list[tuple[str, int, int]]:
    """``(path, label, line number)`` per non-blank line of an image list (split at the last space)."""
    try:
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError as e:
        raise CctError(f"{field}: cannot open image list {source} ({e.strerror})") from None
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        pos = line.rfind(" ")
        path, label = (line[:pos], line[pos + 1:]) if pos >= 0 else (line, line)
        entries.append((path, atoi(label), lineno))
    return entries


class ListProducer:
    """Loads one batch of listed images (runs in the prefetch thread)."""

    def __init__(self, source: str, lines: list[tuple[str, int, int]], root: str, height: int, width: int,
                 is_color: bool, transformer: DataTransformer, batch_size: int,
                 shuffle_rng: np.random.Generator | None, pos: int):
        self.source = source
        self.lines = lines
        self.root = root
        self.height = height
        self.width = width
        self.is_color = is_color
        self.transformer = transformer
        self.batch_size = batch_size
        self.shuffle_rng = shuffle_rng
        self.pos = pos
        self.listed = lines  # in the list file's order
        self.order = np.arange(len(lines))  # self.lines[i] is self.listed[self.order[i]]

    def load(self, i: int) -> np.ndarray:
        path, _, lineno = self.lines[i]
        img = read_image(self.root + path, self.height, self.width, self.is_color)
        if img is None:
            raise CctError(f"{self.source}:{lineno}: could not load image {self.root + path}")
        return img.transpose(2, 0, 1)

    def shuffle(self) -> None:
        if self.shuffle_rng is not None:
            self.order = self.order[self.shuffle_rng.permutation(len(self.order))]
            self.lines = [self.listed[i] for i in self.order]

    def next_batch(self, recycled: Batch | None) -> Batch:
        images, labels, names = [], [], []
        for _ in range(self.batch_size):
            path, label, lineno = self.lines[self.pos]
            images.append(self.load(self.pos))
            labels.append(label)
            names.append(f"{self.source}:{lineno}: {self.root + path}")
            self.pos += 1
            if self.pos >= len(self.lines):
                self.pos = 0
                self.shuffle()
        try:
            shape = (self.batch_size,) + self.transformer.infer_shape(images[0].shape)
        except CctError as e:
            raise CctError(f"{names[0]}: {e}") from None
        batch = reuse(recycled, shape, (self.batch_size,))
        self.transformer.transform_batch(images, batch.data, names)
        batch.label[...] = labels
        return batch

    def state(self) -> dict:
        """The position in the (shuffled) list, the list's order and both streams."""
        return {"pos": self.pos, "order": self.order.tolist() if self.shuffle_rng is not None else None,
                "shuffle": None if self.shuffle_rng is None else self.shuffle_rng.bit_generator.state,
                "rand": self.transformer.rand_state()}

    def restore(self, state: dict) -> None:
        if state["order"] is not None and self.shuffle_rng is not None:
            order = np.asarray(state["order"], dtype=np.int64)
            if sorted(order.tolist()) != list(range(len(self.listed))):
                raise ValueError(f"the saved order is not a permutation of the {len(self.listed)} listed images")
            self.order = order
            self.lines = [self.listed[i] for i in order]
            self.shuffle_rng.bit_generator.state = state["shuffle"]
        pos = int(state["pos"])
        if not 0 <= pos < len(self.lines):
            raise ValueError(f"position {pos} is outside the {len(self.lines)} listed images")
        self.pos = pos
        self.transformer.restore_rand(state["rand"])

    def close(self) -> None:
        pass


@register("ImageData")
class ImageDataLayer(PrefetchingDataLayer):
    """Caffe's ``ImageData`` layer: exactly two tops, data and label."""

    exact_num_top = 2

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.image_data_param
        height, width = int(p.new_height), int(p.new_width)
        if not ((height == 0 and width == 0) or (height > 0 and width > 0)):
            raise ParamError("image_data_param.new_height", "Current implementation requires new_height "
                                                             "and new_width to be set at the same time.")
        if p.batch_size <= 0:
            raise ParamError("image_data_param.batch_size", "Positive batch size required")
        source = p.source
        log.info("Opening file %s", source)
        lines = read_list_file(source, "image_data_param.source")
        if not lines:
            raise CctError(f"image_data_param.source: {source}: File is empty")
        transformer = DataTransformer(self.layer_param.transform_param, self.phase)
        rng = None
        if p.shuffle:
            log.info("Shuffling data")
            rng = np.random.default_rng(int(get_rng().integers(1 << 63)))
        producer = ListProducer(source, lines, p.root_folder, height, width, bool(p.is_color), transformer,
                                int(p.batch_size), rng, 0)
        producer.shuffle()
        log.info("A total of %d images.", len(lines))
        if p.rand_skip:
            skip = int(get_rng().integers(1 << 32)) % p.rand_skip
            log.info("Skipping first %d data points.", skip)
            if skip >= len(lines):
                raise ParamError("image_data_param.rand_skip", f"Not enough points to skip ({len(lines)} "
                                                                f"images, skipping {skip})")
            producer.pos = skip
        first = producer.load(producer.pos)
        path, _, lineno = producer.lines[producer.pos]
        try:
            shape = transformer.infer_shape(first.shape)
            transformer.check(first.shape)
        except CctError as e:
            raise CctError(f"{source}:{lineno}: {p.root_folder + path}: {e}") from None
        top[0].reshape((int(p.batch_size),) + shape)
        log.info("output data size: %d,%d,%d,%d", top[0].num, top[0].channels, top[0].height, top[0].width)
        top[1].reshape((int(p.batch_size),))
        transformer.init_rand()
        self.transformer = transformer
        self.start_prefetch(producer, int(self.layer_param.data_param.prefetch))
