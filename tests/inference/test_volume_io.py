"""Volume readers (HDF5, .npy, multi-page TIFF, PNG), boxes beyond the volume, mirror padding, the input
transform, and the HDF5 writer."""
from __future__ import annotations

import numpy as np
import pytest

from cct.errors import CctError
from cct.inference.volume_io import HDF5Writer, chunk_shape, open_volume


@pytest.fixture
def volume():
    return (np.random.default_rng(0).random((7, 9, 11)) * 60000).astype(np.uint16)


def _check_reads(v, ref):
    np.testing.assert_array_equal(v.read((1, 2, 3), (4, 5, 6))[0], ref[1:5, 2:7, 3:9].astype(np.float32))
    beyond = v.read((5, 6, 8), (4, 5, 6))[0]
    np.testing.assert_array_equal(beyond[:2, :3, :3], ref[5:, 6:, 8:])
    assert not beyond[2:].any() and not beyond[:, 3:].any() and not beyond[:, :, 3:].any()


def test_npy_h5_tiff_readers(tmp_path, volume):
    import h5py
    from PIL import Image

    np.save(tmp_path / "v.npy", volume)
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f.create_dataset("a/b", data=volume)
    pages = [Image.fromarray(p) for p in volume]
    pages[0].save(tmp_path / "v.tif", save_all=True, append_images=pages[1:])
    for path in ("v.npy", "v.h5", "v.h5:a/b", "v.tif"):
        v = open_volume(str(tmp_path / path), 3, 1)
        assert v.spatial == (7, 9, 11) and v.channels == 1
        _check_reads(v, volume)
        v.close()
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f["x"] = volume
        f["y"] = volume
    with pytest.raises(CctError, match=r"two.h5: 2 datasets \(x, y\); name one as .*two.h5:DATASET"):
        open_volume(str(tmp_path / "two.h5"), 3, 1)
    with pytest.raises(CctError, match="no dataset 'z'"):
        open_volume(str(tmp_path / "two.h5") + ":z", 3, 1)
    (tmp_path / "v.txt").write_text("hello")
    with pytest.raises(CctError, match="unknown volume format"):
        open_volume(str(tmp_path / "v.txt"), 3, 1)


def test_png_for_2d_nets(tmp_path):
    from PIL import Image

    rgb = (np.random.default_rng(1).random((20, 30, 3)) * 255).astype(np.uint8)
    Image.fromarray(rgb).save(tmp_path / "i.png")
    v = open_volume(str(tmp_path / "i.png"), 2, 3)
    assert v.channels == 3 and v.spatial == (20, 30)
    np.testing.assert_array_equal(v.read((0, 0), (20, 30)), np.moveaxis(rgb, -1, 0).astype(np.float32))
    with pytest.raises(CctError, match="has 3 channels; the net takes 1"):
        open_volume(str(tmp_path / "i.png"), 2, 1)


def test_mirror_padding_and_transform(volume):
    v = open_volume(volume, 3, 1)
    v.set_mirror((5, 4, 7))
    assert v.before == (2, 1, 3) and v.padded == (11, 12, 17)
    padded = np.pad(volume, [(2, 2), (1, 2), (3, 3)], mode="reflect").astype(np.float32)
    np.testing.assert_array_equal(v.read((0, 0, 0), (11, 12, 17))[0], padded)
    np.testing.assert_array_equal(v.read((3, 4, 5), (6, 6, 6))[0], padded[3:9, 4:10, 5:11])
    v.set_transform([100.0], 0.5)
    np.testing.assert_allclose(v.read((0, 0, 0), (4, 4, 4))[0], (padded[:4, :4, :4] - 100) * 0.5)
    with pytest.raises(CctError, match="-input_mean: 2 values for a volume of 1 channels"):
        v.set_transform([1.0, 2.0])


def test_shapes_must_fit_the_net(volume):
    assert open_volume(volume[None].repeat(2, 0), 3, 2).channels == 2
    with pytest.raises(CctError, match=r"volume of shape \(7, 9, 11\) does not fit a net with 3 spatial axes and 2"):
        open_volume(volume, 3, 2)
    with pytest.raises(CctError, match="does not fit a net with 2 spatial axes"):
        open_volume(volume[None, None], 2, 1)


def test_hdf5_writer_is_renamed_when_complete(tmp_path):
    import h5py

    w = HDF5Writer(tmp_path / "o.h5", (2, 10, 12), {"fov": [3, 3]}, chunk=(8, 8))
    assert (tmp_path / "o.h5.partial").exists() and not (tmp_path / "o.h5").exists()
    w.write((0, 0), np.ones((2, 8, 8), np.float32))
    w.write((8, 0), np.full((2, 2, 12), 2, np.float32))
    w.write((0, 8), np.full((2, 8, 4), 3, np.float32))
    w.close()
    with h5py.File(tmp_path / "o.h5", "r") as f:
        d = f["output"]
        assert d.chunks == (1, 8, 8) and list(d.attrs["fov"]) == [3, 3]
        assert d[0, 9, 11] == 2 and d[1, 7, 9] == 3 and d[0, 0, 0] == 1
    w2 = HDF5Writer(tmp_path / "p.h5", (1, 4, 4))
    w2.abort()
    assert not (tmp_path / "p.h5.partial").exists() and not (tmp_path / "p.h5").exists()
    assert chunk_shape((1000, 1000, 1000), (512, 512, 512)) == (64, 128, 128)
