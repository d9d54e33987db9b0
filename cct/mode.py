"""Caffe's global mode state: CPU/GPU mode, device id, solver count/rank (pycaffe's module functions).

Solver count and rank are process wide (``set_solver_count``/``set_solver_rank``: pycaffe's functions, an
MPI rank), except inside :func:`replica`, which sets them for the calling thread's context only — how
data-parallel replicas are built side by side in one process (Caffe keeps them per thread too)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from cct.device import cupy_available
from cct.errors import CctError

CPU, GPU = 0, 1
_state = {"mode": CPU, "device": 0, "solver_count": 1, "solver_rank": 0, "multiprocess": False}


def set_mode_cpu() -> None:
    _state["mode"] = CPU


def set_mode_gpu() -> None:
    """GPU mode needs cupy and a CUDA device; without them this is an error, not a silent CPU run."""
    if not cupy_available:
        raise CctError("GPU mode needs cupy and a CUDA device (pip install 'cct[gpu]'); none is available")
    _state["mode"] = GPU


def mode() -> int:
    return _state["mode"]


def set_device(device_id: int) -> None:
    _state["device"] = int(device_id)


def device() -> int:
    """The CUDA device id of GPU mode (``set_device``)."""
    return _state["device"]


_replica: ContextVar[tuple[int, int] | None] = ContextVar("cct_solver_replica", default=None)


@contextlib.contextmanager
def replica(rank: int, count: int) -> Iterator[None]:
    """Within the block (this thread's context only), ``solver_rank() == rank`` and ``solver_count() ==
    count``: what a solver, its nets and their data layers read while being built as one replica of many."""
    token = _replica.set((int(rank), int(count)))
    try:
        yield
    finally:
        _replica.reset(token)


def solver_count() -> int:
    r = _replica.get()
    return r[1] if r is not None else _state["solver_count"]


def set_solver_count(n: int) -> None:
    _state["solver_count"] = int(n)


def solver_rank() -> int:
    r = _replica.get()
    return r[0] if r is not None else _state["solver_rank"]


def set_solver_rank(r: int) -> None:
    _state["solver_rank"] = int(r)


def set_multiprocess(flag: bool) -> None:
    _state["multiprocess"] = bool(flag)


def has_nccl() -> bool:
    """True: ``caffe.NCCL`` works, for the processes of one machine (:mod:`cct.distributed.processes`)."""
    return True
