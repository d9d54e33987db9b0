"""Solvers: the training loop (:mod:`~cct.solvers.solver`), the six update rules (:mod:`~cct.solvers.sgd`)
and the learning-rate policies (:mod:`~cct.solvers.lr_policy`), with pycaffe's names.

``SGDSolver(file)`` … ``AdamSolver(file)`` fix the rule by class; :func:`get_solver` picks it from the
file's ``type``.  :class:`~cct.solvers.signals.SignalHandler` turns SIGINT/SIGHUP into solver actions.
"""
from cct.solvers.sgd import (
    AdaDeltaSolver,
    AdaGradSolver,
    AdamSolver,
    NesterovSolver,
    RMSPropSolver,
    SGDSolver,
)
from cct.solvers.signals import SignalHandler
from cct.solvers.solver import (
    Solver,
    SolverAction,
    SolverCallback,
    create_solver,
    get_solver,
    read_solver_file,
    register_solver,
    solver_type_list,
)

__all__ = [
    "AdaDeltaSolver", "AdaGradSolver", "AdamSolver", "NesterovSolver", "RMSPropSolver", "SGDSolver",
    "SignalHandler", "Solver", "SolverAction", "SolverCallback", "create_solver", "get_solver",
    "read_solver_file", "register_solver", "solver_type_list",
]
