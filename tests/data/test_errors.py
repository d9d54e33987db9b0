"""User mistakes give one-line CctErrors naming the file, record or line."""
from __future__ import annotations

import numpy as np
import pytest

from cct.errors import CctError, ParamError
from cct.proto import caffe_pb2 as pb
from tests.data.helpers import captured_log, forward, make_layer, random_images, raw_datum, write_lmdb


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def data(source, batch=2, extra="", backend="backend: LMDB"):
    return make_layer(f'type: "Data" data_param {{ source: "{source}" batch_size: {batch} {backend} }} {extra}', 2)


def test_absent_lmdb(tmp_path):
    with pytest.raises(CctError) as e:
        data(tmp_path / "nope")
    assert "nope" in one_line(e) and "does not exist" in one_line(e)


def test_leveldb_default_backend(tmp_path):
    src = write_lmdb(tmp_path / "db", [(b"k0", raw_datum(random_images(1)[0], 1))])
    with captured_log() as buf:
        layer, top = data(src, backend="")
    assert "backend is LEVELDB" in buf.getvalue() and "reading it as LMDB" in buf.getvalue()
    assert forward(layer, top)[1].tolist() == [1, 1]
    layer.close()
    (tmp_path / "leveldb").mkdir()
    with pytest.raises(CctError) as e:
        data(tmp_path / "leveldb", backend="backend: LEVELDB")
    assert "leveldb is not a LevelDB directory (no CURRENT file in it)" in one_line(e)
    with pytest.raises(CctError) as e:
        data(tmp_path / "leveldb", backend="backend: LMDB")
    assert "is not an LMDB directory" in one_line(e)


def test_corrupt_record_at_setup_and_in_prefetch(tmp_path):
    img = random_images(1)[0]
    src = write_lmdb(tmp_path / "bad_first", [(b"00_bad", b"\xff\xff\xff garbage")])
    with pytest.raises(CctError) as e:
        data(src)
    assert "bad_first" in one_line(e) and "00_bad" in one_line(e)
    recs = [(b"00_ok", raw_datum(img, 0)), (b"01_ok", raw_datum(img, 1)), (b"02_bad", b"\x08\x01\x12")]
    src = write_lmdb(tmp_path / "bad_later", recs)
    layer, top = data(src, batch=2)
    forward(layer, top)
    with pytest.raises(CctError) as e:
        forward(layer, top)  # the prefetch thread hit the record: reported in the consumer's forward
    assert "bad_later" in one_line(e) and "02_bad" in one_line(e) and "layer 'Data'" in one_line(e)
    with pytest.raises(CctError):
        forward(layer, top)
    layer.close()


def test_empty_image_and_wrong_size_in_batch(tmp_path):
    a, b = np.zeros((3, 4, 4), np.uint8), np.zeros((3, 5, 4), np.uint8)
    empty = pb.Datum(channels=3, height=4, width=4).SerializeToString()
    src = write_lmdb(tmp_path / "empty", [(b"0", raw_datum(a, 0)), (b"1_empty", empty)])
    layer, top = data(src)
    with pytest.raises(CctError) as e:
        forward(layer, top)
    assert "1_empty" in one_line(e) and "empty" in one_line(e)
    layer.close()
    src = write_lmdb(tmp_path / "sizes", [(b"0", raw_datum(a, 0)), (b"1_bigger", raw_datum(b, 0))])
    layer, top = data(src)
    with pytest.raises(CctError) as e:
        forward(layer, top)
    assert "sizes" in one_line(e) and "1_bigger" in one_line(e) and "3x5x4" in one_line(e)
    layer.close()
    # With a crop, records of different sizes may share a batch (each is cropped on its own).
    layer, top = data(src, extra="transform_param { crop_size: 3 }")
    assert forward(layer, top)[0].shape == (2, 3, 3, 3)
    layer.close()


def test_mean_of_wrong_shape(tmp_path):
    mean = pb.BlobProto(num=1, channels=3, height=5, width=5, data=[0.0] * 75)
    (tmp_path / "mean.binaryproto").write_bytes(mean.SerializeToString())
    src = write_lmdb(tmp_path / "db", [(b"k", raw_datum(random_images(1)[0], 0))])
    with pytest.raises(CctError) as e:
        data(src, extra=f'transform_param {{ mean_file: "{tmp_path}/mean.binaryproto" }}')
    msg = one_line(e)
    assert "mean.binaryproto" in msg and "1x3x5x5" not in msg and "3x5x5" in msg and "3x8x10" in msg


def test_missing_image_in_list(tmp_path):
    (tmp_path / "list.txt").write_text("missing.png 0\n")
    with pytest.raises(CctError) as e:
        make_layer(f'type: "ImageData" image_data_param {{ source: "{tmp_path}/list.txt" batch_size: 1 }}', 2)
    msg = one_line(e)
    assert f"{tmp_path}/list.txt:1" in msg and "missing.png" in msg
    with pytest.raises(CctError, match="cannot open image list"):
        make_layer('type: "ImageData" image_data_param { source: "/nonexistent.txt" }', 2)


def test_missing_image_later_in_list(tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "ok.png")
    (tmp_path / "list.txt").write_text("ok.png 0\n\nok.png 1\ngone.png 2\n")
    layer, top = make_layer(f'type: "ImageData" image_data_param {{ source: "{tmp_path}/list.txt" '
                            f'root_folder: "{tmp_path}/" batch_size: 3 }}', 2)
    with pytest.raises(CctError) as e:
        forward(layer, top)
    assert f"{tmp_path}/list.txt:4" in one_line(e) and "gone.png" in one_line(e)
    layer.close()


def test_bad_batch_size(tmp_path):
    src = write_lmdb(tmp_path / "db", [(b"k", raw_datum(random_images(1)[0], 0))])
    with pytest.raises(ParamError, match="batch_size"):
        data(src, batch=0)


def test_environment_release_may_run_inside_acquire():
    """A reader finalized by a garbage collection that lmdb.open triggers must not deadlock."""
    import threading

    from cct.data import db

    def release_while_holding_the_lock():
        with db._envs_lock:
            db._release_env("/nonexistent/key")

    t = threading.Thread(target=release_while_holding_the_lock, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()
