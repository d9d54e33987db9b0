"""convert_imageset and compute_image_mean: image files -> LMDB -> Data layer give the same pixels."""
from __future__ import annotations

import lmdb
import numpy as np
import pytest
from PIL import Image

from cct.data import db as dbmod
from cct.data.tools import (
    compute_image_mean_main,
    convert_imageset_main,
)
from cct.proto import caffe_pb2 as pb
from tests.data.helpers import captured_log, forward, make_layer


def make_images(folder, n=5, size=(6, 8), seed=0, gray=False):
    rng = np.random.default_rng(seed)
    (folder / "img").mkdir()
    lines, pixels = [], []
    for i in range(n):
        shape = size if gray else size + (3,)
        a = rng.integers(0, 256, shape, dtype=np.uint8)
        Image.fromarray(a).save(folder / "img" / f"im {i}.png")
        lines.append(f"im {i}.png {i % 3}")
        pixels.append(a)
    (folder / "list.txt").write_text("\n".join(lines) + "\n")
    return pixels


def records(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        out = [(k, pb.Datum.FromString(v)) for k, v in txn.cursor()]
    env.close()
    return out


def data_layer(path, batch, extra=""):
    return make_layer(f'type: "Data" data_param {{ source: "{path}" batch_size: {batch} backend: LMDB }} {extra}',
                      2)


@pytest.mark.parametrize("flags", [[], ["-encoded"], ["--encoded=true", "-encode_type", "png"]])
def test_round_trip_same_pixels(tmp_path, flags):
    pixels = make_images(tmp_path)
    out = tmp_path / "db"
    assert convert_imageset_main(flags + [f"{tmp_path}/img/", str(tmp_path / "list.txt"), str(out)]) == 0
    recs = records(out)
    assert [k for k, _ in recs] == [f"{i:08d}_im {i}.png".encode() for i in range(5)]
    assert all(d.encoded == bool(flags) for _, d in recs)
    if flags:  # extension matches and no resize: the file bytes themselves
        assert recs[0][1].data == (tmp_path / "img" / "im 0.png").read_bytes()
    layer, top = data_layer(out, 5)
    data, label = forward(layer, top)
    np.testing.assert_array_equal(data, np.stack([p[:, :, ::-1].transpose(2, 0, 1) for p in pixels]))
    np.testing.assert_array_equal(label, [i % 3 for i in range(5)])
    layer.close()


def test_gray_resize_reencode_and_missing_file(tmp_path):
    make_images(tmp_path)
    with open(tmp_path / "list.txt", "a") as f:
        f.write("missing.png 2\nim 1.png 7\n")
    out = tmp_path / "db"
    with captured_log() as buf:
        rc = convert_imageset_main(["-gray", "-resize_width=5", "-resize_height", "3", "-encode_type=jpg",
                                    f"{tmp_path}/img/", str(tmp_path / "list.txt"), str(out)])
    assert rc == 0
    err = buf.getvalue()
    assert "Could not open or find file" in err and "Processed 6 files." in err
    assert "encode_type specified, assuming encoded=true." in err
    recs = records(out)
    keys = [k for k, _ in recs]
    assert b"00000005_missing.png" not in keys and keys[-1] == b"00000006_im 1.png"
    assert recs[-1][1].label == 7 and recs[-1][1].data[:2] == b"\xff\xd8"  # a JPEG
    layer, top = data_layer(out, 2)
    assert top[0].shape == (2, 1, 3, 5)
    layer.close()


def test_progress_every_1000_and_map_growth(tmp_path, monkeypatch):
    monkeypatch.setattr(dbmod, "_MAP_SIZE", 1 << 16)
    (tmp_path / "img").mkdir()
    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(tmp_path / "img" / "a.png")
    (tmp_path / "list.txt").write_text("a.png 1\n" * 1001)
    out = tmp_path / "db"
    with captured_log() as buf:
        assert convert_imageset_main([f"{tmp_path}/img/", str(tmp_path / "list.txt"), str(out)]) == 0
    err = buf.getvalue()
    assert "Processed 1000 files." in err and "Processed 1001 files." in err
    assert "Doubling LMDB map size" in err
    assert len(records(out)) == 1001


def test_shuffle_keeps_all(tmp_path):
    make_images(tmp_path, n=8)
    out = tmp_path / "db"
    assert convert_imageset_main(["-shuffle", f"{tmp_path}/img/", str(tmp_path / "list.txt"), str(out)]) == 0
    recs = records(out)
    assert sorted(k[9:] for k, _ in recs) == sorted(f"im {i}.png".encode() for i in range(8))


def test_errors_are_one_line(tmp_path, capsys):
    make_images(tmp_path, size=(4, 4))
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(tmp_path / "img" / "big.png")
    with open(tmp_path / "list.txt", "a") as f:
        f.write("big.png 0\n")
    args = [f"{tmp_path}/img/", str(tmp_path / "list.txt")]
    cases = [
        (["-check_size"] + args + [str(tmp_path / "db1")], "Incorrect data field size 75"),
        (["-bogus"] + args + [str(tmp_path / "db2")], "unknown command line flag 'bogus'"),
        (["-resize_width=abc"] + args + [str(tmp_path / "db3")], "illegal value 'abc'"),
        (["-backend=bdb"] + args + [str(tmp_path / "db4")], "unknown database backend"),
        ([f"{tmp_path}/img/", str(tmp_path / "nolist.txt"), str(tmp_path / "db5")], "nolist.txt"),
    ]
    for argv, text in cases:
        capsys.readouterr()
        with captured_log() as buf:
            assert convert_imageset_main(argv) != 0
        out = buf.getvalue() + capsys.readouterr().err
        err = [ln for ln in out.splitlines() if text in ln]
        assert len(err) == 1, (argv, text)
        assert "Traceback" not in err[0]
    assert convert_imageset_main(args + [str(tmp_path / "db1")]) != 0  # exists (made by the first case)
    assert convert_imageset_main(["only_one_arg"]) == 1


def test_compute_image_mean(tmp_path):
    pixels = make_images(tmp_path, n=6)
    out = tmp_path / "db"
    assert convert_imageset_main(["-encoded", f"{tmp_path}/img/", str(tmp_path / "list.txt"), str(out)]) == 0
    mean_file = tmp_path / "mean.binaryproto"
    with captured_log() as buf:
        assert compute_image_mean_main(["-backend=lmdb", str(out), str(mean_file)]) == 0
    err = buf.getvalue()
    blob = pb.BlobProto.FromString(mean_file.read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 6, 8)
    total = np.zeros(3 * 6 * 8, np.float32)
    for p in pixels:
        total += p[:, :, ::-1].transpose(2, 0, 1).ravel()
    mean = total / np.float32(6)
    np.testing.assert_array_equal(np.array(blob.data, np.float32), mean)
    for c in range(3):
        assert f"mean_value channel [{c}]: {float(mean.reshape(3, -1)[c].mean()):.6g}" in err
    # The mean file feeds a Data layer's transform_param.
    layer, top = data_layer(out, 6, f'transform_param {{ mean_file: "{mean_file}" }}')
    data, _ = forward(layer, top)
    np.testing.assert_allclose(data.mean(axis=0), 0, atol=1e-4)
    layer.close()
    with captured_log() as buf:
        assert compute_image_mean_main([str(tmp_path / "nodb")]) == 1
    assert "does not exist" in buf.getvalue()
    assert compute_image_mean_main([]) == 1
