"""Data parallelism across the processes of one machine, for pycaffe's ``caffe.NCCL`` (Caffe's
``python/train.py``: one process per device, started by ``multiprocessing``, joined by a uid).

The processes share one memory-mapped file named by the uid (in ``/dev/shm`` where it exists): a small
header, then one float32 slot of all learnable parameters per rank.  Rank 0 creates it; the others wait for it
to appear.  Every collective is: write your slot, meet at a barrier, read what you need, meet again (so a slot is
never overwritten while another rank reads it).  The barrier is a counter and a generation in the header,
changed under an advisory file lock (``fcntl.flock`` on a lock file of the same name); waiting ranks poll the
generation.  Sums run over the slots in rank order on every rank, so all ranks get bitwise the same mean and
their weights stay identical.  A rank that fails marks the header; the others stop at their next wait with one
error, and every wait is bounded (``timeout``), so a dead rank ends the run instead of hanging it.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Iterator

import numpy as np

from cct.distributed.exchange import GradientExchange
from cct.errors import CctError

_HEADER = 8  # int64s: arrived, generation, failed rank + 1, parameter count, ...
_ARRIVED, _GENERATION, _FAILED, _COUNT = 0, 1, 2, 3


def new_uid() -> bytes:
    """A fresh identifier for one group of processes (pycaffe's ``NCCL.new_uid()``)."""
    return secrets.token_hex(16).encode("ascii")


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ProcessExchange(GradientExchange):
    """The exchange of ``rank`` out of ``size`` processes joined by ``uid`` (see the module docstring)."""

    def __init__(self, uid: bytes | str, rank: int, size: int, count: int, timeout: float = 600.0):
        if isinstance(uid, bytes):
            uid = uid.decode("ascii", "replace")
        if not uid or not all(c.isalnum() for c in uid):
            raise CctError(f"NCCL: a uid from NCCL.new_uid() is needed (got {uid!r})")
        if not 0 <= rank < size:
            raise CctError(f"NCCL: solver rank {rank} is outside the solver count {size} "
                           "(caffe.set_solver_count / set_solver_rank)")
        self.rank, self.size, self.count, self.timeout = rank, size, count, timeout
        base = os.path.join(_folder(), f"cct-nccl-{uid}")
        self.path, self._lock_path = base + ".buf", base + ".lock"
        nbytes = 8 * _HEADER + 4 * size * count
        if rank == 0:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.truncate(nbytes)
            header = np.memmap(tmp, dtype=np.int64, mode="r+", shape=(_HEADER,))
            header[_COUNT] = count
            header.flush()
            del header
            os.replace(tmp, self.path)
        else:
            deadline = time.monotonic() + timeout
            while not os.path.exists(self.path):
                if time.monotonic() > deadline:
                    raise CctError(f"NCCL rank {rank}: rank 0 did not start within {timeout:g} s")
                time.sleep(0.01)
        self._lock_file = open(self._lock_path, "a+b")  # noqa: SIM115 - held for the exchange's life
        raw = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(nbytes,))
        self._header = raw[:8 * _HEADER].view(np.int64)
        self._slots = raw[8 * _HEADER:].view(np.float32).reshape(size, count)
        if int(self._header[_COUNT]) != count:
            raise CctError(f"NCCL rank {rank}: this net has {count} learnable values, rank 0's has "
                           f"{int(self._header[_COUNT])}: every process must train the same net")
        self._broadcast_done = False

    # ---- the barrier -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl

        fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)

    def _check_failed(self) -> None:
        failed = int(self._header[_FAILED])
        if failed:
            raise CctError(f"NCCL: solver rank {failed - 1} of {self.size} failed; stopping rank {self.rank}")

    def barrier(self, what: str) -> None:
        h = self._header
        with self._locked():
            self._check_failed()
            generation = int(h[_GENERATION])
            h[_ARRIVED] += 1
            if h[_ARRIVED] == self.size:
                h[_ARRIVED] = 0
                h[_GENERATION] = generation + 1
                return
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while int(h[_GENERATION]) == generation:
            self._check_failed()
            if time.monotonic() > deadline:
                raise CctError(f"NCCL rank {self.rank} of {self.size}: the others did not reach the {what} within "
                               f"{self.timeout:g} s")
            time.sleep(pause)
            pause = min(1e-3, pause + 5e-5)

    # ---- the seam --------------------------------------------------------------------------------
    def broadcast_params(self, solver) -> None:
        if self._broadcast_done:
            return
        params = solver.net.learnable_params
        if self.rank == 0:
            _pack([p.data for p in params], self._slots[0])
        self.barrier("broadcast of rank 0's weights")
        if self.rank != 0:
            _unpack(self._slots[0], [p.data for p in params])
        self.barrier("end of the broadcast")
        self._broadcast_done = True

    def allreduce_mean(self, solver) -> None:
        params = solver.net.learnable_params
        _pack([p.diff for p in params], self._slots[self.rank])
        self.barrier("gradient exchange")
        total = self._slots[0].copy()
        for r in range(1, self.size):
            total += self._slots[r]
        total *= np.float32(1.0 / self.size)
        self.barrier("end of the gradient exchange")
        _unpack(total, [p.diff for p in params])

    def fail(self, error: BaseException | None) -> None:
        with contextlib.suppress(Exception), self._locked():
            if not int(self._header[_FAILED]):
                self._header[_FAILED] = self.rank + 1

    def close(self) -> None:
        if self.rank == 0:
            for path in (self.path, self._lock_path):
                with contextlib.suppress(OSError):
                    os.remove(path)
        with contextlib.suppress(Exception):
            self._lock_file.close()


class NCCL:
    """pycaffe's ``caffe.NCCL(solver, uid)``: joins this process's solver to the others of ``uid`` (one process
    per device, ``caffe.set_solver_count(n)`` / ``set_solver_rank(r)`` set in each).  ``bcast()`` gives every
    solver rank 0's weights; added as a solver callback (``solver.add_callback(nccl)``) it averages the
    gradients before every update; ``net.after_backward(nccl)`` (``layer_wise_reduce``) is accepted — the
    reduction of the whole iteration happens at ``on_gradients_ready`` either way, with the same numbers."""

    def __init__(self, solver, uid: bytes | str, timeout: float = 600.0):
        from cct import mode

        self.solver = solver
        count = sum(p.count for p in solver.net.learnable_params)
        self.exchange = ProcessExchange(uid, mode.solver_rank(), mode.solver_count(), count, timeout)

    @staticmethod
    def new_uid() -> bytes:
        return new_uid()

    def bcast(self) -> None:
        self._guarded(self.exchange.broadcast_params)

    def on_start(self) -> None:
        self._guarded(self.exchange.broadcast_params)  # nothing after the first (bcast() usually did it)

    def on_gradients_ready(self) -> None:
        self._guarded(self.exchange.allreduce_mean)

    def __call__(self, layer_index: int) -> None:
        """A per-layer hook (``net.after_backward(nccl)``): the iteration's reduction waits for all layers."""

    def _guarded(self, step) -> None:
        try:
            step(self.solver)
        except BaseException as e:
            self.exchange.fail(e)
            raise

    def close(self) -> None:
        self.exchange.close()


def _pack(arrays, flat: np.ndarray) -> None:
    from cct.device import to_host

    offset = 0
    for a in arrays:
        n = a.size
        flat[offset:offset + n] = np.asarray(to_host(a), dtype=np.float32).reshape(-1)
        offset += n


def _unpack(flat: np.ndarray, arrays) -> None:
    from cct.device import get_array_module

    offset = 0
    for a in arrays:
        n = a.size
        a.reshape(-1)[...] = get_array_module(a).asarray(flat[offset:offset + n])
        offset += n


__all__ = ["NCCL", "ProcessExchange", "new_uid"]
