"""The embedded default (models/digits) trains to >= 95% test accuracy, as the README promises."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.reference import REPO


def test_digits_default_trains_to_95_percent(tmp_path) -> None:
    solver = (REPO / "models" / "digits" / "solver.prototxt").read_text()
    solver = re.sub(r"max_iter: \d+", "max_iter: 500", solver)
    solver = re.sub(r"test_interval: \d+", "test_interval: 500", solver)
    solver = re.sub(r'snapshot_prefix: ".*"', f'snapshot_prefix: "{tmp_path}/lenet"', solver)
    path = tmp_path / "solver.prototxt"
    path.write_text(solver)
    run = subprocess.run([sys.executable, "-m", "cct", "train", "-solver", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    accuracies = [float(m) for m in re.findall(r"Test net output #0: accuracy = ([\d.]+)", run.stderr)]
    assert len(accuracies) == 2 and accuracies[-1] >= 0.95, accuracies
    assert (tmp_path / "lenet_iter_500.caffemodel").exists()
    assert (tmp_path / "lenet_iter_500.solverstate").exists()
