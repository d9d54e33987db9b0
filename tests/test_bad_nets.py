"""Bad nets and weight files: one line from the command line naming file, line, layer or field; no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.reference import REPO

GOOD = """name: "n"
layer {
  name: "data"
  type: "Input"
  top: "data"
  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } }
}
layer {
  name: "conv"
  type: "Convolution"
  bottom: "data"
  top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 }
}
"""

CASES = [
    ("syntax error", GOOD.replace('top: "conv"', 'top: "conv"\n  }'), r"net\.prototxt:\d+:\d+: "),
    ("unknown type", GOOD.replace('"Convolution"', '"Convolutoin"'),
     r"net\.prototxt:9: layer 'conv' \(Convolutoin\): type: Unknown layer type: Convolutoin \(known types: .*"),
    ("unknown field", GOOD.replace("kernel_size: 3", "kernel_size: 3 kernal: 2"),
     r"net\.prototxt:\d+:\d+: .*kernal"),
    ("missing bottom", GOOD.replace('bottom: "data"', 'bottom: "dta"'),
     r"net\.prototxt:9: layer 'conv' \(Convolution\): Unknown bottom blob 'dta'"),
    ("zero stride", GOOD.replace("kernel_size: 3", "kernel_size: 3 stride: 0"),
     r"layer 'conv' \(Convolution\): convolution_param\.stride"),
    ("kernel larger than padded input", GOOD.replace("kernel_size: 3", "kernel_size: 11"),
     r"layer 'conv' \(Convolution\): .*kernel"),
    ("group not dividing channels", GOOD.replace("kernel_size: 3", "kernel_size: 3 group: 2"),
     r"layer 'conv' \(Convolution\): convolution_param\.group"),
]


def run_cct(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cct", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def assert_one_line(proc: subprocess.CompletedProcess, pattern: str) -> None:
    import re

    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    fatal = [line for line in proc.stderr.splitlines() if line.startswith("F")]
    assert len(fatal) == 1, proc.stderr[-3000:]
    assert re.search(pattern, fatal[0]), fatal[0]


@pytest.mark.parametrize("what,text,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_net_is_one_line(what: str, text: str, pattern: str, tmp_path) -> None:
    (tmp_path / "net.prototxt").write_text(text)
    assert_one_line(run_cct("time", "-model", "net.prototxt", "-iterations", "1", cwd=tmp_path), pattern)


def _good_weights(tmp_path) -> None:
    import cct

    (tmp_path / "net.prototxt").write_text(GOOD)
    cct.Net(str(tmp_path / "net.prototxt"), cct.TEST).save(str(tmp_path / "w.caffemodel"))


def test_weights_of_the_wrong_shape(tmp_path) -> None:
    _good_weights(tmp_path)
    (tmp_path / "net.prototxt").write_text(GOOD.replace("num_output: 4", "num_output: 5"))
    proc = run_cct("test", "-model", "net.prototxt", "-weights", "w.caffemodel", "-iterations", "1", cwd=tmp_path)
    assert_one_line(proc, r"w\.caffemodel: Cannot copy param 0 weights from layer 'conv'; shape mismatch.  "
                          r"Source param shape is 4 3 3 3 \(108\); target param shape is 5 3 3 3 \(135\)")


@pytest.mark.parametrize("damage,pattern", [("empty", r"w\.caffemodel.*empty"),
                                            ("truncated", r"w\.caffemodel.*truncated")])
def test_empty_or_truncated_weights(damage: str, pattern: str, tmp_path) -> None:
    _good_weights(tmp_path)
    data = (tmp_path / "w.caffemodel").read_bytes()
    (tmp_path / "w.caffemodel").write_bytes(b"" if damage == "empty" else data[: len(data) - 17])
    proc = run_cct("test", "-model", "net.prototxt", "-weights", "w.caffemodel", "-iterations", "1", cwd=tmp_path)
    assert_one_line(proc, pattern)
