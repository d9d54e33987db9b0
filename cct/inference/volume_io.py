"""Volumes in and out of sliding-window inference, one patch at a time.

Readers (:func:`open_volume`): HDF5 (``path.h5`` with one dataset, or ``path.h5:dataset``; h5py, read lazily
by hyperslab), NumPy ``.npy`` (memory-mapped per read), multi-page TIFF (one page per z slice; Pillow, only the pages
a patch needs are decoded), PNG/JPEG/BMP images for 2-D nets (Pillow; RGB as 3 channels), or an array.  A
volume is ``(C, *spatial)`` or, for one channel, ``(*spatial)``; any dtype.  :meth:`Volume.read` returns a
float32 box ``(C, *size)`` — ``(x - mean) · scale`` when a transform is given, as Caffe's data transformer —
with zeros beyond the volume, or with the volume mirrored about its edges (``pad="mirror"``, numpy's
``reflect``: the edge voxel is not repeated).

Writer (:class:`HDF5Writer`): dataset ``output`` of shape ``(C_out, *spatial)`` float32, chunked, written tile by
tile (only the current tile is in memory), into a temporary file renamed over the output when complete.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cct.errors import CctError

__all__ = ["HDF5Writer", "MemoryWriter", "Volume", "open_volume"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
TIFF_SUFFIXES = (".tif", ".tiff")


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise CctError("HDF5 volumes need h5py: pip install 'cct[hdf5]'") from None
    return h5py


class _Tiff:
    """A multi-page TIFF as a lazily read ``(Z, Y, X)`` array (``[z0:z1, y0:y1, x0:x1]`` slicing only)."""

    def __init__(self, path: str):
        from PIL import Image

        self.path = path
        self.image = Image.open(path)
        self.pages = getattr(self.image, "n_frames", 1)
        first = np.asarray(self.image)
        if first.ndim != 2:
            raise CctError(f"{path}: TIFF pages of shape {first.shape}; cct infer reads single-channel pages")
        self.shape = (self.pages,) + first.shape
        self.dtype = first.dtype
        self.ndim = 3

    def __getitem__(self, key: tuple[slice, ...]) -> np.ndarray:
        zs, rest = key[0], key[1:]
        out = []
        for z in range(*zs.indices(self.pages)):
            self.image.seek(z)
            out.append(np.asarray(self.image)[rest])
        return np.stack(out) if out else np.empty((0,) + self.shape[1:], dtype=self.dtype)

    def close(self) -> None:
        self.image.close()


class _Npy:
    """A ``.npy`` file read box by box through a memory map opened for each read and closed after it: the
    pages a read touches leave the process's resident set with the map (a map kept open would count every
    page ever read: a volume larger than memory would show as resident)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            self.offset = f.tell()
        if dtype.hasobject:
            raise CctError(f"{path}: a .npy of Python objects is not a volume")
        self.path, self.shape, self.dtype, self.order = path, tuple(shape), dtype, "F" if fortran else "C"
        self.ndim = len(self.shape)

    def __getitem__(self, key: Any) -> np.ndarray:
        import mmap

        count = math.prod(self.shape)
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            whole = np.frombuffer(m, dtype=self.dtype, count=count, offset=self.offset)
            box = np.array(whole.reshape(self.shape, order=self.order)[key])
            del whole
        return box


class Volume:
    """A source volume ``(C, *spatial)`` (see the module docstring); ``pad`` "mirror" makes it ``F - 1``
    larger per axis (``before`` voxels ahead), so that the valid output has the input's size."""

    def __init__(self, array: Any, channels_axis: bool, source: str = "<array>", closer: Any = None):
        self.array = array
        self.channels_axis = channels_axis
        self.source = source
        self._closer = closer
        shape = tuple(int(v) for v in array.shape)
        self.channels = shape[0] if channels_axis else 1
        self.spatial = shape[1:] if channels_axis else shape
        self.dtype = np.dtype(array.dtype)
        self.mean: np.ndarray | None = None
        self.scale = 1.0
        self.before: tuple[int, ...] = (0,) * len(self.spatial)
        self.after: tuple[int, ...] = (0,) * len(self.spatial)
        self.mirror = False

    @property
    def padded(self) -> tuple[int, ...]:
        """The spatial size the net sees (the volume plus any mirror padding)."""
        return tuple(s + b + a for s, b, a in zip(self.spatial, self.before, self.after))

    def set_transform(self, mean: Sequence[float] | None = None, scale: float = 1.0) -> None:
        """``(x - mean[c]) · scale`` per channel (one mean for all, or one per channel)."""
        if mean is not None and len(mean):
            m = np.asarray(mean, dtype=np.float32).reshape(-1)
            if m.size not in (1, self.channels):
                raise CctError(f"-input_mean: {m.size} values for a volume of {self.channels} channels")
            self.mean = np.broadcast_to(m, (self.channels,)).copy()
        self.scale = float(scale)

    def set_mirror(self, fov: Sequence[int]) -> None:
        """Mirror-pad by ``(F-1)//2`` ahead and the rest behind on every axis."""
        self.before = tuple((f - 1) // 2 for f in fov)
        self.after = tuple(f - 1 - b for f, b in zip(fov, self.before))
        self.mirror = True

    def read(self, start: Sequence[int], size: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """The float32 box ``(C, *size)`` whose first voxel is ``start`` (padded coordinates); zeros beyond."""
        size = tuple(int(v) for v in size)
        if out is None:
            out = np.empty((self.channels,) + size, dtype=np.float32)
        box, take, inside = [], [], []
        for a, (s, n) in enumerate(zip(start, size)):
            pos = np.arange(s, s + n)
            valid = pos < self.padded[a]
            src = pos[valid] - self.before[a]
            if self.mirror:
                src = _reflect(src, self.spatial[a])
            inside.append(int(valid.sum()))
            if src.size == 0:
                box.append(slice(0, 0))
                take.append(src)
                continue
            lo, hi = int(src.min()), int(src.max()) + 1
            box.append(slice(lo, hi))
            take.append(src - lo)
        region = tuple(slice(0, k) for k in inside)
        if any(k < n for k, n in zip(inside, size)):
            out.fill(0)
        if all(k > 0 for k in inside):
            key = ((slice(None),) if self.channels_axis else ()) + tuple(box)
            block = np.asarray(self.array[key])
            if not self.channels_axis:
                block = block[None]
            for a, t in enumerate(take):
                if t.size != block.shape[1 + a] or np.any(t != np.arange(t.size)):
                    block = np.take(block, t, axis=1 + a)
            dst = out[(slice(None),) + region]
            np.copyto(dst, block, casting="unsafe")
            if self.mean is not None:
                dst -= self.mean.reshape((-1,) + (1,) * len(size))
            if self.scale != 1.0:
                dst *= np.float32(self.scale)
        return out

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None


def _reflect(i: np.ndarray, n: int) -> np.ndarray:
    """numpy's ``reflect`` padding: indices mirrored about 0 and ``n - 1`` (period ``2(n-1)``)."""
    if n == 1:
        return np.zeros_like(i)
    period = 2 * (n - 1)
    i = np.mod(i, period)
    return np.where(i >= n, period - i, i)


def _split_dataset(path: str) -> tuple[str, str | None]:
    if os.path.exists(path):
        return path, None
    head, sep, tail = path.rpartition(":")
    if sep and head and os.path.exists(head):
        return head, tail
    return path, None


def open_volume(source: Any, num_spatial: int, channels: int) -> Volume:
    """The volume at ``source`` (a path as in the module docstring, or an array) for a net with
    ``num_spatial`` spatial axes and ``channels`` input channels; a one-line CctError otherwise."""
    closer = None
    if isinstance(source, (str, os.PathLike)):
        path, dataset = _split_dataset(os.fspath(source))
        label = os.fspath(source)
        if not os.path.exists(path):
            raise CctError(f"{label}: input volume not found")
        low = path.lower()
        if low.endswith(".npy"):
            try:
                array = _Npy(path)
            except (ValueError, OSError) as e:
                raise CctError(f"{label}: not a readable .npy file ({e})") from None
        elif low.endswith(TIFF_SUFFIXES):
            array = _Tiff(path)
            closer = array.close
        elif low.endswith(IMAGE_SUFFIXES):
            from PIL import Image

            with Image.open(path) as im:
                a = np.asarray(im)
            array = a if a.ndim == 2 else np.moveaxis(a, -1, 0)
        else:
            from cct.io.weights import is_hdf5

            if not is_hdf5(path):
                raise CctError(f"{label}: unknown volume format (expected .h5, .npy, .tif or an image)")
            h5py = _h5py()
            f = h5py.File(path, "r")
            closer = f.close
            if dataset is None:
                names: list[str] = []
                f.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
                if len(names) != 1:
                    f.close()
                    raise CctError(f"{label}: {len(names)} datasets ({', '.join(names[:6])}); name one as "
                                   f"{path}:DATASET")
                dataset = names[0]
            if dataset not in f or not isinstance(f[dataset], h5py.Dataset):
                f.close()
                raise CctError(f"{label}: no dataset '{dataset}'")
            array = f[dataset]
    else:
        array, label = np.asarray(source) if not hasattr(source, "shape") else source, "<array>"
    nd = len(array.shape)
    if nd == num_spatial + 1:
        if int(array.shape[0]) != channels:
            raise CctError(f"{label}: volume of shape {tuple(array.shape)} has {array.shape[0]} channels; the "
                           f"net takes {channels} (shape (C, *spatial) or, for one channel, (*spatial))")
        return Volume(array, True, label, closer)
    if nd == num_spatial and channels == 1:
        return Volume(array, False, label, closer)
    if closer is not None:
        closer()
    raise CctError(f"{label}: volume of shape {tuple(array.shape)} does not fit a net with {num_spatial} "
                   f"spatial axes and {channels} channel(s): expected ({'C, ' if channels else ''}"
                   f"{', '.join('ZYX'[3 - num_spatial:] if num_spatial <= 3 else ['d'] * num_spatial)})")


class HDF5Writer:
    """The dense output as HDF5 dataset ``output`` ``(C, *spatial)`` float32, written region by region into
    ``path + ".partial"`` and renamed to ``path`` by :meth:`close` (an interrupted run leaves no output
    that looks complete).  ``attrs`` are stored on the dataset."""

    def __init__(self, path: str | os.PathLike[str], shape: Sequence[int], attrs: dict[str, Any] | None = None,
                 chunk: Sequence[int] | None = None):
        h5py = _h5py()
        self.path = os.fspath(path)
        self.tmp = self.path + ".partial"
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise CctError(f"{self.path}: the output directory {parent} does not exist")
        try:
            self.file = h5py.File(self.tmp, "w")
        except OSError as e:
            raise CctError(f"{self.path}: cannot write ({e})") from None
        shape = tuple(int(v) for v in shape)
        chunks = (1,) + chunk_shape(shape[1:], chunk or (64,) * (len(shape) - 1))
        self.dataset = self.file.create_dataset("output", shape=shape, dtype="float32", chunks=chunks)
        for k, v in (attrs or {}).items():
            self.dataset.attrs[k] = v
        self.shape = shape

    def write(self, start: Sequence[int], block: np.ndarray) -> None:
        """``output[:, start : start + block.shape[1:]] = block``."""
        key = (slice(None),) + tuple(slice(s, s + n) for s, n in zip(start, block.shape[1:]))
        self.dataset[key] = np.ascontiguousarray(block)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            try:
                os.remove(self.tmp)
            except OSError:
                pass


def chunk_shape(spatial: Sequence[int], tile: Sequence[int], limit: int = 4 << 20) -> tuple[int, ...]:
    """HDF5 chunks for tiles of ``tile``: the tile itself (each tile write then fills whole chunks: no chunk is
    read back and rewritten, and a few large chunks keep HDF5's index small), its longest axis halved until a
    chunk is at most ``limit`` bytes of float32; clipped to the output."""
    c = [max(1, min(int(t), int(s))) for t, s in zip(tile, spatial)]
    while 4 * math.prod(c) > limit and max(c) > 1:
        a = c.index(max(c))
        c[a] = -(-c[a] // 2)
    return tuple(c)


class MemoryWriter:
    """The dense output in memory (``array``), counting how often each voxel is written (``counts``)."""

    def __init__(self, shape: Sequence[int]):
        self.array = np.full(tuple(shape), np.nan, dtype=np.float32)
        self.counts = np.zeros(tuple(shape[1:]), dtype=np.int32)

    def write(self, start: Sequence[int], block: np.ndarray) -> None:
        key = tuple(slice(s, s + n) for s, n in zip(start, block.shape[1:]))
        self.array[(slice(None),) + key] = block
        self.counts[key] += 1

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def volume_bytes(shape: Sequence[int], itemsize: int) -> int:
    return int(math.prod(shape)) * itemsize
