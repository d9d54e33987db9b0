"""``cct compare`` (cct.compare.reference + cct.cli.compare) against real Caffe's reference files: every net
agrees in both phases; an altered weight file is caught at the first blob it changes; missing and extra
arrays, HDF5 files, phase inference and bad files are reported, never crashed on."""
from __future__ import annotations

import json

import numpy as np
import pytest

import cct
from cct import cli
from cct.compare.reference import (
    EXTRA,
    FAIL,
    MISSING,
    OK,
    compare_with_reference,
    read_reference,
    reference_phase,
)
from tests.reference import REFERENCE, reference_dir
from tests.solvers.helpers import captured_log, messages

NETS = sorted(p.name for p in (REFERENCE / "nets").iterdir()) if (REFERENCE / "nets").exists() else []


def _files(name: str):
    folder = reference_dir("nets", name)
    return str(folder / "net.prototxt"), str(folder / "weights.caffemodel"), folder


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with captured_log() as buf:
        rc = cli.main(["compare", *args])
    return rc, capsys.readouterr().out, buf.getvalue()


@pytest.mark.parametrize("phase", ["train", "test"])
@pytest.mark.parametrize("name", NETS)
def test_every_reference_net_agrees(name: str, phase: str) -> None:
    model, weights, folder = _files(name)
    ref = folder / f"{phase}.npz"
    report = compare_with_reference(model, [weights], str(ref))
    assert report.phase == (cct.TRAIN if phase == "train" else cct.TEST)  # inferred from the file
    assert report.ok, report.first_failure.detail()
    computed = [k for k in np.load(ref).files if not k.startswith("input/")]
    assert sorted(r.name for r in report.rows) == sorted(computed)  # every array compared, none missing


def test_cli_prints_the_table_in_net_order_and_exits_0(capsys) -> None:
    model, weights, folder = _files("lenet")
    rc, out, log_text = run_cli(capsys, "-model", model, "-weights", weights, "-reference",
                                str(folder / "train.npz"))
    assert rc == 0, log_text
    lines = out.splitlines()
    assert lines[0].split() == ["blob", "shape", "max", "abs", "err", "rel", "to", "scale", "status"]
    names = [line.split()[0] for line in lines[1:35]]
    blobs = ["data", "label", "conv1", "pool1", "conv2", "pool2", "ip1", "ip2", "loss"]
    assert names[:18] == [f"data/{b}" for b in blobs] + [f"diff/{b}" for b in blobs]
    assert names[18:20] == ["param/conv1/0", "param/conv1/1"] and names[-1] == "param_diff/ip2/1"
    assert lines[1].split()[1] == "8x1x28x28" and all(line.split()[-1] == OK for line in lines[1:35])
    assert "34 ok, 0 differ, 0 missing, 0 extra" in out and lines[-1] == "PASS"


@pytest.fixture
def altered_lenet(tmp_path):
    """lenet's weights with one conv2 weight moved by 0.05."""
    model, weights, folder = _files("lenet")
    net = cct.Net(model, cct.TEST, weights=weights)
    net.params["conv2"][0].data[3, 5, 2, 2] += 0.05
    path = tmp_path / "altered.caffemodel"
    net.save(str(path))
    return model, str(path), folder


def test_altered_weights_name_the_first_affected_blob(capsys, altered_lenet) -> None:
    model, weights, folder = altered_lenet
    for phase in ("train", "test"):
        rc, out, log_text = run_cli(capsys, "-model", model, "-weights", weights, "-reference",
                                    str(folder / f"{phase}.npz"))
        assert rc == 1
        assert out.splitlines()[-1].startswith("FAIL: first disagreement: data/conv2: ")
        errors = messages(log_text, "E")
        assert len(errors) == 1 and errors[0].startswith("data/conv2: ") and "Traceback" not in log_text
        status = {line.split()[0]: line.split()[-1] for line in out.splitlines()[1:] if "/" in line.split()[0]}
        assert status["data/conv1"] == status["data/pool1"] == OK
        assert status["data/conv2"] == status["param/conv2/0"] == FAIL
        assert status["param/conv1/0"] == OK


def test_a_looser_tolerance_accepts_what_the_default_rejects(capsys, altered_lenet) -> None:
    model, weights, folder = altered_lenet
    rc, _, _ = run_cli(capsys, "-model", model, "-weights", weights, "-reference", str(folder / "test.npz"),
                       "-tolerance", "10")
    assert rc == 0


def test_json_output(capsys, altered_lenet) -> None:
    model, weights, folder = altered_lenet
    rc, out, _ = run_cli(capsys, "-model", model, "-weights", weights, "-reference", str(folder / "train.npz"),
                         "-format", "json", "-phase", "TRAIN")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and doc["first_failure"] == "data/conv2" and doc["phase"] == "TRAIN"
    rows = {r["blob"]: r for r in doc["rows"]}
    assert rows["data/conv1"]["status"] == OK and rows["data/conv1"]["max_abs"] < 1e-5
    assert rows["data/conv2"]["status"] == FAIL and rows["data/conv2"]["max_rel"] > 1e-2
    assert rows["data/conv2"]["shape"] == [8, 50, 8, 8] and rows["data/conv2"]["elements_outside"] > 0


def test_missing_and_extra_arrays_are_reported(tmp_path, capsys) -> None:
    model, weights, folder = _files("lenet")
    arrays = dict(np.load(folder / "train.npz"))
    del arrays["data/pool1"], arrays["param_diff/ip1/0"]
    arrays["data/not_a_blob"] = np.zeros(3, np.float32)
    arrays["param/no_layer/0"] = np.zeros(3, np.float32)
    arrays["input/ghost"] = np.zeros(3, np.float32)
    ref = tmp_path / "partial.npz"
    np.savez(ref, **arrays)
    report = compare_with_reference(model, [weights], str(ref))
    status = {r.name: r.status for r in report.rows}
    assert status["data/pool1"] == MISSING and status["param_diff/ip1/0"] == MISSING
    assert status["data/not_a_blob"] == status["param/no_layer/0"] == status["input/ghost"] == EXTRA
    assert report.first_failure.name == "data/pool1"
    assert report.counts() == {OK: 32, FAIL: 0, MISSING: 2, EXTRA: 3}
    rc, out, log_text = run_cli(capsys, "-model", model, "-weights", weights, "-reference", str(ref))
    assert rc == 1 and "FAIL: first disagreement: data/pool1: in the net but not in the reference file" in out
    assert "Traceback" not in log_text


def test_shape_mismatch_is_a_failed_row(tmp_path) -> None:
    model, weights, folder = _files("lenet")
    arrays = dict(np.load(folder / "test.npz"))
    arrays["data/ip2"] = arrays["data/ip2"][:, :5]
    ref = tmp_path / "shape.npz"
    np.savez(ref, **arrays)
    report = compare_with_reference(model, [weights], str(ref))
    row = report.first_failure
    assert row.name == "data/ip2" and row.status == FAIL and row.comparison.shape_mismatch == (8, 10)


def test_unfed_inputs_are_named(tmp_path) -> None:
    model, weights, folder = _files("lenet")
    arrays = {k: v for k, v in np.load(folder / "test.npz").items() if k != "input/label"}
    ref = tmp_path / "nolabel.npz"
    np.savez(ref, **arrays)
    report = compare_with_reference(model, [weights], str(ref))
    assert report.unfed_inputs == ["label"]


def test_hdf5_reference_with_slashes_in_blob_names(tmp_path) -> None:
    h5py = pytest.importorskip("h5py")
    model, weights, folder = _files("lenet")
    arrays = dict(np.load(folder / "train.npz"))
    path = tmp_path / "ref.h5"
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
        f.create_dataset("data/inception_3a/1x1", data=np.zeros(2, np.float32))
    back = read_reference(str(path))
    assert set(back) == set(arrays) | {"data/inception_3a/1x1"}
    np.testing.assert_array_equal(back["param/conv2/0"], arrays["param/conv2/0"])
    report = compare_with_reference(model, [weights], str(path))
    assert [r.name for r in report.rows if not r.ok] == ["data/inception_3a/1x1"]


def test_phase_inference_and_explicit_phase() -> None:
    assert reference_phase({"data/x": np.zeros(1)}) == cct.TEST
    assert reference_phase({"data/x": np.zeros(1), "diff/x": np.zeros(1)}) == cct.TRAIN
    model, weights, folder = _files("lenet")
    # TRAIN against a TEST file: the diffs are missing, and TEST's split blobs are extra
    report = compare_with_reference(model, [weights], str(folder / "test.npz"), phase=cct.TRAIN)
    status = {r.name: r.status for r in report.rows}
    assert status["diff/conv1"] == MISSING and status["data/label_data_1_split_0"] == EXTRA


@pytest.mark.parametrize("content, expected", [
    (b"not a zip", "not an .npz or HDF5 reference file"),
    (None, "no such file"),
])
def test_bad_reference_file_is_one_line(tmp_path, capsys, content, expected) -> None:
    model, weights, _ = _files("lenet")
    path = tmp_path / "bad.npz"
    if content is not None:
        path.write_bytes(content)
    rc, _, log_text = run_cli(capsys, "-model", model, "-weights", weights, "-reference", str(path))
    fatal = messages(log_text, "F")
    assert rc == 1 and len(fatal) == 1 and expected in fatal[0] and "Traceback" not in log_text


def test_badly_named_arrays_are_one_line(tmp_path, capsys) -> None:
    model, weights, _ = _files("lenet")
    path = tmp_path / "names.npz"
    np.savez(path, **{"blobs/conv1": np.zeros(1)})
    rc, _, log_text = run_cli(capsys, "-model", model, "-weights", weights, "-reference", str(path))
    assert rc == 1 and "array 'blobs/conv1' is not named input/<blob>" in messages(log_text, "F")[0]


def test_needs_model_and_reference(capsys) -> None:
    rc, _, log_text = run_cli(capsys, "-reference", "x.npz")
    assert rc == 1 and "Need a model definition" in messages(log_text, "F")[0]
    rc, _, log_text = run_cli(capsys, "-model", "x.prototxt")
    assert rc == 1 and "Need a reference file" in messages(log_text, "F")[0]
