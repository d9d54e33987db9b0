"""The dense ZNN nets of ``models/znn/`` (max-filter twins of CTMCTMCTCT, 3-D and 2-D) train from the command
line on the synthetic volume dataset, with the layer executor and with ``-executor taskgraph -workers 2`` to the
same weights."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from cct.cli import main
from cct.compare.tolerance import assert_close
from cct.io.weights import read_caffemodel
from tests.solvers.helpers import captured_log, messages

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("h5py")


def _dataset(folder: Path, dims: int, train: int, test: int) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_volume_dataset
    finally:
        sys.path.pop(0)
    args = ["--out", str(folder), "--dense", "26", "--patch", "37", "--volume", "44", "--dims", str(dims),
            "--train", str(train), "--test", str(test)]
    assert make_volume_dataset.main(args) == 0


def _case(tmp_path: Path, model: str, dims: int, train: int, test: int, **solver) -> Path:
    """The model's net and solver in ``tmp_path``, reading a small generated dataset there."""
    _dataset(tmp_path / "data", dims, train, test)
    net = (ROOT / "models" / "znn" / model / "train_test.prototxt").read_text()
    net = net.replace("models/znn/data/", f"{tmp_path / 'data'}/")
    (tmp_path / "net.prototxt").write_text(net)
    text = (ROOT / "models" / "znn" / model / "solver.prototxt").read_text()
    lines = [line for line in text.splitlines() if not line.startswith(("net:", "snapshot_prefix:", *solver))]
    lines += ['net: "net.prototxt"', 'snapshot_prefix: "snap"'] + [f"{k}: {v}" for k, v in solver.items()]
    (tmp_path / "solver.prototxt").write_text("\n".join(lines) + "\n")
    return tmp_path


def _train(folder: Path, *flags: str) -> str:
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with captured_log() as buf:
            rc = main(["train", "-solver", "solver.prototxt", *flags])
    finally:
        os.chdir(cwd)
    assert rc == 0, buf.getvalue()[-3000:]
    return buf.getvalue()


def _weights(path: Path) -> list[np.ndarray]:
    return [np.array(b.data, dtype=np.float32) for layer in read_caffemodel(str(path)).layer for b in layer.blobs]


def test_the_2d_twin_learns(tmp_path):
    folder = _case(tmp_path, "ctm2d_dense", 2, 64, 16, max_iter=60, snapshot=60, test_interval=60, test_iter=4,
                   display=10)
    text = _train(folder)
    losses = [float(m.rsplit("=", 1)[1]) for m in messages(text) if m.startswith("Iteration") and "loss =" in m]
    assert losses[-1] < losses[0] - 0.05, losses  # the smoothed loss falls from ln 2 ≈ 0.69
    accuracy = [float(m.rsplit("=", 1)[1]) for m in messages(text) if "accuracy =" in m]
    assert accuracy and accuracy[-1] > 0.6, accuracy


@pytest.mark.parametrize("model, dims", [("ctm_dense", 3), ("ctm2d_dense", 2)])
def test_task_graph_trains_to_the_same_weights(tmp_path, model, dims):
    solver = dict(max_iter=3, snapshot=3, test_interval=100, test_iter=1, display=1)
    layer = _case(tmp_path / "layer", model, dims, 4, 1, **solver)
    graph = _case(tmp_path / "graph", model, dims, 4, 1, **solver)
    _train(layer, "-executor", "layer")
    text = _train(graph, "-executor", "taskgraph", "-workers", "2")
    assert "taskgraph" in text.lower()
    for i, (a, b) in enumerate(zip(_weights(graph / "snap_iter_3.caffemodel"),
                                   _weights(layer / "snap_iter_3.caffemodel"))):
        assert_close(a, b, f"{model} blob {i}", rtol=1e-5, reference="the layer executor")
