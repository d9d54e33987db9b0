"""The executor contract (see :mod:`cct.exec`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cct.runtime import partition

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

    def sync(self) -> None:  # noqa: B027 - a no-op by default, not abstract
        """Finish any work still running in the background (weight updates applied lazily); a no-op for
        executors that finish everything inside a pass."""

    def clear_param_diffs(self, net: NetCore) -> None:
        """Zero the diffs of all learnable parameters (shared copies share the memory)."""
        zero_param_diffs(net.learnable_params)

    def update_on_device(self, items: Sequence[tuple[Any, str]], update: Callable[[list[Any]], None]) -> bool:
        """Where the passes keep a parameter on a device (Caffe's GPU mode): ``update(arrays)`` on the device's
        copies of ``items`` — (blob, ``"data"`` or ``"diff"``) pairs, the parameter's first, then the solver's
        history —, which then are the newest (the host's come back when touched), and True.  False, nothing
        done, where they live on the host (by default)."""
        return False

    def newest(self, blob: Any, what: str) -> Any:
        """``blob``'s ``data`` or ``diff`` to read, not write: where the passes keep a newer copy on a device,
        that copy, left there (a check of every gradient need not bring them all back); else the blob's own."""
        return getattr(blob, what)

    def layer_array_module(self) -> Any:
        """The array module the layers' passes run on where that is not the net's own (host) memory — cupy in
        Caffe's GPU mode —, else None: a net built for this executor chooses its convolution engines for it."""
        return None

    def close(self) -> None:
        """Release threads and buffers (the executor may not be used afterwards)."""
        self.sync()

    def describe(self) -> str:
        """One line for logs: what runs the passes."""
        return type(self).__name__


ExecutorFactory = Callable[[], Executor]


def zero_param_diffs(params: Sequence[Any]) -> None:
    """Zero the diffs of ``params`` (blobs) on the host, large ones over the batch partitions."""
    for p in params:
        partition.zero(p.diff)
