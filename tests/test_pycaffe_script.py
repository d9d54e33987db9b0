"""A pycaffe user's script, run unchanged with ``import cct as caffe``, checked against numpy.

Builds a small LeNet-like net with NetSpec, does net surgery and weight round trips, forward (kwargs,
``blobs=``/``end=``/``start=``), reshape, backward, forward_all, image preprocessing with caffe.io,
BlobProto/Datum helpers, Classifier and Detector — every number against a plain numpy version of the net.
"""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import cct as caffe

L = caffe.layers
P = caffe.params

BATCH, SIDE = 4, 12


# ---- the same net in plain numpy -------------------------------------------------------------------
def conv_forward(x, w, b):
    k = w.shape[2]
    oh, ow = x.shape[2] - k + 1, x.shape[3] - k + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for i in range(k):
        for j in range(k):
            out += np.einsum("oc,nchw->nohw", w[:, :, i, j], x[:, :, i:i + oh, j:j + ow])
    return out + b[None, :, None, None]


def conv_backward(x, w, dtop):
    k = w.shape[2]
    oh, ow = dtop.shape[2:]
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for i in range(k):
        for j in range(k):
            dx[:, :, i:i + oh, j:j + ow] += np.einsum("oc,nohw->nchw", w[:, :, i, j], dtop)
            dw[:, :, i, j] = np.einsum("nohw,nchw->oc", dtop, x[:, :, i:i + oh, j:j + ow])
    return dx, dw, dtop.sum(axis=(0, 2, 3))


def maxpool2(x):
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def maxpool2_backward(x, y, dtop):
    up = lambda a: a.repeat(2, axis=2).repeat(2, axis=3)  # noqa: E731
    return (x == up(y)) * up(dtop)


def softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def reference(x, w, label=None):
    """All intermediate blobs (and the loss and gradients when ``label`` is given) in float64."""
    x = x.astype(np.float64)
    w = {k: [a.astype(np.float64) for a in v] for k, v in w.items()}
    r = {"conv1": conv_forward(x, *w["conv1"])}
    r["pool1"] = maxpool2(r["conv1"])
    flat = r["pool1"].reshape(len(x), -1)
    r["ip1"] = flat @ w["ip1"][0].T + w["ip1"][1]
    r["relu1"] = np.maximum(r["ip1"], 0)
    r["ip2"] = r["relu1"] @ w["ip2"][0].T + w["ip2"][1]
    r["prob"] = softmax(r["ip2"])
    if label is None:
        return r
    n = len(x)
    lab = label.astype(int)
    r["loss"] = -np.log(r["prob"][np.arange(n), lab]).mean()
    d_ip2 = r["prob"].copy()
    d_ip2[np.arange(n), lab] -= 1
    d_ip2 /= n
    g = {"ip2": [d_ip2.T @ r["relu1"], d_ip2.sum(0)]}
    d_ip1 = (d_ip2 @ w["ip2"][0]) * (r["ip1"] > 0)
    g["ip1"] = [d_ip1.T @ flat, d_ip1.sum(0)]
    d_pool = (d_ip1 @ w["ip1"][0]).reshape(r["pool1"].shape)
    d_conv = maxpool2_backward(r["conv1"], r["pool1"], d_pool)
    dx, dw, db = conv_backward(x, w["conv1"][0], d_conv)
    g["conv1"] = [dw, db]
    r["grads"], r["data_diff"] = g, dx
    return r


# ---- the script ----------------------------------------------------------------------------------
def lenet_like(batch, channels=1, side=SIDE):
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[batch, channels, side, side]))
    n.label = L.Input(shape=dict(dim=[batch]), include=dict(phase=caffe.TRAIN))
    n.conv1 = L.Convolution(n.data, num_output=3, kernel_size=3, weight_filler=dict(type="gaussian", std=0.3),
                            bias_filler=dict(type="constant", value=0.1))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool1, num_output=6, weight_filler=dict(type="xavier"),
                           param=[dict(lr_mult=1), dict(lr_mult=2)])
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=4, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label, include=dict(phase=caffe.TRAIN))
    n.prob = L.Softmax(n.ip2, include=dict(phase=caffe.TEST))
    proto = n.to_proto()
    proto.name = "LeNetLike"
    proto.force_backward = True  # gradients down to the data, for saliency
    return proto


@pytest.fixture()
def prototxt(tmp_path):
    path = tmp_path / "lenet_like.prototxt"
    with open(path, "w") as f:
        f.write(str(lenet_like(BATCH)))
    return str(path)


def net_weights(net):
    return {name: [b.data.copy() for b in blobs] for name, blobs in net.params.items()}


def surgery(net, rng):
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rng.standard_normal(blob.data.shape).astype(np.float32) * 0.5


def test_build_both_phases(prototxt):
    test_net = caffe.Net(prototxt, caffe.TEST)
    train_net = caffe.Net(prototxt, caffe.TRAIN)
    assert list(test_net.blobs) == ["data", "conv1", "pool1", "ip1", "ip2", "prob"]
    assert list(train_net.blobs) == ["data", "label", "conv1", "pool1", "ip1", "ip2", "loss"]
    assert test_net.inputs == ["data"] and train_net.inputs == ["data", "label"]
    assert test_net.outputs == ["prob"] and train_net.outputs == ["loss"]
    assert list(test_net.params) == ["conv1", "ip1", "ip2"]
    assert [p.data.shape for p in test_net.params["conv1"]] == [(3, 1, 3, 3), (3,)]
    assert test_net.params["ip1"][0].data.shape == (6, 75)
    assert test_net.blobs["pool1"].data.shape == (BATCH, 3, 5, 5)
    assert np.all(test_net.params["conv1"][1].data == np.float32(0.1))
    assert train_net.layer_dict["loss"].type == "SoftmaxWithLoss"
    assert train_net.blob_loss_weights["loss"] == 1.0


def test_surgery_save_and_reload(prototxt, tmp_path):
    net = caffe.Net(prototxt, caffe.TEST)
    surgery(net, np.random.default_rng(0))
    weights = str(tmp_path / "surgery.caffemodel")
    net.save(weights)
    reloaded = caffe.Net(prototxt, caffe.TEST, weights=weights)
    legacy = caffe.Net(prototxt, weights, caffe.TEST)  # the deprecated positional form
    train = caffe.Net(prototxt, caffe.TRAIN)
    train.copy_from(weights)
    for other in (reloaded, legacy, train):
        for name, blobs in net.params.items():
            for a, b in zip(blobs, other.params[name]):
                np.testing.assert_array_equal(a.data, b.data)


def test_forward_matches_numpy(prototxt):
    rng = np.random.default_rng(1)
    net = caffe.Net(prototxt, caffe.TEST)
    surgery(net, rng)
    w = net_weights(net)
    x = rng.standard_normal((BATCH, 1, SIDE, SIDE)).astype(np.float32)
    out = net.forward(data=x)
    assert list(out) == ["prob"]
    ref = reference(x, w)
    np.testing.assert_allclose(out["prob"], ref["prob"], rtol=1e-4, atol=1e-6)
    assert out["prob"] is net.blobs["prob"].data or np.shares_memory(out["prob"], net.blobs["prob"].data)
    # relu1 ran in place on ip1
    np.testing.assert_allclose(net.blobs["ip1"].data, ref["relu1"], rtol=1e-4, atol=1e-5)

    partial = net.forward(blobs=["conv1", "pool1"], end="ip1")
    assert set(partial) == {"ip1", "conv1", "pool1"}
    for name in ("conv1", "pool1", "ip1"):  # ip1 before the in-place ReLU
        np.testing.assert_allclose(partial[name], ref[name], rtol=1e-4, atol=1e-5)
    rest = net.forward(start="relu1")
    np.testing.assert_allclose(rest["prob"], ref["prob"], rtol=1e-4, atol=1e-6)

    with pytest.raises(Exception, match="Input blob arguments do not match net inputs"):
        net.forward(label=np.zeros(BATCH))
    with pytest.raises(Exception, match="Input is not batch sized"):
        net.forward(data=x[:2])


def test_reshape(prototxt):
    rng = np.random.default_rng(2)
    net = caffe.Net(prototxt, caffe.TEST)
    w = net_weights(net)
    net.blobs["data"].reshape(7, 1, SIDE, SIDE)
    net.reshape()
    assert net.blobs["prob"].data.shape == (7, 4)
    x = rng.standard_normal((7, 1, SIDE, SIDE)).astype(np.float32)
    net.blobs["data"].data[...] = x
    out = net.forward()
    np.testing.assert_allclose(out["prob"], reference(x, w)["prob"], rtol=1e-4, atol=1e-6)


def test_backward_matches_numpy(prototxt):
    rng = np.random.default_rng(3)
    net = caffe.Net(prototxt, caffe.TRAIN)
    surgery(net, rng)
    w = net_weights(net)
    x = rng.standard_normal((BATCH, 1, SIDE, SIDE)).astype(np.float32)
    label = np.array([0, 3, 1, 2], dtype=np.float32)
    out = net.forward(data=x, label=label)
    ref = reference(x, w, label)
    np.testing.assert_allclose(float(out["loss"]), ref["loss"], rtol=1e-4)
    net.clear_param_diffs()
    diffs = net.backward()
    assert set(diffs) == {"data", "label"}
    np.testing.assert_allclose(diffs["data"], ref["data_diff"], rtol=1e-3, atol=1e-6)
    for name, (dw, db) in ref["grads"].items():
        np.testing.assert_allclose(net.params[name][0].diff, dw, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(net.params[name][1].diff, db, rtol=1e-3, atol=1e-6)
    # seeding the output diff explicitly: twice the loss weight → twice the gradient
    net.clear_param_diffs()
    net.backward(loss=np.array(2.0, dtype=np.float32).reshape(net.blobs["loss"].data.shape))
    np.testing.assert_allclose(net.params["ip2"][0].diff, 2 * ref["grads"]["ip2"][0], rtol=1e-3, atol=1e-6)


def test_forward_all_pads_the_last_batch(prototxt):
    rng = np.random.default_rng(4)
    net = caffe.Net(prototxt, caffe.TEST)
    w = net_weights(net)
    x = rng.standard_normal((10, 1, SIDE, SIDE)).astype(np.float32)  # 10 = 2 * 4 + 2
    out = net.forward_all(blobs=["ip1"], data=x)
    assert set(out) == {"prob", "ip1"}
    assert out["prob"].shape == (10, 4) and out["ip1"].shape == (10, 6)
    ref = reference(x, w)
    np.testing.assert_allclose(out["prob"], ref["prob"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["ip1"], ref["relu1"], rtol=1e-4, atol=1e-5)


def write_image(path, rng, size=(20, 24), mode="L"):
    shape = size if mode == "L" else size + (3,)
    pixels = rng.integers(0, 256, shape).astype(np.uint8)
    Image.fromarray(pixels, mode=mode).save(path)
    return pixels


def test_transformer_feeds_the_net(prototxt, tmp_path):
    rng = np.random.default_rng(5)
    net = caffe.Net(prototxt, caffe.TEST)
    w = net_weights(net)
    paths = [str(tmp_path / f"digit{i}.png") for i in range(BATCH)]
    pixels = [write_image(p, rng) for p in paths]

    # a mean image stored as .binaryproto (as compute_image_mean writes it), read the pycaffe way
    mean_path = tmp_path / "mean.binaryproto"
    mean_path.write_bytes(caffe.io.array_to_blobproto(np.full((1, 1, SIDE, SIDE), 100.0)).SerializeToString())
    blob = caffe.proto.caffe_pb2.BlobProto()
    blob.ParseFromString(mean_path.read_bytes())
    mean = caffe.io.blobproto_to_array(blob)[0]
    assert mean.shape == (1, SIDE, SIDE)

    transformer = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_raw_scale("data", 255)
    transformer.set_mean("data", mean)
    transformer.set_input_scale("data", 1 / 64.0)
    images = []
    for i, path in enumerate(paths):
        image = caffe.io.load_image(path, color=False)
        assert image.shape == (20, 24, 1) and image.dtype == np.float32
        np.testing.assert_allclose(image[:, :, 0], pixels[i] / 255.0, rtol=1e-6)
        images.append(image)
        net.blobs["data"].data[i] = transformer.preprocess("data", image)
    out = net.forward()
    expected_in = np.stack([(caffe.io.resize_image(im, (SIDE, SIDE)).transpose(2, 0, 1) * 255 - 100) / 64
                            for im in images])
    np.testing.assert_allclose(net.blobs["data"].data, expected_in, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["prob"], reference(expected_in, w)["prob"], rtol=1e-4, atol=1e-6)
    back = transformer.deprocess("data", net.blobs["data"].data[0])
    np.testing.assert_allclose(back, caffe.io.resize_image(images[0], (SIDE, SIDE)), atol=1e-5)


def test_blobproto_and_datum_helpers():
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in [(2, 3), (1, 2, 3, 4)]]
    s = caffe.io.arraylist_to_blobprotovecor_str(arrays)
    for a, b in zip(arrays, caffe.io.blobprotovector_str_to_arraylist(s)):
        np.testing.assert_array_equal(a, b)
    image = rng.integers(0, 256, (3, 5, 6)).astype(np.uint8)
    datum = caffe.io.array_to_datum(image, label=3)
    parsed = caffe.proto.caffe_pb2.Datum.FromString(datum.SerializeToString())
    assert parsed.label == 3
    np.testing.assert_array_equal(caffe.io.datum_to_array(parsed), image)


@pytest.fixture()
def deploy(tmp_path):
    """A 3-channel TEST-only net (8×8 input) with random weights saved to a caffemodel."""
    path = tmp_path / "deploy.prototxt"
    path.write_text(str(lenet_like(2, channels=3, side=8)))
    net = caffe.Net(str(path), caffe.TEST)
    surgery(net, np.random.default_rng(7))
    weights = str(tmp_path / "deploy.caffemodel")
    net.save(weights)
    return str(path), weights, net_weights(net)


def _manual_in(image, mean, box=None):
    if box is not None:
        image = image[box[0]:box[2], box[1]:box[3]]
    image = caffe.io.resize_image(image, (8, 8))
    return image.transpose(2, 0, 1)[[2, 1, 0]] * 255 - mean[:, None, None]


def test_classifier(deploy, tmp_path):
    model, weights, w = deploy
    rng = np.random.default_rng(8)
    mean = np.array([104.0, 117.0, 123.0])
    classifier = caffe.Classifier(model, weights, image_dims=(10, 10), mean=mean, raw_scale=255,
                                  channel_swap=(2, 1, 0))
    images = []
    for i in range(3):
        write_image(str(tmp_path / f"im{i}.png"), rng, (13, 11), "RGB")
        images.append(caffe.io.load_image(str(tmp_path / f"im{i}.png")))
    pred = classifier.predict(images, oversample=True)
    assert pred.shape == (3, 4)
    for i, image in enumerate(images):
        crops = caffe.io.oversample([caffe.io.resize_image(image, (10, 10))], (8, 8))
        batch = np.stack([(c.transpose(2, 0, 1)[[2, 1, 0]] * 255 - mean[:, None, None]) for c in crops])
        np.testing.assert_allclose(pred[i], reference(batch, w)["prob"].mean(0), rtol=1e-4, atol=1e-6)
    centre = classifier.predict(images, oversample=False)
    batch = np.stack([_manual_in(caffe.io.resize_image(im, (10, 10)), mean, (1, 1, 9, 9)) for im in images])
    np.testing.assert_allclose(centre, reference(batch, w)["prob"], rtol=1e-4, atol=1e-6)


def test_detector(deploy, tmp_path):
    model, weights, w = deploy
    rng = np.random.default_rng(9)
    path = str(tmp_path / "scene.png")
    write_image(path, rng, (16, 20), "RGB")
    mean = np.array([90.0, 100.0, 110.0])
    detector = caffe.Detector(model, weights, mean=mean, raw_scale=255, channel_swap=(2, 1, 0))
    assert list(detector.crop_dims) == [8, 8, 3]
    windows = [np.array([0, 0, 6, 7]), np.array([2, 3, 16, 20]), np.array([4, 4, 12, 12])]
    detections = detector.detect_windows([(path, windows)])
    assert [d["filename"] for d in detections] == [path] * 3
    image = caffe.io.load_image(path)
    batch = np.stack([_manual_in(image, mean, win) for win in windows])
    expected = reference(batch, w)["prob"]
    for det, win, exp in zip(detections, windows, expected):
        assert det["window"] is win
        np.testing.assert_allclose(det["prediction"], exp, rtol=1e-4, atol=1e-6)

    padded = caffe.Detector(model, weights, mean=mean, raw_scale=255, channel_swap=(2, 1, 0), context_pad=1)
    np.testing.assert_allclose(padded.crop_mean.ravel(), mean[::-1] / 255)
    crop = padded.crop(image, np.array([0, 0, 6, 7]))
    assert crop.shape == (8, 8, 3)
    np.testing.assert_allclose(crop[0, 0], mean[::-1] / 255)  # outside the image: the mean
    assert len(padded.detect_windows([(path, windows)])) == 3

    with pytest.raises(caffe.errors.CctError, match="selective_search_ijcv_with_python"):
        detector.detect_selective_search([path])
