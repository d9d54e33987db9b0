"""``mpiexec -n P cct train``: one solver per MPI rank, synchronous data parallelism (Caffe's semantics).

Rank r of P builds its solver as solver rank r of P (``cct.mode``): its TRAIN data layers take records r, r+P,
r+2P, … of their source, it seeds ``random_seed + r``, and ``batch_size`` is per rank, as with Caffe's
``-gpu``.  Only rank 0 loads ``-weights`` or restores ``-snapshot``; its weights, update history and iteration
are broadcast before the first iteration.  Every iteration the gradients are averaged over the ranks (blocking
or overlapped with backprop: :mod:`cct.distributed.overlap`), every rank applies the same update, so the
weights stay bitwise identical (a SHA-256 of each rank's weights is compared at the end).  Only rank 0 tests,
displays, snapshots and logs at INFO; the other ranks log warnings and errors only.  Rank 0's signal
actions (SIGHUP: snapshot; SIGINT from ``kill -INT <rank 0's pid>``: stop) ride in one float of the last
reduction of an iteration, so every rank takes them at the same iteration.  A failure on any rank is one line
``rank r of P: <error>`` and ``MPI_Abort``: the whole job ends, never hangs.  Snapshots are exact resume
points: every rank's data cursors and random streams are gathered into rank 0's solver state, and ``-snapshot``
hands each rank its own.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from cct import log, mode
from cct.distributed.exchange import ExchangeCallback
from cct.distributed.mpi import MpiExchange, init_world, library_version, thread_level_name
from cct.distributed.overlap import OVERLAP_MODES, BlockingStats, OverlapCallback
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb


def train(param: pb.SolverParameter, *, source: str, size: int, variable: str, snapshot: str = "",
          overlap: str = "lee", chunk_split: str = "auto", replicate_fc: int = 0, timeout: float = 600.0,
          action: Callable[[], int] | None = None, stop_on_nan: bool = False) -> None:
    """Train ``param`` as this process's rank of an MPI job of ``size`` ranks (see the module docstring)."""
    from cct.exec.diff_memory import share_as_the_command_line_does
    from cct.solvers import create_solver

    if overlap not in OVERLAP_MODES:
        raise CctError(f"-overlap {overlap}: must be one of {', '.join(OVERLAP_MODES)}")
    if replicate_fc < 0:
        raise CctError(f"-replicate_fc {replicate_fc}: must be 0 or more")
    if timeout <= 0:
        raise CctError(f"-mpi_timeout {timeout:g}: must be a positive number of seconds")
    comm = init_world(size, variable)
    rank = comm.Get_rank()
    solver = None
    exchange = MpiExchange(comm, timeout, iteration=lambda: solver.iter if solver is not None else 0)
    try:
        if rank != 0:
            log.logger.setLevel(max(log.logger.level, logging.WARNING))
            param.ClearField("weights")  # the broadcast gives them the root's
        from mpi4py import MPI

        log.info("MPI: %d ranks, %s, thread level %s", size, library_version(), thread_level_name(MPI.Query_thread()))
        mode.set_solver_count(size)
        mode.set_solver_rank(rank)
        mode.set_multiprocess(True)
        solver = create_solver(param, source=source)
        sharing = share_as_the_command_line_does(solver.net)
        if sharing is not None:
            log.info("Training net: %s", sharing.describe())
        if overlap == "none":
            solver.add_callback(ExchangeCallback(exchange, solver, broadcast=False))
            solver.add_callback(BlockingStats(solver, exchange))
            log.info("MPI overlap none: one blocking Allreduce of %d parameters per iteration",
                     sum(p.count for p in solver.net.learnable_params))
        else:
            solver.add_callback(OverlapCallback(solver, exchange, overlap, chunk_split, replicate_fc))
        if rank == 0:
            exchange.root_action = action
        solver.set_action_function(exchange.requested_action)
        solver.stop_on_nan = stop_on_nan
        # exact resume: every rank's data cursors and streams go into the root's snapshots ...
        solver.state_gather = lambda data: exchange.allgather_variable(data, "gather of the data cursors")
        if snapshot and rank == 0:
            log.info("Resuming from %s", snapshot)
            solver.restore(snapshot)
        exchange.broadcast_params(solver)
        first_iter = solver.iter
        if snapshot:  # ... and each rank takes its own back
            from cct.solvers.resume import read_resume_state, restore

            doc = exchange.bcast_bytes(read_resume_state(snapshot) if rank == 0 else b"",
                                       "broadcast of the snapshot's data cursors")
            if rank != 0:
                restore(solver, doc, snapshot)
        exchange.start()
        log.info("Starting Optimization")
        solver.solve()
        exchange.stop()
        stats = exchange.stats
        log.info("MPI communication in all: %d floats reduced, %d gathered (%d iterations trained)",
                 stats.reduced, stats.gathered, solver.iter - first_iter)
        digests = exchange.weights_digest(solver)
        same = "identical" if len(set(digests)) == 1 else "DIFFERENT"
        log.info("MPI final weights SHA-256 per rank: %s (%s)", " ".join(d[:16] for d in digests), same)
        if len(set(digests)) != 1:
            raise CctError(f"the ranks' final weights differ (SHA-256 {', '.join(d[:16] for d in digests)})")
    except BaseException as e:  # noqa: BLE001 - any failure ends the whole job (one line, then MPI_Abort)
        exchange.fail(e)


__all__ = ["train"]
