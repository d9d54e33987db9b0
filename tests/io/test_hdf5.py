"""HDF5 weights and solver states in Caffe's layout (cct.io.hdf5)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from cct.blob import blob_from_proto
from cct.errors import CctError
from cct.io.hdf5 import (
    read_hdf5_solverstate,
    read_hdf5_weights,
    write_hdf5_solverstate,
    write_hdf5_weights,
)
from cct.io.weights import is_hdf5, read_caffemodel

h5py = pytest.importorskip("h5py")

RNG = np.random.default_rng(1)
W = RNG.standard_normal((4, 3, 2, 2)).astype(np.float32)
B = RNG.standard_normal(4).astype(np.float32)
IP = RNG.standard_normal((5, 16)).astype(np.float32)


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_weights_round_trip_and_layout(tmp_path):
    p = tmp_path / "w.caffemodel.h5"
    layers = [("conv1", [W, B]), ("relu1", []), ("ip", [IP, None]), ("block/conv", [B])]
    write_hdf5_weights(p, layers)
    assert is_hdf5(p)
    with h5py.File(p, "r") as f:
        assert set(f) == {"data"}
        assert f["data/conv1/0"].dtype == np.float32 and f["data/conv1/0"].shape == (4, 3, 2, 2)
        assert "relu1" in f["data"] and len(f["data/relu1"]) == 0
        assert "1" not in f["data/ip"]  # weight-shared copy: not written, as Caffe
    w = read_hdf5_weights(p)
    assert set(w) == {"conv1", "relu1", "ip", "block/conv"}
    np.testing.assert_array_equal(w["conv1"][0], W)
    np.testing.assert_array_equal(w["conv1"][1], B)
    assert w["relu1"] == {} and list(w["ip"]) == [0]
    np.testing.assert_array_equal(w["block/conv"][0], B)
    assert leftovers(tmp_path) == []


def test_weights_with_diffs(tmp_path):
    p = tmp_path / "w.h5"
    write_hdf5_weights(p, [("conv1", [W, B])], diffs=[("conv1", [W * 2, B * 2])])
    d = read_hdf5_weights(p, group="diff")
    np.testing.assert_array_equal(d["conv1"][0], W * 2)
    np.testing.assert_array_equal(read_hdf5_weights(p)["conv1"][1], B)


def test_float64_input_is_stored_as_float32(tmp_path):
    p = tmp_path / "w.h5"
    write_hdf5_weights(p, [("l", [np.ones((2, 2))])])
    assert read_hdf5_weights(p)["l"][0].dtype == np.float32


def test_duplicate_layer_names_are_an_error(tmp_path):
    with pytest.raises(CctError, match="layer name 'a' appears twice"):
        write_hdf5_weights(tmp_path / "w.h5", [("a", [B]), ("a", [B])])
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_existing_file(tmp_path):
    p = tmp_path / "w.h5"
    write_hdf5_weights(p, [("conv1", [W, B])])
    before = p.read_bytes()

    class Bad:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_hdf5_weights(p, [("conv1", [W, Bad()])])
    assert p.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_not_caffe_layout_and_not_hdf5(tmp_path):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("foo", data=np.zeros(2))
    with pytest.raises(CctError, match=r"no '/data' group"):
        read_hdf5_weights(p)
    q = tmp_path / "y.h5"
    q.write_bytes(b"not hdf5 at all")
    with pytest.raises(CctError, match="could not open as an HDF5 file"):
        read_hdf5_weights(q)
    with pytest.raises(CctError, match="Could not open file"):
        read_hdf5_weights(tmp_path / "missing.h5")


def test_caffemodel_reader_rejects_hdf5(tmp_path):
    p = tmp_path / "w.caffemodel.h5"
    write_hdf5_weights(p, [("conv1", [W])])
    with pytest.raises(CctError, match="HDF5"):
        read_caffemodel(p)


def test_solverstate_round_trip_and_layout(tmp_path):
    p = tmp_path / "s.solverstate.h5"
    hist = [W * 0.1, B * 0.1, np.zeros((5, 16), np.float32)]
    write_hdf5_solverstate(p, 1500, "snap_iter_1500.caffemodel.h5", 2, hist)
    with h5py.File(p, "r") as f:
        assert f["iter"].shape == (1,) and f["iter"].dtype == np.int32 and f["iter"][0] == 1500
        assert f["current_step"][0] == 2
        t = f["learned_net"].id.get_type()
        # fixed length, NUL-terminated, like H5LTmake_dataset_string (Caffe reads it as a C string)
        assert t.get_strpad() == h5py.h5t.STR_NULLTERM
        assert t.get_size() == len("snap_iter_1500.caffemodel.h5") + 1
        assert sorted(f["history"]) == ["0", "1", "2"]
    s = read_hdf5_solverstate(p)
    assert s.iter == 1500 and s.current_step == 2 and s.learned_net == "snap_iter_1500.caffemodel.h5"
    assert len(s.history) == 3
    for proto, a in zip(s.history, hist):
        np.testing.assert_allclose(blob_from_proto(proto).data, a)
    assert leftovers(tmp_path) == []


def test_solverstate_without_learned_net(tmp_path):
    p = tmp_path / "s.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("iter", data=np.array([7], np.int32))
        f.create_dataset("current_step", data=np.array([0], np.int32))
        f.create_group("history").create_dataset("0", data=np.ones(3, np.float32))
    s = read_hdf5_solverstate(p)
    assert s.iter == 7 and not s.HasField("learned_net") and len(s.history) == 1


def test_solverstate_missing_fields(tmp_path):
    p = tmp_path / "s.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("current_step", data=np.array([0], np.int32))
    with pytest.raises(CctError, match="no 'iter' dataset"):
        read_hdf5_solverstate(p)


def test_without_h5py_the_error_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(CctError, match=r"HDF5 files need h5py: pip install 'cct\[hdf5\]'"):
        write_hdf5_weights(tmp_path / "w.h5", [("a", [B])])
    with pytest.raises(CctError, match="need h5py"):
        read_hdf5_solverstate(tmp_path / "s.h5")
