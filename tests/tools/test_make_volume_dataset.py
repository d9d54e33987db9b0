"""tools/make_volume_dataset.py writes the HDF5 volumes, and the ZNN-style 3-D nets in models/znn train on them
(a few iterations of ``cct train`` on a tmp copy of each solver)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.reference import REPO

h5py = pytest.importorskip("h5py")


def _tool():
    spec = importlib.util.spec_from_file_location("cct_tools_make_volume_dataset",
                                                  REPO / "tools" / "make_volume_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("volumes")
    assert _tool().main(["--out", str(out), "--train", "16", "--test", "8", "--volume", "40"]) == 0
    return out


def test_dataset_shapes_and_labels(dataset):
    with h5py.File(dataset / "train.h5", "r") as f:
        data, label = f["data"][...], f["label"][...]
    assert data.shape == (16, 1, 32, 32, 32) and data.dtype == np.float32
    assert label.shape == (16, 1, 8, 8, 8) and set(np.unique(label)) <= {0.0, 1.0}
    assert 0.0 <= data.min() and data.max() <= 1.0
    assert 0.2 < label.mean() < 0.7  # both classes well represented
    # membranes are dark: the labelled voxels are darker on average
    centre = data[:, :, 2::4, 2::4, 2::4]
    assert centre[label == 1].mean() < centre[label == 0].mean() - 0.1
    assert (dataset / "test.txt").read_text().split() == [str(dataset / "test.h5")]


@pytest.mark.parametrize("net", ["ctmctmctct", "cpcpcccc"])
def test_znn_net_trains_a_few_iterations(net, dataset, tmp_path):
    src = REPO / "models" / "znn" / net
    net_text = (src / "train_test.prototxt").read_text().replace("models/znn/data/", f"{dataset}/")
    (tmp_path / "train_test.prototxt").write_text(net_text)
    solver = (src / "solver.prototxt").read_text()
    for key, value in (("max_iter", "3"), ("test_interval", "3"), ("test_iter", "1"), ("display", "1"),
                       ("snapshot", "0")):
        solver = re.sub(rf"^{key}: .*$", f"{key}: {value}", solver, flags=re.M)
    solver = re.sub(r"^net: .*$", f'net: "{tmp_path}/train_test.prototxt"', solver, flags=re.M)
    solver = re.sub(r"^snapshot_prefix: .*$", f'snapshot_prefix: "{tmp_path}/{net}"', solver, flags=re.M)
    (tmp_path / "solver.prototxt").write_text(solver)
    run = subprocess.run([sys.executable, "-m", "cct", "train", "-solver", str(tmp_path / "solver.prototxt")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"Iteration \d+ \(.*\), loss = ([\d.]+)", run.stderr)]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert "Test net output #0: accuracy" in run.stderr


def test_inference_volume(tmp_path):
    """--inference-volume writes one volume slab by slab (no seams between slabs) that cct infer reads."""
    assert _tool().main(["--out", str(tmp_path), "--inference-volume", "40", "--only-inference"]) == 0
    assert not (tmp_path / "train.h5").exists()
    with h5py.File(tmp_path / "volume.h5", "r") as f:
        raw, membrane = f["raw"][...], f["membrane"][...]
    assert raw.shape == membrane.shape == (40, 40, 40) and raw.dtype == np.float32
    assert 0.2 < membrane.mean() < 0.7
    assert raw[membrane == 1].mean() < raw[membrane == 0].mean() - 0.1
    whole = tmp_path / "whole"
    tool = _tool()
    import numpy.random as npr

    tool.write_inference_volume(whole, 40, 14.0, npr.default_rng(9), slab=40)
    tool.write_inference_volume(tmp_path / "slabs", 40, 14.0, npr.default_rng(9), slab=16)
    with h5py.File(whole, "r") as a, h5py.File(tmp_path / "slabs", "r") as b:
        np.testing.assert_array_equal(a["membrane"][...], b["membrane"][...])  # the same cells, no seams
