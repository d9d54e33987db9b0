"""Shared helpers for the data tests: layer construction, small LMDBs and images."""
from __future__ import annotations

import contextlib
import gc
import io
import os
import threading
import time
from collections.abc import Collection

import lmdb
import numpy as np

import cct.layers  # noqa: F401  (registers the layers)
from cct import log
from cct.blob import Blob
from cct.gradient_check import layer_param
from cct.layers.registry import create_layer
from cct.proto import caffe_pb2 as pb
from tests.reference import REFERENCE  # noqa: F401  (re-exported for the data tests)


def make_layer(text: str, num_tops: int, phase: int = pb.TEST, bottoms: list[Blob] | None = None):
    """A layer from prototxt text, set up on ``bottoms`` with ``num_tops`` fresh tops."""
    layer = create_layer(layer_param(text, phase))
    top = [Blob() for _ in range(num_tops)]
    layer.setup_layer(bottoms or [], top)
    return layer, top


def forward(layer, top, bottoms=None) -> list[np.ndarray]:
    layer.forward_layer(bottoms or [], top)
    return [t.data.copy() for t in top]


def write_lmdb(path: str | os.PathLike, records: list[tuple[bytes, bytes]]) -> str:
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for k, v in records:
            txn.put(k, v)
    env.close()
    return str(path)


def raw_datum(img_chw: np.ndarray, label: int) -> bytes:
    c, h, w = img_chw.shape
    return pb.Datum(channels=c, height=h, width=w, label=label,
                    data=np.ascontiguousarray(img_chw, dtype=np.uint8).tobytes()).SerializeToString()


def random_images(n: int, shape=(3, 8, 10), seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cct-prefetch-") and t.is_alive()]


def wait_no_prefetch_threads(existing: Collection[threading.Thread] = (),
                             timeout: float = 5.0) -> list[threading.Thread]:
    """The prefetch threads still alive after waiting up to ``timeout`` for them to end, except those in
    ``existing`` (what other tests left running before this one started: not this test's business)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        alive = [t for t in prefetch_threads() if t not in existing]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


@contextlib.contextmanager
def captured_log():
    """cct's glog lines go into the yielded StringIO for the duration."""
    buf = io.StringIO()
    log.init_log(stream=buf)
    try:
        yield buf
    finally:
        log.init_log()
