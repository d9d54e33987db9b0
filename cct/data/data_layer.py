"""``Data``: batches of Datum records from an LMDB or a LevelDB (Caffe's ``DataLayer``).

Tops: ``data`` ``(batch_size, C, H', W')`` — the shape of each batch's first record after the
transformer — and optionally ``label`` ``(batch_size,)`` (``Datum.label``).  Records are read in key
order and the cursor wraps at the end ("Restarting data prefetching from start.").  Each layer keeps
its own cursor for its lifetime, so a test net's Data layer continues where the previous test pass
stopped.  ``data_param.rand_skip`` is ignored, as in Caffe 1.0.  With several solver ranks
(``cct.mode.solver_count() > 1``) a TRAIN-phase layer takes every ``count``-th record starting at its
rank.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from cct import log, mode
from cct.blob import Blob
from cct.data.base import Batch, PrefetchingDataLayer, reuse
from cct.data.datum import DatumError, datum_to_array, decode_flag, parse_datum, raw_batch, raw_view
from cct.data.db import LeveldbReader, LmdbReader, open_reader
from cct.data.transformer import DataTransformer
from cct.errors import CctError, ParamError
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb


def _key_name(key: bytes | memoryview) -> str:
    return bytes(key).decode("utf-8", "backslashreplace")


class _RecordNames(Sequence[str]):
    """``"<db>: record <key>"`` for each key, made only when an error message asks for one."""

    def __init__(self, path: str, keys: list[bytes]):
        self.path, self.keys = path, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i):  # type: ignore[override]
        return f"{self.path}: record {_key_name(self.keys[i])}"


class DbProducer:
    """Reads, decodes and transforms one batch of records at a time (runs in the prefetch thread, or in the
    net's when its batches cost next to nothing: :mod:`cct.data.prefetch`).

    Encoded images are decoded by a small pool of threads (Pillow releases the GIL while decoding)."""

    decode_threads = min(8, os.cpu_count() or 1)

    def __init__(self, reader: LmdbReader | LeveldbReader, transformer: DataTransformer, batch_size: int, flag: int,
                 labels: bool, shard: tuple[int, int] | None):
        self.reader = reader
        self.transformer = transformer
        self.batch_size = batch_size
        self.flag = flag
        self.labels = labels
        self.shard = shard
        self.offset = 0
        self._pool: ThreadPoolExecutor | None = None

    def decode(self, key: bytes, value: Any) -> tuple[np.ndarray, int]:
        fast = raw_view(value)
        if fast is not None:
            return fast
        datum = self.parse(key, value)
        return self.to_array(key, datum), datum.label

    def parse(self, key: bytes, value: Any) -> pb.Datum:
        try:
            return parse_datum(value)
        except DatumError as e:
            raise CctError(f"{self.reader.path}: record {_key_name(key)}: {e}") from None

    def to_array(self, key: bytes, datum: pb.Datum) -> np.ndarray:
        try:
            return datum_to_array(datum, self.flag)
        except DatumError as e:
            raise CctError(f"{self.reader.path}: record {_key_name(key)}: {e}") from None

    def _decode_all(self, records: list[tuple[bytes, Any]]) -> list[tuple[np.ndarray, int]]:
        if self.decode_threads > 1 and len(records) > 1 and raw_view(records[0][1]) is None:
            datums = [self.parse(k, v) for k, v in records]
            if datums[0].encoded:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="cct-decode")
                images = list(self._pool.map(self.to_array, [k for k, _ in records], datums))
                return [(im, d.label) for im, d in zip(images, datums)]
        return [self.decode(k, v) for k, v in records]

    def _read(self) -> tuple[bytes, Any]:
        if self.shard is not None:
            size, rank = self.shard
            while self.offset % size != rank:
                self.reader.skip()
                self.offset += 1
        self.offset += 1
        return self.reader.next()

    def next_batch(self, recycled: Batch | None) -> Batch:
        if self.shard is None:
            self.offset += self.batch_size
            records = self.reader.take(self.batch_size)
        else:
            records = [self._read() for _ in range(self.batch_size)]
        keys = [k for k, _ in records]
        alike = raw_batch([v for _, v in records])
        if alike is not None:
            images, labels = alike
        else:
            decoded = self._decode_all(records)
            images = [im for im, _ in decoded]
            labels = [lab for _, lab in decoded]
        names = _RecordNames(self.reader.path, keys)
        try:
            shape = (self.batch_size,) + self.transformer.infer_shape(images[0].shape)
        except CctError as e:
            raise CctError(f"{names[0]}: {e}") from None
        batch = reuse(recycled, shape, (self.batch_size,) if self.labels else None)
        self.transformer.transform_batch(images, batch.data, names)
        if batch.label is not None:
            batch.label[...] = labels
        return batch

    def state(self) -> dict:
        """Records read so far (the cursor, sharding skips included) and the transformer's stream."""
        return {"offset": self.offset, "rand": self.transformer.rand_state()}

    def restore(self, state: dict) -> None:
        self.offset = int(state["offset"])
        self.reader.seek(self.offset)
        self.transformer.restore_rand(state["rand"])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.reader.close()


@register("Data")
class DataLayer(PrefetchingDataLayer):
    """Caffe's ``Data`` layer over an LMDB or LevelDB of Datum records."""

    min_top = 1
    max_top = 2

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        dp = self.layer_param.data_param
        tp = self.layer_param.transform_param
        if dp.batch_size <= 0:
            raise ParamError("data_param.batch_size", "a positive batch_size is required")
        reader = open_reader(dp.source, dp.backend)
        source = reader.path
        if dp.rand_skip:
            log.info("data_param.rand_skip (%d) is ignored by the Data layer, as in Caffe 1.0", dp.rand_skip)
        transformer = DataTransformer(tp, self.phase)
        flag = decode_flag(tp.force_color, tp.force_gray)
        producer = DbProducer(reader, transformer, int(dp.batch_size), flag, len(top) > 1, None)
        key, value = reader.first()
        datum = producer.parse(key, value)
        if (tp.force_color or tp.force_gray) and not datum.encoded:
            log.error("force_color and force_gray only for encoded datum")
        image, _ = producer.decode(key, value)
        try:
            shape = transformer.infer_shape(image.shape)
            transformer.check(image.shape)
        except CctError as e:
            raise CctError(f"{source}: record {_key_name(key)}: {e}") from None
        top[0].reshape((int(dp.batch_size),) + shape)
        log.info("output data size: %d,%d,%d,%d", top[0].num, top[0].channels, top[0].height, top[0].width)
        if len(top) > 1:
            top[1].reshape((int(dp.batch_size),))
        size, rank = mode.solver_count(), mode.solver_rank()
        if self.phase == pb.TRAIN and size > 1:
            producer.shard = (size, rank)
        transformer.init_rand()
        self.transformer = transformer
        self.start_prefetch(producer, int(dp.prefetch))

