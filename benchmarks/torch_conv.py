"""PyTorch's ``conv2d`` timed in a worker process of its own, for the scripts that set a layer of cct beside it.

The worker is spawned (PyTorch's OpenMP threads keep spinning after each call and would slow numpy work in the
same process; a spawned process inherits the environment :func:`torch_isa.match_torch_isa` set) with the
caller's thread count; :meth:`TorchConv.time` sends it one layer and gets back the median forward and forward +
backward (data and weights, autograd, no bias) seconds of ``repeat`` runs after a warm-up.  Without PyTorch
installed :attr:`TorchConv.version` is None and the scripts print no PyTorch rows.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time


def timed(fn) -> float:
    """Seconds one call of ``fn`` takes (the scripts that import this module time their cct side with it too)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _torch_layer(torch, repeat: int, batch: int, d: int, o: int, grp: int, n: int, k: int, st: int,
                 p: int) -> tuple[float, float]:
    conv2d = torch.nn.functional.conv2d
    x = torch.randn(batch, d, n, n, requires_grad=True)
    w = torch.randn(o, d // grp, k, k, requires_grad=True)
    y = conv2d(x, w, None, st, p, 1, grp)
    dy = torch.randn_like(y)
    y.backward(dy)
    with torch.no_grad():
        tf = statistics.median(timed(lambda: conv2d(x, w, None, st, p, 1, grp)) for _ in range(repeat))

    def step() -> None:
        x.grad = w.grad = None
        conv2d(x, w, None, st, p, 1, grp).backward(dy)

    return tf, statistics.median(timed(step) for _ in range(repeat))


def _worker(conn, threads: int, repeat: int) -> None:
    try:
        import torch
    except ImportError:
        conn.send(None)
        return
    torch.set_num_threads(threads)
    conn.send(torch.__version__)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(_torch_layer(torch, repeat, *msg))


class TorchConv:
    """A PyTorch worker process: ``version`` (None without PyTorch), :meth:`time`, :meth:`close`."""

    def __init__(self, threads: int, repeat: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, threads, repeat), daemon=True)
        self._proc.start()
        self.version: str | None = self._conn.recv()

    def time(self, batch: int, d: int, o: int, group: int, n: int, k: int, stride: int, pad: int
             ) -> tuple[float, float]:
        """Median (forward, forward + backward) seconds of ``conv2d`` on ``batch`` images ``d x n x n`` into ``o``
        channels, ``k x k`` kernels, ``stride``, ``pad``, ``group``."""
        self._conn.send((batch, d, o, group, n, k, stride, pad))
        return self._conn.recv()

    def close(self) -> None:
        if self.version is not None:
            self._conn.send(None)
        self._proc.join()
