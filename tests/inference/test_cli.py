"""``cct infer``: the HDF5 output and its convention, the planner's lines in the log, the progress bar (and
-quiet), and one-line errors with exit status 1 for every user mistake."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
from google.protobuf import text_format

from cct import cli
from cct.compare.tolerance import assert_close
from cct.inference import load_spec
from tests.inference.helpers import DEPLOY, dense_reference, deploy_param, save_weights
from tests.solvers.helpers import captured_log, messages

CTM = os.path.join(DEPLOY, "ctm_valid.prototxt")


def run(*args: str) -> tuple[int, str]:
    with captured_log() as buf:
        rc = cli.main(list(args))
    return rc, buf.getvalue()


def fatal(text: str) -> str:
    assert "Traceback" not in text
    lines = messages(text, "F")
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture
def small_net(tmp_path):
    param = deploy_param("ctm_valid", width=4)
    model = tmp_path / "deploy.prototxt"
    model.write_text(text_format.MessageToString(param))
    weights = save_weights(param, str(tmp_path / "w.caffemodel"), seed=5)
    return param, str(model), weights


def test_infer_writes_the_dense_output(small_net, tmp_path, capfd):
    import h5py

    param, model, weights = small_net
    volume = np.random.default_rng(0).random((1, 40, 38, 36), dtype=np.float32)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("raw/volume", data=volume)
        f.create_dataset("other", data=np.zeros(3))
    out = tmp_path / "out.h5"
    rc, log = run("infer", "-model", model, "-weights", weights, "-input", f"{tmp_path / 'in.h5'}:raw/volume",
                  "-output", str(out), "-memory_budget", "16MiB")
    assert rc == 0, log
    msgs = messages(log)
    assert any(re.match(r"planner: net ctm_valid, FOV 26x26x26, 2 pooling -> MPF x64", m) for m in msgs), msgs
    assert any(m.startswith("chosen input ") for m in msgs)
    assert any(m.startswith("infer: ") and "vox/s" in m for m in msgs)
    err = capfd.readouterr().err
    assert re.search(r"infer \[#+\] 100\.0% .* voxels, .* vox/s, elapsed \d:\d\d:\d\d, ETA", err), err
    with h5py.File(out, "r") as f:
        got = f["output"][()]
        assert tuple(f["output"].attrs["fov"]) == (26, 26, 26)
    assert got.shape == (2, 15, 13, 11)
    assert not os.path.exists(str(out) + ".partial")
    spec = load_spec(param)
    assert_close(got, dense_reference(param, weights, volume, spec.fov, spec.pooling), "cct infer", rtol=1e-5)


def test_quiet_has_no_progress_bar_and_mirror_gives_the_input_size(small_net, tmp_path, capfd):
    import h5py

    _, model, weights = small_net
    np.save(tmp_path / "v.npy", (np.random.default_rng(1).random((30, 28, 29)) * 255).astype(np.uint8))
    rc, log = run("infer", "-model", model, "-weights", weights, "-input", str(tmp_path / "v.npy"), "-output",
                  str(tmp_path / "o.h5"), "-pad", "mirror", "-quiet", "-input_scale", "0.00390625", "-input_mean",
                  "10")
    assert rc == 0, log
    assert "infer [" not in capfd.readouterr().err
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert f["output"].shape == (2, 30, 28, 29)


@pytest.mark.parametrize("args, message", [
    ((), "Need a model definition to infer with"),
    (("-model", CTM), "Need an input volume"),
    (("-model", CTM, "-input", "v.npy"), "Need an output file"),
    (("-model", CTM, "-input", "missing.npy", "-output", "o.h5"), "missing.npy: input volume not found"),
    (("-model", CTM, "-input", "small.npy", "-output", "o.h5"),
     "volume 20x40x40 is smaller than the field of view 26x26x26 of net ctm_valid"),
    (("-model", CTM, "-input", "v.npy", "-output", "o.h5", "-memory_budget", "lots"),
     "-memory_budget 'lots': expected a size such as 2GiB"),
    (("-model", CTM, "-input", "v.npy", "-output", "o.h5", "-memory_budget", "1MiB"),
     "memory budget 1.0 MiB is too small for net ctm_valid: the smallest valid patch"),
    (("-model", CTM, "-input", "v.npy", "-output", "o.h5", "-pad", "zero"), "-pad zero: expected valid or mirror"),
    (("-model", CTM, "-input", "v.npy", "-output", "o.h5", "-plan", "fast"), "-plan fast: expected auto or measure"),
    (("-model", CTM, "-input", "v.npy", "-output", "o.h5", "-devices", "gpu:0"), "gpu:0"),
    (("-model", CTM, "-input", "rgb.npy", "-output", "o.h5"),
     "rgb.npy: volume of shape (3, 30, 30, 30) has 3 channels"),
    (("-model", "lenet.prototxt", "-input", "v.npy", "-output", "o.h5"),
     "layer 'fc' (InnerProduct): not supported by sliding-window inference"),
    (("-model", CTM, "-weights", "bad.caffemodel", "-input", "v.npy", "-output", "o.h5"), "bad.caffemodel"),
    (("-model", CTM, "-input", "v.npy", "-output", "nodir/o.h5"), "the output directory"),
])
def test_user_errors_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "v.npy", np.zeros((30, 30, 30), np.float32))
    np.save(tmp_path / "small.npy", np.zeros((20, 40, 40), np.float32))
    np.save(tmp_path / "rgb.npy", np.zeros((3, 30, 30, 30), np.float32))
    (tmp_path / "bad.caffemodel").write_bytes(b"\x08\x96\x01garbage")
    (tmp_path / "lenet.prototxt").write_text("""
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 28 dim: 28 } } }
layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 2 kernel_size: 5 } }
layer { name: "fc" type: "InnerProduct" bottom: "c" top: "fc" inner_product_param { num_output: 10 } }""")
    rc, log = run("infer", *args)
    assert rc == 1
    assert message in fatal(log), fatal(log)


def test_two_cpu_workers_give_the_single_worker_output(small_net, tmp_path):
    """-devices cpu:1,cpu:1: two workers share the tiles (each its own net, half the budget); same numbers."""
    import h5py

    _, model, weights = small_net
    np.save(tmp_path / "v.npy", np.random.default_rng(2).random((50, 47, 45), dtype=np.float32))
    outs = []
    for extra in ((), ("-devices", "cpu:1,cpu:1")):
        out = tmp_path / f"o{len(extra)}.h5"
        rc, log = run("infer", "-model", model, "-weights", weights, "-input", str(tmp_path / "v.npy"), "-output",
                      str(out), "-memory_budget", "24MiB", "-quiet", *extra)
        assert rc == 0, log
        with h5py.File(out, "r") as f:
            outs.append(f["output"][()])
        if extra:
            assert "infer: 2 workers (cpu:1,cpu:1), 12.0 MiB of the budget each" in messages(log)
    assert_close(outs[1], outs[0], "two workers vs one", rtol=1e-5, reference="one worker")


def test_listed_in_usage():
    assert "infer" in cli.usage() and "dense sliding-window inference" in cli.usage()
