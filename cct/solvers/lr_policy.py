"""Learning-rate policies (``SolverParameter.lr_policy``), as Caffe's ``SGDSolver::GetLearningRate``.

``iter`` is the solver's iteration count *before* the update it is used for (0 for the first update).
Every rate is computed in double from the solver's float parameters and returned as float32, the type
Caffe keeps it in.  The seven policies:

=========== =====================================================================================
fixed       ``base_lr``
step        ``base_lr * gamma ^ floor(iter / stepsize)``   (``current_step = iter // stepsize``)
exp         ``base_lr * gamma ^ iter``
inv         ``base_lr * (1 + gamma * iter) ^ (-power)``
multistep   ``base_lr * gamma ^ current_step``, where ``current_step`` advances by at most one per
            call when ``iter >= stepvalue[current_step]`` (and is saved in the solverstate)
poly        ``base_lr * (1 - iter / max_iter) ^ power``
sigmoid     ``base_lr / (1 + exp(-gamma * (iter - stepsize)))``
=========== =====================================================================================

A policy is a function ``(param, iter, current_step) -> (rate, current_step)``; :data:`POLICIES`
maps the names to them and :func:`check_lr_policy` validates a solver's settings up front (Caffe
only checks them at the first update).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from cct import log
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb

Policy = Callable[[pb.SolverParameter, int, int], "tuple[float, int]"]


def _pow(base: float, exponent: float) -> float:
    """C's ``pow`` in double: inf on overflow, nan for a negative base with a fractional exponent."""
    with np.errstate(all="ignore"):
        return float(np.power(np.float64(base), np.float64(exponent)))


def fixed(param: pb.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """``base_lr``."""
    return param.base_lr, current_step


def step(param: pb.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """``base_lr * gamma ^ floor(iter / stepsize)``; sets ``current_step = iter // stepsize``."""
    current_step = it // param.stepsize
    return param.base_lr * _pow(param.gamma, current_step), current_step


def exp(param: pb.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """``base_lr * gamma ^ iter``."""
    return param.base_lr * _pow(param.gamma, it), current_step


def inv(param: pb.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """``base_lr * (1 + gamma * iter) ^ (-power)``."""
    return param.base_lr * _pow(1.0 + param.gamma * it, -param.power), current_step


def multistep(param: pb.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """``base_lr * gamma ^ current_step``; ``current_step`` moves on (by one) once ``iter`` reaches
    ``stepvalue[current_step]``, logging ``MultiStep Status: Iteration <iter>, step = <step>``."""
    if current_step < len(param.stepvalue) and it >= param.stepvalue[current_step]:
        current_step += 1
        log.info("MultiStep Status: Iteration %d, step = %d", it, current_step)
    return param.base_lr * _pow(param.gamma, current_step), current_step


def poly(param: pb.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """``base_lr * (1 - iter / max_iter) ^ power`` (reaches 0 at ``max_iter``)."""
    with np.errstate(all="ignore"):
        frac = 1.0 - np.float64(it) / np.float64(param.max_iter)
    return param.base_lr * _pow(frac, param.power), current_step


def sigmoid(param: pb.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """``base_lr / (1 + exp(-gamma * (iter - stepsize)))``."""
    with np.errstate(all="ignore"):
        return param.base_lr / (1.0 + float(np.exp(np.float64(-param.gamma * (it - param.stepsize))))), \
            current_step


POLICIES: dict[str, Policy] = {
    "fixed": fixed, "step": step, "exp": exp, "inv": inv, "multistep": multistep, "poly": poly,
    "sigmoid": sigmoid,
}


def check_lr_policy(param: pb.SolverParameter, source: str = "solver") -> None:
    """Raise a one-line :class:`CctError` for an unknown policy or settings Caffe would CHECK-fail on."""
    name = param.lr_policy
    if name not in POLICIES:
        raise CctError(f"{source}: Unknown learning rate policy: {name or '(lr_policy not set)'} "
                       f"(known policies: {', '.join(POLICIES)})")
    if name in ("step", "sigmoid") and param.stepsize <= 0:
        raise CctError(f"{source}: lr_policy \"{name}\" needs stepsize > 0 (got {param.stepsize})")
    if name in ("step", "exp", "inv", "multistep", "sigmoid") and param.gamma < 0:
        raise CctError(f"{source}: lr_policy \"{name}\" needs gamma >= 0 (got {log.fmt(param.gamma)})")


def learning_rate(param: pb.SolverParameter, it: int, current_step: int) -> tuple[np.float32, int]:
    """The rate for iteration ``it`` as float32, and the (possibly advanced) ``current_step``."""
    policy = POLICIES.get(param.lr_policy)
    if policy is None:
        check_lr_policy(param)
    rate, current_step = policy(param, it, current_step)
    with np.errstate(all="ignore"):
        return np.float32(rate), current_step


__all__ = ["POLICIES", "check_lr_policy", "learning_rate", "fixed", "step", "exp", "inv", "multistep",
           "poly", "sigmoid"]
