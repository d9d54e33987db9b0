"""tools/parse_log.py and tools/plot_training_log.py on Caffe's own training log and on ours."""
from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from cct.cli import main
from tests.reference import REFERENCE
from tests.solvers.helpers import captured_log, copy_case

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"cct_tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(TOOLS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
    return module


@pytest.fixture(scope="module")
def parse_log():
    return _load("parse_log")


@pytest.fixture
def logs(tmp_path, monkeypatch):
    """(Caffe's caffe_train.log, our log of the same training run) for the sgd_step case."""
    src = REFERENCE / "solvers" / "sgd_step"
    if not src.exists():
        pytest.skip(f"Caffe reference case not found at {src}")
    case = copy_case(src, tmp_path / "case")
    monkeypatch.chdir(case)
    with captured_log() as buf:
        assert main(["train", "-solver", "solver.prototxt", "-weights", "initial.caffemodel"]) == 0
    ours = case / "cct_train.log"
    ours.write_text(buf.getvalue())
    return case / "caffe_train.log", ours


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_same_tables_from_caffes_log_and_ours(parse_log, logs, tmp_path):
    out = tmp_path / "csv"
    out.mkdir()
    for log in logs:
        assert parse_log.main([str(log), str(out)]) == 0
    caffe_train, ours_train = _read(out / "caffe_train.log.train"), _read(out / "cct_train.log.train")
    caffe_test, ours_test = _read(out / "caffe_train.log.test"), _read(out / "cct_train.log.test")
    assert list(caffe_train[0]) == list(ours_train[0]) == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert list(caffe_test[0]) == list(ours_test[0]) == ["NumIters", "Seconds", "LearningRate", "acc", "loss"]
    assert len(caffe_train) == len(ours_train) == 12 and len(caffe_test) == len(ours_test) == 3
    for theirs, ours in ((caffe_train, ours_train), (caffe_test, ours_test)):
        for a, b in zip(theirs, ours):
            for key in a:
                if key != "Seconds":
                    assert np.isclose(float(a[key]), float(b[key]), rtol=1e-3), (key, a, b)
            assert float(b["Seconds"]) >= 0
    # as in Caffe's script, a row carries the lr logged before its outputs (the previous iteration's)
    assert [r["LearningRate"] for r in ours_train[:6]] == ["0.1"] * 5 + ["0.05"]


def test_delimiter_and_fields_for_parse_log_sh(parse_log, logs, tmp_path):
    _, ours = logs
    assert parse_log.main([str(ours), str(tmp_path), "--delimiter", ";"]) == 0
    assert (tmp_path / "cct_train.log.test").read_text().startswith("NumIters;Seconds;LearningRate;acc;loss")
    # parse_log.sh reads fixed awk fields: $11 of the test output lines, $9 of the lr lines
    for line in ours.read_text().splitlines():
        if "Test net output #" in line:
            assert line.split()[10] == line.split(" = ")[1].split()[0]
        if ", lr = " in line:
            assert line.split()[8] == line.rsplit(" ", 1)[1]


def test_plot_training_log(logs, tmp_path, capsys):
    plot = _load("plot_training_log")
    caffe_log, ours = logs
    png = tmp_path / "chart.png"
    assert plot.series(6, str(ours))[1][:2] == pytest.approx([1.66321, 1.58612], rel=1e-4)
    assert plot.series(0, str(caffe_log)) == ([0.0, 6.0, 12.0], [0.0, 0.666667, 1.0])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot.main(["6", str(png), str(caffe_log)]) == 1
        assert "needs matplotlib" in capsys.readouterr().err
        return
    assert plot.main(["6", str(png), str(caffe_log), str(ours)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_rejects_bad_arguments(tmp_path, capsys):
    plot = _load("plot_training_log")
    assert plot.main([]) == 1 and "Supported chart types:" in capsys.readouterr().out
    assert plot.main(["9", "x.png", "a.log"]) == 1 and "9 is not a valid chart type." in capsys.readouterr().out
    assert plot.main(["0", "x.jpg", "a.log"]) == 1
