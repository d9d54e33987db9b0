"""``HDF5Data`` and ``HDF5Output`` (Caffe's ``hdf5_data_layer.cpp``, ``hdf5_output_layer.cpp``).

HDF5Data: ``hdf5_data_param.source`` is a text file listing HDF5 files (whitespace-separated; relative
paths are taken from the working directory, as Caffe does).  Each top reads the dataset named like the
top from every file, as float32 (integer datasets are converted), N-D; all tops of a file must have
the same number of rows.  Top ``i`` has shape ``(batch_size,) + dataset.shape[1:]``.  Rows are served
in order across files, loading the next file when one is exhausted and wrapping at the end; with
``shuffle`` the file order is permuted at setup and at every wrap, and the rows of each loaded file
(again at every reuse of a file).  No transformation (``transform_param`` is refused).

HDF5Output: writes its two bottoms to ``hdf5_output_param.file_name`` as datasets ``data`` and
``label``, with Caffe's legacy 4-D shapes ``(num, channels, height, width)``.  The file is created
(truncated) at setup and rewritten by each forward.

h5py is imported only when one of these layers is set up (``pip install 'cct[hdf5]'``).
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from cct import log, mode
from cct.blob import Blob
from cct.errors import CctError, ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb
from cct.rng import get_rng


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise CctError("HDF5 layers need h5py: pip install 'cct[hdf5]'") from None
    return h5py


def _legacy_shape(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    if len(shape) > 4:
        raise CctError(f"HDF5Output writes legacy 4-D blobs; got a {len(shape)}-D blob {shape}")
    return tuple(shape[i] if i < len(shape) else 1 for i in range(4))  # type: ignore[return-value]


@register("HDF5Data")
class HDF5DataLayer(Layer):
    """Caffe's ``HDF5Data``: rows of float datasets named by the tops."""

    exact_num_bottom = 0
    min_top = 1

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        if self.layer_param.HasField("transform_param"):
            raise ParamError("transform_param", f"{self.type} does not transform data.")
        p = self.layer_param.hdf5_data_param
        self._h5py = _h5py()
        source = p.source
        log.info("Loading list of HDF5 filenames from: %s", source)
        try:
            with open(source, encoding="utf-8") as f:
                self.files = f.read().split()
        except OSError as e:
            raise CctError(f"hdf5_data_param.source: Failed to open source file: {source} ({e.strerror})") \
                from None
        log.info("Number of HDF5 files: %d", len(self.files))
        if not self.files:
            raise CctError(f"hdf5_data_param.source: Must have at least 1 HDF5 filename listed in {source}")
        if p.batch_size <= 0:
            raise ParamError("hdf5_data_param.batch_size", "a positive batch_size is required")
        self.source = source
        self.batch_size = int(p.batch_size)
        self.shuffle = bool(p.shuffle)
        self.names = list(self.layer_param.top)
        self.file_order = np.arange(len(self.files))
        if self.shuffle:
            self._rng = np.random.default_rng(int(get_rng().integers(1 << 63)))
            self._rng.shuffle(self.file_order)
        self.current_file = 0
        self._load(self.files[self.file_order[0]])
        self.current_row = 0
        self.offset = 0
        size, rank = mode.solver_count(), mode.solver_rank()
        self.shard = (size, rank) if self.phase == pb.TRAIN and size > 1 else None
        for t, arr in zip(top, self.arrays):
            t.reshape((self.batch_size,) + arr.shape[1:])

    def _load(self, path: str) -> None:
        try:
            f = self._h5py.File(path, "r")
        except OSError as e:
            raise CctError(f"{self.source}: Failed opening HDF5 file: {path} ({e})") from None
        with f:
            arrays = []
            for name in self.names:
                if name not in f or not isinstance(f[name], self._h5py.Dataset):
                    raise CctError(f"{path}: Failed to find HDF5 dataset {name} (named by a top of layer "
                                   f"'{self.name}')")
                ds = f[name]
                if ds.dtype.kind not in "fiub":
                    raise CctError(f"{path}: dataset {name} has type {ds.dtype}; a number type is required")
                if ds.ndim < 1:
                    raise CctError(f"{path}: dataset {name} must have at least 1 axis")
                arrays.append(np.asarray(ds[()], dtype=np.float32))
        num = arrays[0].shape[0]
        for name, a in zip(self.names, arrays):
            if a.shape[0] != num:
                raise CctError(f"{path}: dataset {name} has {a.shape[0]} rows, {self.names[0]} has {num}")
            if hasattr(self, "arrays") and a.shape[1:] != self.arrays[self.names.index(name)].shape[1:]:
                raise CctError(f"{path}: dataset {name} has rows of shape {a.shape[1:]}, earlier files "
                               f"{self.arrays[self.names.index(name)].shape[1:]}")
        if num == 0:
            raise CctError(f"{path}: the datasets are empty")
        self.arrays = arrays
        self.rows = np.arange(num)
        if self.shuffle:
            self._rng.shuffle(self.rows)

    def _next(self) -> None:
        self.current_row += 1
        if self.current_row == self.arrays[0].shape[0]:
            if len(self.files) > 1:
                self.current_file += 1
                if self.current_file == len(self.files):
                    self.current_file = 0
                    if self.shuffle:
                        self._rng.shuffle(self.file_order)
                self._load(self.files[self.file_order[self.current_file]])
            elif self.shuffle:
                self._rng.shuffle(self.rows)
            self.current_row = 0
        self.offset += 1

    def resume_state(self) -> dict:
        """The file and row cursors, the shuffled orders and the shuffling stream."""
        return {"current_file": self.current_file, "current_row": self.current_row, "offset": self.offset,
                "file_order": self.file_order.tolist(), "rows": self.rows.tolist() if self.shuffle else None,
                "rng": self._rng.bit_generator.state if self.shuffle else None}

    def restore_resume_state(self, state: dict) -> None:
        try:
            file_order = np.asarray(state["file_order"], dtype=np.int64)
            current = int(state["current_file"])
            if sorted(file_order.tolist()) != list(range(len(self.files))) or not 0 <= current < len(self.files):
                raise ValueError(f"the saved file order does not fit the {len(self.files)} listed files")
            self.file_order = file_order
            self.current_file = current
            self._load(self.files[self.file_order[current]])
            if self.shuffle:
                rows = np.asarray(state["rows"], dtype=np.int64)
                if rows.shape != self.rows.shape:
                    raise ValueError(f"{rows.size} saved rows for a file of {self.rows.size}")
                self.rows = rows
                self._rng.bit_generator.state = state["rng"]
            row = int(state["current_row"])
            if not 0 <= row < self.rows.size:
                raise ValueError(f"row {row} is outside the file's {self.rows.size} rows")
            self.current_row, self.offset = row, int(state["offset"])
        except (KeyError, TypeError, ValueError) as e:
            raise CctError(f"layer '{self.name}' ({self.type}): its resume state does not fit the layer "
                           f"({type(e).__name__}: {e})") from None

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        """Nothing: the shapes are fixed at setup."""

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        outs = [np.empty((self.batch_size,) + a.shape[1:], dtype=np.float32) for a in self.arrays]
        for i in range(self.batch_size):
            if self.shard is not None:
                while self.offset % self.shard[0] != self.shard[1]:
                    self._next()
            row = self.rows[self.current_row]
            for out, a in zip(outs, self.arrays):
                out[i] = a[row]
            self._next()
        for t, out in zip(top, outs):
            t.reshape(out.shape)
            t.data[...] = t.xp.asarray(out)


@register("HDF5Output")
class HDF5OutputLayer(Layer):
    """Caffe's ``HDF5Output``: saves bottoms ``data`` and ``label`` to an HDF5 file."""

    exact_num_bottom = 2
    exact_num_top = 0

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        h5py = _h5py()
        self.file_name = self.layer_param.hdf5_output_param.file_name
        if not self.file_name:
            raise ParamError("hdf5_output_param.file_name", "an output file name is required")
        try:
            self._file = h5py.File(self.file_name, "w")
        except OSError as e:
            raise CctError(f"hdf5_output_param.file_name: Failed to open HDF5 file {self.file_name} ({e})") \
                from None
        weakref.finalize(self, self._file.close)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        """Nothing to size: the layer has no tops."""

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        from cct.device import to_host

        data_shape, label_shape = _legacy_shape(bottom[0].shape), _legacy_shape(bottom[1].shape)
        if data_shape[0] != label_shape[0]:
            raise CctError(f"layer '{self.name}' (HDF5Output): data blob and label blob must have the same "
                           f"batch size ({data_shape[0]} vs {label_shape[0]})")
        log.info("Saving HDF5 file %s", self.file_name)
        for name, blob, shape in (("data", bottom[0], data_shape), ("label", bottom[1], label_shape)):
            if name in self._file:
                del self._file[name]
            values = np.asarray(to_host(blob.data), dtype=np.float32).reshape(shape)
            self._file.create_dataset(name, data=values)
        self._file.flush()
        log.info("Successfully saved %d rows", data_shape[0])

    def backward(self, top: list[Blob], propagate_down, bottom: list[Blob]) -> None:
        """Nothing to propagate (Caffe's HDF5Output backward is a no-op)."""

    def close(self) -> None:
        self._file.close()
