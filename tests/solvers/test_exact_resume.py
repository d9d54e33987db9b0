"""Exact resume: a run stopped at a snapshot and resumed with it ends bit for bit where the uninterrupted run
ends — data cursors, shuffled orders, mirror/crop and Dropout streams included — for every update rule,
with iter_size, with both snapshot formats, and under data parallelism; a solverstate without cct's field
(Caffe's) resumes as in Caffe."""
from __future__ import annotations

import os

import numpy as np
import pytest
from google.protobuf import text_format
from PIL import Image

from cct import mode
from cct.device import Device
from cct.distributed.replicas import DataParallel
from cct.io.weights import read_solverstate, write_solverstate
from cct.proto import caffe_pb2 as pb
from cct.solvers import create_solver
from tests.helpers import datum_lmdb
from tests.solvers.helpers import captured_log, messages, set_fields

RECORDS = 37  # not a multiple of any batch: the cursor is mid-pass at every snapshot

DATA_NET = """
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "SOURCE" batch_size: 5 backend: LMDB }
        transform_param { scale: 0.00390625 mirror: true crop_size: 6 } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
        data_param { source: "SOURCE" batch_size: 4 backend: LMDB } transform_param { scale: 0.00390625 crop_size: 6 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "drop" type: "Dropout" bottom: "conv" top: "conv" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" include { phase: TEST } }
"""

IMAGE_NET = """
layer { name: "data" type: "ImageData" top: "data" top: "label"
        image_data_param { source: "SOURCE" batch_size: 3 shuffle: true is_color: false }
        transform_param { scale: 0.00390625 mirror: true crop_size: 6 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

TYPES = {
    "SGD": dict(momentum=0.9), "Nesterov": dict(momentum=0.9), "AdaGrad": dict(),
    "RMSProp": dict(rms_decay=0.9), "AdaDelta": dict(momentum=0.9, base_lr=1.0),
    "Adam": dict(momentum=0.9, momentum2=0.999, base_lr=0.01),
}


@pytest.fixture(scope="module")
def lmdb_source(tmp_path_factory) -> str:
    return datum_lmdb(tmp_path_factory.mktemp("resume") / "train_lmdb", RECORDS, 8, 3)


@pytest.fixture(scope="module")
def image_list(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(4)
    lines = []
    for i in range(11):
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(folder / f"{i}.png")
        lines.append(f"{folder / f'{i}.png'} {int(rng.integers(3))}")
    listing = folder / "list.txt"
    listing.write_text("\n".join(lines) + "\n")
    return str(listing)


@pytest.fixture(autouse=True)
def _mode_restored():
    saved = dict(mode._state)
    yield
    mode._state.update(saved)


def _param(net: str, source: str, **fields) -> pb.SolverParameter:
    p = pb.SolverParameter()
    text_format.Parse(net.replace("SOURCE", source), p.net_param)
    p.base_lr = 0.05
    p.lr_policy = "fixed"
    p.random_seed = 5
    p.snapshot_prefix = "snap"
    p.snapshot_after_train = False
    return set_fields(p, **fields)


def _weights(solver) -> list[np.ndarray]:
    return [np.array(b.data) for b in solver.net.learnable_params] + [np.array(h.data) for h in solver.history]


def _straight_and_resumed(param: pb.SolverParameter, stop: int, total: int, resume_file: str):
    """The weights and history after ``total`` iterations straight, and after ``stop`` + a resume to ``total``."""
    straight = _run(param, total)
    first = pb.SolverParameter()
    first.CopyFrom(param)
    first.snapshot = stop
    _run(first, stop)
    assert os.path.exists(resume_file)
    return straight, _run(param, total, resume_file)


def _run(param: pb.SolverParameter, max_iter: int, resume_file: str | None = None) -> list[np.ndarray]:
    p = pb.SolverParameter()
    p.CopyFrom(param)
    p.max_iter = max_iter
    with captured_log():
        solver = create_solver(p)
        solver.solve(resume_file)
    result = _weights(solver)
    _close(solver)
    return result


def _close(solver) -> None:
    for net in [solver.net, *solver.test_nets]:
        for layer in net.layers:
            if hasattr(layer, "close"):
                layer.close()


def _assert_bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    worst = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    assert worst == 0.0, f"max |diff| {worst}"


@pytest.mark.parametrize("kind", list(TYPES))
def test_every_update_rule_resumes_bit_for_bit_mid_pass_with_mirror_crop_and_dropout(kind, lmdb_source, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    param = _param(DATA_NET, lmdb_source, type=kind, **TYPES[kind], test_iter=[2], test_interval=4)
    straight, resumed = _straight_and_resumed(param, 5, 11, "snap_iter_5.solverstate")
    _assert_bitwise(straight, resumed)


@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_iter_size_and_both_snapshot_formats(fmt, lmdb_source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    param = _param(DATA_NET, lmdb_source, type="SGD", momentum=0.9, iter_size=3,
                   snapshot_format=getattr(pb.SolverParameter, fmt))
    ext = ".solverstate.h5" if fmt == "HDF5" else ".solverstate"
    straight, resumed = _straight_and_resumed(param, 4, 9, "snap_iter_4" + ext)
    _assert_bitwise(straight, resumed)


def test_shuffled_image_data_with_dropout(image_list, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 11 images, batch 3: the snapshot at 7 falls after the list was reshuffled once, mid-pass
    param = _param(IMAGE_NET, image_list, type="SGD", momentum=0.9)
    straight, resumed = _straight_and_resumed(param, 7, 13, "snap_iter_7.solverstate")
    _assert_bitwise(straight, resumed)


def test_without_the_saved_cursor_the_run_differs(lmdb_source, tmp_path, monkeypatch):
    """The control: Caffe's fields alone (the cct field cleared) do not reproduce the run; it is logged."""
    monkeypatch.chdir(tmp_path)
    param = _param(DATA_NET, lmdb_source, type="SGD", momentum=0.9)
    straight = _run(param, 9)
    first = pb.SolverParameter()
    first.CopyFrom(param)
    first.snapshot = 4
    _run(first, 4)
    state = read_solverstate("snap_iter_4.solverstate")
    assert state.cct_resume_state
    state.ClearField("cct_resume_state")
    write_solverstate("caffe_iter_4.solverstate", state)
    p = pb.SolverParameter()
    p.CopyFrom(param)
    p.max_iter = 9
    with captured_log() as buf:
        solver = create_solver(p)
        solver.solve("caffe_iter_4.solverstate")
    resumed = _weights(solver)
    _close(solver)
    assert any("has no cct resume state" in m for m in messages(buf.getvalue()))
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(straight, resumed)) > 1e-4


def test_a_damaged_resume_state_is_one_error_naming_the_file(lmdb_source, tmp_path, monkeypatch):
    from cct.errors import CctError

    monkeypatch.chdir(tmp_path)
    param = _param(DATA_NET, lmdb_source, type="SGD", snapshot=2)
    _run(param, 2)
    state = read_solverstate("snap_iter_2.solverstate")
    state.cct_resume_state = state.cct_resume_state[:-7]
    write_solverstate("bad.solverstate", state)
    p = pb.SolverParameter()
    p.CopyFrom(param)
    p.max_iter = 4
    with captured_log():
        solver = create_solver(p)
        with pytest.raises(CctError, match=r"^bad\.solverstate: cct_resume_state is damaged"):
            solver.solve("bad.solverstate")
    _close(solver)


def test_data_parallel_resume_is_bit_for_bit(lmdb_source, tmp_path, monkeypatch):
    """Two replicas (one-thread CPU devices): each rank's cursor is in the root's snapshot."""
    monkeypatch.chdir(tmp_path)
    net = DATA_NET.replace('layer { name: "drop" type: "Dropout" bottom: "conv" top: "conv" '
                           'dropout_param { dropout_ratio: 0.3 } }\n', "")
    param = _param(net, lmdb_source, type="SGD", momentum=0.9)
    devices = [Device("cpu", 0, 1), Device("cpu", 1, 1)]

    def run(max_iter: int, snapshot: int = 0, resume: str | None = None):
        p = pb.SolverParameter()
        p.CopyFrom(param)
        p.max_iter, p.snapshot = max_iter, snapshot
        with captured_log():
            dp = DataParallel(p, devices)
            dp.solve(resume)
        result = [_weights(s) for s in dp.solvers]
        for s in dp.solvers:
            _close(s)
        return result

    straight = run(9)
    run(4, snapshot=4)
    resumed = run(9, resume="snap_iter_4.solverstate")
    for a, b in zip(straight, resumed):
        _assert_bitwise(a, b)
    _assert_bitwise(resumed[0], resumed[1])
