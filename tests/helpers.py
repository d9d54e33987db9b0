"""Helpers shared by test modules."""
from __future__ import annotations

import contextlib

import numpy as np

from cct.config import settings


def use_flags(lowering: str | None = None, partitions: str | None = None, conv_engine: str | None = None) -> None:
    """What ``-lowering``, ``-partitions`` and ``-conv_engine`` on the command line do (None: not given)."""
    settings.apply_flags({"lowering": lowering or "", "partitions": partitions or "", "conv_engine": conv_engine or ""})
    settings.validate()


def check_gradient_through_engine(engine: str, text: str, x: np.ndarray) -> None:
    """The numerical gradient check of the convolution layer ``text`` (prototxt) on ``x`` with ``-conv_engine
    engine``, which must be the engine the layer runs."""
    from cct.gradient_check import check_gradient, setup_layer

    use_flags(None, None, engine)
    assert setup_layer(text, [x]).layer.engine.name == engine
    check_gradient(text, [x])


def datum_lmdb(path, records: int, side: int, seed: int, classes: int = 3) -> str:
    """An LMDB at ``path`` of ``records`` Datums: seeded 1 x side x side uint8 images, labels in [0, classes)."""
    from cct.data.datum import array_to_datum
    from cct.data.db import LmdbWriter

    rng = np.random.default_rng(seed)
    writer = LmdbWriter(str(path))
    for i in range(records):
        image = rng.integers(0, 256, (side, side, 1), dtype=np.uint8)
        writer.put(b"%08d" % i, array_to_datum(image, int(rng.integers(classes))).SerializeToString())
    writer.close()
    return str(path)


BODIES = ["compiled", "numpy"]


def select_body(request, monkeypatch) -> str:
    """For a fixture parametrized over :data:`BODIES`: the compiled kernels of cct.native (skipped where they
    were not built) or the layers' numpy bodies (``CCT_NATIVE=0``)."""
    import pytest

    from cct import native

    if request.param == "numpy":
        monkeypatch.setenv("CCT_NATIVE", "0")
    elif native.kernels() is None:
        pytest.skip("compiled kernels not built (no C compiler at install)")
    return request.param


def compiled_vector_widths() -> list[int]:
    """The register widths in bytes (16, 32, 64) at which this machine runs the compiled kernels built once per
    width — each up to its widest — or [] where the kernels were not built."""
    from cct import native

    compiled = native.kernels()
    if compiled is None:
        return []
    previous = compiled.vector_width(0)
    widest = compiled.vector_width(previous)
    return [w for w in (16, 32, 64) if w <= widest]


@contextlib.contextmanager
def at_vector_width(width: int):
    """The compiled kernels built once per register width run at ``width`` bytes inside the block."""
    from cct import native

    compiled = native.kernels()
    previous = compiled.vector_width(width)
    try:
        yield
    finally:
        compiled.vector_width(previous)


def run_batch_in_one_range(n: int, body, work: float = 0.0, parts: int | None = None) -> int:
    """A stand-in for :func:`cct.runtime.partition.run_batch`: the whole range in one call, as one thread runs it."""
    body(0, 0, n)
    return 1


def run_batch_in_ranges(parts: int, seen: list):
    """A stand-in for :func:`cct.runtime.partition.run_batch`: ``parts`` ranges one after the other, each
    recorded in ``seen``."""
    from cct.runtime.partition import batch_ranges

    count = parts

    def run(n: int, body, work: float = 0.0, parts: int | None = None) -> int:  # parts: ignored, count ranges
        ranges = batch_ranges(n, count)
        for r0, r1 in ranges:
            seen.append((r0, r1))
            body(0, r0, r1)
        return len(ranges)
    return run
