"""pycaffe's ``caffe.io`` conversions between numpy arrays and BlobProto / Datum messages.

Same behaviour as pycaffe (``python/caffe/io.py``), written for numpy 2 (no ``tostring``/``fromstring``):

* ``blobproto_to_array(blob)`` reads a legacy 4-D blob (``num/channels/height/width`` set) as N×C×H×W and
  any other blob by ``shape.dim``; values come back as float64, as pycaffe returns them.
* ``array_to_blobproto(arr, diff=None)`` writes ``shape.dim`` and the values as floats (any rank).
* ``array_to_datum(arr, label=None)`` takes a C×H×W array: uint8 goes into the ``data`` bytes, anything else
  into ``float_data``; ``datum_to_array`` is the inverse (uint8 from ``data`` if present, else float64).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from cct.errors import CctError
from cct.proto import caffe_pb2


class ArrayShapeError(CctError, ValueError):
    """An array of the wrong rank for a conversion (a ValueError, as pycaffe's 'Incorrect array shape.')."""


def blobproto_to_array(blob: caffe_pb2.BlobProto, return_diff: bool = False) -> np.ndarray:
    """BlobProto → ndarray of its ``data`` (or ``diff`` if ``return_diff``), float64.

    Shape: ``(num, channels, height, width)`` if any legacy dimension field is set, else ``shape.dim``."""
    values = np.array(blob.diff if return_diff else blob.data, dtype=np.float64)
    if any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        return values.reshape(blob.num, blob.channels, blob.height, blob.width)
    return values.reshape(tuple(blob.shape.dim))


def array_to_blobproto(arr: np.ndarray, diff: np.ndarray | None = None) -> caffe_pb2.BlobProto:
    """ndarray (any rank) → BlobProto with ``shape.dim`` = ``arr.shape``, ``data`` = ``arr`` flattened
    (C order) and, if given, ``diff`` (assumed to have the same shape; not checked, as pycaffe)."""
    arr = np.asarray(arr)
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(int(d) for d in arr.shape)
    blob.data.extend(arr.astype(np.float64).ravel().tolist())
    if diff is not None:
        blob.diff.extend(np.asarray(diff).astype(np.float64).ravel().tolist())
    return blob


def arraylist_to_blobprotovector_str(arraylist: Iterable[np.ndarray]) -> bytes:
    """A list of arrays → serialized BlobProtoVector (bytes)."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(arr) for arr in arraylist)
    return vec.SerializeToString()


# pycaffe's own spelling of the name (with the typo), which scripts call.
arraylist_to_blobprotovecor_str = arraylist_to_blobprotovector_str


def blobprotovector_str_to_arraylist(serialized: bytes) -> list[np.ndarray]:
    """Serialized BlobProtoVector → list of arrays (see :func:`blobproto_to_array`)."""
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(serialized)
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr: np.ndarray, label: int | None = None) -> caffe_pb2.Datum:
    """C×H×W array → Datum.  uint8 arrays are stored as the ``data`` byte string, other dtypes as
    ``float_data``; ``label`` is set only when given."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ArrayShapeError("Incorrect array shape.")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = (int(d) for d in arr.shape)
    if arr.dtype == np.uint8:
        datum.data = np.ascontiguousarray(arr).tobytes()
    else:
        datum.float_data.extend(arr.astype(np.float64).ravel().tolist())
    if label is not None:
        datum.label = int(label)
    return datum


def datum_to_array(datum: caffe_pb2.Datum) -> np.ndarray:
    """Datum → C×H×W array: uint8 from ``data`` when it is non-empty, else float64 from ``float_data``.
    The label is not returned (read ``datum.label``)."""
    shape = (datum.channels, datum.height, datum.width)
    if len(datum.data):
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape).copy()
    return np.array(datum.float_data, dtype=np.float64).reshape(shape)
