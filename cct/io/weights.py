"""Binary protobuf files: .caffemodel, .binaryproto (mean files), .solverstate.

A binary file is one serialized message with no header (Caffe's ``ReadProtoFromBinaryFile`` /
``WriteProtoToBinaryFile``).  Python's protobuf has no 64 MB message limit, so big caffemodels read
as they do in Caffe (which raises the limit to INT_MAX).

Writes are atomic (:func:`atomic_write`): the bytes go to a temporary file in the destination's
directory, are flushed and fsynced, and the file is then renamed over the destination, so a crash or
an exception never leaves a half-written snapshot behind.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, TypeVar

from google.protobuf.message import DecodeError, Message

from cct.errors import CctError
from cct.io.upgrade import upgrade_net_as_needed
from cct.io.wire import WIRE_32BIT, WIRE_64BIT, WIRE_LEN, WIRE_VARINT, Malformed, Truncated, read_varint
from cct.proto import caffe_pb2

M = TypeVar("M", bound=Message)

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------
# Atomic writing
# ------------------------------------------------------------------------------------------------

def _make_temp(path: str) -> tuple[str, int]:
    """Create a new empty temporary file next to ``path``: (its path, an open write descriptor).
    Created with mode 0666 so that the umask applies, as for any new file."""
    directory = os.path.dirname(path) or "."
    base = os.path.basename(path)
    for attempt in range(1000):
        tmp = os.path.join(directory, f".{base}.{os.getpid()}.{attempt}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                                0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise CctError(f"Could not write file {path}: {e.strerror or e}") from None
    raise CctError(f"Could not write file {path}: could not create a temporary file in {directory}")


def _finish(tmp: str, path: str, body: Callable[[], None]) -> None:
    """Run ``body`` (which fills ``tmp``), then rename ``tmp`` over ``path``; on failure remove
    ``tmp`` and turn OS errors into :class:`CctError`."""
    try:
        body()
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CctError(f"Could not write file {path}: {e.strerror or e}") from None
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """Write a file atomically: ``write(f)`` fills a temporary file next to ``path``, which is then
    flushed, fsynced and renamed over ``path``.  On any exception the temporary file is removed and
    ``path`` is left as it was."""
    path = os.fspath(path)
    tmp, fd = _make_temp(path)

    def body() -> None:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())

    _finish(tmp, path, body)


def atomic_write_path(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Like :func:`atomic_write` for writers that open a file by name (h5py): ``write(tmp_path)``
    creates the content at ``tmp_path``, which is then fsynced and renamed over ``path``."""
    path = os.fspath(path)
    tmp, fd = _make_temp(path)
    os.close(fd)

    def body() -> None:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())

    _finish(tmp, path, body)


def _fsync_dir(directory: str) -> None:
    """Make the rename durable (POSIX); best effort."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------

def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The whole file; a missing or unreadable file is a :class:`CctError`."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CctError(f"Could not open file {os.fspath(path)}") from None
    except OSError as e:
        raise CctError(f"Could not open file {os.fspath(path)}: {e.strerror or e}") from None


def _diagnose(data: bytes) -> str:
    """Why ``data`` does not parse: walk the top-level wire records and report a record that runs
    past the end of the file (truncated) or is malformed (corrupt)."""
    pos, n = 0, len(data)
    where = "a field tag"
    try:
        while pos < n:
            where = "a field tag"
            start = pos
            tag, pos = read_varint(data, pos)
            field, wire = tag >> 3, tag & 7
            if field == 0:
                return f"the file is corrupt (invalid field tag at byte {start})"
            where = f"field {field}"
            if wire == WIRE_VARINT:
                _, pos = read_varint(data, pos)
            elif wire == WIRE_64BIT:
                pos += 8
            elif wire == WIRE_32BIT:
                pos += 4
            elif wire == WIRE_LEN:
                where = f"the length of field {field}"
                length, pos = read_varint(data, pos)
                pos += length
                if pos > n:
                    return (f"the file is truncated (field {field} needs {length} bytes, "
                            f"{n - (pos - length)} left)")
            else:
                return f"the file is corrupt (unexpected wire type {wire} for field {field})"
            if pos > n:
                return f"the file is truncated (it ends inside field {field})"
    except Truncated:
        return f"the file is truncated (it ends inside {where})"
    except Malformed:
        return f"the file is corrupt (bad varint in {where})"
    return "the file is corrupt (a nested message does not decode)"


def looks_like_text(data: bytes) -> bool:
    """UTF-8 text without control characters other than whitespace (a prototxt, not binary)."""
    head = data[:4096]
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not merely a multi-byte character cut at the 4096 boundary
            return False
    return not any(b < 0x20 and b not in (0x09, 0x0A, 0x0D) for b in head)


def parse_proto_binary(data: bytes, message: M, source: str) -> M:
    """Parse ``data`` into ``message`` (cleared first); errors name ``source``."""
    type_name = message.DESCRIPTOR.name
    if not data:
        raise CctError(f"{source}: file is empty (expected a binary {type_name})")
    try:
        message.Clear()
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        message.Clear()
        if data.startswith(HDF5_SIGNATURE):
            raise CctError(f"{source}: is an HDF5 file, not a binary {type_name}") from None
        if looks_like_text(data):
            raise CctError(f"{source}: is a text file (a prototxt?), not a binary {type_name}") from None
        raise CctError(f"{source}: could not parse a binary {type_name}: {_diagnose(data)}") from None
    return message


def read_proto_binary(path: str | os.PathLike[str], message: M) -> M:
    """Caffe's ``ReadProtoFromBinaryFile``: fill ``message`` from the file and return it.

    Errors (one line, naming the file): missing/unreadable, empty, truncated or corrupt, or a
    text/HDF5 file where a binary one was expected."""
    return parse_proto_binary(read_bytes(path), message, os.fspath(path))


def write_proto_binary(path: str | os.PathLike[str], message: Message) -> None:
    """Caffe's ``WriteProtoToBinaryFile``, atomically."""
    atomic_write(path, lambda f: f.write(message.SerializeToString()))


# ------------------------------------------------------------------------------------------------
# Typed helpers
# ------------------------------------------------------------------------------------------------

def is_hdf5(path: str | os.PathLike[str]) -> bool:
    """True iff the file carries the HDF5 signature at offset 0, 512, 1024, 2048, ... (HDF5 allows a
    user block of a power-of-two size >= 512 before the superblock).  Missing file -> False."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            offset = 0
            while offset + len(HDF5_SIGNATURE) <= size:
                f.seek(offset)
                if f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                    return True
                offset = 512 if offset == 0 else offset * 2
    except OSError:
        return False
    return False


def read_caffemodel(path: str | os.PathLike[str]) -> caffe_pb2.NetParameter:
    """A binary caffemodel as an upgraded ``NetParameter`` (Caffe's
    ``ReadNetParamsFromBinaryFileOrDie``).  An HDF5 or text file is rejected with a clear error."""
    source = os.fspath(path)
    if is_hdf5(path):
        raise CctError(f"{source}: is an HDF5 weights file (.caffemodel.h5), not a binary caffemodel; "
                       "read it with cct.io.hdf5.read_hdf5_weights")
    data = read_bytes(path)
    net = parse_proto_binary(data, caffe_pb2.NetParameter(), source)
    if not (len(net.layer) or len(net.layers)) and looks_like_text(data):
        # A short text file can happen to parse as (meaningless) binary fields.
        raise CctError(f"{source}: is a text file (a prototxt?), not a binary NetParameter")
    upgrade_net_as_needed(net, source)
    return net


def write_caffemodel(path: str | os.PathLike[str], net: caffe_pb2.NetParameter) -> None:
    """Write a ``NetParameter`` (as built by ``Net.to_proto``) atomically."""
    write_proto_binary(path, net)


def read_blobproto(path: str | os.PathLike[str]) -> caffe_pb2.BlobProto:
    """A single ``BlobProto`` (e.g. a mean.binaryproto)."""
    return read_proto_binary(path, caffe_pb2.BlobProto())


def write_blobproto(path: str | os.PathLike[str], blob: caffe_pb2.BlobProto) -> None:
    write_proto_binary(path, blob)


def read_solverstate(path: str | os.PathLike[str]) -> caffe_pb2.SolverState:
    """A binary ``.solverstate`` (``iter``, ``learned_net``, ``history``, ``current_step``)."""
    return read_proto_binary(path, caffe_pb2.SolverState())


def write_solverstate(path: str | os.PathLike[str], state: caffe_pb2.SolverState) -> None:
    write_proto_binary(path, state)


__all__ = ["atomic_write", "atomic_write_path", "read_bytes", "parse_proto_binary", "read_proto_binary",
           "write_proto_binary", "is_hdf5", "looks_like_text", "read_caffemodel", "write_caffemodel",
           "read_blobproto", "write_blobproto", "read_solverstate", "write_solverstate", "HDF5_SIGNATURE"]
