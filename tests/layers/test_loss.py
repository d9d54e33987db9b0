"""Loss layers: forward against straightforward references, gradients for every mode, errors."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers.loss  # noqa: F401  (registers the layers even if other layer modules are unfinished)
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer
from cct.proto import caffe_pb2 as pb
from tests.helpers import BODIES, select_body

FLT_MIN = float(np.finfo(np.float32).tiny)
NORMS = ["FULL", "VALID", "BATCH_SIZE", "NONE"]


@pytest.fixture(params=BODIES)
def body(request, monkeypatch):
    """SoftmaxWithLoss's backward by the compiled kernels (where built) and by its numpy body."""
    return select_body(request, monkeypatch)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def forward(text: str, bottoms, num_tops=None, dtype=np.float64):
    run = setup_layer(text, bottoms, num_tops, dtype=dtype)
    return run, run.forward()


def softmax_rows(rows: np.ndarray) -> np.ndarray:
    e = np.exp(rows - rows.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def rows_and_labels(x: np.ndarray, labels: np.ndarray, axis: int):
    """Score vectors (outer·inner × C) in Caffe's (outer, inner) order, and the flat labels."""
    xm = np.moveaxis(x, axis, -1)
    return xm.reshape(-1, xm.shape[-1]), labels.reshape(-1)


def ref_normalizer(mode: str, outer: int, inner: int, valid: int) -> float:
    value = {"FULL": outer * inner, "VALID": valid, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return max(1.0, float(value))


def loss_fields(ignore=None, norm=None) -> str:
    text = f" ignore_label: {ignore}" if ignore is not None else ""
    return text + (f" normalization: {norm}" if norm else "")


def outer_inner(shape, axis):
    axis = axis % len(shape)
    return int(np.prod(shape[:axis])), int(np.prod(shape[axis + 1:]))


# ---- SoftmaxWithLoss -------------------------------------------------------------------------
def ref_softmax_loss(x, labels, axis=1, ignore=None, mode="VALID"):
    rows, lab = rows_and_labels(x, labels, axis)
    loss, count = 0.0, 0
    for r, l in zip(rows, lab):
        if ignore is not None and int(l) == ignore:
            continue
        e = np.exp(r - r.max())
        loss -= np.log(max(e[int(l)] / e.sum(), FLT_MIN))
        count += 1
    return loss / ref_normalizer(mode, *outer_inner(x.shape, axis), count)


def swl(axis=None, ignore=None, norm=None, normalize=None, extra="") -> str:
    lp = ""
    if ignore is not None:
        lp += f" ignore_label: {ignore}"
    if norm is not None:
        lp += f" normalization: {norm}"
    if normalize is not None:
        lp += f" normalize: {'true' if normalize else 'false'}"
    sp = f"softmax_param {{ axis: {axis} }}" if axis is not None else ""
    return f'type: "SoftmaxWithLoss" {sp} loss_param {{ {lp} }} {extra}'


def class_labels(shape, classes, seed=1, ignore=None, ignore_frac=0.3):
    lab = rng(seed).integers(0, classes, size=shape).astype(np.float64)
    if ignore is not None:
        mask = rng(seed + 1).random(shape) < ignore_frac
        mask.flat[0] = True
        mask.flat[-1] = False
        lab[mask] = ignore
    return lab


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("ignore", [None, 2])
def test_softmax_loss_forward_normalizations(norm, ignore):
    x = rng().standard_normal((3, 4, 2, 2))
    lab = class_labels((3, 1, 2, 2), 4, ignore=ignore)
    _, (loss,) = forward(swl(ignore=ignore, norm=norm), [x, lab])
    np.testing.assert_allclose(loss, ref_softmax_loss(x, lab, 1, ignore, norm), rtol=1e-12)


@pytest.mark.parametrize("normalize,mode", [(True, "VALID"), (False, "BATCH_SIZE")])
def test_softmax_loss_legacy_normalize(normalize, mode):
    x = rng().standard_normal((3, 4, 2))
    lab = class_labels((3, 2), 4, ignore=1)
    _, (loss,) = forward(swl(ignore=1, normalize=normalize), [x, lab])
    np.testing.assert_allclose(loss, ref_softmax_loss(x, lab, 1, 1, mode), rtol=1e-12)
    # an explicit normalization wins over normalize
    _, (loss,) = forward(swl(ignore=1, normalize=normalize, norm="FULL"), [x, lab])
    np.testing.assert_allclose(loss, ref_softmax_loss(x, lab, 1, 1, "FULL"), rtol=1e-12)


@pytest.mark.parametrize("shape,axis,label_shape", [((2, 3, 4, 5), 2, (2, 3, 5)), ((2, 3, 4), -1, (2, 3)),
                                                    ((6, 4), 1, (6,))])
def test_softmax_loss_axis(shape, axis, label_shape):
    x = rng().standard_normal(shape)
    lab = class_labels(label_shape, shape[axis])
    _, (loss,) = forward(swl(axis=axis), [x, lab])
    np.testing.assert_allclose(loss, ref_softmax_loss(x, lab, axis), rtol=1e-12)


def test_softmax_loss_labels_truncated_and_flt_min_clamp():
    x = np.array([[0.0, -1000.0, 1.0]])
    lab = np.array([1.9])  # truncates to 1, whose probability underflows to 0
    _, (loss,) = forward(swl(), [x, lab], dtype=np.float32)
    np.testing.assert_allclose(loss, -np.log(FLT_MIN), rtol=1e-6)


def test_softmax_loss_all_ignored_is_zero():
    x = rng().standard_normal((2, 3))
    _, (loss,) = forward(swl(ignore=0), [x, np.zeros(2)])
    assert loss == 0.0


def test_softmax_loss_second_top_is_probabilities():
    x = rng().standard_normal((2, 3, 2))
    lab = class_labels((2, 2), 3)
    run, (loss, prob) = forward(swl(extra="loss_weight: 1 loss_weight: 0"), [x, lab], num_tops=2)
    np.testing.assert_allclose(prob, np.moveaxis(softmax_rows(np.moveaxis(x, 1, -1).reshape(-1, 3))
                                                 .reshape(2, 2, 3), -1, 1), rtol=1e-12)
    assert run.top[0].shape == ()
    assert run.top[1].shape == x.shape


def test_softmax_loss_two_tops_need_two_loss_weights():
    with pytest.raises(ParamError, match="loss_weight"):
        setup_layer(swl(), [np.zeros((2, 3)), np.zeros(2)], num_tops=2)


def test_softmax_loss_float32_matches_reference():
    x = rng().standard_normal((4, 10, 3)).astype(np.float32)
    lab = class_labels((4, 3), 10)
    _, (loss,) = forward(swl(), [x, lab], dtype=np.float32)
    np.testing.assert_allclose(loss, ref_softmax_loss(x.astype(np.float64), lab), rtol=1e-5)


@pytest.mark.parametrize("bad", [3.0, -1.0, 7.5])
def test_label_out_of_range(bad):
    lab = np.array([0.0, bad])
    with pytest.raises(CctError, match=f"label value {bad:g}"):
        forward(swl(), [rng().standard_normal((2, 3)), lab])
    # the ignore label itself may lie outside [0, C)
    forward(swl(ignore=int(bad)), [rng().standard_normal((2, 3)), lab])


def test_label_count_mismatch():
    with pytest.raises(CctError, match="number of labels"):
        setup_layer(swl(), [np.zeros((2, 3, 4)), np.zeros((2, 3))])


def test_first_dimension_mismatch():
    with pytest.raises(CctError, match="first dimension"):
        setup_layer(swl(axis=2), [np.zeros((2, 3, 4)), np.zeros((6,))])


def test_softmax_axis_out_of_range():
    with pytest.raises(ParamError, match="softmax_param.axis"):
        setup_layer(swl(axis=3), [np.zeros((2, 3, 4)), np.zeros(2)])


def test_no_backprop_to_labels():
    run = setup_layer(swl(), [rng().standard_normal((2, 3)), np.array([0.0, 1.0])])
    run.forward()
    with pytest.raises(CctError, match="label"):
        run.layer.backward_layer(run.top, [True, True], run.bottom)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("ignore", [None, 1])
def test_softmax_loss_gradient(norm, ignore, body):
    x = rng(4).standard_normal((2, 3, 2, 2))
    lab = class_labels((2, 1, 2, 2), 3, seed=5, ignore=ignore)
    check_gradient(swl(ignore=ignore, norm=norm), [x, lab], check_bottoms=[0])


@pytest.mark.parametrize("ignore", [None, 1])
def test_softmax_loss_float32_gradient_has_caffes_roundings(ignore, body):
    """The gradient is bitwise Caffe's sequence in float32: copy p, subtract 1 at each label, zero the ignored
    positions, scale by loss weight / normalizer."""
    x = rng(8).standard_normal((5, 7, 3)).astype(np.float32)
    lab = class_labels((5, 3), 7, seed=9, ignore=ignore)
    run = setup_layer(swl(ignore=ignore, extra="loss_weight: 3"), [x, lab], dtype=np.float32)
    run.forward()
    run.layer.backward_layer(run.top, [True, False], run.bottom)
    p = run.layer.prob.data.copy()
    valid = np.ones((5, 3), bool) if ignore is None else lab != ignore
    want = p.copy()
    o, i = np.nonzero(valid)
    want[o, lab[o, i].astype(int), i] -= np.float32(1)
    want *= valid[:, None, :]
    want *= np.float32(3) / np.float32(valid.sum())
    np.testing.assert_array_equal(run.bottom[0].diff, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["plain", "ignored", "all ignored", "axis 2", "negative weight"])
def test_softmax_loss_backward_bodies_agree_bit_for_bit(dtype, case, monkeypatch):
    """The compiled backward gives the numpy body's bits: truncated fractional labels, an ignore label outside
    [0, C), ignored positions (-0 under a negative weight), classes along an inner axis."""
    from cct import native

    if native.kernels() is None:
        pytest.skip("compiled kernels not built (no C compiler at install)")
    shape, axis, ignore, weight = (4, 6, 3), 1, None, 3
    lab = rng(2).integers(0, 6, size=(4, 3)) + rng(3).random((4, 3)) * 0.9
    if case in ("ignored", "all ignored", "negative weight"):
        ignore = -1
        lab[rng(4).random((4, 3)) < (1.0 if case == "all ignored" else 0.4)] = -1.5
    if case == "axis 2":
        shape, axis = (4, 3, 6), 2
    if case == "negative weight":
        weight = -2
    x = rng(5).standard_normal(shape).astype(dtype) * 4
    text = swl(axis=axis, ignore=ignore, norm="VALID", extra=f"loss_weight: {weight}")
    grads = []
    for switch in ("1", "0"):
        monkeypatch.setenv("CCT_NATIVE", switch)
        run = setup_layer(text, [x, lab.astype(dtype)], dtype=dtype)
        run.forward()
        run.bottom[0].diff[...] = np.nan
        run.layer.backward_layer(run.top, [True, False], run.bottom)
        grads.append(run.bottom[0].diff.copy())
    bits = np.uint32 if dtype is np.float32 else np.uint64
    np.testing.assert_array_equal(grads[0].view(bits), grads[1].view(bits))
    if case == "negative weight":
        ignored = np.moveaxis(grads[0], 1, -1)[lab == -1.5]
        assert ignored.size and not ignored.any() and np.signbit(ignored).any()


def test_softmax_loss_backward_refuses_a_label_changed_out_of_range(body):
    run = setup_layer(swl(), [rng().standard_normal((2, 3)).astype(np.float32), np.array([0.0, 1.0])],
                      dtype=np.float32)
    run.forward()
    run.bottom[1].data[1] = 3
    with pytest.raises(CctError, match="label value 3"):
        run.layer.backward_layer(run.top, [True, False], run.bottom)


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_loss_gradient_legacy_normalize(normalize, body):
    x = rng(4).standard_normal((3, 4))
    lab = class_labels((3,), 4, seed=5, ignore=2)
    check_gradient(swl(ignore=2, normalize=normalize), [x, lab], check_bottoms=[0])


@pytest.mark.parametrize("shape,axis,label_shape", [((2, 3, 4, 2), 2, (2, 3, 2)), ((2, 3, 4), -1, (2, 3))])
def test_softmax_loss_gradient_axis(shape, axis, label_shape, body):
    x = rng(6).standard_normal(shape)
    check_gradient(swl(axis=axis), [x, class_labels(label_shape, shape[axis])], check_bottoms=[0])


def test_softmax_loss_gradient_with_prob_top(body):
    x = rng(7).standard_normal((3, 4))
    check_gradient(swl(extra="loss_weight: 2 loss_weight: 0"), [x, class_labels((3,), 4)],
                   num_tops=2, top_indices=[0], check_bottoms=[0])


# ---- InfogainLoss ----------------------------------------------------------------------------
def ref_infogain(x, labels, h, axis=1, ignore=None, mode="VALID"):
    rows, lab = rows_and_labels(x, labels, axis)
    p = softmax_rows(rows)
    loss, count = 0.0, 0
    for pr, l in zip(p, lab):
        if ignore is not None and int(l) == ignore:
            continue
        loss -= sum(h[int(l), j] * np.log(max(pr[j], 1e-20)) for j in range(len(pr)))
        count += 1
    return loss / ref_normalizer(mode, *outer_inner(x.shape, axis), count)


def infogain(axis=None, ignore=None, norm=None, source=None, extra="") -> str:
    lp = loss_fields(ignore, norm)
    ip = (f" axis: {axis}" if axis is not None else "") + (f' source: "{source}"' if source else "")
    return f'type: "InfogainLoss" infogain_loss_param {{ {ip} }} loss_param {{ {lp} }} {extra}'


def write_h(path, h: np.ndarray, legacy: bool = True) -> str:
    proto = pb.BlobProto()
    if legacy:
        proto.num, proto.channels, proto.height, proto.width = 1, 1, *h.shape
    else:
        proto.shape.dim.extend(h.shape)
    proto.data.extend(h.ravel().tolist())
    path.write_bytes(proto.SerializeToString())
    return str(path)


def random_h(c: int, seed: int = 8) -> np.ndarray:
    return rng(seed).random((c, c)) + np.eye(c)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("ignore", [None, 0])
def test_infogain_forward_bottom_h(norm, ignore):
    x = rng().standard_normal((3, 4, 2))
    lab = class_labels((3, 2), 4, ignore=ignore)
    h = random_h(4)
    _, (loss,) = forward(infogain(ignore=ignore, norm=norm), [x, lab, h])
    np.testing.assert_allclose(loss, ref_infogain(x, lab, h, 1, ignore, norm), rtol=1e-12)


def test_infogain_identity_equals_softmax_loss():
    x = rng().standard_normal((5, 3))
    lab = class_labels((5,), 3)
    _, (a,) = forward(infogain(), [x, lab, np.eye(3)])
    _, (b,) = forward(swl(), [x, lab])
    np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("legacy", [True, False])
def test_infogain_source_file(tmp_path, legacy):
    h = random_h(3).astype(np.float32).astype(np.float64)
    src = write_h(tmp_path / "h.binaryproto", h, legacy)
    x = rng().standard_normal((2, 2, 3))  # classes on the last axis: outer = 2·2, inner = 1
    lab = class_labels((2, 2), 3)
    run, (loss, prob) = forward(infogain(axis=2, source=src, extra="loss_weight: 1 loss_weight: 0"),
                                [x, lab], num_tops=2)
    np.testing.assert_allclose(loss, ref_infogain(x, lab, h, 2), rtol=1e-12)
    np.testing.assert_allclose(prob.reshape(-1, 3), softmax_rows(x.reshape(-1, 3)), rtol=1e-12)


def test_infogain_errors(tmp_path):
    x, lab = np.zeros((2, 3)), np.zeros(2)
    with pytest.raises(ParamError, match="infogain_loss_param.source"):
        setup_layer(infogain(), [x, lab])
    with pytest.raises(ParamError, match="infogain_loss_param.source"):
        setup_layer(infogain(source=str(tmp_path / "missing.binaryproto")), [x, lab])
    bad = tmp_path / "bad.binaryproto"
    bad.write_bytes(b"\xff\xff\xff")
    with pytest.raises(ParamError, match="infogain_loss_param.source"):
        setup_layer(infogain(source=str(bad)), [x, lab])
    with pytest.raises(ParamError, match="loss_param.normalize"):
        setup_layer('type: "InfogainLoss" loss_param { normalize: true }', [x, lab, np.eye(3)])
    with pytest.raises(CctError, match="infogain matrix"):
        setup_layer(infogain(), [x, lab, np.eye(2)])
    with pytest.raises(ParamError, match="infogain_loss_param.axis"):
        setup_layer(infogain(axis=-3), [x, lab, np.eye(3)])


def test_infogain_no_backprop_to_h():
    run = setup_layer(infogain(), [rng().standard_normal((2, 3)), np.array([0.0, 2.0]), np.eye(3)])
    run.forward()
    with pytest.raises(CctError, match="infogain matrix"):
        run.layer.backward_layer(run.top, [True, False, True], run.bottom)
    assert not run.layer.allow_force_backward(2)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("ignore", [None, 1])
def test_infogain_gradient_bottom_h(norm, ignore):
    x = rng(9).standard_normal((2, 3, 2))
    lab = class_labels((2, 2), 3, seed=10, ignore=ignore)
    check_gradient(infogain(ignore=ignore, norm=norm), [x, lab, random_h(3)], check_bottoms=[0])


def test_infogain_gradient_source_axis(tmp_path):
    src = write_h(tmp_path / "h.binaryproto", random_h(4))
    x = rng(11).standard_normal((2, 3, 4))
    check_gradient(infogain(axis=-1, source=src), [x, class_labels((2, 3), 4)], check_bottoms=[0])


# ---- EuclideanLoss ---------------------------------------------------------------------------
def test_euclidean_forward():
    a, b = rng().standard_normal((3, 4)), rng(1).standard_normal((3, 2, 2))
    _, (loss,) = forward('type: "EuclideanLoss"', [a, b])
    np.testing.assert_allclose(loss, ((a - b.reshape(3, 4)) ** 2).sum() / 6, rtol=1e-12)


def test_euclidean_gradient_both_bottoms():
    a, b = rng(2).standard_normal((3, 2, 2)), rng(3).standard_normal((3, 4))
    check_gradient('type: "EuclideanLoss"', [a, b])


def test_euclidean_force_backward_and_shape_check():
    run = setup_layer('type: "EuclideanLoss"', [np.zeros((2, 3)), np.zeros((2, 3))])
    assert run.layer.allow_force_backward(0) and run.layer.allow_force_backward(1)
    with pytest.raises(CctError, match="same dimension"):
        setup_layer('type: "EuclideanLoss"', [np.zeros((2, 3)), np.zeros((2, 4))])


# ---- SigmoidCrossEntropyLoss -----------------------------------------------------------------
def ref_sigmoid_ce(x, t, ignore=None, mode="BATCH_SIZE"):
    loss, count = 0.0, 0
    for xv, tv in zip(x.ravel(), t.ravel()):
        if ignore is not None and int(tv) == ignore:
            continue
        p = 1 / (1 + np.exp(-xv))
        loss -= tv * np.log(p) + (1 - tv) * np.log(1 - p)
        count += 1
    n = x.shape[0]
    return loss / ref_normalizer(mode, n, x.size // n, count)


def sce(ignore=None, norm=None, normalize=None) -> str:
    lp = loss_fields(ignore, norm)
    if normalize is not None:
        lp += f" normalize: {'true' if normalize else 'false'}"
    return f'type: "SigmoidCrossEntropyLoss" loss_param {{ {lp} }}'


def sce_inputs(seed=0, ignore=None):
    x = rng(seed).standard_normal((3, 4)) * 2
    t = rng(seed + 1).random((3, 4))
    if ignore is not None:
        t[rng(seed + 2).random((3, 4)) < 0.3] = ignore
    return x, t


@pytest.mark.parametrize("norm", [None, *NORMS])
@pytest.mark.parametrize("ignore", [None, -1])
def test_sigmoid_ce_forward(norm, ignore):
    x, t = sce_inputs(ignore=ignore)
    _, (loss,) = forward(sce(ignore, norm), [x, t])
    np.testing.assert_allclose(loss, ref_sigmoid_ce(x, t, ignore, norm or "BATCH_SIZE"), rtol=1e-10)


@pytest.mark.parametrize("normalize,mode", [(True, "VALID"), (False, "BATCH_SIZE")])
def test_sigmoid_ce_legacy_normalize(normalize, mode):
    x, t = sce_inputs(ignore=-1)
    _, (loss,) = forward(sce(-1, normalize=normalize), [x, t])
    np.testing.assert_allclose(loss, ref_sigmoid_ce(x, t, -1, mode), rtol=1e-10)


def test_sigmoid_ce_stable_for_large_logits():
    x = np.array([[100.0, -100.0]], dtype=np.float32)
    _, (loss,) = forward(sce(), [x, np.array([[0.0, 1.0]])], dtype=np.float32)
    np.testing.assert_allclose(loss, 200.0, rtol=1e-6)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("ignore", [None, -1])
def test_sigmoid_ce_gradient(norm, ignore):
    x, t = sce_inputs(seed=3, ignore=ignore)
    check_gradient(sce(ignore, norm), [x, t], check_bottoms=[0])


def test_sigmoid_ce_count_mismatch():
    with pytest.raises(CctError, match="same count"):
        setup_layer(sce(), [np.zeros((2, 3)), np.zeros((2, 2))])


# ---- HingeLoss -------------------------------------------------------------------------------
def ref_hinge(x, labels, norm):
    n = x.shape[0]
    x2 = x.reshape(n, -1)
    total = 0.0
    for i in range(n):
        for j in range(x2.shape[1]):
            s = -1.0 if j == int(labels.ravel()[i]) else 1.0
            d = max(0.0, 1 + s * x2[i, j])
            total += d if norm == "L1" else d * d
    return total / n


def hinge(norm=None) -> str:
    return f'type: "HingeLoss" hinge_loss_param {{ norm: {norm} }}' if norm else 'type: "HingeLoss"'


@pytest.mark.parametrize("norm", [None, "L1", "L2"])
def test_hinge_forward(norm):
    x = rng().standard_normal((4, 3, 1, 1))
    lab = class_labels((4, 1, 1, 1), 3)
    _, (loss,) = forward(hinge(norm), [x, lab])
    np.testing.assert_allclose(loss, ref_hinge(x, lab, norm or "L1"), rtol=1e-12)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_gradient(norm):
    x = rng(12).standard_normal((4, 5)) * 1.5
    check_gradient(hinge(norm), [x, class_labels((4,), 5, seed=13)], check_bottoms=[0])


def test_hinge_label_out_of_range():
    with pytest.raises(CctError, match="label value 5"):
        forward(hinge(), [np.zeros((2, 5)), np.array([0.0, 5.0])])


# ---- MultinomialLogisticLoss -----------------------------------------------------------------
def test_multinomial_forward_and_clamp():
    p = softmax_rows(rng().standard_normal((4, 3)))
    p[2, 1] = 0.0
    lab = np.array([0.0, 2.0, 1.0, 1.0])
    _, (loss,) = forward('type: "MultinomialLogisticLoss"', [p, lab.reshape(4, 1, 1, 1)])
    ref = -sum(np.log(max(p[i, int(lab[i])], 1e-20)) for i in range(4)) / 4
    np.testing.assert_allclose(loss, ref, rtol=1e-12)


def test_multinomial_gradient():
    p = rng(14).random((3, 4)) + 0.1
    check_gradient('type: "MultinomialLogisticLoss"', [p, class_labels((3,), 4)], check_bottoms=[0],
                   step=1e-4)


def test_multinomial_label_shape():
    with pytest.raises(CctError, match="N x 1 x 1 x 1"):
        setup_layer('type: "MultinomialLogisticLoss"', [np.zeros((2, 3)), np.zeros((2, 3))])


# ---- ContrastiveLoss -------------------------------------------------------------------------
def ref_contrastive(a, b, y, margin, legacy):
    n = a.shape[0]
    total = 0.0
    for i in range(n):
        d2 = float(((a[i] - b[i]) ** 2).sum())
        if int(y.ravel()[i]):
            total += d2
        elif legacy:
            total += max(margin - d2, 0.0)
        else:
            total += max(margin - np.sqrt(d2), 0.0) ** 2
    return total / (2 * n)


def contrastive(margin=None, legacy=None) -> str:
    cp = (f" margin: {margin}" if margin is not None else "") + (
        f" legacy_version: {'true' if legacy else 'false'}" if legacy is not None else "")
    return f'type: "ContrastiveLoss" contrastive_loss_param {{ {cp} }}'


def pairs(seed=0, n=6, c=4, scale=1.0):
    a = rng(seed).standard_normal((n, c, 1, 1)) * scale
    b = rng(seed + 1).standard_normal((n, c, 1, 1)) * scale
    y = (rng(seed + 2).random((n, 1, 1, 1)) < 0.5).astype(np.float64)
    y[0], y[1] = 1.0, 0.0
    return a, b, y


@pytest.mark.parametrize("margin,legacy", [(None, None), (2.0, False), (3.0, True)])
def test_contrastive_forward(margin, legacy):
    a, b, y = pairs()
    _, (loss,) = forward(contrastive(margin, legacy), [a, b, y])
    ref = ref_contrastive(a, b, y, 1.0 if margin is None else margin, bool(legacy))
    np.testing.assert_allclose(loss, ref, rtol=1e-12)


def test_contrastive_gradient():
    # distances of a few units keep Caffe's 1e-4 guard in (d + 1e-4) below the tolerance
    a, b, y = pairs(seed=15, n=8, scale=2.0)
    check_gradient(contrastive(margin=6.0), [a, b, y], check_bottoms=[0, 1])


def test_contrastive_gradient_legacy():
    a, b, y = pairs(seed=16, n=8)
    check_gradient(contrastive(margin=8.0, legacy=True), [a, b, y], check_bottoms=[0, 1])


def test_contrastive_shapes_and_force_backward():
    a, b, y = pairs()
    run = setup_layer(contrastive(), [a, b, y])
    assert run.layer.allow_force_backward(0) and run.layer.allow_force_backward(1)
    assert not run.layer.allow_force_backward(2)
    with pytest.raises(CctError, match="ContrastiveLoss"):
        setup_layer(contrastive(), [np.zeros((2, 3, 2, 1)), np.zeros((2, 3, 2, 1)), np.zeros((2, 1))])
    with pytest.raises(ParamError, match="bottom"):
        setup_layer(contrastive(), [a, b])


# ---- against real Caffe (nets/losses of the reference outputs) --------------------------------
# Which split blob feeds which layer: Caffe numbers a blob's splits in the order of its consumers.
CAFFE_BOTTOMS = {
    "softmax_loss": ["x_data_0_split_0", "label"],
    "softmax_loss_ign": ["y_data_1_split_0", "label"],
    "softmax_loss_batch": ["x_data_0_split_1", "label"],
    "euclid": ["x_data_0_split_2", "y_data_1_split_1"],
    "sce": ["y_data_1_split_2", "target01"],
    "hinge_l1": ["x_data_0_split_3", "label"],
    "hinge_l2": ["y_data_1_split_3", "label"],
    "contrastive": ["pair_a", "pair_b", "sim"],
    "prob": ["y_data_1_split_4"],
    "mlogistic": ["prob", "label"],
}


@pytest.mark.parametrize("name", sorted(CAFFE_BOTTOMS))
def test_matches_caffe_reference(name):
    from google.protobuf import text_format

    from cct.layers.registry import create_layer
    from tests.reference import assert_close, reference_dir

    folder = reference_dir("nets", "losses")
    net = text_format.Parse((folder / "net.prototxt").read_text(), pb.NetParameter())
    param = next(lp for lp in net.layer if lp.name == name)
    param.phase = pb.TRAIN
    ref = np.load(folder / "train.npz")
    bottoms = [ref[f"data/{b}"] for b in CAFFE_BOTTOMS[name]]
    run = setup_layer(create_layer(param), bottoms, dtype=np.float32)
    (out,) = run.forward()
    assert_close(out, ref[f"data/{param.top[0]}"], f"{name} top")
    run.top[0].diff[...] = ref[f"diff/{param.top[0]}"]
    prop = [run.layer.allow_force_backward(i) for i in range(len(bottoms))]
    run.layer.backward_layer(run.top, prop, run.bottom)
    for i, b in enumerate(CAFFE_BOTTOMS[name]):
        if prop[i]:
            assert_close(run.bottom[i].diff, ref[f"diff/{b}"], f"{name} bottom {i} diff")
