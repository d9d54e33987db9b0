"""Blob: Caffe's N-D array pair (data, diff), float32.

Memory is a flat buffer with a capacity, as in Caffe: reshaping within the capacity keeps the buffer (and
its contents), growing it allocates a new zero-filled one.  ``data``/``diff`` are views of the buffer in
the blob's shape, so pycaffe code such as ``net.blobs['data'].data[...] = x`` writes into the net.
Buffers are allocated lazily (zero-filled) on first access, under a lock so that threads touching a
fresh blob at once share one buffer.  Two blobs can share data or diff memory
(Split tops, Flatten/Reshape, weight sharing, in-place layers use the very same Blob object).
A :class:`RowView` (``Blob.view_rows(parent, start, stop)``) is a sub-batch: rows of a parent blob along
axis 0, in the parent's memory (the device split of :mod:`cct.exec.device_split` runs layers on them).
A buffer may have a device copy that an executor keeps (GPU mode): then an access of ``data``/``diff`` first
brings back newer values written on the device (:class:`_Buffer`).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from cct.errors import CctError

MAX_AXES = 32
DTYPE = np.float32
_default_dtype: Any = DTYPE
# Taken on the first access of a blob's data or diff only: two threads touching a fresh blob at once (the
# workers of the task-graph executor writing the channel blocks of one top) must get the same buffer, not
# one each with the writes to the other lost.
_ALLOC_LOCK = threading.Lock()
# Taken when a tracked buffer (one with a device copy: _Buffer) is accessed or written on a device
_SYNC_LOCK = threading.RLock()


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    """Blobs created inside the block use ``dtype`` (float32 otherwise).

    Nets and the command line are float32 like Caffe; float64 exists for gradient checks (as Caffe's own
    tests run every layer in double too)."""
    global _default_dtype
    old, _default_dtype = _default_dtype, np.dtype(dtype)
    try:
        yield
    finally:
        _default_dtype = old


class _Buffer:
    """A flat array that several blobs may reference (Caffe's SyncedMemory).

    ``array`` is where the blobs' ``data``/``diff`` views live.  An executor may keep a copy of it on a device
    (the device split's GPU copy of a net blob: :mod:`cct.exec.device_split`) and let layers write that copy
    without copying it back after each layer.  Such a buffer is ``tracked``: every access of a view through
    ``Blob.data``/``Blob.diff`` counts as a write of ``array`` (a view is mutable: pycaffe's accessors are)
    and bumps ``version``, so a device copy taken at an older version is known stale; a device copy newer
    than ``array`` is ``pending``, and the first such access copies it in (:meth:`host_access`)."""

    __slots__ = ("array", "version", "pending", "tracked", "__weakref__")

    def __init__(self, xp: ModuleType, capacity: int, dtype: Any):
        self.array = xp.zeros(max(capacity, 1), dtype=dtype)
        self.version = 0
        self.pending: Any = None  # a callable that copies the newer device copy into ``array``, with ``.owner``
        self.tracked = False

    def host_access(self) -> None:
        """``array`` is about to be read or written here: bring in a pending device copy; count the access."""
        with _SYNC_LOCK:
            pending, self.pending = self.pending, None
            if pending is not None:
                pending()
            self.version += 1

    def device_wrote(self, pending: Any) -> int:
        """A device copy (``pending.owner``) now holds newer values than ``array``; ``pending()`` copies them
        in.  Another copy's pending values are brought in first (blobs that share memory).  Returns the new
        version, at which the writer's copy is current."""
        with _SYNC_LOCK:
            earlier = self.pending
            if earlier is not None and earlier.owner != pending.owner:
                earlier()
            self.tracked = True
            self.pending = pending
            self.version += 1
            return self.version


def new_buffer(xp: ModuleType, capacity: int, dtype: Any) -> _Buffer:
    """A zero-filled buffer of ``capacity`` values for blobs to share (:meth:`Blob.set_buffer`): a memory plan's
    (:mod:`cct.exec.diff_memory`)."""
    return _Buffer(xp, capacity, dtype)


class Blob:
    """An N-D float32 array of data and the gradient (diff) of the same shape."""

    __slots__ = ("_shape", "_count", "_data_buf", "_diff_buf", "_data", "_diff", "xp", "dtype",
                 "__weakref__")

    def __init__(self, shape: Iterable[int] = (), xp: ModuleType = np, dtype: Any = None):
        self.xp = xp
        self.dtype = np.dtype(dtype) if dtype is not None else _default_dtype
        self._shape: tuple[int, ...] = ()
        self._count = 1
        self._data_buf: _Buffer | None = None
        self._diff_buf: _Buffer | None = None
        self._data: Any = None
        self._diff: Any = None
        self.reshape(shape)

    # ---- shape -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def count(self) -> int:
        return self._count

    @property
    def num_axes(self) -> int:
        return len(self._shape)

    def reshape(self, *shape: Any) -> None:
        """Reshape to ``shape`` (ints, or one sequence of ints).  Keeps memory if the count fits."""
        if len(shape) == 1 and isinstance(shape[0], Iterable) and not isinstance(shape[0], (str, bytes)):
            shape = tuple(shape[0])
        dims = tuple(int(d) for d in shape)
        if dims == self._shape and (self._data_buf is not None or self._diff_buf is not None):
            return
        if len(dims) > MAX_AXES:
            raise CctError(f"blob has {len(dims)} axes; at most {MAX_AXES} are supported")
        if any(d < 0 for d in dims):
            raise CctError(f"blob shape {dims} has a negative dimension")
        count = 1
        for d in dims:
            count *= d
        self._shape = dims
        self._count = count
        for name in ("_data_buf", "_diff_buf"):
            buf = getattr(self, name)
            if buf is not None and buf.array.size < count:
                setattr(self, name, None)  # grows: new zero-filled memory on next access
        self._data = None
        self._diff = None

    def reshape_like(self, other: Blob) -> None:
        self.reshape(other.shape)

    def shape_string(self) -> str:
        """Caffe's ``shape_string``: ``'64 1 28 28 (50176)'``; a scalar is ``'(1)'``."""
        return "".join(f"{d} " for d in self._shape) + f"({self._count})"

    def canonical_axis_index(self, axis: int) -> int:
        n = len(self._shape)
        if not -n <= axis < max(n, 1):
            raise CctError(f"axis {axis} out of range for a {n}-D blob with shape {self.shape_string()}")
        return axis + n if axis < 0 else axis

    def count_range(self, start: int, end: int | None = None) -> int:
        """Product of dims ``start..end-1`` (Caffe's ``count(start, end)``)."""
        c = 1
        for d in self._shape[start:end]:
            c *= d
        return c

    # legacy 4-D accessors (pycaffe's num/channels/height/width)
    def _legacy(self, i: int) -> int:
        if len(self._shape) > 4:
            raise CctError(f"legacy accessor used on a {len(self._shape)}-D blob")
        return self._shape[i] if i < len(self._shape) else 1

    @property
    def num(self) -> int:
        return self._legacy(0)

    @property
    def channels(self) -> int:
        return self._legacy(1)

    @property
    def height(self) -> int:
        return self._legacy(2)

    @property
    def width(self) -> int:
        return self._legacy(3)

    # ---- memory ------------------------------------------------------------------------------
    @property
    def data(self) -> Any:
        """The data as an array of the blob's shape (a live view: writes go into the blob)."""
        data = self._data
        if data is None:
            with _ALLOC_LOCK:
                if self._data_buf is None:
                    self._data_buf = _Buffer(self.xp, self._count, self.dtype)
                data = self._data = self._data_buf.array[: self._count].reshape(self._shape)
        if self._data_buf.tracked:  # type: ignore[union-attr]
            self._data_buf.host_access()  # type: ignore[union-attr]
        return data

    @property
    def diff(self) -> Any:
        """The gradient, same shape as ``data`` (a live view)."""
        diff = self._diff
        if diff is None:
            with _ALLOC_LOCK:
                if self._diff_buf is None:
                    self._diff_buf = _Buffer(self.xp, self._count, self.dtype)
                diff = self._diff = self._diff_buf.array[: self._count].reshape(self._shape)
        if self._diff_buf.tracked:  # type: ignore[union-attr]
            self._diff_buf.host_access()  # type: ignore[union-attr]
        return diff

    def buffer(self, what: str = "data") -> _Buffer:
        """The buffer behind ``data`` or ``diff`` (allocated if need be), without counting as an access of it
        (for executors that keep a device copy of it: :class:`_Buffer`)."""
        attr = "_data_buf" if what == "data" else "_diff_buf"
        buf = getattr(self, attr)
        if buf is None:
            with _ALLOC_LOCK:
                buf = getattr(self, attr)
                if buf is None:
                    buf = _Buffer(self.xp, self._count, self.dtype)
                    setattr(self, attr, buf)
        return buf

    def allocated_buffer(self, what: str = "data") -> _Buffer | None:
        """The buffer behind ``data`` or ``diff`` if there is one yet (None: not allocated; nothing allocated
        here): blobs that share memory return the same object."""
        return self._data_buf if what == "data" else self._diff_buf

    def set_buffer(self, what: str, buf: _Buffer) -> None:
        """Use ``buf`` (another blob's :meth:`buffer`, or an executor's device copy of one) for ``data`` or
        ``diff``; it must hold the blob's count."""
        if buf.array.size < self._count:
            raise CctError(f"cannot use a buffer of {buf.array.size} values for a blob of {self._count}")
        if what == "data":
            self._data_buf, self._data = buf, None
        else:
            self._diff_buf, self._diff = buf, None

    def share_data(self, other: Blob) -> None:
        """Use ``other``'s data memory (counts must match)."""
        if other.count != self._count:
            raise CctError(f"cannot share data: count {other.count} != {self._count}")
        self._data_buf = other.buffer("data")
        self._data = None

    def share_diff(self, other: Blob) -> None:
        """Use ``other``'s diff memory (counts must match)."""
        if other.count != self._count:
            raise CctError(f"cannot share diff: count {other.count} != {self._count}")
        self._diff_buf = other.buffer("diff")
        self._diff = None

    def shares_data_with(self, other: Blob) -> bool:
        return self._data_buf is not None and self._data_buf is other._data_buf

    def shares_diff_with(self, other: Blob) -> bool:
        return self._diff_buf is not None and self._diff_buf is other._diff_buf

    def set_data(self, values: Any) -> None:
        """Copy ``values`` (broadcastable) into data."""
        self.data[...] = values

    def set_diff(self, values: Any) -> None:
        self.diff[...] = values

    def update(self) -> None:
        """``data -= diff`` (Caffe's ``Blob::Update``)."""
        data = self.data
        data -= self.diff

    def __repr__(self) -> str:
        return f"Blob({self.shape_string()})"

    @staticmethod
    def view_rows(parent: Blob, start: int, stop: int) -> RowView:
        """Rows ``[start, stop)`` of ``parent`` along axis 0 as a blob in the parent's memory (a sub-batch);
        see :class:`RowView`."""
        return RowView(parent, start, stop)


class RowView(Blob):
    """Rows ``[start, stop)`` of a parent blob along axis 0, living in the parent's memory: a sub-batch.

    ``data``/``diff`` re-slice the parent's current arrays at every access, so the view stays valid when the
    parent reshapes or reallocates.  The view's own shape is what a layer gives it (``reshape``); it must be
    ``(stop - start,) + parent.shape[1:]`` by the time memory is touched, else a CctError.  Memory sharing
    is the parents' business: ``share_data``/``share_diff`` on a view only check that both views already
    see the same memory (Split tops share their bottom's once the whole-batch layer has reshaped them).
    """

    __slots__ = ("parent", "start", "stop", "_data_src", "_diff_src")

    def __init__(self, parent: Blob, start: int, stop: int):
        if parent.num_axes == 0 or not 0 <= start <= stop <= parent.shape[0]:
            raise CctError(f"rows [{start}, {stop}) are not inside blob {parent.shape_string()}")
        self.parent, self.start, self.stop = parent, start, stop
        self._data_src: Any = None
        self._diff_src: Any = None
        super().__init__((stop - start,) + parent.shape[1:], xp=parent.xp, dtype=parent.dtype)

    def _rows(self, whole: Any) -> Any:
        p = self.parent
        if p.num_axes == 0 or self.stop > p.shape[0] or self._count != (self.stop - self.start) * p.count_range(1):
            raise CctError(f"rows [{self.start}, {self.stop}) of blob {p.shape_string()} cannot be seen as "
                           f"{self.shape_string()}")
        return whole[self.start:self.stop].reshape(self._shape)

    @property
    def data(self) -> Any:
        whole = self.parent.data
        if self._data is None or self._data_src is not whole:
            self._data, self._data_src = self._rows(whole), whole
        return self._data

    @property
    def diff(self) -> Any:
        whole = self.parent.diff
        if self._diff is None or self._diff_src is not whole:
            self._diff, self._diff_src = self._rows(whole), whole
        return self._diff

    def _check_same(self, mine: Any, theirs: Any, what: str) -> None:
        from cct.device.backend import data_pointer

        if mine.shape != theirs.shape or data_pointer(mine) != data_pointer(theirs):
            raise CctError(f"cannot share {what} between sub-batch views that do not already coincide "
                           f"({self.shape_string()})")

    def share_data(self, other: Blob) -> None:
        self._check_same(self.data, other.data, "data")

    def share_diff(self, other: Blob) -> None:
        self._check_same(self.diff, other.diff, "diff")

    def shares_data_with(self, other: Blob) -> bool:
        from cct.device.backend import data_pointer

        return other.count == self._count and data_pointer(self.data) == data_pointer(other.data)

    def __repr__(self) -> str:
        return f"RowView({self.shape_string()} = rows {self.start}:{self.stop} of {self.parent!r})"


class BlobVec(list):
    """A layer's list of parameter blobs; ``add_blob(*shape)`` as in pycaffe's ``layer.blobs``."""

    def add_blob(self, *shape: int) -> Blob:
        b = Blob(shape)
        self.append(b)
        return b


def shape_equals_legacy(proto_dims: Sequence[int], shape: Sequence[int]) -> bool:
    """Caffe's ``ShapeEquals`` for a legacy (num, channels, height, width) proto: the target shape,
    right-aligned and left-padded with 1s to 4 axes, must equal the four legacy dims."""
    if len(shape) > 4:
        return False
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    return padded == tuple(proto_dims)


def blob_from_proto(proto: Any, blob: Blob | None = None, reshape: bool = True) -> Blob:
    """Caffe's ``Blob::FromProto``: shape from legacy num/channels/height/width if any is set, else
    ``shape.dim``; data from ``double_data`` if present else ``data``; diff likewise if present."""
    legacy = any(proto.HasField(f) for f in ("num", "channels", "height", "width"))
    shape = (proto.num, proto.channels, proto.height, proto.width) if legacy else tuple(proto.shape.dim)
    if blob is None:
        blob = Blob(shape)
    elif reshape:
        blob.reshape(shape)
    count = blob.count
    src = proto.double_data if len(proto.double_data) else proto.data
    if len(src) != count:
        raise CctError(f"blob proto has {len(src)} values for shape {shape} (count {count})")
    blob.data[...] = blob.xp.asarray(np.fromiter(src, dtype=np.float64 if src is proto.double_data
                                                  else np.float32, count=count).reshape(blob.shape))
    diff = proto.double_diff if len(proto.double_diff) else proto.diff
    if len(diff):
        if len(diff) != count:
            raise CctError(f"blob proto has {len(diff)} diff values for shape {shape} (count {count})")
        blob.diff[...] = blob.xp.asarray(np.fromiter(diff, dtype=np.float64 if diff is proto.double_diff
                                                      else np.float32, count=count).reshape(blob.shape))
    return blob


def proto_shape(proto: Any) -> tuple[int, ...]:
    """The shape a BlobProto describes (legacy 4-D or ``shape.dim``)."""
    if any(proto.HasField(f) for f in ("num", "channels", "height", "width")):
        return (proto.num, proto.channels, proto.height, proto.width)
    return tuple(proto.shape.dim)


def blob_to_proto(blob: Blob, proto: Any, write_diff: bool = False) -> Any:
    """Caffe's ``Blob::ToProto``: ``shape.dim`` + float ``data`` (+ ``diff``)."""
    from cct.device import to_host
    from cct.io.wire import packed_floats

    proto.Clear()
    proto.shape.dim.extend(blob.shape)
    # Packed floats go in as raw bytes: parsing them is a memcpy, while extend() converts one by one.
    proto.MergeFromString(packed_floats(5, to_host(blob.data)))
    if write_diff:
        proto.MergeFromString(packed_floats(6, to_host(blob.diff)))
    return proto
