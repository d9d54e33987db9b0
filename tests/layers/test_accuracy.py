"""Accuracy: Caffe HEAD's tie rule, top-k, ignore_label, axis, per-class top, errors."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers.accuracy  # noqa: F401  (registers the layer even if other layer modules are unfinished)
from cct.errors import CctError, ParamError
from cct.gradient_check import setup_layer


def acc(top_k=None, axis=None, ignore=None) -> str:
    ap = "".join(f" {k}: {v}" for k, v in (("top_k", top_k), ("axis", axis), ("ignore_label", ignore))
                 if v is not None)
    return f'type: "Accuracy" accuracy_param {{ {ap} }}'


def ref_accuracy(x, labels, top_k=1, axis=1, ignore=None):
    """Per (outer, inner) position: correct iff #classes scoring >= the true class is <= top_k."""
    xm = np.moveaxis(x, axis, -1)
    rows, lab = xm.reshape(-1, xm.shape[-1]), labels.reshape(-1)
    classes = rows.shape[1]
    hits, seen = np.zeros(classes), np.zeros(classes)
    for r, l in zip(rows, lab):
        l = int(l)
        if ignore is not None and l == ignore:
            continue
        seen[l] += 1
        if sum(1 for v in r if v >= r[l]) <= top_k:
            hits[l] += 1
    total = hits.sum() / seen.sum() if seen.sum() else 0.0
    per_class = np.array([h / s if s else 0.0 for h, s in zip(hits, seen)])
    return total, per_class


def run_acc(text, x, lab, num_tops=2):
    run = setup_layer(text, [x, lab], num_tops=num_tops, dtype=np.float64)
    return run, run.forward()


def test_ties_count_against_the_true_class():
    x = np.array([[1.0, 1.0, 0.0],
                  [2.0, 1.0, 2.0],
                  [0.0, 3.0, 1.0]])
    lab = np.array([1.0, 0.0, 1.0])
    _, (top1, per_class) = run_acc(acc(), x, lab)
    # row 0: classes 0 and 1 tie → wrong for top-1 (Caffe 1.0 would have counted it right);
    # row 1: classes 0 and 2 tie → wrong; row 2: right.
    assert top1 == pytest.approx(1 / 3)
    np.testing.assert_allclose(per_class, [0.0, 0.5, 0.0])
    _, (top2, per_class2) = run_acc(acc(top_k=2), x, lab)
    assert top2 == pytest.approx(1.0)
    np.testing.assert_allclose(per_class2, [1.0, 1.0, 0.0])


@pytest.mark.parametrize("top_k", [1, 2, 3, 5])
def test_top_k_matches_reference(top_k):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(20, 5)).astype(np.float64)  # many ties
    lab = rng.integers(0, 5, size=20).astype(np.float64)
    _, (a, per) = run_acc(acc(top_k=top_k), x, lab)
    ref, ref_per = ref_accuracy(x, lab, top_k)
    assert a == pytest.approx(ref)
    np.testing.assert_allclose(per, ref_per)


@pytest.mark.parametrize("shape,axis,label_shape", [((2, 4, 3, 2), 1, (2, 3, 2)), ((2, 3, 4), 2, (2, 3)),
                                                    ((2, 3, 4), -1, (6,))])
def test_axis_with_spatial_dims(shape, axis, label_shape):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    lab = rng.integers(0, shape[axis], size=label_shape).astype(np.float64)
    _, (a, per) = run_acc(acc(top_k=2, axis=axis), x, lab)
    ref, ref_per = ref_accuracy(x, lab, 2, axis)
    assert a == pytest.approx(ref)
    np.testing.assert_allclose(per, ref_per)
    assert per.shape == (shape[axis],)


def test_ignore_label():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((10, 3))
    lab = rng.integers(0, 3, size=10).astype(np.float64)
    lab[[1, 4, 7]] = 255  # ignored labels may lie outside [0, C)
    _, (a, per) = run_acc(acc(ignore=255), x, lab)
    ref, ref_per = ref_accuracy(x, lab, 1, 1, 255)
    assert a == pytest.approx(ref)
    np.testing.assert_allclose(per, ref_per)


def test_nothing_counted_gives_zero():
    _, (a, per) = run_acc(acc(ignore=0), np.ones((3, 2)), np.zeros(3))
    assert a == 0.0
    np.testing.assert_array_equal(per, [0.0, 0.0])


def test_one_top_is_scalar():
    run, (a,) = run_acc(acc(), np.eye(3), np.array([0.0, 1.0, 2.0]), num_tops=1)
    assert a == 1.0 and a.shape == () and run.top[0].shape == ()


def test_labels_truncated():
    _, (a,) = run_acc(acc(), np.array([[0.0, 1.0], [1.0, 0.0]]), np.array([1.7, 0.2]), num_tops=1)
    assert a == 1.0


def test_errors():
    with pytest.raises(ParamError, match="accuracy_param.top_k"):
        setup_layer(acc(top_k=4), [np.zeros((2, 3)), np.zeros(2)])
    with pytest.raises(ParamError, match="accuracy_param.axis"):
        setup_layer(acc(axis=2), [np.zeros((2, 3)), np.zeros(2)])
    with pytest.raises(CctError, match="number of labels"):
        setup_layer(acc(), [np.zeros((2, 3, 2)), np.zeros((2, 3))])
    with pytest.raises(CctError, match="label value 3"):
        run_acc(acc(), np.zeros((2, 3)), np.array([0.0, 3.0]))


def test_no_backward():
    run, _ = run_acc(acc(), np.eye(2), np.array([0.0, 1.0]))
    run.layer.backward_layer(run.top, [False, False], run.bottom)
    with pytest.raises(CctError):
        run.layer.backward_layer(run.top, [True, False], run.bottom)


@pytest.mark.parametrize("name,scores", [("acc", "x"), ("acc_top2", "y")])
def test_matches_caffe_reference(name, scores):
    from google.protobuf import text_format

    from cct.layers.registry import create_layer
    from cct.proto import caffe_pb2 as pb
    from tests.reference import assert_close, reference_dir

    folder = reference_dir("nets", "losses")
    net = text_format.Parse((folder / "net.prototxt").read_text(), pb.NetParameter())
    param = next(lp for lp in net.layer if lp.name == name)
    param.phase = pb.TEST
    ref = np.load(folder / "test.npz")
    run = setup_layer(create_layer(param), [ref[f"data/{scores}"], ref["data/label"]], dtype=np.float32)
    assert_close(run.forward()[0], ref[f"data/{name}"], name)
