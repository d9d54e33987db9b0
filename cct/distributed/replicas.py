"""Caffe's multi-GPU data parallelism (``caffe train -gpu 0,1``; its ``NCCL`` class in ``parallel.cpp``):
one solver replica per device, each training on its own batches, all holding the same weights.

Semantics (Caffe 1.0), for N devices (``solver_count`` = N):

* Replica r (solver rank r; rank 0 is the *root*) is a full solver built from the same SolverParameter
  inside ``cct.mode.replica(r, N)`` (``solver_count() == N``, ``solver_rank() == r`` for the building
  thread only) and with an executor that runs its nets on device r (``executor_factory``): its TRAIN
  Data/HDF5Data layers take every N-th record starting at r, and it seeds ``random_seed + r``.  Only the
  root builds test nets, tests, displays (its own loss, not averaged) and snapshots (interval, signals,
  final); the others train silently (their INFO log lines are dropped, as Caffe's
  ``LOG_IF(INFO, Caffe::root_solver())``).
* Before the first iteration every replica takes the root's parameters (after the root loaded
  ``weights`` or restored a snapshot): Caffe's broadcast.  Non-root replicas do not load ``weights``.
* Every iteration each replica runs forward/backward on its own batch; at ``on_gradients_ready`` the
  learnable parameters' diffs are summed over the replicas in rank order and scaled by ``1/N`` (Caffe:
  allreduce sum, then scal 1/solver_count), and every replica gets that average; then each applies its own
  update (same rule, same history, so the weights stay identical).  ``iter_size``, clipping, weight decay
  and every update rule act on the averaged diffs, unchanged.
* The root runs ``solve()`` in the calling thread (so it gets the signals), the others ``step(max_iter -
  iter)`` in threads, in lockstep at one :class:`threading.Barrier`: passed at each replica's first
  ``on_start`` (the broadcast) and at every ``on_gradients_ready`` (the reduction), the exchange being the
  barrier's action, run once all replicas have arrived.  The root alone asks the action function
  (signals): it alone snapshots on request, and when it stops early it meets the others at their next
  exchange with "finished", so every replica ends at the root's iteration count.  A failure in any replica
  aborts the barrier, every replica stops, and :meth:`DataParallel.solve` raises one :class:`CctError`
  naming the rank and device.  ``timeout`` (seconds, default none: a root test pass may be long) bounds
  each wait at the barrier.

Not reproduced: Caffe's per-thread random streams.  Replicas drawing from cct's global stream while
training (Dropout, stochastic pooling) share it, in whatever order their threads come, so such runs are not
bit-reproducible for N > 1 (data transformers have their own generators, seeded at setup).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from cct import log, mode
from cct.device import get_array_module
from cct.device.device import Device, copy_into
from cct.distributed.exchange import ExchangeCallback, GradientExchange
from cct.errors import CctError
from cct.exec.base import Executor
from cct.exec.device_split import split_executor
from cct.proto import caffe_pb2 as pb
from cct.rng import get_rng
from cct.solvers.solver import Solver, create_solver

# ------------------------------------------------------------------------------------------------
# Building a replica: solver count/rank and the device setting in effect, quiet log for non-roots
# ------------------------------------------------------------------------------------------------

_PREFETCH = "cct-prefetch-"  # the names of data layers' prefetch threads (cct.data.prefetch)


class _QuietThreads(logging.Filter):
    """Drops INFO lines of non-root replicas' threads (warnings and errors pass).

    ``threads``: the threads of non-root replicas (weakly held).  While :meth:`quiet` is active, the
    calling thread is quiet and so is any thread started meanwhile; the prefetch threads among those stay
    quiet afterwards (a shared pool's threads do not: they also work for the root)."""

    def __init__(self) -> None:
        super().__init__("cct.distributed.replicas")
        self.threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._alive_before: set[int] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        thread = threading.current_thread()
        if thread in self.threads:
            return False
        before = self._alive_before
        return before is None or thread.ident in before

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The block runs quietly, and threads it starts stay quiet (a non-root replica's build/restore)."""
        me = threading.current_thread()
        before = {t.ident for t in threading.enumerate() if t is not me}
        self._alive_before = before
        try:
            yield
        finally:
            self._alive_before = None
            self.threads.update(t for t in threading.enumerate()
                                if t.ident not in before and t is not me and t.name.startswith(_PREFETCH))


_QUIET = _QuietThreads()


def _quiet_filter() -> _QuietThreads:
    if _QUIET not in log.logger.filters:
        log.logger.addFilter(_QUIET)
    return _QUIET


def _on_device(device: Device) -> Callable[[], Executor]:
    """The executor factory of a replica's nets: every layer on ``device`` (a split over one device)."""
    return lambda: split_executor([device])


# ------------------------------------------------------------------------------------------------
# Synchronisation
# ------------------------------------------------------------------------------------------------

class _Stopped(Exception):
    """This replica stops: the root's solve ended early, or a replica failed (the barrier was aborted)."""


class _Sync:
    """The replicas' rendezvous: one barrier, passed by every replica at its first ``on_start`` (the
    broadcast) and at every ``on_gradients_ready`` (the reduction); the barrier's action does the exchange
    once all have arrived.  The root's thread ends the run by arriving once more with ``finished`` set;
    that generation's action sets ``stopping``, which every replica reads before it can arrive again (so
    one still leaving the previous exchange is not stopped early).  A failure aborts the barrier."""

    def __init__(self, solvers: list[Solver], timeout: float | None):
        self.solvers = solvers
        self.timeout = timeout
        self.active = False
        self._lock = threading.Lock()
        self.begin()
        self.active = False

    def begin(self) -> None:
        """A fresh rendezvous for one :meth:`DataParallel.solve`."""
        self.barrier = threading.Barrier(len(self.solvers), action=self._exchange)
        self.started = [False] * len(self.solvers)
        self.finished = False
        self.stopping = False
        self.errors: list[tuple[int, BaseException]] = []
        self._broadcast_done = False
        self.active = True

    def _exchange(self) -> None:
        if self.finished:
            self.stopping = True
        elif not self._broadcast_done:
            self._broadcast()
            self._broadcast_done = True
        else:
            self._allreduce()

    def _broadcast(self) -> None:
        """Every replica's learnable parameters := the root's."""
        root = self.solvers[0].net.learnable_params
        for s in self.solvers[1:]:
            for dst, src in zip(s.net.learnable_params, root):
                copy_into(dst.data, src.data)

    def _allreduce(self) -> None:
        """Every replica's learnable diffs := (Σ_r diff_r) · (1/N), summed in rank order."""
        scale = np.float32(1) / np.float32(len(self.solvers))
        for group in zip(*(s.net.learnable_params for s in self.solvers)):
            diffs = [p.diff for p in group]
            xp = get_array_module(diffs[0])
            total = xp.array(diffs[0], copy=True)
            for d in diffs[1:]:
                if get_array_module(d) is xp:
                    total += d
                else:
                    other = xp.empty_like(total)
                    copy_into(other, d)
                    total += other
            total *= scale
            for d in diffs:
                copy_into(d, total)

    def wait(self, rank: int, what: str) -> None:
        """Arrive at the barrier; :class:`_Stopped` when the run is over or broken."""
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            if self.timeout is not None:
                self.fail(rank, CctError(f"waited more than {self.timeout:g} s for the other replicas at {what}"))
            raise _Stopped() from None
        if self.stopping:
            raise _Stopped()

    def fail(self, rank: int, error: BaseException | None) -> None:
        """Record ``error`` (if it is the first) and stop every replica."""
        with self._lock:
            if error is not None and not self.errors:
                self.errors.append((rank, error))
        self.barrier.abort()


class ThreadExchange(GradientExchange):
    """Replica ``rank``'s side of the in-process exchange (:class:`GradientExchange` over threads): each call
    arrives at the replicas' one barrier, whose action broadcasts or averages over the solver objects."""

    def __init__(self, sync: _Sync, rank: int):
        self.sync = sync
        self.rank = rank
        self.size = len(sync.solvers)

    def _check(self) -> None:
        if not self.sync.active:
            raise CctError(f"solver rank {self.rank} of {self.size} is a data-parallel replica: "
                           "train it with DataParallel.solve(), not on its own")

    def broadcast_params(self, solver: Solver) -> None:
        self._check()
        if not self.sync.started[self.rank]:
            self.sync.started[self.rank] = True
            self.sync.wait(self.rank, "the initial broadcast")

    def allreduce_mean(self, solver: Solver) -> None:
        self._check()
        self.sync.wait(self.rank, "the gradient exchange")

    def fail(self, error: BaseException | None) -> None:
        self.sync.fail(self.rank, error)


# ------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------

class DataParallel:
    """Data-parallel training on ``devices`` (one solver replica each; see the module docstring).

    ``param``: the SolverParameter (its ``weights`` are loaded by the root only); ``source`` names it in
    errors.  ``solvers[0]`` (``root``) is the solver the caller talks to (action function, callbacks).
    """

    def __init__(self, param: pb.SolverParameter, devices: Sequence[Device], *, source: str | None = None,
                 timeout: float | None = None):
        self.devices = list(devices)
        if not self.devices:
            raise CctError(f"{source or 'data parallelism'}: no devices to train on")
        n = len(self.devices)
        with mode.replica(0, n):
            root = create_solver(param, source=source, executor_factory=_on_device(self.devices[0]))
        self.solvers: list[Solver] = [root]
        worker_param = pb.SolverParameter()
        worker_param.CopyFrom(root.param)
        worker_param.ClearField("weights")  # the broadcast gives them the root's
        quiet = _quiet_filter()
        stream = get_rng().bit_generator.state  # the root's random stream goes on as if it were alone
        try:
            for rank in range(1, n):
                with mode.replica(rank, n), quiet.quiet():
                    self.solvers.append(create_solver(worker_param, source=source,
                                                      executor_factory=_on_device(self.devices[rank])))
        finally:
            get_rng().bit_generator.state = stream
        root.replicas = self.solvers  # the root's snapshots carry every rank's data cursors
        self._sync = _Sync(self.solvers, timeout)
        for rank, s in enumerate(self.solvers):
            s.add_callback(ExchangeCallback(ThreadExchange(self._sync, rank), s))

    @property
    def root(self) -> Solver:
        return self.solvers[0]

    def restore(self, state_file: str | os.PathLike[str]) -> None:
        """Every replica resumes from ``state_file`` (iter, weights, history; logged by the root only)."""
        self.root.restore(state_file)
        self._restore_others(state_file)

    def _restore_others(self, state_file: str | os.PathLike[str]) -> None:
        with _quiet_filter().quiet():
            for s in self.solvers[1:]:
                s.restore(state_file)

    def solve(self, resume_file: str | os.PathLike[str] | None = None) -> None:
        """Train all replicas to ``max_iter`` (from ``resume_file``'s state if given); returns when the
        root's ``solve`` has ended and the other replicas have stopped."""
        sync = self._sync
        root = self.root
        for s in self.solvers[1:]:  # the root's settings as they are now (max_iter, base_lr, ...)
            s.param.CopyFrom(root.param)
            s.param.ClearField("weights")
        if resume_file:
            self._restore_others(resume_file)
        elif any(s.iter != root.iter for s in self.solvers):
            raise CctError(f"the replicas are at iterations {', '.join(str(s.iter) for s in self.solvers)}: "
                           "restore them with DataParallel.restore(), not one by one")
        sync.begin()
        threads = [threading.Thread(target=self._run_replica, args=(rank,), daemon=True,
                                    name=f"cct-solver-rank-{rank}") for rank in range(1, len(self.solvers))]
        # each replica's layers ask for their device's BLAS threads; the budget keeps concurrent requests apart
        for t in threads:
            t.start()
        solved = False
        try:
            root.solve(resume_file)
            solved = True
            if root.iter < root.param.max_iter:
                # stopped early: the others are on their way to the next exchange; meet them there
                sync.finished = True
                sync.wait(0, "the end of training")
        except _Stopped:
            pass
        except Exception as e:  # noqa: BLE001 - reported as one error below, after the others stopped
            sync.fail(0, e)
        finally:
            if not solved:
                sync.fail(0, None)  # also on KeyboardInterrupt: stop the others before it propagates
            for t in threads:
                t.join()
            sync.active = False
        if sync.errors:
            rank, error = sync.errors[0]
            raise CctError(self._describe(rank, error)) from error

    def _run_replica(self, rank: int) -> None:
        _QUIET.threads.add(threading.current_thread())
        solver = self.solvers[rank]
        try:
            solver.step(solver.param.max_iter - solver.iter)  # the root's max_iter (copied in solve)
        except _Stopped:
            solver.requested_early_exit = True
        except BaseException as e:  # noqa: BLE001 - handed to the root's thread
            self._sync.fail(rank, e)

    def _describe(self, rank: int, error: BaseException) -> str:
        what = str(error) if isinstance(error, CctError) else f"{type(error).__name__}: {error}"
        what = " ".join(what.splitlines())
        return f"solver rank {rank} of {len(self.solvers)} ({self.devices[rank]}): {what}"

