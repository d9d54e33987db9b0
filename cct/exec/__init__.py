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
  (:class:`cct.exec.device_split.DeviceSplitRunner`: batch-separable layers on per-device shares) or a
  plan's (:class:`cct.exec.planned.PlannedRunner`: each layer's sample and channel splits from a plan file);
* :func:`executor_from_settings` — what a net gets when its builder names none: the device split of
  ``cct.set_devices`` / ``-devices`` / ``CCT_DEVICES``, or Caffe's GPU mode, else the plain serial loop.
"""
from __future__ import annotations

from cct.exec.base import Executor, ExecutorFactory


def executor_from_settings() -> Executor:
    """The executor a net gets when its builder names none: the device split the settings ask for
    (``set_devices`` / ``-devices`` / ``CCT_DEVICES``, or Caffe's GPU mode), else the plain serial loop."""
    from cct.exec.device_split import runner_from_settings
    from cct.exec.serial import SerialExecutor

    return SerialExecutor(runner_from_settings())


__all__ = ["Executor", "ExecutorFactory", "executor_from_settings"]
