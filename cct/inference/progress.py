"""A progress bar on stderr for long inference runs: voxels done, voxels/s and the time left.

On a terminal one line is redrawn in place (at most every ``interval`` seconds); otherwise (a log file, a
pipe) a plain line is printed every ``log_interval`` seconds.  The last line is printed at :meth:`close`.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


def _clock(seconds: float) -> str:
    seconds = int(round(max(seconds, 0.0)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _count(v: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}"


class Progress:
    """``update(voxels)`` after each written tile; ``close()`` at the end.  ``enabled=False``: silent."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, interval: float = 0.5,
                 log_interval: float = 10.0, width: int = 28):
        self.total, self.enabled = int(total), enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if self.tty else log_interval
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self._last = -float("inf")
        self._shown = -1

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta_text = _clock(eta) if eta == eta else "?"
        return (f"infer [{'#' * filled}{'.' * (self.width - filled)}] {100 * frac:5.1f}% "
                f"{_count(self.done)}/{_count(self.total)} voxels, {_count(rate)} vox/s, "
                f"elapsed {_clock(elapsed)}, ETA {eta_text}")

    def update(self, voxels: int) -> None:
        self.done += int(voxels)
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            self._emit()

    def _emit(self) -> None:
        self._shown = self.done
        if self.tty:
            self.stream.write("\r" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            if self._shown != self.done:
                self._emit()
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()
