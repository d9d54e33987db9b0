"""The shared body of the prefetching data layers (Data, ImageData, WindowData).

A subclass's :meth:`setup` sizes the tops from a first record and calls :meth:`start_prefetch` with a
producer; :meth:`forward` then copies the next prefetched batch into the tops.  Data layers have no
bottoms, so :meth:`reshape` does nothing: the tops take each batch's shape in :meth:`forward`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cct.blob import Blob
from cct.data.prefetch import Prefetcher, Producer
from cct.errors import CctError
from cct.layers.base import Layer


@dataclass
class Batch:
    """One prefetched batch: ``data`` ``(N, ...)`` float32 and ``label`` ``(N, ...)`` float32."""

    data: np.ndarray
    label: np.ndarray | None


def reuse(recycled: Batch | None, shape: tuple[int, ...], label_shape: tuple[int, ...] | None) -> Batch:
    """A batch of the given shapes, reusing ``recycled``'s arrays when they fit."""
    if recycled is not None and recycled.data.shape == shape and (
            label_shape is None or (recycled.label is not None and recycled.label.shape == label_shape)):
        return recycled
    return Batch(np.empty(shape, dtype=np.float32),
                 None if label_shape is None else np.empty(label_shape, dtype=np.float32))


class PrefetchingDataLayer(Layer):
    """Base of data layers whose batches are made by a background thread."""

    exact_num_bottom = 0
    _prefetcher: Prefetcher | None = None

    def start_prefetch(self, producer: Producer, depth: int) -> None:
        # The producer belongs to the prefetch thread (or, once moved there, the consuming thread: cct.data.prefetch)
        # while it runs; use it only after close().
        self.producer = producer
        self._prefetcher = Prefetcher(producer, depth, self.name)
        self._prefetcher.attach(self)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        """Nothing to do: the tops take each batch's shape in :meth:`forward`."""

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        if self._prefetcher is None:
            raise CctError(f"layer '{self.name}' ({self.type}) was not set up or has been closed")
        try:
            batch = self._prefetcher.get()
        except CctError as e:
            raise CctError(f"layer '{self.name}' ({self.type}): {e}") from None
        for blob, arr in zip(top, (batch.data, batch.label)):
            if arr is None:
                continue
            blob.reshape(arr.shape)
            blob.data[...] = blob.xp.asarray(arr)
        self._prefetcher.recycle(batch)

    def resume_state(self) -> dict | None:
        """The producer's cursor and streams after the last batch this layer gave out (not the read-ahead's)."""
        if self._prefetcher is None or self._prefetcher.consumed_state is None:
            return None
        return {"producer": self._prefetcher.consumed_state}

    def restore_resume_state(self, state: dict) -> None:
        if self._prefetcher is None:
            raise CctError(f"layer '{self.name}' ({self.type}) was not set up or has been closed")
        try:
            self._prefetcher.rewind(state["producer"])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CctError(f"layer '{self.name}' ({self.type}): its resume state does not fit the layer "
                           f"({type(e).__name__}: {e})") from None

    def close(self) -> None:
        """Stop the prefetch thread now (it also stops when the layer is garbage-collected)."""
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None
