"""Executors: how a net's forward and backward passes run.

A net (:class:`cct.net.NetCore`) builds the graph and owns blobs and layers; it runs a pass by asking its
executor, which whoever builds the net gives it (the pycaffe :class:`cct.Net` constructor, a solver's
``executor_factory``, a data-parallel replica, the command line):

* :class:`Executor` — the contract: ``forward(net, start, end) -> loss`` and ``backward(net, start, end)``
  over a range of layers (inclusive, as Caffe's ``ForwardFromTo``/``BackwardFromTo``), plus ``attach(net)``,
  called once when the executor is given to a net (an executor serves one net); and where the parameters
  live between passes — ``clear_param_diffs``, ``update_on_device`` (the solver's step on a device's copies)
  and ``newest`` (a gradient to read where it is) — the host by default, a GPU in Caffe's GPU mode; and
  ``layer_array_module`` (cupy in GPU mode, else None), for which a net built for the executor configures its
  convolution engines;
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
    """The executor a net gets when its builder names none: the task graph when ``set_executor`` /
    ``-executor`` / ``CCT_EXECUTOR`` say ``taskgraph`` (with ``workers`` threads); else the device split the
    settings ask for (``set_devices`` / ``-devices`` / ``CCT_DEVICES``, or Caffe's GPU mode), else the plain
    serial loop."""
    from cct.config import settings
    from cct.exec.device_split import runner_from_settings
    from cct.exec.serial import SerialExecutor

    if settings.get("executor") == "taskgraph":
        from cct import mode
        from cct.errors import CctError
        from cct.exec.taskgraph import TaskGraphExecutor

        source = settings.source("executor")
        if settings.get("devices") is not None:
            raise CctError(f"{source} taskgraph: the task graph runs on the CPU's cores; it does not split batches "
                           f"across devices ({settings.source('devices')} {settings.get('devices')})")
        if mode.mode() == mode.GPU:
            raise CctError(f"{source} taskgraph: the task graph runs numpy arrays on the CPU, not in GPU mode")
        return TaskGraphExecutor(settings.get("workers"))
    return SerialExecutor(runner_from_settings())


def set_executor(name: str | None, workers: int | str | None = None) -> None:
    """Run the passes of nets built afterwards with ``name``: ``"layer"`` (Caffe's loop) or ``"taskgraph"``
    (ZNN's task graph with ``workers`` threads, default the cores); None: back to ``CCT_EXECUTOR``."""
    from cct.config import settings

    settings.set("executor", name, "set_executor")
    settings.set("workers", workers, "set_executor")


__all__ = ["Executor", "ExecutorFactory", "executor_from_settings", "set_executor"]
