"""Binary protobuf files (cct.io.weights): caffemodel, binaryproto, solverstate."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from cct.blob import Blob, blob_from_proto, blob_to_proto, proto_shape
from cct.errors import CctError
from cct.io.weights import (
    HDF5_SIGNATURE,
    atomic_write,
    is_hdf5,
    read_blobproto,
    read_caffemodel,
    read_proto_binary,
    read_solverstate,
    write_blobproto,
    write_caffemodel,
    write_proto_binary,
    write_solverstate,
)
from cct.proto import caffe_pb2

REFERENCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "caffe-reference"
needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(),
                                     reason=f"Caffe reference files not found at {REFERENCE}")


def blob_proto(a: np.ndarray) -> caffe_pb2.BlobProto:
    b = Blob(a.shape, dtype=np.float32)
    b.data[...] = a
    return blob_to_proto(b, caffe_pb2.BlobProto())


def small_net() -> caffe_pb2.NetParameter:
    rng = np.random.default_rng(0)
    n = caffe_pb2.NetParameter(name="small")
    conv = n.layer.add(name="conv", type="Convolution", bottom=["data"], top=["conv"])
    conv.blobs.append(blob_proto(rng.standard_normal((4, 3, 3, 3)).astype(np.float32)))
    conv.blobs.append(blob_proto(rng.standard_normal(4).astype(np.float32)))
    n.layer.add(name="relu", type="ReLU", bottom=["conv"], top=["conv"])
    return n


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------

def test_caffemodel_round_trip(tmp_path):
    n = small_net()
    write_caffemodel(tmp_path / "m.caffemodel", n)
    back = read_caffemodel(tmp_path / "m.caffemodel")
    assert back == n
    w = blob_from_proto(back.layer[0].blobs[0])
    assert w.shape == (4, 3, 3, 3)
    assert leftovers(tmp_path) == []


def test_blobproto_round_trip(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    write_blobproto(tmp_path / "mean.binaryproto", blob_proto(a))
    back = read_blobproto(tmp_path / "mean.binaryproto")
    assert proto_shape(back) == (2, 3, 4)
    np.testing.assert_array_equal(blob_from_proto(back).data, a)
    legacy = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=2, data=[1, 2, 3, 4])
    write_blobproto(tmp_path / "legacy.binaryproto", legacy)
    assert read_blobproto(tmp_path / "legacy.binaryproto") == legacy


def test_solverstate_round_trip(tmp_path):
    s = caffe_pb2.SolverState(iter=1200, learned_net="snap_iter_1200.caffemodel", current_step=3)
    s.history.append(blob_proto(np.full((2, 2), 0.5, np.float32)))
    s.history.append(blob_proto(np.zeros(3, np.float32)))
    write_solverstate(tmp_path / "snap.solverstate", s)
    assert read_solverstate(tmp_path / "snap.solverstate") == s


def test_overwrite_replaces_content(tmp_path):
    p = tmp_path / "m.caffemodel"
    write_caffemodel(p, small_net())
    write_caffemodel(p, caffe_pb2.NetParameter(name="other"))
    assert read_proto_binary(p, caffe_pb2.NetParameter()).name == "other"


def test_new_file_respects_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_blobproto(tmp_path / "b.binaryproto", caffe_pb2.BlobProto())
    finally:
        os.umask(old)
    assert (tmp_path / "b.binaryproto").stat().st_mode & 0o777 == 0o644


# ------------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------------

class ExplodingMessage:
    """Stands in for a message whose serialization fails half way."""

    def SerializeToString(self) -> bytes:
        raise RuntimeError("boom")


def test_failed_serialization_keeps_existing_file(tmp_path):
    p = tmp_path / "snap.caffemodel"
    write_caffemodel(p, small_net())
    before = p.read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        write_proto_binary(p, ExplodingMessage())  # type: ignore[arg-type]
    assert p.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_failure_after_partial_write_keeps_existing_file(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old content")

    def half(f):
        f.write(b"new, half written")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(p, half)
    assert p.read_bytes() == b"old content"
    assert leftovers(tmp_path) == []


def test_write_into_missing_directory(tmp_path):
    with pytest.raises(CctError, match=r"Could not write file .*nodir.*m\.caffemodel"):
        write_caffemodel(tmp_path / "nodir" / "m.caffemodel", small_net())


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    p = tmp_path / "none.caffemodel"
    with pytest.raises(CctError) as e:
        read_caffemodel(p)
    assert str(e.value) == f"Could not open file {p}"


def test_empty_file(tmp_path):
    p = tmp_path / "empty.caffemodel"
    p.write_bytes(b"")
    with pytest.raises(CctError, match=rf"^{p}: file is empty"):
        read_caffemodel(p)


def test_truncated_file(tmp_path):
    p = tmp_path / "t.caffemodel"
    write_caffemodel(p, small_net())
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(CctError) as e:
        read_caffemodel(p)
    assert str(e.value).startswith(f"{p}: could not parse a binary NetParameter: the file is truncated")


def test_corrupt_file(tmp_path):
    p = tmp_path / "c.caffemodel"
    p.write_bytes(b"\x0a\x03abc\x07\x01\x02")  # field 0 / wire type 7
    with pytest.raises(CctError, match=rf"^{p}: could not parse a binary NetParameter: the file is corrupt"):
        read_caffemodel(p)


def test_text_prototxt_given_as_caffemodel(tmp_path):
    p = tmp_path / "net.prototxt"
    p.write_text('name: "x"\nlayer { name: "a" type: "ReLU" }\n')
    with pytest.raises(CctError, match="is a text file .*not a binary NetParameter"):
        read_caffemodel(p)


def test_hdf5_given_as_caffemodel(tmp_path):
    p = tmp_path / "w.caffemodel.h5"
    p.write_bytes(HDF5_SIGNATURE + b"\0" * 100)
    with pytest.raises(CctError, match="HDF5"):
        read_caffemodel(p)


def test_is_hdf5_signature_offsets(tmp_path):
    for offset, expected in [(0, True), (512, True), (1024, True), (4096, True), (100, False)]:
        p = tmp_path / f"f{offset}"
        p.write_bytes(b"\0" * offset + HDF5_SIGNATURE + b"\0" * 16)
        assert is_hdf5(p) is expected, offset
    assert not is_hdf5(tmp_path / "missing")
    (tmp_path / "short").write_bytes(b"\x89HD")
    assert not is_hdf5(tmp_path / "short")


def test_message_over_64mb(tmp_path):
    """Caffe lifts protobuf's 64 MB limit; so must we.  One BlobProto of 20M floats (80 MB)."""
    n = 20_000_000
    raw = np.arange(n, dtype="<f4").tobytes()

    def varint(v: int) -> bytes:
        out = bytearray()
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                return bytes(out)

    shape = b"\x08" + varint(n)                     # BlobShape.dim (field 1, varint; packed also ok)
    data = (b"\x3a" + varint(len(shape)) + shape    # BlobProto.shape (field 7)
            + b"\x2a" + varint(len(raw)) + raw)     # BlobProto.data (field 5, packed)
    p = tmp_path / "big.binaryproto"
    p.write_bytes(data)
    assert p.stat().st_size > 64 * 2**20
    b = read_blobproto(p)  # about 0.2-1 s; the whole test stays under 3 s
    assert list(b.shape.dim) == [n] and len(b.data) == n
    assert b.data[n - 1] == struct.unpack("<f", raw[-4:])[0]


# ------------------------------------------------------------------------------------------------
# Real Caffe files
# ------------------------------------------------------------------------------------------------

@needs_reference
def test_reference_caffemodels_load():
    files = sorted(REFERENCE.glob("nets/*/weights.caffemodel"))
    assert files
    total = 0
    for f in files:
        n = read_caffemodel(f)
        assert n.layer and not n.layers
        for layer in n.layer:
            for b in layer.blobs:
                blob_from_proto(b)  # shapes and counts agree
                total += 1
    assert total > 0


@needs_reference
def test_reference_solverstates_load():
    files = sorted(REFERENCE.glob("solvers/*/caffe_snapshot_iter_12.solverstate"))
    assert files
    for f in files:
        s = read_solverstate(f)
        assert s.iter == 12 and s.learned_net.endswith("caffe_snapshot_iter_12.caffemodel")
        assert len(s.history) >= 1
        for h in s.history:
            blob_from_proto(h)


@needs_reference
def test_reference_snapshot_caffemodels_and_mean_load(tmp_path):
    for f in sorted(REFERENCE.glob("solvers/*/*.caffemodel")):
        assert read_caffemodel(f).layer
    mean = read_blobproto(REFERENCE / "data_layer" / "mean.binaryproto")
    assert int(np.prod(proto_shape(mean))) == len(mean.data) > 0
    # and writing what we read gives the same bytes back
    write_blobproto(tmp_path / "mean.binaryproto", mean)
    assert read_blobproto(tmp_path / "mean.binaryproto") == mean
