"""Every blob, diff and parameter of Caffe's reference nets, both phases, within 1e-4 relative.

For each ``nets/NAME``: build ``cct.Net(net.prototxt, phase, weights=weights.caffemodel)``, feed the
recorded inputs, forward (and backward in TRAIN) and compare with what real Caffe produced.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import cct
from tests.reference import REFERENCE, assert_close, reference_dir

NETS = sorted(p.name for p in (REFERENCE / "nets").iterdir()) if (REFERENCE / "nets").exists() else []


def _run(name: str, phase: int):
    folder = reference_dir("nets", name)
    meta = json.loads((folder / "meta.json").read_text())
    ref = np.load(folder / ("train.npz" if phase == cct.TRAIN else "test.npz"))
    net = cct.Net(str(folder / "net.prototxt"), phase, weights=str(folder / "weights.caffemodel"))
    inputs = {k[len("input/"):]: ref[k] for k in ref.files if k.startswith("input/")}
    net.forward(**inputs)
    if phase == cct.TRAIN:
        net.clear_param_diffs()
        net.backward()
    return net, ref, meta


def check_matches_caffe(name: str, phase: int) -> None:
    """Every blob (and in TRAIN every diff), parameter and parameter gradient against Caffe's, 1e-4 relative."""
    net, ref, meta = _run(name, phase)
    tag = "TRAIN" if phase == cct.TRAIN else "TEST"
    assert list(net.blobs) == meta["train_blobs" if phase == cct.TRAIN else "test_blobs"]
    for key in ref.files:
        kind, _, rest = key.partition("/")
        if kind == "data":
            assert_close(net.blobs[rest].data, ref[key], f"{name} {tag} data/{rest}")
        elif kind == "diff" and phase == cct.TRAIN:
            assert_close(net.blobs[rest].diff, ref[key], f"{name} {tag} diff/{rest}")
        elif kind == "param" or (kind == "param_diff" and phase == cct.TRAIN):
            layer, _, i = rest.rpartition("/")
            blob = net.params[layer][int(i)]
            assert_close(blob.data if kind == "param" else blob.diff, ref[key], f"{name} {tag} {key}")


@pytest.mark.parametrize("name", NETS)
def test_train_phase_matches_caffe(name: str) -> None:
    check_matches_caffe(name, cct.TRAIN)


@pytest.mark.parametrize("name", NETS)
def test_test_phase_matches_caffe(name: str) -> None:
    check_matches_caffe(name, cct.TEST)


@pytest.mark.parametrize("name", NETS)
def test_net_surface_matches_meta(name: str) -> None:
    folder = reference_dir("nets", name)
    meta = json.loads((folder / "meta.json").read_text())
    net = cct.Net(str(folder / "net.prototxt"), cct.TRAIN, weights=str(folder / "weights.caffemodel"))
    assert net.inputs == meta["inputs"]
    assert net.outputs == meta["outputs"]
    assert {k: [list(b.shape) for b in v] for k, v in net.params.items()} == meta["params"]


def test_saved_weights_equal_caffe_file(tmp_path) -> None:
    """Saving what we loaded reproduces Caffe's weights (a round trip through our writer)."""
    folder = reference_dir("nets", "lenet")
    net = cct.Net(str(folder / "net.prototxt"), cct.TEST, weights=str(folder / "weights.caffemodel"))
    out = os.fspath(tmp_path / "w.caffemodel")
    net.save(out)
    again = cct.Net(str(folder / "net.prototxt"), cct.TEST, weights=out)
    for layer, blobs in net.params.items():
        for a, b in zip(blobs, again.params[layer]):
            np.testing.assert_array_equal(a.data, b.data)
