"""Data layer throughput: decoded + transformed images/s, and how long training waits for data.

Builds, in a temporary directory, two LMDBs of the same 256x256 colour images — raw Datums and
JPEG-encoded Datums (quality 95, as convert_imageset -encoded re-encodes) — and reads them through a
TRAIN-phase Data layer with ``crop_size: 227``, ``mirror: true`` and a per-channel ``mean_value``
(batch 64, the AlexNet/CaffeNet input pipeline).  For each database it prints (medians of ``--runs``):

* images/s of the prefetch producer (read + parse + decode + transform of whole batches, one thread),
  against the baseline of the same images transformed one at a time (``DataTransformer.transform``,
  Caffe's per-Datum structure) measured in the same run;
* the time a consumer waits in ``forward`` per batch when each iteration computes for ``--compute``
  seconds (simulated with sleep, as GPU compute leaves the CPU free), as a fraction of that time.

Usage::

    python benchmarks/data_throughput.py [--images 320] [--compute 1.0] [--runs 3] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("GLOG_minloglevel", "1")

import cct.layers  # noqa: E402,F401  (registers the layers)
from cct.blob import Blob  # noqa: E402
from cct.data.datum import array_to_datum, datum_to_array, parse_datum  # noqa: E402
from cct.data.db import LmdbWriter  # noqa: E402
from cct.data.image import encode_image  # noqa: E402
from cct.gradient_check import layer_param  # noqa: E402
from cct.layers.registry import create_layer  # noqa: E402
from cct.proto import caffe_pb2 as pb  # noqa: E402

BATCH = 64
TRANSFORM = "transform_param { crop_size: 227 mirror: true mean_value: 104 mean_value: 117 mean_value: 123 }"


def make_images(n: int, seed: int = 0) -> list[np.ndarray]:
    """Photo-like 256x256 BGR images: smooth colour fields plus noise (so JPEG sizes are realistic)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:256, 0:256].astype(np.float32) / 256
    out = []
    for _ in range(n):
        f = rng.uniform(1, 6, (3, 2))
        p = rng.uniform(0, 2 * np.pi, (3, 2))
        planes = [127 + 100 * np.sin(f[c, 0] * 6 * xx + p[c, 0]) * np.cos(f[c, 1] * 6 * yy + p[c, 1])
                  for c in range(3)]
        img = np.stack(planes, axis=2) + rng.normal(0, 12, (256, 256, 3))
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def build_db(path: str, images: list[np.ndarray], encoded: bool) -> int:
    db = LmdbWriter(path)
    size = 0
    for i, img in enumerate(images):
        if encoded:
            datum = pb.Datum(data=encode_image(img, "jpg"), label=i % 1000, encoded=True)
        else:
            datum = array_to_datum(img, i % 1000)
        value = datum.SerializeToString()
        size += len(value)
        db.put(f"{i:08d}_img{i}.jpg".encode(), value)
        if (i + 1) % 1000 == 0:
            db.commit()
    db.close()
    return size // len(images)


def make_layer(source: str):
    param = layer_param(f'type: "Data" data_param {{ source: "{source}" batch_size: {BATCH} backend: LMDB '
                        f'prefetch: 4 }} {TRANSFORM}', pb.TRAIN)
    layer = create_layer(param)
    top = [Blob(), Blob()]
    layer.setup_layer([], top)
    return layer, top


def producer_rate(source: str, batches: int) -> float:
    """images/s of the producer's next_batch, called directly (no thread)."""
    layer, _ = make_layer(source)
    layer.close()  # stop the thread; then its producer can be driven directly
    producer = layer.producer
    batch = None
    producer.next_batch(None)
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = producer.next_batch(batch)
    return batches * BATCH / (time.perf_counter() - t0)


def per_image_rate(source: str, batches: int) -> float:
    """Baseline: the same records, each parsed, decoded and transformed on its own."""
    layer, _ = make_layer(source)
    layer.close()
    producer = layer.producer
    t = layer.transformer
    out = np.empty((BATCH, 3, 227, 227), np.float32)
    t0 = time.perf_counter()
    for _ in range(batches):
        for i in range(BATCH):
            _, value = producer.reader.next()
            out[i] = t.transform(datum_to_array(parse_datum(value), producer.flag))
    return batches * BATCH / (time.perf_counter() - t0)


def consumer_wait(source: str, compute: float, iters: int) -> float:
    """Median seconds a training loop waits in forward per batch, computing ``compute`` s per batch."""
    layer, top = make_layer(source)
    layer.forward_layer([], top)
    waits = []
    for _ in range(iters):
        time.sleep(compute)
        t0 = time.perf_counter()
        layer.forward_layer([], top)
        waits.append(time.perf_counter() - t0)
    layer.close()
    return statistics.median(waits)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=320, help="images per database (default 320)")
    ap.add_argument("--compute", type=float, default=1.0, help="per-iteration compute time in s (default 1.0)")
    ap.add_argument("--runs", type=int, default=3, help="runs per measurement; medians are printed")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per wait measurement")
    ap.add_argument("--batches", type=int, default=6, help="batches per throughput measurement")
    args = ap.parse_args(argv)
    print(f"Data layer, TRAIN, batch {BATCH}, crop 227 + mirror + mean_value, {args.images} images of "
          f"256x256x3, {os.cpu_count()} CPUs")
    images = make_images(args.images)
    with tempfile.TemporaryDirectory() as tmp:
        for name, encoded in (("raw", False), ("jpeg", True)):
            path = os.path.join(tmp, name)
            size = build_db(path, images, encoded)
            fast = statistics.median(producer_rate(path, args.batches) for _ in range(args.runs))
            slow = statistics.median(per_image_rate(path, args.batches) for _ in range(args.runs))
            wait = statistics.median(consumer_wait(path, args.compute, args.iters) for _ in range(args.runs))
            need = BATCH / args.compute
            print(f"{name:>4} Datums ({size / 1024:.0f} KiB each): {fast:8.1f} images/s batched "
                  f"({fast / slow:.2f}x the per-image baseline {slow:.1f} images/s; "
                  f"{fast / need:.1f}x the {need:.0f} images/s a {args.compute:g} s iteration consumes)")
            print(f"     wait per batch of {BATCH} with {args.compute:g} s compute: {wait * 1000:.2f} ms "
                  f"({100 * wait / args.compute:.2f}% of compute)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
