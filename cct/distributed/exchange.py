"""The gradient-exchange seam of data-parallel training, shared by the thread replicas (:mod:`.replicas`,
``-gpu 0,1``) and by MPI ranks (:mod:`.mpi`, ``mpiexec -n P cct train``).

A replica (thread or process) of rank ``r`` out of ``size`` talks to the others through one
:class:`GradientExchange`:

* ``broadcast_params(solver)`` — every replica's learnable parameters := the root's (rank 0), before the first
  iteration (Caffe's broadcast; the root has loaded ``-weights`` or restored ``-snapshot``);
* ``allreduce_mean(solver)`` — every replica's learnable diffs := ``(Σ_r diff_r) · f32(1/size)`` (Caffe: allreduce
  sum, then scale by ``1/solver_count``), after the gradients of an iteration are accumulated;
* ``fail(error)`` — stop every replica now (a failure anywhere ends the whole run, never a hang).

:class:`ExchangeCallback` is the solver callback that drives an exchange the blocking way (broadcast at the first
``on_start``, allreduce at every ``on_gradients_ready``).  MPI's overlapped modes (:mod:`.overlap`) post the
reductions from the net's per-layer hooks instead and wait for them chunk by chunk in the solver's
``update_groups``; they use the MPI exchange's non-blocking primitives on top of the same seam.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from cct.solvers.solver import Solver


class GradientExchange(abc.ABC):
    """How one replica (``rank`` of ``size``) exchanges parameters and gradients with the others."""

    rank: int = 0
    size: int = 1

    @abc.abstractmethod
    def broadcast_params(self, solver: Solver) -> None:
        """``solver``'s learnable parameters := the root's (collective: every replica calls it; asked at every
        ``on_start``, it broadcasts at the first of a run and does nothing after)."""

    @abc.abstractmethod
    def allreduce_mean(self, solver: Solver) -> None:
        """``solver``'s learnable diffs := the mean of every replica's (collective)."""

    @abc.abstractmethod
    def fail(self, error: BaseException | None) -> None:
        """Stop every replica (``error``: why; the first one is what the run reports)."""

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size}"


class ExchangeCallback:
    """A solver callback that runs ``exchange`` blocking: the broadcast before the first iteration (unless
    ``broadcast`` is False: the caller does it before training), the averaging of the gradients at every
    ``on_gradients_ready``."""

    def __init__(self, exchange: GradientExchange, solver: Solver, *, broadcast: bool = True):
        self.exchange = exchange
        self.solver = solver
        self.broadcast = broadcast

    def on_start(self) -> None:
        if self.broadcast:
            self.exchange.broadcast_params(self.solver)

    def on_gradients_ready(self) -> None:
        self.exchange.allreduce_mean(self.solver)


__all__ = ["ExchangeCallback", "GradientExchange"]
