"""``cct train|time|device_query`` with ``-devices``/``-split``: the same weights as the plain run after Caffe's
reference solver cases, the split logged, peak FLOPS per device, and bad input as one line."""
from __future__ import annotations

import numpy as np
import pytest

from cct import cli
from cct.blob import blob_from_proto
from cct.device import cupy_available
from cct.io.weights import read_caffemodel
from tests.reference import REFERENCE, reference_dir
from tests.solvers.helpers import captured_log, copy_case, messages

CASES = sorted(p.name for p in (REFERENCE / "solvers").iterdir()) if (REFERENCE / "solvers").exists() else []


def run(*args: str) -> tuple[int, str]:
    with captured_log() as buf:
        rc = cli.main(list(args))
    return rc, buf.getvalue()


def one_fatal_line(rc: int, text: str) -> str:
    assert rc != 0 and "Traceback" not in text
    fatal = messages(text, "F")
    assert len(fatal) == 1 and len([x for x in text.splitlines() if x.startswith("F")]) == 1, text
    return fatal[0]


def _train(tmp_path, monkeypatch, case: str, tag: str, *flags: str) -> tuple[dict, str]:
    folder = copy_case(reference_dir("solvers", case), tmp_path / tag)
    monkeypatch.chdir(folder)
    rc, text = run("train", "-solver", "solver.prototxt", "-weights", "initial.caffemodel", *flags)
    assert rc == 0, text
    model = read_caffemodel(str(folder / "caffe_snapshot_iter_12.caffemodel"))
    weights = {f"{lp.name}/{i}": blob_from_proto(b).data.copy() for lp in model.layer for i, b in enumerate(lp.blobs)}
    return weights, text


@pytest.mark.parametrize("case", CASES)
def test_train_with_a_split_ends_with_the_plain_weights(case, tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    plain, _ = _train(tmp_path, monkeypatch, case, "plain")
    for tag, flags, line in [
        ("auto", ("-devices", "cpu:1,cpu:1"), "each batch of 8: cpu:1 gets 4, cpu:1 gets 4, by peak FLOPS ("),
        ("split", ("-devices", "cpu:1,cpu:1", "-split", "0.75,0.25"),
         "each batch of 8: cpu:1 gets 6, cpu:1 gets 2, by -split"),
    ]:
        weights, text = _train(tmp_path, monkeypatch, case, tag, *flags)
        assert any(m.startswith(line) for m in messages(text, "I")), text
        assert weights.keys() == plain.keys()
        for k, w in plain.items():
            err = float(np.max(np.abs(weights[k] - w)))
            assert err <= 1e-5, f"{case} {tag} {k}: weights differ by {err:.3g} after 12 iterations"


def test_device_query_reports_peak_gflops_per_device(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    rc, text = run("device_query", "-devices", "cpu:1,cpu:1")
    assert rc == 0, text
    lines = [m for m in messages(text, "I") if m.startswith("Device ")]
    assert len(lines) == 2 and all(" GFLOP/s (" in m and ": cpu:1 (CPU (" in m for m in lines)
    assert float(lines[0].split("peak ")[1].split()[0]) > 0
    assert any(m == "Split by peak FLOPS: cpu:1 50.0%, cpu:1 50.0%" for m in messages(text, "I"))


def test_time_runs_the_split(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    model = str(reference_dir("nets", "lenet") / "net.prototxt")
    rc, text = run("time", "-model", model, "-iterations", "1", "-devices", "cpu:1,cpu:1", "-split", "0.5,0.5")
    assert rc == 0, text
    assert any(m.startswith("each batch of ") and m.endswith("by -split") for m in messages(text, "I"))
    assert any(m.startswith("Average Forward-Backward:") for m in messages(text, "I"))


@pytest.mark.parametrize("flags, words", [
    (("-devices", "cpu:1,tpu:0"), "-devices cpu:1,tpu:0: unknown device 'tpu:0'"),
    (("-devices", "cpu:1,cpu:1", "-split", "0.5,0.6"), "-split 0.5,0.6: the fractions sum to 1.1, not 1"),
    (("-devices", "cpu:1,cpu:1", "-split", "1,0"), "-split 1,0: cpu:1 gets a share of 0"),
    (("-devices", "cpu:1,cpu:1", "-split", "0.99,0.01"), "cpu:1 (device 2 of 2) gets 0 of a batch of 8 (by -split"),
    (("-split", "0.5,0.5"), "-split 0.5,0.5 needs -devices"),
    (("-devices", "cpu:1", "-gpu", "0"), "-gpu 0 and -devices cpu:1"),
])
def test_bad_device_input_is_one_line(flags, words, tmp_path, monkeypatch):
    folder = copy_case(reference_dir("solvers", "sgd_step"), tmp_path / "case")
    monkeypatch.chdir(folder)
    line = one_fatal_line(*run("train", "-solver", "solver.prototxt", *flags))
    assert words in line


@pytest.mark.skipif(cupy_available, reason="this machine has cupy and a GPU")
def test_gpu_device_without_cupy_is_one_line():
    line = one_fatal_line(*run("device_query", "-devices", "cpu:1,gpu:0"))
    assert "'gpu:0' needs cupy and a CUDA device" in line
