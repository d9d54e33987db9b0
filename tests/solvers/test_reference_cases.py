"""``cct train`` on Caffe's reference solver cases reproduces ``caffe_train.log`` and the final snapshot.

For each ``solvers/CASE`` (see the reference README), in a copy of the folder:
``cct train -solver solver.prototxt -weights initial.caffemodel`` must log the same progress lines
(test outputs, display losses, train outputs, lr, snapshot names, final loss) with numbers within 1e-3
relative, and write ``caffe_snapshot_iter_12.caffemodel`` / ``.solverstate`` within 1e-3 of Caffe's.
Resuming from a 6-iteration snapshot with ``-snapshot`` must give exactly the 12-iteration result.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cct.cli import main
from cct.io.weights import read_caffemodel, read_solverstate
from tests.reference import REFERENCE, assert_close
from tests.solvers.helpers import assert_same_progress, captured_log, copy_case, key_lines

CASES_DIR = REFERENCE / "solvers"
CASES = sorted(p.name for p in CASES_DIR.iterdir()) if CASES_DIR.exists() else []
SNAP = "caffe_snapshot_iter_12"


def _case(name: str, tmp_path: Path) -> Path:
    if not (CASES_DIR / name).exists():
        pytest.skip(f"Caffe reference case not found at {CASES_DIR / name} (set CCT_CAFFE_REFERENCE)")
    return copy_case(CASES_DIR / name, tmp_path / name)


def _train(folder: Path, monkeypatch, *args: str) -> str:
    monkeypatch.chdir(folder)
    with captured_log() as buf:
        rc = main(["train", "-solver", "solver.prototxt", *args])
    text = buf.getvalue()
    assert rc == 0, text[-3000:]
    return text


def _blobs(path: Path) -> list[np.ndarray]:
    if path.suffix == ".caffemodel":
        return [np.array(b.data, dtype=np.float32) for layer in read_caffemodel(path).layer for b in layer.blobs]
    return [np.array(h.data, dtype=np.float32) for h in read_solverstate(path).history]


def _assert_blobs_close(ours: Path, theirs: Path, rtol: float = 1e-3) -> None:
    """Caffe's trajectory after 12 iterations: the project's rule at 1e-3 (float32 differences compound)."""
    a, b = _blobs(ours), _blobs(theirs)
    assert len(a) == len(b), f"{ours.name}: {len(a)} blobs vs Caffe's {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert_close(x, y, f"{ours.name} blob {i}", rtol=rtol)


def check_train_reproduces_caffe(case: str, tmp_path: Path, monkeypatch, *flags: str) -> None:
    """``cct train -solver solver.prototxt -weights initial.caffemodel FLAGS`` gives Caffe's log and snapshot."""
    folder = _case(case, tmp_path)
    text = _train(folder, monkeypatch, "-weights", "initial.caffemodel", *flags)
    caffe_log = (folder / "caffe_train.log").read_text()
    assert_same_progress(key_lines(text), key_lines(caffe_log))
    for ext in ("caffemodel", "solverstate"):
        _assert_blobs_close(folder / f"{SNAP}.{ext}", CASES_DIR / case / f"{SNAP}.{ext}")
    ours = read_solverstate(folder / f"{SNAP}.solverstate")
    theirs = read_solverstate(CASES_DIR / case / f"{SNAP}.solverstate")
    assert (ours.iter, ours.learned_net, ours.current_step) == (theirs.iter, theirs.learned_net, theirs.current_step)


@pytest.mark.skipif(not CASES, reason=f"Caffe reference solver cases not found at {CASES_DIR}")
@pytest.mark.parametrize("case", CASES)
def test_train_reproduces_caffe(case, tmp_path, monkeypatch):
    check_train_reproduces_caffe(case, tmp_path, monkeypatch)


@pytest.mark.skipif(not CASES, reason=f"Caffe reference solver cases not found at {CASES_DIR}")
@pytest.mark.parametrize("case", CASES)
def test_resume_from_iteration_6_equals_12_straight(case, tmp_path, monkeypatch):
    # batch 8 of a 40-image train set: the snapshot at 6 is mid-pass, so the data cursor must be restored
    straight = _case(case, tmp_path / "straight")
    solver = (straight / "solver.prototxt").read_text()
    assert re.search(r"max_iter: 12\b", solver)
    resumed = copy_case(straight, tmp_path / "resumed")
    _train(straight, monkeypatch, "-weights", "initial.caffemodel")
    (resumed / "solver.prototxt").write_text(solver.replace("max_iter: 12", "max_iter: 6"))
    _train(resumed, monkeypatch, "-weights", "initial.caffemodel")
    assert (resumed / "caffe_snapshot_iter_6.solverstate").exists()
    (resumed / "solver.prototxt").write_text(solver)
    text = _train(resumed, monkeypatch, "-snapshot", "caffe_snapshot_iter_6.solverstate")
    assert "Resuming from caffe_snapshot_iter_6.solverstate" in text
    for ext in ("caffemodel", "solverstate"):
        a, b = _blobs(straight / f"{SNAP}.{ext}"), _blobs(resumed / f"{SNAP}.{ext}")
        assert len(a) == len(b)
        worst = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
        assert worst == 0.0, f"{ext}: max |diff| {worst} between the resumed and the straight run"


@pytest.mark.skipif(not CASES, reason=f"Caffe reference solver cases not found at {CASES_DIR}")
def test_caffe_made_solverstate_resumes_as_caffe_does(tmp_path, monkeypatch):
    """Caffe's own iteration-12 state (no cct field) restores iter, history and weights, logged once."""
    folder = _case(CASES[0], tmp_path)
    text = _train(folder, monkeypatch, "-snapshot", f"{SNAP}.solverstate")
    assert f"{SNAP}.solverstate has no cct resume state" in text
    assert text.count("has no cct resume state") == 1
    assert "Optimization Done." in text
