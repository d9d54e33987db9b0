"""Gradient memory shared between blobs whose gradients are never alive at once (training from the command line).

Caffe keeps a gradient (``diff``) for every blob for the life of the net, so that pycaffe can read any of them
after a pass; ``cct train`` and ``cct time`` read none of them. During a backward pass a blob's gradient is
alive only from the first layer that writes it (the last of its consumers, in backward order) to the last
layer that reads it (its producer): in a chain at most a few are alive at once. :func:`share_diff_memory`
gives every blob a gradient buffer shared with blobs whose live intervals do not overlap — intervals of the
backward order, packed largest first into the fewest bytes, as a memory planner does.

What is left alone (each keeps its own buffer, as Caffe's):

* a gradient read before any layer writes it: a loss top (its diff holds the loss weight from setup), a
  top whose consumers do not back-propagate into it (its producer reads the zeros it was allocated with);
* the net's outputs, and the tops and bottoms of Python layers (user code may keep or accumulate into them);
* blobs already sharing gradient memory (in-place layers, Flatten and Reshape) move together, as one.

A layer's backward overwrites the gradients of the bottoms it propagates to (the layer contract,
:mod:`cct.layers.base`; tested for every layer type), so a buffer's earlier contents never leak into a
result: a net trained with shared gradients takes bitwise the same steps. The sharing follows the order
of the serial executor with the plain layer runner; other executors (the device split, the task graph, a
plan) run layers in other orders or keep device copies, and leave the blobs as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cct.blob import Blob, new_buffer
from cct.config import settings
from cct.exec.serial import LayerRunner, SerialExecutor

if TYPE_CHECKING:  # pragma: no cover
    from cct.net import NetCore


@dataclass
class DiffSharing:
    """What :func:`share_diff_memory` did: ``reason`` says why nothing was shared where ``buffers`` is 0."""

    blobs: int = 0           # blobs given a shared buffer
    buffers: int = 0         # buffers they share
    bytes_before: int = 0    # their gradients' bytes, one buffer each
    bytes_after: int = 0     # the shared buffers' bytes
    kept: int = 0            # blobs needing a gradient that keep their own (see the module docstring)
    reason: str = ""
    slots: list[list[Blob]] = field(default_factory=list, repr=False)  # the blobs on each shared buffer

    def describe(self) -> str:
        if not self.buffers:
            return f"gradients not shared: {self.reason}"
        return (f"{self.blobs} blobs' gradients in {self.buffers} shared buffers: "
                f"{self.bytes_after / 2**20:.1f} MiB instead of {self.bytes_before / 2**20:.1f} MiB"
                + (f" ({self.kept} keep their own)" if self.kept else ""))


def runs_in_layer_order(net: NetCore) -> bool:
    """Whether ``net``'s passes run layer after layer on the host's blobs (the serial executor, plain runner)."""
    ex = net.executor
    return type(ex) is SerialExecutor and type(ex.runner) is LayerRunner


def share_as_the_command_line_does(net: NetCore, every_layer: bool = False) -> DiffSharing | None:
    """``cct train`` / ``cct time``: :func:`share_diff_memory` unless the ``share_diffs`` setting is off
    (``-share_diffs 0``, ``CCT_SHARE_DIFFS=0``: then None). Benchmarks call it to run what the commands run."""
    return share_diff_memory(net, every_layer) if settings.get("share_diffs") else None


def share_diff_memory(net: NetCore, every_layer: bool = False) -> DiffSharing:
    """Give ``net``'s blobs shared gradient buffers (see the module docstring). ``every_layer``: every layer's
    backward runs, also where the net needs none (``cct time``'s passes), so every layer reads its tops'
    gradients. Returns what was done; calling it again re-plans for the blobs' current shapes."""
    if not runs_in_layer_order(net):
        return DiffSharing(reason=f"the passes run on {net.executor.describe()}")
    blobs = list({id(b): b for vec in net.bottom_vecs + net.top_vecs for b in vec}.values())
    if any(b.xp is not np for b in blobs):
        return DiffSharing(reason="blobs live on a device")
    groups = _groups(blobs)
    order = len(net.layers)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    read: set[int] = set()
    written: set[int] = set()
    keep: set[int] = set()

    def touch(g: int, step: int) -> None:
        first[g] = min(first.get(g, step), step)
        last[g] = max(last.get(g, step), step)

    for i, layer in enumerate(net.layers):
        step = order - 1 - i  # backward runs the layers last to first
        python = layer.layer_param.type == "Python"
        for k, blob in enumerate(net.top_vecs[i]):
            g = groups[id(blob)]
            if python or layer.loss(k):
                keep.add(g)
            if every_layer or net.layer_need_backward[i]:
                read.add(g)
                touch(g, step)
        for blob, need in zip(net.bottom_vecs[i], net.bottom_need_backward[i]):
            g = groups[id(blob)]
            if python:
                keep.add(g)
            if need:
                written.add(g)
                touch(g, step)
    for blob in net.output_blobs:
        keep.add(groups[id(blob)])
    keep |= read - written  # read before anything writes it: its contents matter
    members: dict[int, list[Blob]] = {}
    for blob in blobs:
        members.setdefault(groups[id(blob)], []).append(blob)
    planned = [g for g in first if g not in keep]
    result = DiffSharing(kept=sum(len(members[g]) for g in first if g in keep))
    if not planned:
        result.reason = "no gradient whose memory another could use"
        return result
    size = {g: max(b.count for b in members[g]) for g in planned}
    slots: list[tuple[int, list[int]]] = []  # (capacity, groups), each slot's intervals disjoint
    for g in sorted(planned, key=lambda g: (-size[g], first[g])):
        for k, (cap, taken) in enumerate(slots):
            if all(last[h] < first[g] or last[g] < first[h] for h in taken):
                taken.append(g)
                slots[k] = (max(cap, size[g]), taken)
                break
        else:
            slots.append((size[g], [g]))
    dtypes = {np.dtype(b.dtype) for g in planned for b in members[g]}
    if len(dtypes) > 1:
        return DiffSharing(reason=f"blobs of {len(dtypes)} dtypes")
    dtype = dtypes.pop()
    for cap, taken in slots:
        buf = new_buffer(np, cap, dtype)
        group_blobs = [b for g in taken for b in members[g]]
        for blob in group_blobs:
            blob.set_buffer("diff", buf)
        result.slots.append(group_blobs)
    result.blobs = sum(len(members[g]) for g in planned)
    result.buffers = len(slots)
    result.bytes_before = sum(size[g] for g in planned) * dtype.itemsize
    result.bytes_after = sum(cap for cap, _ in slots) * dtype.itemsize
    return result


def _groups(blobs: list[Blob]) -> dict[int, int]:
    """Per blob (by id) its group's index: blobs that already share one gradient buffer are one group."""
    index: dict[Any, int] = {}
    groups = {}
    for b in blobs:
        buf = b.allocated_buffer("diff")
        groups[id(b)] = index.setdefault(id(buf) if buf is not None else ("blob", id(b)), len(index))
    return groups
