"""ImageData, MemoryData, DummyData, HDF5Data/HDF5Output and WindowData."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from cct.blob import Blob
from cct.data.image import resize_linear
from cct.errors import CctError, ParamError
from cct.proto import caffe_pb2 as pb
from tests.data.helpers import forward, make_layer


# ---- ImageData -------------------------------------------------------------------------------------
def image_list(tmp_path, n=5, size=(6, 7)):
    rng = np.random.default_rng(3)
    (tmp_path / "img").mkdir()
    pixels = []
    with open(tmp_path / "list.txt", "w") as f:
        for i in range(n):
            a = rng.integers(0, 256, size + (3,), dtype=np.uint8)
            Image.fromarray(a).save(tmp_path / "img" / f"a {i}.png")
            f.write(f"a {i}.png {10 + i}\n")
            pixels.append(a[:, :, ::-1].transpose(2, 0, 1))  # BGR, CHW
    return pixels


def test_image_data_order_wrap_and_labels(tmp_path):
    pixels = image_list(tmp_path)
    layer, top = make_layer(f'type: "ImageData" image_data_param {{ source: "{tmp_path}/list.txt" '
                            f'root_folder: "{tmp_path}/img/" batch_size: 3 }}', 2)
    assert top[0].shape == (3, 3, 6, 7) and top[1].shape == (3,)
    seen, labels = [], []
    for _ in range(3):
        d, lab = forward(layer, top)
        seen.extend(d)
        labels.extend(lab)
    order = [i % 5 for i in range(9)]
    np.testing.assert_array_equal(np.stack(seen), np.stack([pixels[i] for i in order]))
    assert labels == [10 + i for i in order]
    layer.close()


def test_image_data_resize_gray_transform(tmp_path):
    pixels = image_list(tmp_path)
    layer, top = make_layer(f'type: "ImageData" image_data_param {{ source: "{tmp_path}/list.txt" '
                            f'root_folder: "{tmp_path}/img/" batch_size: 2 new_height: 4 new_width: 5 '
                            f'is_color: false }} transform_param {{ scale: 0.5 }}', 2)
    assert top[0].shape == (2, 1, 4, 5)
    d, _ = forward(layer, top)
    rgb = pixels[0][::-1].transpose(1, 2, 0).astype(np.int32)  # back to RGB HWC
    grey = ((4899 * rgb[..., 0] + 9617 * rgb[..., 1] + 1868 * rgb[..., 2] + 8192) >> 14)  # not PNG's
    assert np.abs(d[0, 0] * 2 - resize_linear(grey.astype(np.uint8), 5, 4)).max() <= 1
    layer.close()


def test_image_data_shuffle_and_rand_skip(tmp_path):
    image_list(tmp_path, n=6)
    layer, top = make_layer(f'type: "ImageData" image_data_param {{ source: "{tmp_path}/list.txt" '
                            f'root_folder: "{tmp_path}/img/" batch_size: 6 shuffle: true rand_skip: 3 }}', 2)
    labels = [forward(layer, top)[1] for _ in range(3)]
    assert set(np.concatenate(labels).tolist()) == set(range(10, 16))
    layer.close()
    layer, top = make_layer(f'type: "ImageData" image_data_param {{ source: "{tmp_path}/list.txt" '
                            f'root_folder: "{tmp_path}/img/" batch_size: 6 rand_skip: 4 }}', 2)
    lab = forward(layer, top)[1].tolist()
    assert any(lab == [10 + (s + i) % 6 for i in range(6)] for s in range(4))
    layer.close()
    with pytest.raises(ParamError, match="new_height and new_width"):
        make_layer(f'type: "ImageData" image_data_param {{ source: "{tmp_path}/list.txt" new_height: 3 }}', 2)


# ---- MemoryData ------------------------------------------------------------------------------------
def test_memory_data_cycles_and_checks():
    layer, top = make_layer('type: "MemoryData" memory_data_param { batch_size: 2 channels: 1 height: 2 '
                            'width: 3 }', 2)
    assert top[0].shape == (2, 1, 2, 3) and top[1].shape == (2,)
    with pytest.raises(CctError, match="reset"):
        forward(layer, top)
    data = np.arange(6 * 6, dtype=np.float32).reshape(6, 1, 2, 3)
    labels = np.arange(6, dtype=np.float32)
    layer.reset(data, labels)
    for i in (0, 2, 4, 0):
        d, lab = forward(layer, top)
        np.testing.assert_array_equal(d, data[i:i + 2])
        assert top[1].shape == (2, 1, 1, 1)
        np.testing.assert_array_equal(lab.ravel(), labels[i:i + 2])
    data[2] = -1  # the arrays are kept, not copied
    np.testing.assert_array_equal(forward(layer, top)[0][0], data[2])
    with pytest.raises(CctError, match="multiple of batch size"):
        layer.reset(data[:5], labels[:5])
    with pytest.raises(CctError, match="shape"):
        layer.reset(np.zeros((2, 1, 3, 3), np.float32), np.zeros(2, np.float32))
    with pytest.raises(ParamError, match="must be specified"):
        make_layer('type: "MemoryData" memory_data_param { batch_size: 2 }', 2)


# ---- DummyData -------------------------------------------------------------------------------------
def test_dummy_data_shapes_and_fillers():
    layer, top = make_layer('type: "DummyData" dummy_data_param { shape { dim: 2 dim: 3 } '
                            'shape { dim: 4 } data_filler { type: "constant" value: 7 } '
                            'data_filler { type: "gaussian" std: 1 } }', 2)
    assert [t.shape for t in top] == [(2, 3), (4,)]
    np.testing.assert_array_equal(top[0].data, 7)
    top[0].data[...] = 1  # constant tops are never refilled
    a = forward(layer, top)
    b = forward(layer, top)
    np.testing.assert_array_equal(a[0], 1)
    assert not np.array_equal(a[1], b[1])
    _, top = make_layer('type: "DummyData" dummy_data_param { num: 2 channels: 3 height: 4 width: 5 }', 2)
    assert [t.shape for t in top] == [(2, 3, 4, 5)] * 2
    np.testing.assert_array_equal(top[1].data, 0)
    layer, top = make_layer('type: "DummyData" dummy_data_param { shape { dim: 3 } '
                            'data_filler { type: "uniform" min: 1 max: 2 } }', 3)
    np.testing.assert_array_equal(top[2].data, 0)  # non-constant fillers run in forward only
    assert all(t.shape == (3,) and (t >= 1).all() for t in forward(layer, top))
    with pytest.raises(ParamError, match="Must specify 'channels' once"):
        make_layer('type: "DummyData" dummy_data_param { num: 2 }', 1)
    with pytest.raises(ParamError, match="Number of data fillers"):
        make_layer('type: "DummyData" dummy_data_param { shape { dim: 1 } data_filler {} data_filler {} }', 3)
    with pytest.raises(ParamError, match="Both shape and legacy"):
        make_layer('type: "DummyData" dummy_data_param { shape { dim: 1 } num: 1 channels: 1 height: 1 '
                   'width: 1 }', 1)


# ---- HDF5 ------------------------------------------------------------------------------------------
def test_hdf5_data_across_files_and_output(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    rows = []
    for i, n in enumerate((3, 2)):
        with h5py.File(f"f{i}.h5", "w") as f:
            data = np.arange(n * 2 * 3 * 4, dtype=np.float64).reshape(n, 2, 3, 4) + 1000 * i
            f["data"] = data
            f["label"] = np.arange(n, dtype=np.int32) + 10 * i
            rows.extend(zip(data, np.arange(n) + 10 * i))
    (tmp_path / "list.txt").write_text("f0.h5\n  f1.h5\n")
    layer, top = make_layer('top: "data" top: "label" type: "HDF5Data" '
                            'hdf5_data_param { source: "list.txt" batch_size: 4 }', 2)
    assert [t.shape for t in top] == [(4, 2, 3, 4), (4,)]
    for it in range(3):
        d, lab = forward(layer, top)
        for i in range(4):
            want_d, want_l = rows[(it * 4 + i) % 5]
            np.testing.assert_array_equal(d[i], want_d.astype(np.float32))
            assert lab[i] == want_l
    shuffled, stop = make_layer('top: "data" top: "label" type: "HDF5Data" '
                                'hdf5_data_param { source: "list.txt" batch_size: 5 shuffle: true }', 2)
    _, lab = forward(shuffled, stop)
    assert sorted(lab.tolist()) == [0, 1, 2, 10, 11]
    # HDF5Output writes legacy 4-D datasets.
    out, _ = make_layer('type: "HDF5Output" bottom: "d" bottom: "l" hdf5_output_param { file_name: "out.h5" }',
                        0, bottoms=[top[0], top[1]])
    out.forward_layer([top[0], top[1]], [])
    out.forward_layer([top[0], top[1]], [])  # rewrites
    out.close()
    with h5py.File("out.h5", "r") as f:
        np.testing.assert_array_equal(f["data"][()], top[0].data)
        assert f["label"].shape == (4, 1, 1, 1)
    with pytest.raises(CctError, match="Failed to find HDF5 dataset nope"):
        make_layer('top: "nope" type: "HDF5Data" hdf5_data_param { source: "list.txt" batch_size: 1 }', 1)
    with pytest.raises(ParamError, match="does not transform"):
        make_layer('top: "data" type: "HDF5Data" hdf5_data_param { source: "list.txt" batch_size: 1 } '
                   'transform_param { scale: 2 }', 1)


# ---- WindowData ------------------------------------------------------------------------------------
def test_window_data(tmp_path):
    rng = np.random.default_rng(4)
    img = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(img).save(tmp_path / "w.png")
    bgr = img[:, :, ::-1]
    (tmp_path / "windows.txt").write_text(
        "# 0\nw.png\n3\n20\n30\n3\n"
        "5 0.9 2 3 11 12\n"       # foreground, class 5
        "7 0.2 0 0 29 19\n"       # background (label forced to 0)
        "1 0.3 1 1 4 4\n")        # background
    tp = 'transform_param { crop_size: 8 mean_value: 100 }'
    layer, top = make_layer(f'type: "WindowData" window_data_param {{ source: "{tmp_path}/windows.txt" '
                            f'root_folder: "{tmp_path}/" batch_size: 8 fg_fraction: 0.25 scale: 0.5 }} {tp}',
                            2, pb.TRAIN)
    assert [t.shape for t in top] == [(8, 3, 8, 8), (8,)]
    d, lab = forward(layer, top)
    assert lab.tolist() == [0] * 6 + [5] * 2
    fg = (resize_linear(np.ascontiguousarray(bgr[3:13, 2:12]), 8, 8).transpose(2, 0, 1).astype(np.float32)
          - 100) * np.float32(0.5)
    np.testing.assert_array_equal(d[6], fg)
    layer.close()
    # mean_file: its centre crop_size square is subtracted.
    mean = rng.random((3, 10, 10)).astype(np.float32) * 200
    blob = pb.BlobProto(num=1, channels=3, height=10, width=10, data=mean.ravel().tolist())
    (tmp_path / "mean.binaryproto").write_bytes(blob.SerializeToString())
    layer, top = make_layer(f'type: "WindowData" window_data_param {{ source: "{tmp_path}/windows.txt" '
                            f'root_folder: "{tmp_path}/" batch_size: 2 fg_fraction: 1 }} transform_param {{ '
                            f'crop_size: 8 mean_file: "{tmp_path}/mean.binaryproto" }}', 2, pb.TRAIN)
    d, lab = forward(layer, top)
    warped = resize_linear(np.ascontiguousarray(bgr[3:13, 2:12]), 8, 8).transpose(2, 0, 1)
    np.testing.assert_array_equal(d[0], warped - mean[:, 1:9, 1:9])
    layer.close()
    # context_pad: the window grows and the part outside the image stays zero.
    layer, top = make_layer(f'type: "WindowData" window_data_param {{ source: "{tmp_path}/windows.txt" '
                            f'root_folder: "{tmp_path}/" batch_size: 4 fg_fraction: 1 context_pad: 2 '
                            f'crop_mode: "square" }} transform_param {{ crop_size: 10 mirror: true }}', 2)
    d, lab = forward(layer, top)
    assert lab.tolist() == [5] * 4 and d.shape == (4, 3, 10, 10)
    layer.close()
    with pytest.raises(CctError, match="Failed to open window file"):
        make_layer('type: "WindowData" window_data_param { source: "/nonexistent" batch_size: 1 } '
                   'transform_param { crop_size: 4 }', 2)


def test_data_layers_need_no_bottom():
    with pytest.raises(ParamError, match="bottom"):
        make_layer('type: "DummyData" dummy_data_param { shape { dim: 1 } }', 1, bottoms=[Blob((1,))])
