"""Gradient memory shared between blobs never alive at once (cct.exec.diff_memory): the same numbers, bit for
bit, even when every shared buffer holds NaN before the pass; what must keep its own buffer keeps it; the
command line shares, the Python API does not unless asked."""
from __future__ import annotations

import numpy as np
import pytest

import cct
from cct.exec.diff_memory import share_diff_memory

FILLERS = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.2 }'

NET = f"""
name: "mixed"
layer {{ name: "in" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 4 dim: 3 dim: 12 dim: 12 }} shape {{ dim: 4 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 {FILLERS} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param {{ local_size: 3 }} }}
layer {{ name: "a" type: "Convolution" bottom: "norm1" top: "a"
        convolution_param {{ num_output: 4 kernel_size: 1 {FILLERS} }} }}
layer {{ name: "b" type: "Convolution" bottom: "norm1" top: "b"
        convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {FILLERS} }} }}
layer {{ name: "bn" type: "BatchNorm" bottom: "b" top: "b" }}
layer {{ name: "scale" type: "Scale" bottom: "b" top: "b" scale_param {{ bias_term: true }} }}
layer {{ name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" }}
layer {{ name: "cat" type: "Concat" bottom: "sum" bottom: "norm1" top: "cat" }}
layer {{ name: "sig" type: "Sigmoid" bottom: "cat" top: "sig" }}
layer {{ name: "pool2" type: "Pooling" bottom: "sig" top: "pool2"
        pooling_param {{ pool: AVE kernel_size: 3 stride: 2 }} }}
layer {{ name: "flat" type: "Flatten" bottom: "pool2" top: "flat" }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "flat" top: "ip1"
        inner_product_param {{ num_output: 10 {FILLERS} }} }}
layer {{ name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param {{ num_output: 3 {FILLERS} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" }}
"""


def _net(tmp_path, text: str = NET):
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    net = cct.Net(str(path), cct.TRAIN)
    rng = np.random.default_rng(3)
    for ps in net.params.values():
        for p in ps:
            p.data[...] = rng.standard_normal(p.data.shape).astype(p.data.dtype) * 0.3
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    if "label" in net.blobs:
        net.blobs["label"].data[...] = rng.integers(0, 3, net.blobs["label"].data.shape)
    return net


def _step(net, poison: list | None = None) -> dict[str, np.ndarray]:
    """One forward and backward; the parameters' gradients, then a plain update."""
    cct.set_random_seed(11)  # the same Dropout mask for every net
    net.forward()
    for blobs in poison or []:  # what a shared buffer holds before the pass must not matter
        blobs[0].buffer("diff").array.fill(np.nan)
    net.clear_param_diffs()
    net.backward()
    out = {f"{n}.{j}": p.diff.copy() for n, ps in net.params.items() for j, p in enumerate(ps)}
    for ps in net.params.values():
        for p in ps:
            p.data[...] -= 0.1 * p.diff
    return out


def test_shared_gradients_give_the_same_steps_bit_for_bit_whatever_the_buffers_held(tmp_path):
    plain, shared = _net(tmp_path), _net(tmp_path)
    sharing = shared.share_diff_memory()
    assert sharing.buffers and sharing.buffers < sharing.blobs and sharing.bytes_after < sharing.bytes_before
    assert "shared buffers" in sharing.describe()
    for _ in range(3):
        want, got = _step(plain), _step(shared, poison=sharing.slots)
        assert want.keys() == got.keys()
        for k in want:
            assert np.array_equal(want[k], got[k]), k
            assert np.isfinite(got[k]).all(), k


def _slot_of(sharing, blob):
    return next((i for i, slot in enumerate(sharing.slots) if any(b is blob for b in slot)), None)


def test_what_must_keep_its_gradient_keeps_its_own_buffer(tmp_path):
    net = _net(tmp_path)
    sharing = net.share_diff_memory()
    for name in ("loss", "acc", "label", "data"):  # a loss weight, an output, gradients nobody needs
        assert _slot_of(sharing, net.blobs[name]) is None, name
    assert net.blobs["loss"].diff[()] == 1  # its loss weight, as setup left it
    # blobs sharing memory already (in place, Flatten) stay together
    assert net.blobs["flat"].shares_diff_with(net.blobs["pool2"])
    slot = _slot_of(sharing, net.blobs["pool2"])
    assert slot is not None and slot == _slot_of(sharing, net.blobs["flat"])
    # no layer touches two blobs of one buffer (but those sharing by design: Flatten's top is its bottom's view)
    for i, layer in enumerate(net.layers):
        if layer.type in ("Flatten", "Reshape"):
            continue
        blobs = {id(b): b for b in net.top_vecs[i] + net.bottom_vecs[i]}.values()
        slots = [s for s in (_slot_of(sharing, b) for b in blobs) if s is not None]
        assert len(slots) == len(set(slots)), net._layer_names[i]


def test_a_gradient_read_before_anything_writes_it_keeps_its_zeros(tmp_path):
    """A bottom its consumer does not propagate to (propagate_down: false) is still read by its producer's
    backward: Caffe gives it the zeros it was allocated with, and so does a shared net."""
    text = NET.replace('top: "sig" }', 'top: "sig" propagate_down: false }')
    plain, shared = _net(tmp_path, text), _net(tmp_path, text)
    sharing = shared.share_diff_memory()
    assert _slot_of(sharing, shared.blobs["cat"]) is None
    want, got = _step(plain), _step(shared, poison=sharing.slots)
    for k in want:
        assert np.array_equal(want[k], got[k]), k


def test_other_executors_leave_the_blobs_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_EXECUTOR", "taskgraph")
    net = _net(tmp_path)
    sharing = share_diff_memory(net)
    assert sharing.buffers == 0 and "the passes run on" in sharing.describe()


@pytest.mark.parametrize("value, flags, shared", [(None, [], True), ("0", [], False),
                                                  (None, ["-share_diffs", "0"], False),
                                                  ("0", ["-share_diffs", "1"], True)])  # the flag wins
def test_cct_time_shares_unless_told_not_to(tmp_path, monkeypatch, value, flags, shared):
    from cct.cli import main
    from tests.solvers.helpers import captured_log

    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    if value is not None:
        monkeypatch.setenv("CCT_SHARE_DIFFS", value)
    with captured_log() as buf:
        assert main(["time", "-model", str(path), "-iterations", "1"] + flags) == 0
    assert ("shared buffers" in buf.getvalue()) == shared


def test_cct_train_with_shared_gradients_writes_the_same_weights(tmp_path, monkeypatch):
    """``cct train`` from an LMDB, with and without the sharing: the same .caffemodel, byte for byte."""
    from cct.cli import main
    from tests.helpers import datum_lmdb
    from tests.solvers.helpers import captured_log

    monkeypatch.chdir(tmp_path)
    datum_lmdb(tmp_path / "db", records=12, side=12, seed=4)
    data = ('layer { name: "in" type: "Data" top: "data" top: "label" transform_param { scale: 0.0039 } '
            'data_param { source: "db" batch_size: 4 backend: LMDB } }')
    start, end = NET.index('layer {{ name: "in"'.replace("{{", "{")), NET.index('layer { name: "conv1"')
    (tmp_path / "net.prototxt").write_text(NET[:start] + data + "\n" + NET[end:])
    weights = {}
    for share in ("0", "1"):
        (tmp_path / "solver.prototxt").write_text(
            f'net: "net.prototxt" base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 lr_policy: "fixed" '
            f'max_iter: 5 snapshot_prefix: "s{share}" random_seed: 5 solver_mode: CPU')
        monkeypatch.setenv("CCT_SHARE_DIFFS", share)
        with captured_log() as buf:
            assert main(["train", "-solver", "solver.prototxt"]) == 0
        assert ("shared buffers" in buf.getvalue()) == (share == "1")
        weights[share] = (tmp_path / f"s{share}_iter_5.caffemodel").read_bytes()
    assert weights["0"] == weights["1"]
