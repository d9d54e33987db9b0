"""BatchNorm and MVN: forward against loop references, running statistics, gradients (also in place),
parameter handling, and Caffe's own numbers (nets/batchnorm_block, nets/neuron_zoo)."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.config import settings
from cct.errors import ParamError
from cct.gradient_check import check_gradient, setup_layer
from cct.proto import caffe_pb2 as pb
from cct.runtime import partition
from tests.helpers import BODIES, select_body
from tests.reference import assert_close, reference_dir

RNG = np.random.default_rng(5)
F32 = float(np.float32(0.999))


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape) * 1.5 + 0.3


def blobs_text(mean, var, s) -> str:
    out = ""
    for values in (mean, var, [s]):
        data = " ".join(f"data: {v!r}" for v in values)
        out += f"blobs {{ shape {{ dim: {len(values)} }} {data} }} "
    return out


# ---- BatchNorm reference -------------------------------------------------------------------------
def bn_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and biased variance, with plain loops."""
    c = 1 if x.ndim == 1 else x.shape[1]
    xs = x.reshape(x.shape[0], c, -1)
    mean, var = np.zeros(c), np.zeros(c)
    for ch in range(c):
        vals = [float(v) for v in xs[:, ch, :].ravel()]
        mean[ch] = sum(vals) / len(vals)
        var[ch] = sum((v - mean[ch]) ** 2 for v in vals) / len(vals)
    return mean, var


def bn_apply(x: np.ndarray, mean, var, eps: float) -> np.ndarray:
    c = 1 if x.ndim == 1 else x.shape[1]
    shape = (1, c) + (1,) * (x.ndim - 2) if x.ndim > 1 else (1,)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)


@pytest.mark.parametrize("shape", [(4, 3, 2, 5), (6, 4), (5,), (2, 3, 2, 2, 2)])
def test_batchnorm_train_forward_and_running_stats(shape):
    x1, x2 = rand(*shape), rand(*shape)
    proto = 'type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 eps: 0.01 }'
    run = setup_layer(proto, [x1], dtype=np.float64)
    maf, eps = float(np.float32(0.9)), float(np.float32(0.01))
    c = 1 if len(shape) == 1 else shape[1]
    assert [b.shape for b in run.layer.blobs] == [(c,), (c,), (1,)]
    assert all(np.all(b.data == 0) for b in run.layer.blobs)
    (y,) = run.forward()
    m1, v1 = bn_stats(x1)
    np.testing.assert_allclose(y, bn_apply(x1, m1, v1, eps), rtol=1e-10, atol=1e-12)
    run.inputs[0] = x2
    run.forward()
    m2, v2 = bn_stats(x2)
    m = x1.size // c
    corr = m / (m - 1)
    blobs = run.layer.blobs
    np.testing.assert_allclose(blobs[2].data, [maf * 1 + 1])
    np.testing.assert_allclose(blobs[0].data, m2 + maf * m1)
    np.testing.assert_allclose(blobs[1].data, corr * v2 + maf * corr * v1)


def test_batchnorm_global_stats_forward():
    x = rand(3, 2, 4)
    text = f'type: "BatchNorm" {blobs_text([1.0, -2.0], [8.0, 0.5], 2.0)}'
    for phase, extra in ((pb.TEST, ""), (pb.TRAIN, "batch_norm_param { use_global_stats: true }")):
        run = setup_layer(text + extra, [x], phase=phase, dtype=np.float64)
        (y,) = run.forward()
        eps = float(np.float32(1e-5))
        np.testing.assert_allclose(y, bn_apply(x, np.array([0.5, -1.0]), np.array([4.0, 0.25]), eps))
        np.testing.assert_array_equal(run.layer.blobs[2].data, [2.0])  # no update with global stats
    # TEST phase, use_global_stats: false -> batch statistics
    run = setup_layer('type: "BatchNorm" batch_norm_param { use_global_stats: false }', [x], phase=pb.TEST,
                      dtype=np.float64)
    mean, var = bn_stats(x)
    np.testing.assert_allclose(run.forward()[0], bn_apply(x, mean, var, float(np.float32(1e-5))))


def test_batchnorm_zero_scale_factor_means_zero_stats():
    x = rand(2, 3)
    run = setup_layer('type: "BatchNorm"', [x], phase=pb.TEST, dtype=np.float64)
    np.testing.assert_allclose(run.forward()[0], x / np.sqrt(float(np.float32(1e-5))))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (5, 2), (6,)])
def test_batchnorm_gradient_batch_stats(shape, in_place):
    check_gradient('type: "BatchNorm"', [rand(*shape)], in_place=in_place, check_params=False)


@pytest.mark.parametrize("in_place", [False, True])
def test_batchnorm_gradient_global_stats(in_place):
    text = f'type: "BatchNorm" {blobs_text([1.0, -2.0, 0.5], [8.0, 0.5, 2.0], 2.0)}'
    check_gradient(text, [rand(3, 3, 2, 2)], phase=pb.TEST, in_place=in_place, check_params=False)


def test_batchnorm_backward_survives_clobbered_top():
    """Backward uses its saved y, not the top data that a later in-place layer may overwrite."""
    x, td = rand(4, 3, 5), rand(4, 3, 5)
    grads = []
    for clobber in (False, True):
        run = setup_layer('type: "BatchNorm"', [x], in_place=True, dtype=np.float64)
        run.forward()
        if clobber:
            run.top[0].data[...] = 123.0
        run.top[0].diff[...] = td
        run.layer.backward_layer(run.top, [True], run.bottom)
        grads.append(run.bottom[0].diff.copy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_batchnorm_param_specs():
    run = setup_layer('type: "BatchNorm"', [rand(2, 3)])
    assert [p.lr_mult for p in run.layer.layer_param.param] == [0, 0, 0]
    run = setup_layer('type: "BatchNorm" param { lr_mult: 0 decay_mult: 0 }', [rand(2, 3)])
    assert [p.lr_mult for p in run.layer.layer_param.param] == [0, 0, 0]
    with pytest.raises(ParamError, match=r"param\[1\].lr_mult"):
        setup_layer('type: "BatchNorm" param { lr_mult: 0 } param { lr_mult: 1 }', [rand(2, 3)])
    with pytest.raises(ParamError, match=r"param\[0\].lr_mult"):
        setup_layer('type: "BatchNorm" param { }', [rand(2, 3)])  # lr_mult defaults to 1


def test_batchnorm_stored_blob_shapes_checked():
    with pytest.raises(ParamError, match="blobs"):
        setup_layer(f'type: "BatchNorm" {blobs_text([1.0, 2.0], [1.0, 1.0], 1.0)}', [rand(2, 3)])


def test_batchnorm_float32_running_update():
    """In float32 the update is done in float32 with maf as a float."""
    x = rand(4, 2, 3).astype(np.float32)
    run = setup_layer('type: "BatchNorm"', [x], dtype=np.float32)
    run.forward()
    run.forward()
    mean, var = bn_stats(x)
    b = run.layer.blobs
    assert b[0].data.dtype == np.float32
    np.testing.assert_allclose(b[2].data, [F32 + 1], rtol=1e-7)
    np.testing.assert_allclose(b[0].data, mean * (1 + F32), rtol=1e-5)
    np.testing.assert_allclose(b[1].data, var * 12 / 11 * (1 + F32), rtol=1e-5)


# ---- MVN -------------------------------------------------------------------------------------------
def mvn_reference(x: np.ndarray, normalize_variance: bool, across_channels: bool, eps: float) -> np.ndarray:
    x4 = x.reshape(x.shape + (1,) * (4 - x.ndim))
    n, c = x4.shape[:2]
    out = np.empty_like(x4)
    groups = [(i, slice(None)) for i in range(n)] if across_channels else \
        [(i, slice(j, j + 1)) for i in range(n) for j in range(c)]
    for i, sl in groups:
        v = x4[i, sl]
        centered = v - v.mean()
        if normalize_variance:
            centered = centered / (np.sqrt((centered ** 2).mean()) + eps)
        out[i, sl] = centered
    return out


MVN_CASES = [
    ("", True, False),
    ("mvn_param { across_channels: true }", True, True),
    ("mvn_param { normalize_variance: false }", False, False),
    ("mvn_param { normalize_variance: false across_channels: true }", False, True),
]


@pytest.mark.parametrize("proto, nv, across", MVN_CASES)
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 4)])
def test_mvn_forward(proto, nv, across, shape):
    x = rand(*shape)
    # (in place, a non-4-D bottom is itself reshaped to 4-D, as in Caffe)
    for in_place in (False, True) if x.ndim == 4 else (False,):
        run = setup_layer(f'type: "MVN" {proto}', [x], in_place=in_place, dtype=np.float64)
        (y,) = run.forward()
        assert y.ndim == 4  # Caffe's legacy 4-D top
        np.testing.assert_allclose(y, mvn_reference(x, nv, across, float(np.float32(1e-9))), atol=1e-12)


def test_mvn_eps_added_to_std():
    x = np.array([[[[0.0, 2.0]]]])  # std 1
    (y,) = setup_layer('type: "MVN" mvn_param { eps: 0.5 }', [x], dtype=np.float64).forward()
    np.testing.assert_allclose(y.ravel(), [-1 / 1.5, 1 / 1.5])


@pytest.mark.parametrize("proto, nv, across", MVN_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_mvn_gradient(proto, nv, across, in_place):
    check_gradient(f'type: "MVN" {proto}', [rand(2, 3, 2, 3)], in_place=in_place)


# ---- against Caffe ----------------------------------------------------------------------------------
def conv3x3_pad1(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Plain cross-correlation, stride 1, pad 1 (the reference nets' convolutions)."""
    n, _, h, wd = x.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    return out.astype(np.float32)


def test_batchnorm_block_matches_caffe():
    """BatchNorm + Scale(bias) in place, forward (TRAIN, and TEST with global stats) and backward."""
    folder = reference_dir("nets", "batchnorm_block")
    tr, te = np.load(folder / "train.npz"), np.load(folder / "test.npz")
    bn_b = 'type: "BatchNorm" batch_norm_param { eps: 0.001 moving_average_fraction: 0.9 }'
    scale = 'type: "Scale" scale_param { bias_term: true }'

    def block(ref, phase, conv_in: str, conv: str, bn: str, bn_proto: str, sc: str, relu: bool):
        x = conv3x3_pad1(ref[f"data/{conv_in}"], ref[f"param/{conv}/0"])
        bn_run = setup_layer(bn_proto, [x], in_place=True, phase=phase)
        for j in range(3):  # the weights file holds the statistics before the forward
            bn_run.layer.blobs[j].data[...] = te[f"param/{bn}/{j}"]
        sc_run = setup_layer(scale, [x], in_place=True, phase=phase)
        sc_run.bottom[0] = sc_run.top[0] = bn_run.top[0]
        for j in range(2):
            sc_run.layer.blobs[j].data[...] = ref[f"param/{sc}/{j}"]
        bn_run.forward()
        sc_run.layer.forward_layer(sc_run.bottom, sc_run.top)
        if phase == pb.TRAIN:
            for j in range(3):
                assert_close(bn_run.layer.blobs[j].data, ref[f"param/{bn}/{j}"], f"{bn} statistics {j}")
        y = np.maximum(sc_run.top[0].data, 0) if relu else sc_run.top[0].data
        return y, bn_run, sc_run

    for ref, phase in ((tr, pb.TRAIN), (te, pb.TEST)):
        y, _, _ = block(ref, phase, "data", "conv_a", "bn_a", 'type: "BatchNorm"', "scale_a", True)
        assert_close(y, ref["data/conv_a"], f"conv_a after bn/scale/relu (phase {phase})")
        y, bn_run, sc_run = block(ref, phase, "conv_a", "conv_b", "bn_b", bn_b, "scale_b", False)
        assert_close(y, ref["data/conv_b"], f"conv_b after bn/scale (phase {phase})")
    # backward of block b (TRAIN): the Eltwise SUM passes diff/sum straight to conv_b
    _, bn_run, sc_run = block(tr, pb.TRAIN, "conv_a", "conv_b", "bn_b", bn_b, "scale_b", False)
    top = sc_run.top[0]
    top.diff[...] = tr["diff/sum"]
    for b in sc_run.layer.blobs:
        b.diff[...] = 0
    sc_run.layer.backward_layer(sc_run.top, [True], sc_run.bottom)
    for j in range(2):
        assert_close(sc_run.layer.blobs[j].diff, tr[f"param_diff/scale_b/{j}"], f"scale_b param diff {j}")
    bn_run.layer.backward_layer(bn_run.top, [True], bn_run.bottom)
    assert_close(bn_run.bottom[0].diff, tr["diff/conv_b"], "diff into bn_b")


def test_mvn_matches_caffe():
    ref = np.load(reference_dir("nets", "neuron_zoo") / "train.npz")
    x = ref["data/data"]
    # bottoms: the 12th and 13th consumers of "data" read its split blobs 11 and 12
    nv = "mvn_param { normalize_variance: false across_channels: true }"
    for name, proto, split in (("mvn", "", 11), ("mvn_nv", nv, 12)):
        run = setup_layer(f'type: "MVN" {proto}', [x])
        assert_close(run.forward()[0], ref[f"data/{name}"], f"{name} data")
        run.top[0].diff[...] = ref[f"diff/{name}"]
        run.layer.backward_layer(run.top, [True], run.bottom)
        assert_close(run.bottom[0].diff, ref[f"diff/data_data_0_split_{split}"], f"{name} bottom diff")


# ---- blocks, partitions and the compiled kernels -------------------------------------------------------
@pytest.fixture(params=BODIES)
def body(request, monkeypatch):
    return select_body(request, monkeypatch)


# block budgets: one channel of one image per block (8 B * 24 cells > 64 B), or 3 whole images (3 * 3 * 24 * 8 B)
BLOCKS = [64, 1728]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("parts", [1, 3])
def test_batchnorm_in_blocks_and_partitions(body, parts, block, in_place, monkeypatch):
    """Batch statistics taken per image in blocks of images or channels, in the partitions, and combined in
    image order: the loop reference's statistics, normalization, running sums and gradient; global statistics
    likewise — in place or not, by the compiled kernels or the numpy bodies."""
    monkeypatch.setattr(partition, "BLOCK_BYTES", block)
    x, td = rand(7, 3, 4, 6), rand(7, 3, 4, 6)
    eps = float(np.float32(1e-5))
    with settings.override(partitions=parts):
        run = setup_layer('type: "BatchNorm"', [x], in_place=in_place, dtype=np.float64)
        (y,) = run.forward()
        mean, var = bn_stats(x)
        np.testing.assert_allclose(y, bn_apply(x, mean, var, eps), rtol=1e-10, atol=1e-12)
        m = x.size // 3
        np.testing.assert_allclose(run.layer.blobs[0].data, mean, rtol=1e-12)
        np.testing.assert_allclose(run.layer.blobs[1].data, var * m / (m - 1), rtol=1e-12)
        run.top[0].diff[...] = td
        run.layer.backward_layer(run.top, [True], run.bottom)
        axes = (0, 2, 3)
        want = (td - td.mean(axis=axes, keepdims=True) - y * (td * y).mean(axis=axes, keepdims=True)) / \
            np.sqrt(var + eps).reshape(1, 3, 1, 1)
        np.testing.assert_allclose(run.bottom[0].diff, want, rtol=1e-9, atol=1e-12)

        text = f'type: "BatchNorm" {blobs_text([1.0, -2.0, 0.5], [8.0, 0.5, 2.0], 2.0)}'
        run = setup_layer(text, [x], in_place=in_place, phase=pb.TEST, dtype=np.float64)
        (y,) = run.forward()
        std = np.sqrt(np.array([4.0, 0.25, 1.0]) + eps).reshape(1, 3, 1, 1)
        np.testing.assert_allclose(y, (x - np.array([0.5, -1.0, 0.25]).reshape(1, 3, 1, 1)) / std, rtol=1e-12)
        run.top[0].diff[...] = td
        run.layer.backward_layer(run.top, [True], run.bottom)
        np.testing.assert_allclose(run.bottom[0].diff, td / std, rtol=1e-12)


def test_batchnorm_statistics_do_not_depend_on_the_partitions(body):
    """The same bits for any number of partitions (each image's statistics alone, combined in image order)."""
    x = rand(6, 4, 3, 5).astype(np.float32)
    outs = []
    for parts in (1, 2, 4):
        with settings.override(partitions=parts):
            run = setup_layer('type: "BatchNorm"', [x], dtype=np.float32)
            outs.append((run.forward()[0], run.layer.blobs[0].data.copy(), run.layer.blobs[1].data.copy()))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
