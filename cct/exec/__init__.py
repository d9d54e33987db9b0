"""Executors: how a net's forward and backward passes run.

A net (:class:`cct.net.NetCore`) builds the graph and owns blobs and layers; it runs a pass by asking its
executor, which whoever builds the net gives it (the pycaffe :class:`cct.Net` constructor, a solver's
``executor_factory``, a data-parallel replica, the command line):

* :class:`Executor` — the contract: ``forward(net, start, end) -> loss`` and ``backward(net, start, end)``
  over a range of layers (inclusive, as Caffe's ``ForwardFromTo``/``BackwardFromTo``), plus ``attach(net)``,
  called once when the executor is given to a net (an executor serves one net);
* :class:`SerialExecutor` (:mod:`cct.exec.serial`) — Caffe's loop, layer after layer, with the net's
  per-layer callbacks and ``debug_info`` lines; each layer is run by its :class:`LayerRunner`:
  the plain one (the layer on the whole batch where its blobs live) or the device split
  (:class:`cct.exec.device_split.DeviceSplitRunner`: batch-separable layers on per-device shares);
* :func:`executor_from_settings` — what a net gets when its builder names none: the device split of
  ``cct.set_devices`` / ``-devices`` / ``CCT_DEVICES``, or Caffe's GPU mode, else the plain serial loop.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from cct.net import NetCore


class Executor(ABC):
    """Runs whole passes of one net (see the module docstring).  Layer ranges are inclusive; backward runs
    from ``start`` down to ``end`` (``start >= end``) and only where the net says a layer needs it."""

    net: Any = None

    def attach(self, net: NetCore) -> None:
        """Bind to ``net`` (once; an executor keeps per-layer state for the net it serves)."""
        if self.net is not None and self.net is not net:
            raise RuntimeError(f"{type(self).__name__} already runs another net")
        self.net = net

    @abstractmethod
    def forward(self, net: NetCore, start: int, end: int) -> float:
        """Run layers ``start..end``; return the summed weighted loss of their loss tops."""

    @abstractmethod
    def backward(self, net: NetCore, start: int, end: int) -> None:
        """Back-propagate through layers ``start`` down to ``end``."""

    def describe(self) -> str:
        """One line for logs: what runs the passes."""
        return type(self).__name__


ExecutorFactory = Callable[[], Executor]


def executor_from_settings() -> Executor:
    """The executor a net gets when its builder names none: the device split the settings ask for
    (``set_devices`` / ``-devices`` / ``CCT_DEVICES``, or Caffe's GPU mode), else the plain serial loop."""
    from cct.exec.device_split import runner_from_settings
    from cct.exec.serial import SerialExecutor

    return SerialExecutor(runner_from_settings())


__all__ = ["Executor", "ExecutorFactory", "executor_from_settings"]
