"""LevelDB (the default ``data_param.backend``): convert_imageset -backend leveldb writes what the Data layer and
compute_image_mean read, record for record as the LMDB path; shared opening within a process; and without
plyvel one line says which extra to install."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from cct.data.db import LeveldbReader, is_leveldb, iterate_records, open_reader, open_writer
from cct.data.tools import compute_image_mean_main, convert_imageset_main
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb
from tests.data.helpers import captured_log, forward, make_layer
from tests.data.test_tools import make_images


def _data_layer(path, batch: int, backend: str = ""):
    return make_layer(f'type: "Data" data_param {{ source: "{path}" batch_size: {batch} {backend} }}', 2)


@pytest.fixture
def no_plyvel(monkeypatch):
    monkeypatch.setitem(sys.modules, "plyvel", None)  # import plyvel → ImportError


def test_missing_plyvel_is_one_line(tmp_path, no_plyvel) -> None:
    make_images(tmp_path, n=2)
    with captured_log() as buf:
        assert convert_imageset_main(["-backend", "leveldb", f"{tmp_path}/img/", str(tmp_path / "list.txt"),
                                      str(tmp_path / "db")]) == 1
    lines = [ln for ln in buf.getvalue().splitlines() if "plyvel" in ln]
    assert len(lines) == 1 and "pip install 'cct[leveldb]'" in lines[0] and "Traceback" not in buf.getvalue()
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "CURRENT").write_text("MANIFEST-000001\n")
    with pytest.raises(CctError, match=r"LevelDB databases need plyvel: pip install 'cct\[leveldb\]'"):
        _data_layer(tmp_path / "fake", 2)  # LEVELDB is the default backend


def test_convert_read_and_mean_match_lmdb(tmp_path) -> None:
    pytest.importorskip("plyvel")
    pixels = make_images(tmp_path, n=7)
    args = [f"{tmp_path}/img/", str(tmp_path / "list.txt")]
    assert convert_imageset_main(["-backend", "leveldb"] + args + [str(tmp_path / "ldb")]) == 0
    assert convert_imageset_main(["-backend", "lmdb"] + args + [str(tmp_path / "mdb")]) == 0
    assert is_leveldb(str(tmp_path / "ldb"))
    ldb = list(iterate_records(str(tmp_path / "ldb"), "leveldb"))
    mdb = list(iterate_records(str(tmp_path / "mdb"), "lmdb"))
    assert ldb == mdb and [k for k, _ in ldb][:2] == [b"00000000_im 0.png", b"00000001_im 1.png"]
    # the Data layer (default backend LEVELDB) reads it and wraps around at the end, as from the LMDB
    layer, top = _data_layer(tmp_path / "ldb", 5)
    first, labels = forward(layer, top)
    second, labels2 = forward(layer, top)
    layer.close()
    expect = np.stack([p[:, :, ::-1].transpose(2, 0, 1) for p in pixels])
    np.testing.assert_array_equal(first, expect[:5])
    np.testing.assert_array_equal(second, np.concatenate([expect[5:], expect[:3]]))
    np.testing.assert_array_equal(np.concatenate([labels, labels2]), [i % 3 for i in list(range(7)) + [0, 1, 2]])
    # compute_image_mean gives the same mean file from either database
    for backend, db in (("leveldb", "ldb"), ("lmdb", "mdb")):
        assert compute_image_mean_main(["-backend", backend, str(tmp_path / db), str(tmp_path / f"{db}.mean")]) == 0
    assert (tmp_path / "ldb.mean").read_bytes() == (tmp_path / "mdb.mean").read_bytes()


def test_writer_refuses_an_existing_database_and_reader_shares_it(tmp_path) -> None:
    pytest.importorskip("plyvel")
    path = str(tmp_path / "db")
    w = open_writer(path, pb.DataParameter.LEVELDB)
    for i in range(3):
        w.put(f"{i:03d}".encode(), f"v{i}".encode())
    w.close()
    with pytest.raises(CctError, match="cannot create a LevelDB"):
        open_writer(path, "leveldb")
    a, b = open_reader(path, pb.DataParameter.LEVELDB), open_reader(path, "leveldb")  # one process, one open
    assert isinstance(a, LeveldbReader) and len(a) == 3
    assert [a.next()[1] for _ in range(4)] == [b"v0", b"v1", b"v2", b"v0"]
    assert b.first() == (b"000", b"v0")
    a.close()
    b.close()


def test_wrong_kind_of_directory(tmp_path) -> None:
    pytest.importorskip("plyvel")
    path = str(tmp_path / "db")
    w = open_writer(path, "leveldb")
    w.put(b"k", b"v")
    w.close()
    with pytest.raises(CctError, match=r"is not an LMDB directory \(no data.mdb in it\) \(it is a LevelDB"):
        open_reader(path, pb.DataParameter.LMDB)
    with captured_log() as buf:
        assert compute_image_mean_main(["-backend", "lmdb", path]) == 1
    assert "-backend leveldb" in buf.getvalue()
