"""HDF5 weights (.caffemodel.h5) and solver states (.solverstate.h5) in Caffe's layout.

Weights (``Net::ToHDF5``)::

    /data/<layer name>/<param index>   float32 dataset of the blob's shape (one group per layer, also
                                       for layers without params; weight-shared copies not written)
    /diff/<layer name>/<param index>   the gradients, all params (only when diffs are written)

Solver state (``SGDSolver::SnapshotSolverStateToHDF5``)::

    /iter          int32, shape (1,)
    /learned_net   string (fixed length, NUL-terminated, as H5LTmake_dataset_string writes it)
    /current_step  int32, shape (1,)
    /history/<i>   float32 dataset of the i-th history blob's shape

h5py is optional: it is imported only when an HDF5 file is actually used.  Writes are atomic.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cct.errors import CctError
from cct.io.weights import atomic_write_path
from cct.proto import caffe_pb2

LayerArrays = Sequence[tuple[str, Sequence["np.ndarray | None"]]]


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise CctError("HDF5 files need h5py: pip install 'cct[hdf5]'") from None
    return h5py


def _open_read(path: str | os.PathLike[str]) -> Any:
    h5py = _h5py()
    source = os.fspath(path)
    if not os.path.exists(source):
        raise CctError(f"Could not open file {source}")
    try:
        return h5py.File(source, "r")
    except OSError as e:
        raise CctError(f"{source}: could not open as an HDF5 file ({e})") from None


def _float32(a: Any) -> np.ndarray:
    from cct.device import to_host

    return np.ascontiguousarray(to_host(a), dtype=np.float32)


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------

def write_hdf5_weights(path: str | os.PathLike[str], layers: LayerArrays,
                       diffs: LayerArrays | None = None) -> None:
    """Write ``layers`` = ``[(layer_name, [param arrays])]`` in net order as ``/data/<layer>/<i>``.

    A ``None`` entry is a param that is not written (a weight-shared copy; Caffe writes owners only).
    ``diffs``, if given, has the same form and goes to ``/diff/<layer>/<i>``.  Layer names must be
    unique (an HDF5 group per layer)."""
    h5py = _h5py()
    source = os.fspath(path)

    def write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            _write_groups(f.create_group("data"), layers, source)
            if diffs is not None:
                _write_groups(f.create_group("diff"), diffs, source)

    atomic_write_path(path, write)


def _write_groups(root: Any, layers: LayerArrays, source: str) -> None:
    seen: set[str] = set()
    for name, arrays in layers:
        if name in seen:
            raise CctError(f"{source}: layer name '{name}' appears twice; HDF5 weights need unique "
                           "layer names")
        seen.add(name)
        group = root.create_group(name)
        for i, a in enumerate(arrays):
            if a is not None:
                group.create_dataset(str(i), data=_float32(a))


def read_hdf5_weights(path: str | os.PathLike[str], group: str = "data"
                      ) -> dict[str, dict[int, np.ndarray]]:
    """``{layer_name: {param_index: float32 array}}`` from ``/data`` (or ``group="diff"``).

    Layers appear in the file's order; a layer with no params maps to ``{}``.  Layer names
    containing ``/`` (nested groups) are read back whole."""
    source = os.fspath(path)
    with _open_read(path) as f:
        if group not in f:
            raise CctError(f"{source}: no '/{group}' group; not a Caffe HDF5 weights file")
        out: dict[str, dict[int, np.ndarray]] = {}
        _read_groups(f[group], "", out, source)
        return out


def _read_groups(g: Any, prefix: str, out: dict[str, dict[int, np.ndarray]], source: str) -> None:
    h5py = _h5py()
    params: dict[int, np.ndarray] = {}
    subgroups = []
    for key, item in g.items():
        if isinstance(item, h5py.Dataset):
            if not key.isdigit():
                raise CctError(f"{source}: dataset '{item.name}' is not named by a param index")
            params[int(key)] = np.asarray(item[()], dtype=np.float32)
        else:
            subgroups.append((key, item))
    if prefix and (params or not subgroups):
        out[prefix] = dict(sorted(params.items()))
    for key, item in subgroups:
        _read_groups(item, f"{prefix}/{key}" if prefix else key, out, source)


# ------------------------------------------------------------------------------------------------
# Solver state
# ------------------------------------------------------------------------------------------------

def write_hdf5_solverstate(path: str | os.PathLike[str], iter: int, learned_net: str, current_step: int,
                           history: Sequence[Any], resume_state: bytes = b"") -> None:
    """Write a solver state in Caffe's HDF5 layout (see the module docstring); ``resume_state`` (cct's
    data cursors and random streams) goes in the root attribute ``cct_resume_state``, which Caffe ignores."""
    h5py = _h5py()

    def write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("iter", data=np.array([iter], dtype=np.int32))
            _write_c_string(h5py, f, "learned_net", learned_net)
            f.create_dataset("current_step", data=np.array([current_step], dtype=np.int32))
            hist = f.create_group("history")
            for i, a in enumerate(history):
                hist.create_dataset(str(i), data=_float32(a))
            if resume_state:
                f.attrs["cct_resume_state"] = np.void(resume_state)

    atomic_write_path(path, write)


def _write_c_string(h5py: Any, f: Any, name: str, value: str) -> None:
    """A scalar fixed-length NUL-terminated string dataset (what Caffe's reader expects)."""
    raw = value.encode("utf-8") + b"\0"
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(len(raw))
    tid.set_strpad(h5py.h5t.STR_NULLTERM)
    space = h5py.h5s.create(h5py.h5s.SCALAR)
    ds = h5py.h5d.create(f.id, name.encode(), tid, space)
    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(raw, dtype=f"S{len(raw)}"))


def _read_int(f: Any, name: str, source: str) -> int:
    if name not in f:
        raise CctError(f"{source}: no '{name}' dataset; not a Caffe HDF5 solver state")
    return int(np.asarray(f[name][()]).reshape(-1)[0])


def _read_string(value: Any) -> str:
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0]
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode("utf-8", "replace")
    return str(value).split("\0", 1)[0]


def read_hdf5_solverstate(path: str | os.PathLike[str]) -> caffe_pb2.SolverState:
    """A ``.solverstate.h5`` as a ``SolverState`` message, so that solvers restore both formats the
    same way: ``iter``, ``learned_net`` (only if present, as Caffe), ``current_step`` and one
    ``history`` BlobProto (``shape`` + float ``data``) per ``/history/<i>``, in index order."""
    from cct.blob import Blob, blob_to_proto

    source = os.fspath(path)
    state = caffe_pb2.SolverState()
    with _open_read(path) as f:
        state.iter = _read_int(f, "iter", source)
        if "learned_net" in f:
            state.learned_net = _read_string(f["learned_net"][()])
        state.current_step = _read_int(f, "current_step", source)
        if "history" not in f:
            raise CctError(f"{source}: no '/history' group; not a Caffe HDF5 solver state")
        hist = f["history"]
        for i in range(len(hist)):
            if str(i) not in hist:
                raise CctError(f"{source}: history has {len(hist)} entries but no '/history/{i}'")
            a = np.asarray(hist[str(i)][()], dtype=np.float32)
            blob = Blob(a.shape, dtype=np.float32)
            blob.data[...] = a
            blob_to_proto(blob, state.history.add())
        if "cct_resume_state" in f.attrs:
            state.cct_resume_state = bytes(f.attrs["cct_resume_state"])
    return state


__all__ = ["write_hdf5_weights", "read_hdf5_weights", "write_hdf5_solverstate", "read_hdf5_solverstate"]
