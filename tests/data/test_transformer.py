"""DataTransformer against a literal per-pixel transcription of Caffe's Transform loop."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from google.protobuf import text_format

from cct.data.transformer import DataTransformer
from cct.errors import CctError, ParamError
from cct.proto import caffe_pb2 as pb


def tparam(text: str) -> pb.TransformationParameter:
    return text_format.Parse(text, pb.TransformationParameter())


def oracle(img: np.ndarray, p: pb.TransformationParameter, do_mirror: bool, h_off: int, w_off: int,
           mean=None) -> np.ndarray:
    """Caffe's DataTransformer::Transform(const Datum&, Dtype*), one pixel at a time."""
    c_, h_, w_ = img.shape
    height, width = (p.crop_size, p.crop_size) if p.crop_size else (h_, w_)
    mv = list(p.mean_value)
    if len(mv) == 1:
        mv = mv * c_
    out = np.empty((c_, height, width), np.float32)
    scale = np.float32(p.scale)
    for c in range(c_):
        for h in range(height):
            for w in range(width):
                x = np.float32(img[c, h + h_off, w + w_off])
                if mean is not None:
                    v = (x - np.float32(mean[c, h + h_off, w + w_off])) * scale
                elif mv:
                    v = (x - np.float32(mv[c])) * scale
                else:
                    v = x * scale
                out[c, h, width - 1 - w if do_mirror else w] = v
    return out


def draws(p: pb.TransformationParameter, phase: int, rng, images):
    """The transformer's random choices for a batch: mirror flags, then (h_off, w_off) pairs."""
    n, crop = len(images), p.crop_size
    mirror = rng.integers(2, size=n) == 1 if p.mirror else np.zeros(n, bool)
    hw = np.array([im.shape[1:] for im in images])
    if crop and phase == pb.TRAIN:
        offs = rng.integers(0, hw - crop + 1)
    elif crop:
        offs = (hw - crop) // 2
    else:
        offs = np.zeros((n, 2), int)
    return mirror, offs


def run(text: str, phase: int, images, mean=None):
    p = tparam(text)
    t = DataTransformer(p, phase)
    t.init_rand()
    rng = copy.deepcopy(t.rng)
    shape = t.infer_shape(images[0].shape)
    out = np.empty((len(images),) + shape, np.float32)
    t.transform_batch(images, out)
    mirror, offs = draws(p, phase, rng, images)
    want = np.stack([oracle(im, p, m, h, w, mean) for im, m, (h, w) in zip(images, mirror, offs)])
    np.testing.assert_array_equal(out, want)
    if t.rng is None:
        assert not p.mirror and not (p.crop_size and phase == pb.TRAIN)
    return out


IMAGES = [np.random.default_rng(i).integers(0, 256, (3, 9, 11), dtype=np.uint8) for i in range(6)]


def write_mean(path, mean: np.ndarray, legacy: bool = True) -> str:
    b = pb.BlobProto()
    if legacy:
        b.num, (b.channels, b.height, b.width) = 1, mean.shape
    else:
        b.shape.dim.extend((1,) + mean.shape)
    b.data.extend(mean.ravel().tolist())
    path.write_bytes(b.SerializeToString())
    return str(path)


@pytest.mark.parametrize("text", [
    "", "scale: 0.00390625", "mean_value: 100", "mean_value: 10 mean_value: 20 mean_value: 30 scale: 0.5",
    "crop_size: 5", "crop_size: 9", "mirror: true", "crop_size: 4 mirror: true mean_value: 127.5 scale: 0.017",
])
@pytest.mark.parametrize("phase", [pb.TRAIN, pb.TEST])
def test_options_match_caffe_loop(text, phase):
    run(text, phase, IMAGES)


@pytest.mark.parametrize("extra", ["", "crop_size: 7", "crop_size: 7 mirror: true", "scale: 0.25 mirror: true"])
@pytest.mark.parametrize("phase", [pb.TRAIN, pb.TEST])
@pytest.mark.parametrize("legacy", [True, False])
def test_mean_file_at_uncropped_position(tmp_path, extra, phase, legacy):
    mean = np.random.default_rng(7).random((3, 9, 11)).astype(np.float32) * 255
    path = write_mean(tmp_path / "mean.binaryproto", mean, legacy)
    run(f'mean_file: "{path}" {extra}', phase, IMAGES, mean)


def test_train_crop_is_random_and_test_crop_is_centred():
    img = np.arange(3 * 9 * 11, dtype=np.float32).reshape(3, 9, 11)
    t = DataTransformer(tparam("crop_size: 5"), pb.TRAIN)
    t.init_rand()
    offsets = {tuple(t.transform(img)[0, 0, :1]) for _ in range(60)}
    assert len(offsets) > 5
    t = DataTransformer(tparam("crop_size: 5"), pb.TEST)
    t.init_rand()
    assert t.rng is None  # no stream needed: no mirror, no TRAIN crop
    np.testing.assert_array_equal(t.transform(img), img[:, 2:7, 3:8])


def test_mirror_applies_in_test_phase_too():
    img = np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    t = DataTransformer(tparam("mirror: true"), pb.TEST)
    t.init_rand()
    outs = [t.transform(img) for _ in range(40)]
    assert any(np.array_equal(o, img[:, :, ::-1]) for o in outs)
    assert any(np.array_equal(o, img) for o in outs)


def test_float_data_images():
    imgs = [np.random.default_rng(i).random((2, 6, 6)).astype(np.float32) * 3 for i in range(3)]
    run("crop_size: 4 mirror: true mean_value: 0.5 scale: 2", pb.TRAIN, imgs)


def test_variable_sizes_with_crop():
    imgs = [np.random.default_rng(i).integers(0, 256, (3, 8 + i, 12 - i), dtype=np.uint8) for i in range(4)]
    run("crop_size: 6 mirror: true", pb.TRAIN, imgs)
    run("crop_size: 6", pb.TEST, imgs)


def test_wrong_sizes_without_crop_name_the_image():
    t = DataTransformer(tparam(""), pb.TEST)
    imgs = [np.zeros((3, 4, 4), np.uint8), np.zeros((3, 5, 4), np.uint8)]
    with pytest.raises(CctError, match="key1: image of shape 3x5x4"):
        t.transform_batch(imgs, np.empty((2, 3, 4, 4), np.float32), names=["key0", "key1"])


def test_mean_of_wrong_shape_names_file_and_shapes(tmp_path):
    path = write_mean(tmp_path / "m.binaryproto", np.zeros((3, 5, 5), np.float32))
    t = DataTransformer(tparam(f'mean_file: "{path}"'), pb.TEST)
    with pytest.raises(CctError) as e:
        t.transform(IMAGES[0])
    msg = str(e.value)
    assert "m.binaryproto" in msg and "3x5x5" in msg and "3x9x11" in msg and "\n" not in msg


def test_bad_parameters():
    with pytest.raises(ParamError, match="mean_file and mean_value"):
        DataTransformer(tparam('mean_file: "x" mean_value: 1'), pb.TEST)
    with pytest.raises(ParamError, match="force_color and force_gray"):
        DataTransformer(tparam("force_color: true force_gray: true"), pb.TEST)
    with pytest.raises(CctError, match="cannot read"):
        DataTransformer(tparam('mean_file: "/nonexistent/mean.binaryproto"'), pb.TEST)
    t = DataTransformer(tparam("mean_value: 1 mean_value: 2"), pb.TEST)
    with pytest.raises(ParamError, match="Specify either 1 mean_value or as many as channels: 3"):
        t.transform(IMAGES[0])
    t = DataTransformer(tparam("crop_size: 20"), pb.TEST)
    with pytest.raises(CctError, match="larger than the image"):
        t.transform(IMAGES[0])


def test_stream_seeded_from_global_rng():
    from cct.rng import set_random_seed

    outs = []
    for _ in range(2):
        set_random_seed(5)
        t = DataTransformer(tparam("crop_size: 4 mirror: true"), pb.TRAIN)
        t.init_rand()
        outs.append(np.stack([t.transform(im) for im in IMAGES]))
    np.testing.assert_array_equal(outs[0], outs[1])
