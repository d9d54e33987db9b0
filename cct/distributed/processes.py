"""Data parallelism across the processes of one machine, for pycaffe's ``caffe.NCCL`` (Caffe's
``python/train.py``: one process per device, started by ``multiprocessing``, joined by a uid).

The processes share one memory-mapped file named by the uid (in ``/dev/shm`` where it exists): a small
header, then one float32 slot of all learnable parameters per rank.  Rank 0 creates it; the others wait for it
to appear.  Every collective is: write your slot, meet at a barrier, read what you need, meet again (so a slot is
never overwritten while another rank reads it).  The barrier is a counter and a generation in the header,
changed under an advisory file lock (``fcntl.flock`` on a lock file of the same name); waiting ranks poll the
generation.  Sums run over the slots in rank order on every rank, so all ranks get bitwise the same mean and
their weights stay identical.  A rank that fails in an exchange marks the header; the others stop at their next
wait with one error.  A rank whose process ends some other way — an error in its own code, a kill — is seen
gone: each rank holds an exclusive lock on a lock file of its own for as long as its process lives (the
kernel drops it when the process ends, however it ends), and a rank waiting at a barrier tests the locks of
the ranks that joined, every ``LIVENESS_SECONDS``.  Every wait is also bounded (``timeout``).
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

_HEADER = 8  # int64s: arrived, generation, failed rank + 1, parameter count, ...; then the pid of each rank that
_ARRIVED, _GENERATION, _FAILED, _COUNT = 0, 1, 2, 3  # joined (0 until it does), then the slots
# a rank waiting at a barrier tests whether the others' processes still live this often (seconds)
LIVENESS_SECONDS = 0.05


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
        self._rank_lock_paths = [f"{base}.rank{r}.lock" for r in range(size)]
        self._alive = self._hold_rank_lock()
        nbytes = 8 * (_HEADER + size) + 4 * size * count
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
        self._joined = raw[8 * _HEADER:8 * (_HEADER + size)].view(np.int64)
        self._slots = raw[8 * (_HEADER + size):].view(np.float32).reshape(size, count)
        if int(self._header[_COUNT]) != count:
            raise CctError(f"NCCL rank {rank}: this net has {count} learnable values, rank 0's has "
                           f"{int(self._header[_COUNT])}: every process must train the same net")
        self._joined[rank] = os.getpid()
        self._broadcast_done = False

    def _hold_rank_lock(self):
        """This rank's lock file, locked for the life of the process (see the module docstring)."""
        import fcntl

        f = open(self._rank_lock_paths[self.rank], "a+b")  # noqa: SIM115 - held for the exchange's life
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise CctError(f"NCCL: solver rank {self.rank} of this uid is already taken by another process "
                           "(caffe.set_solver_rank)") from None
        return f

    def _gone(self) -> int | None:
        """A rank that joined and whose process has ended (its lock file free or removed), or None."""
        import fcntl

        for r in range(self.size):
            if r == self.rank or not int(self._joined[r]):
                continue
            try:
                fd = os.open(self._rank_lock_paths[r], os.O_RDONLY)
            except FileNotFoundError:
                return r
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # held: that process lives
            finally:
                os.close(fd)  # (releases the lock this test may have taken)
            return r
        return None

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
        start = time.monotonic()
        deadline, next_check = start + self.timeout, start + LIVENESS_SECONDS
        pause = 0.0
        while int(h[_GENERATION]) == generation:
            self._check_failed()
            now = time.monotonic()
            if now > next_check:
                next_check = now + LIVENESS_SECONDS
                gone = self._gone()
                # (a rank leaves a barrier only once the generation moved: read again, it tells a rank that
                # left after this barrier was passed from one that never reached it)
                if gone is not None and int(h[_GENERATION]) == generation:
                    raise CctError(f"NCCL: solver rank {gone} of {self.size} ended before the {what}; stopping "
                                   f"rank {self.rank}")
            if now > deadline:
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
        with contextlib.suppress(OSError):  # removed before it is unlocked: a free lock file is an ended rank's
            os.remove(self._rank_lock_paths[self.rank])
        for f in (self._lock_file, self._alive):
            with contextlib.suppress(Exception):
                f.close()


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
