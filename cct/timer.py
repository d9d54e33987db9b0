"""pycaffe's ``caffe.Timer``: wall-clock milliseconds between ``start()`` and ``stop()``."""
from __future__ import annotations

import time


class Timer:
    """``t = Timer(); t.start(); ...; t.stop(); t.ms`` (also ``seconds`` and ``microseconds``)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._elapsed = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self._elapsed = time.perf_counter() - self._start
            self._start = None

    @property
    def seconds(self) -> float:
        return self._elapsed

    @property
    def ms(self) -> float:
        return self._elapsed * 1e3

    @property
    def microseconds(self) -> float:
        return self._elapsed * 1e6
