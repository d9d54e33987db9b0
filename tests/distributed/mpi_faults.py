"""A Python layer for the MPI tests: at one training iteration, on one rank, it fails the way ``param_str``
says (``"rank iteration raise|kill|stop"``): raise an error, kill -9 its own process, or SIGSTOP it."""
from __future__ import annotations

import os
import signal

from cct import mode
from cct.layers.base import Layer


class Fault(Layer):
    def setup(self, bottom, top):
        rank, iteration, kind = self.param_str.split()
        self.rank, self.iteration, self.kind = int(rank), int(iteration), kind
        self.calls = 0

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        self.calls += 1
        if mode.solver_rank() != self.rank or self.calls != self.iteration + 1:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected failure at iteration {self.iteration}")
        os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)

    def backward(self, top, propagate_down, bottom):
        pass
