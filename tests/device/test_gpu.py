"""The gpu:N path (cupy): memory helpers, peak FLOPS, a split with a GPU share equal to the plain run, GPU mode
against real Caffe (every reference net, both phases, 1e-4 relative) and ``cct train -gpu 0`` reproducing
Caffe's reference training runs (log lines and iteration-12 snapshots).

These run only where cupy and a CUDA device are present; elsewhere they are skipped (the CPU-only tests
exercise the same mirror/staging code with a stand-in device: tests/exec/test_device_split.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import cct
from cct.device import Device, cupy, cupy_available, gpu_count, parse_devices
from cct.errors import CctError
from tests.reference import REFERENCE, assert_close
from tests.solvers import test_reference_cases as solver_cases
from tests.test_reference_nets import NETS, check_matches_caffe

pytestmark = pytest.mark.skipif(not cupy_available, reason="needs cupy and a CUDA device; none on this machine")


def test_gpu_memory_helpers_round_trip():
    (d,) = parse_devices("gpu:0")
    a = d.allocate((2, 3))
    assert isinstance(a, cupy.ndarray) and d.holds(a) and d.xp is cupy
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    d.copy_in(a, x)
    np.testing.assert_array_equal(d.to_host(a), x)
    assert d.to_device(a) is a
    d.synchronize()


def test_gpu_peak_gflops():
    gflops, source = Device("gpu", 0).peak_gflops()
    assert gflops > 100 and source in ("spec sheet", "measured", "cached")


def test_gpu_index_beyond_the_machine_is_one_line():
    with pytest.raises(CctError, match="no such GPU"):
        parse_devices(f"gpu:{gpu_count()}")


@pytest.mark.parametrize("spec", ["cpu:1,gpu:0", "gpu:0"])
def test_split_with_a_gpu_share_equals_the_plain_run(spec):
    folder = REFERENCE / "nets" / "caffenet_mini"
    if not folder.exists():
        pytest.skip("reference nets not found")
    ref = np.load(folder / "train.npz")
    inputs = {k[len("input/"):]: ref[k] for k in ref.files if k.startswith("input/")}

    def run():
        net = cct.Net(str(folder / "net.prototxt"), cct.TRAIN, weights=str(folder / "weights.caffemodel"))
        net.forward(**inputs)
        net.clear_param_diffs()
        net.backward()
        return {n: (b.data.copy(), b.diff.copy()) for n, b in net.blobs.items()}, \
            {n: [(p.data.copy(), p.diff.copy()) for p in ps] for n, ps in net.params.items()}

    plain_blobs, plain_params = run()
    cct.set_devices(spec, split="0.5,0.5" if "," in spec else "auto")
    blobs, params = run()
    for name, (data, diff) in plain_blobs.items():
        assert_close(blobs[name][0], data, f"{spec} data/{name}", rtol=1e-5, atol=1e-6)
        assert_close(blobs[name][1], diff, f"{spec} diff/{name}", rtol=1e-5, atol=1e-6)
    for name, ps in plain_params.items():
        for j, (_, diff) in enumerate(ps):
            assert_close(params[name][j][1], diff, f"{spec} param_diff/{name}/{j}", rtol=1e-5, atol=1e-6)


@pytest.fixture
def gpu_mode():
    cct.set_device(0)
    cct.set_mode_gpu()
    yield
    cct.set_mode_cpu()


@pytest.mark.parametrize("phase", [cct.TRAIN, cct.TEST], ids=["TRAIN", "TEST"])
@pytest.mark.parametrize("name", NETS)
def test_gpu_mode_matches_caffe(name, phase, gpu_mode):
    check_matches_caffe(name, phase)


@pytest.mark.parametrize("case", solver_cases.CASES)
def test_gpu_training_reproduces_caffe(case, tmp_path, monkeypatch):
    try:
        solver_cases.check_train_reproduces_caffe(case, tmp_path, monkeypatch, "-gpu", "0")
    finally:
        cct.set_mode_cpu()
