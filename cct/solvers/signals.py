"""SIGINT / SIGHUP (and, in cct, SIGTERM) → solver actions (Caffe's ``SignalHandler``,
``util/signal_handler.cpp``).

``caffe train`` installs one for the run: by default SIGINT (Ctrl-C) means *stop* (the current
iteration finishes, then :meth:`~cct.solvers.solver.Solver.solve` snapshots and returns) and SIGHUP
means *snapshot* and go on.  The handler only records the signal; the solver asks for it with
:meth:`SignalHandler.get_action` after each update and between test batches, so a snapshot is never
interrupted half-written by our own handler (and writes are atomic against any other kill).

SIGTERM (what batch schedulers send before a kill) is left to the OS unless ``sigterm_effect`` is given:
``snapshot`` snapshots and stops at the end of the current iteration, ``stop`` stops (``solve`` then
snapshots if ``snapshot_after_train``), ``none`` ignores it.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from cct.errors import CctError
from cct.solvers.solver import SolverAction

_EFFECTS = {"stop": SolverAction.STOP, "snapshot": SolverAction.SNAPSHOT, "none": SolverAction.NONE}


def signal_effect(value: str, flag: str = "") -> SolverAction:
    """``stop`` | ``snapshot`` | ``none`` → SolverAction (anything else is a one-line error)."""
    if value not in _EFFECTS:
        where = f"-{flag}: " if flag else ""
        raise CctError(f"{where}Invalid signal effect \"{value}\" was specified (use stop, snapshot or none)")
    return _EFFECTS[value]


class SignalHandler:
    """Context manager: while active, SIGINT and SIGHUP are recorded instead of acted on.

    ``get_action()`` reports (and clears) a pending SIGHUP first, then a pending SIGINT.
    """

    def __init__(self, sigint_effect: SolverAction | str = SolverAction.STOP,
                 sighup_effect: SolverAction | str = SolverAction.SNAPSHOT,
                 sigterm_effect: SolverAction | str | None = None):
        self.sigint_effect = signal_effect(sigint_effect, "sigint_effect") if isinstance(sigint_effect, str) \
            else SolverAction(sigint_effect)
        self.sighup_effect = signal_effect(sighup_effect, "sighup_effect") if isinstance(sighup_effect, str) \
            else SolverAction(sighup_effect)
        if isinstance(sigterm_effect, str):
            sigterm_effect = None if not sigterm_effect else signal_effect(sigterm_effect, "sigterm_effect")
            if sigterm_effect == SolverAction.SNAPSHOT:
                sigterm_effect = SolverAction.SNAPSHOT_AND_STOP  # the job is about to be killed: do not go on
        self.sigterm_effect = None if sigterm_effect is None else SolverAction(sigterm_effect)
        self._got_sigint = False
        self._got_sighup = False
        self._got_sigterm = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self._got_sigint = True
        elif signum == getattr(signal, "SIGTERM", None):
            self._got_sigterm = True
        else:
            self._got_sighup = True

    def __enter__(self) -> SignalHandler:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only; nothing to hook here
        for name in ("SIGINT", "SIGHUP") + (("SIGTERM",) if self.sigterm_effect is not None else ()):
            signum = getattr(signal, name, None)
            if signum is not None:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def get_action(self) -> SolverAction:
        if self._got_sigterm:
            self._got_sigterm = False
            return self.sigterm_effect
        if self._got_sighup:
            self._got_sighup = False
            return self.sighup_effect
        if self._got_sigint:
            self._got_sigint = False
            return self.sigint_effect
        return SolverAction.NONE
