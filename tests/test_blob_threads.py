"""A fresh blob touched by several threads at once (the task-graph executor's workers writing the channel
blocks of one top): every thread gets the same lazily allocated buffer, so no write is lost."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import cct.blob as blob_module
from cct.blob import Blob


@pytest.mark.parametrize("which", ["data", "diff"])
def test_first_access_from_several_threads_shares_one_buffer(monkeypatch, which):
    real = blob_module._Buffer

    class SlowBuffer(real):  # widen the window between "no buffer yet" and "buffer set"
        __slots__ = ()

        def __init__(self, *args):
            time.sleep(0.02)
            super().__init__(*args)

    monkeypatch.setattr(blob_module, "_Buffer", SlowBuffer)
    workers = 4
    b = Blob((workers, 8))
    start = threading.Barrier(workers)

    def write(k: int) -> None:
        start.wait()
        getattr(b, which)[k] = k + 1

    threads = [threading.Thread(target=write, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = np.repeat(np.arange(1, workers + 1, dtype=np.float32)[:, None], 8, axis=1)
    np.testing.assert_array_equal(getattr(b, which), expected)
