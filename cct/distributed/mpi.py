"""MPI data parallelism across processes (``mpiexec -n P cct train``), on Open MPI (or any MPI) through mpi4py.

* :func:`launcher_size` tells from the environment whether this process runs under an MPI launcher
  (``OMPI_COMM_WORLD_SIZE`` or ``PMI_SIZE`` above 1); only then is mpi4py imported (:func:`init_world`), so
  nothing else in cct ever loads it.
* :class:`MpiExchange` is the :class:`~cct.distributed.exchange.GradientExchange` of one rank: the root's solver
  state broadcast before training (``Bcast``), the gradient average (``Allreduce`` of one preallocated float32
  buffer, then ``× f32(1/P)``), and the non-blocking primitives the overlapped modes post
  (:meth:`MpiExchange.post_allreduce`, :meth:`MpiExchange.post_allgather`).  Buffers, never pickles.
* One communication thread per rank (:class:`_CommThread`) runs the posted collectives in FIFO order while the
  main thread computes; every wait has a deadline (``-mpi_timeout``), and a request is completed by polling
  ``Test`` until it is done or the deadline has passed.  A missed deadline or an error on any rank ends the
  whole job: one line naming the rank and the error, then ``MPI_Abort``.
* :class:`CommStats` keeps, per communication i, its actual duration ``T_c^i`` (on the communication thread) and
  its blocking time ``T_b^i`` (the part of it during which the main thread was waiting); rank 0 logs
  ``R = 100 Σ(T_c^i − T_b^i) / Σ T_c^i`` (Lee et al., Eq. 11) every display interval.
"""
from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cct import log
from cct.distributed.exchange import GradientExchange
from cct.errors import CctError

if TYPE_CHECKING:  # pragma: no cover
    from cct.solvers.solver import Solver

f32 = np.float32
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launcher_size() -> tuple[int, str]:
    """``(P, variable)`` when an MPI launcher started this process as one of P > 1, else ``(1, "")`` (from the
    environment only; nothing is imported)."""
    for name in _LAUNCHER_VARS:
        raw = os.environ.get(name, "")
        try:
            n = int(raw)
        except ValueError:
            continue
        if n > 1:
            return n, name
    return 1, ""


def init_world(expected: int, variable: str) -> Any:
    """Import mpi4py and return ``COMM_WORLD``, checked against the launcher's count ``expected`` (one clear
    error when mpi4py is missing or talks to another MPI library than the launcher's)."""
    try:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
    except ImportError as e:
        raise CctError(f"{variable}={expected}: this process runs under an MPI launcher but mpi4py cannot be "
                       f"imported ({e}); install it with pip install 'cct[mpi]'") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != expected:
        raise CctError(f"{variable}={expected} but MPI reports a world of {comm.Get_size()} process(es): mpi4py "
                       f"is built for another MPI library than the launcher's ({library_version()}"
                       "); use that library's mpiexec or rebuild mpi4py against it")
    return comm


def library_version() -> str:
    """The MPI library's version line (Open MPI pads its string with NULs, which do not belong in a log)."""
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]


def thread_level_name(level: int) -> str:
    from mpi4py import MPI

    return {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED",
            MPI.THREAD_MULTIPLE: "MULTIPLE"}.get(level, str(level))


# ------------------------------------------------------------------------------------------------
# Timers of Eq. 11
# ------------------------------------------------------------------------------------------------

@dataclass
class Op:
    """One posted collective: ``run(comm)`` returns a request; ``label`` names it in errors."""

    label: str
    start_request: Callable[[Any], Any]
    kind: str = ""   # "reduce" | "gather": what the volume counts
    floats: int = 0  # float32 values reduced, or received by a gather (all ranks' parts)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    started: float = 0.0
    ended: float = 0.0
    waits: list[tuple[float, float]] = field(default_factory=list)


class CommStats:
    """Per display interval: the communications, their actual and blocking times (Eq. 11)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.iterations = 0
        self.reduced = self.gathered = 0  # float32 values over the whole run (every op posted)
        self._lock = threading.Lock()

    def add(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)
            self.reduced += op.floats if op.kind == "reduce" else 0
            self.gathered += op.floats if op.kind == "gather" else 0

    def take(self) -> tuple[int, float, float, int, int]:
        """``(ops, Σ T_c, Σ T_b, floats reduced, floats gathered)`` of the finished communications since the
        last call (seconds; the volumes of Eqs. 9-10 and of the replicated layers' gathers)."""
        with self._lock:
            done = [op for op in self.ops if op.done.is_set()]
            self.ops = [op for op in self.ops if not op.done.is_set()]
        t_c = t_b = 0.0
        reduced = gathered = 0
        for op in done:
            t_c += op.ended - op.started
            for ws, we in op.waits:  # the main thread's waits that fell while this communication ran
                t_b += max(0.0, min(we, op.ended) - max(ws, op.started))
            reduced += op.floats if op.kind == "reduce" else 0
            gathered += op.floats if op.kind == "gather" else 0
        return len(done), t_c, t_b, reduced, gathered

    def log_line(self, size: int) -> str:
        """The line of the iterations since the last one (and a fresh count)."""
        n, t_c, t_b, reduced, gathered = self.take()
        iterations, self.iterations = max(self.iterations, 1), 0
        ratio = 100.0 * (t_c - t_b) / t_c if t_c > 0 else 0.0
        return (f"MPI {size} ranks: {n / iterations:g} ops, T_c {1e3 * t_c / iterations:.1f} ms, "
                f"T_b {1e3 * t_b / iterations:.1f} ms, overlap R {ratio:.1f}% (Eq. 11); per iteration "
                f"{reduced / iterations:.0f} floats reduced, {gathered / iterations:.0f} gathered")


# ------------------------------------------------------------------------------------------------
# The communication thread
# ------------------------------------------------------------------------------------------------

class CommTimeout(CctError):
    """A collective did not complete before its deadline (another rank is gone, stopped or far behind)."""


def complete(request: Any, deadline: float, what: str) -> None:
    """Poll ``request.Test()`` until it completes; a :class:`CommTimeout` once ``deadline`` has passed."""
    pause = 0.0
    while not request.Test():
        if time.monotonic() > deadline:
            raise CommTimeout(what)
        time.sleep(pause)
        pause = min(2 * pause + 1e-5, 5e-4)


class _CommThread:
    """Runs posted collectives one after the other (FIFO), each to completion by polling ``Test``."""

    def __init__(self, comm: Any, timeout: float):
        self.comm = comm
        self.timeout = timeout
        self._queue: queue.Queue[Op | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cct-mpi-comm", daemon=True)
        self._thread.start()

    def post(self, op: Op) -> Op:
        self._queue.put(op)
        return op

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            op.started = time.perf_counter()
            try:
                complete(op.start_request(self.comm), time.monotonic() + self.timeout,
                         f"{op.label} did not complete within {self.timeout:g} s")
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                op.error = e
            op.ended = time.perf_counter()
            op.done.set()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


# ------------------------------------------------------------------------------------------------
# The exchange
# ------------------------------------------------------------------------------------------------

class MpiExchange(GradientExchange):
    """Rank ``comm.rank``'s gradient exchange over MPI (see the module docstring).

    ``timeout``: seconds any wait may last (``-mpi_timeout``).  ``iteration()`` gives the iteration for
    messages.  The communication thread starts with :meth:`start` (after the initial broadcast)."""

    def __init__(self, comm: Any, timeout: float, iteration: Callable[[], int] = lambda: 0):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self.iteration = iteration
        self.stats = CommStats()
        self.scale = f32(1) / f32(self.size)
        self._thread: _CommThread | None = None
        self._flat: np.ndarray | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = _CommThread(self.comm, self.timeout)

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def fail(self, error: BaseException | None) -> None:
        """End the whole job: one line naming this rank and ``error``, then ``MPI_Abort``."""
        if error is not None:
            what = str(error) if isinstance(error, CctError) else f"{type(error).__name__}: {error}"
            log.logger.critical("rank %d of %d: %s", self.rank, self.size, " ".join(what.split("\n")).strip())
        for h in log.logger.handlers:
            h.flush()
        self.comm.Abort(1)

    # ---- blocking collectives (main thread, before the communication thread runs or after it stopped) --
    def _blocking(self, request: Any, what: str) -> None:
        complete(request, time.monotonic() + self.timeout, f"no {what} within {self.timeout:g} s; aborting")

    def bcast(self, buffer: np.ndarray, what: str) -> None:
        self._blocking(self.comm.Ibcast(buffer, root=0), what)

    def allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        send = np.frombuffer(data, dtype=np.uint8).copy()
        recv = np.empty(self.size * send.size, dtype=np.uint8)
        self._blocking(self.comm.Iallgather(send, recv), what)
        return [recv[i * send.size:(i + 1) * send.size].tobytes() for i in range(self.size)]

    def allgather_variable(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's ``data`` (lengths may differ: gathered first, the payloads padded to the longest)."""
        lengths = np.empty(self.size, dtype=np.int64)
        self._blocking(self.comm.Iallgather(np.array([len(data)], dtype=np.int64), lengths), what)
        longest = int(lengths.max())
        padded = data + b"\0" * (longest - len(data))
        return [blob[:int(n)] for blob, n in zip(self.allgather_bytes(padded, what), lengths)]

    def bcast_bytes(self, data: bytes, what: str) -> bytes:
        """The root's ``data`` on every rank."""
        length = np.array([len(data)], dtype=np.int64)
        self.bcast(length, what)
        buffer = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == 0 else np.empty(int(length[0]), np.uint8)
        if buffer.size:
            self.bcast(buffer, what)
        return buffer.tobytes()

    def broadcast_params(self, solver: Solver) -> None:
        """The root's solver state to every rank: learnable parameters, the update rule's history, ``iter``
        and ``current_step`` (so ``-snapshot`` and ``-weights`` are read by the root alone)."""
        arrays = [p.data for p in solver.net.learnable_params]
        arrays += [h.data for h in getattr(solver, "history", [])]
        counters = np.array([solver.iter, solver.current_step], dtype=np.int64)
        self.bcast(counters, "broadcast of the root's iteration")
        flat = np.empty(sum(a.size for a in arrays), dtype=f32)
        if self.rank == 0:
            _pack(arrays, flat)
        self.bcast(flat, "broadcast of the root's weights")
        if self.rank != 0:
            _unpack(flat, arrays)
            solver.iter, solver.current_step = int(counters[0]), int(counters[1])

    def allreduce_mean(self, solver: Solver) -> None:
        """Blocking average of every learnable diff (``-overlap none``): one Allreduce of one float32 buffer
        (plus the root's action in its last slot), waited for at once."""
        params = solver.net.learnable_params
        n = sum(p.count for p in params)
        if self._flat is None or self._flat.size != n + 1:
            self._flat = np.empty(n + 1, dtype=f32)
        flat = self._flat
        _pack([p.diff for p in params], flat[:n])
        flat[n] = self.action_slot()
        op = self.post_allreduce(flat, "the gradient allreduce")
        self.wait(op, "the gradient exchange")
        self.take_action(flat[n])
        flat[:n] *= self.scale
        _unpack(flat[:n], [p.diff for p in params])

    # ---- the root's solver actions, agreed through the last reduction of an iteration -------------
    root_action: Callable[[], int] | None = None
    agreed_action: int = 0

    def action_slot(self) -> np.float32:
        """What this rank adds to the action slot: the root's pending request (signals), others 0."""
        if self.rank == 0 and self.root_action is not None:
            return f32(int(self.root_action()))
        return f32(0)

    def take_action(self, value: np.float32) -> None:
        self.agreed_action = int(round(float(value)))

    def requested_action(self) -> int:
        """The action every rank takes after this iteration's update (once)."""
        action, self.agreed_action = self.agreed_action, 0
        return action

    # ---- non-blocking primitives (run by the communication thread) ----------------------------
    def post_allreduce(self, buffer: np.ndarray, label: str) -> Op:
        """Sum ``buffer`` (float32, contiguous) over the ranks, in place, on the communication thread."""
        MPI = self.MPI
        return self._post(Op(label, lambda comm: comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM), "reduce",
                             buffer.size))

    def post_allgather(self, send: np.ndarray, recv: np.ndarray, label: str) -> Op:
        """``recv`` := every rank's ``send`` in rank order, on the communication thread (``send`` must not
        change until the op is waited for)."""
        return self._post(Op(label, lambda comm: comm.Iallgather(send, recv), "gather", recv.size))

    def _post(self, op: Op) -> Op:
        if self._thread is None:
            self.start()
        self.stats.add(op)
        assert self._thread is not None
        return self._thread.post(op)

    def wait(self, op: Op, what: str) -> None:
        """Block until ``op`` is done (its time blocked is ``T_b``); past the deadline, a one-line error."""
        finished = op.done.is_set()
        if not finished:
            began = time.perf_counter()
            finished = op.done.wait(self.timeout)
            op.waits.append((began, time.perf_counter()))
        if not finished or isinstance(op.error, CommTimeout):
            raise CommTimeout(f"no {what} within {self.timeout:g} s at iteration {self.iteration()} ({op.label}); "
                              "aborting")
        if op.error is not None:
            raise CctError(f"{op.label} failed: {op.error}")

    # ---- agreement at the end --------------------------------------------------------------------
    def weights_digest(self, solver: Solver) -> list[str]:
        """Every rank's SHA-256 of its learnable parameters (Allgather of the digests)."""
        digest = hashlib.sha256()
        for p in solver.net.learnable_params:
            digest.update(np.ascontiguousarray(p.data, dtype=f32).tobytes())
        return [d.hex() for d in self.allgather_bytes(digest.digest(), "agreement on the final weights")]


def _pack(arrays: Sequence[Any], flat: np.ndarray) -> None:
    offset = 0
    for a in arrays:
        n = a.size
        flat[offset:offset + n] = np.asarray(a).reshape(-1)
        offset += n


def _unpack(flat: np.ndarray, arrays: Sequence[Any]) -> None:
    offset = 0
    for a in arrays:
        n = a.size
        a.reshape(-1)[...] = flat[offset:offset + n]
        offset += n


__all__ = ["CommStats", "CommTimeout", "MpiExchange", "Op", "complete", "init_world", "launcher_size"]
