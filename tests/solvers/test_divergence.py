"""Divergence is reported once, naming the iteration and the layer of the first non-finite value;
``-stop_on_nan`` snapshots the last finite state and exits non-zero."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from cct import solvers
from cct.cli import main
from cct.errors import CctError
from cct.io.weights import read_caffemodel
from cct.solvers.divergence import first_nonfinite, gradients_finite
from tests.solvers.helpers import captured_log, feed_solver, messages, tiny_solver_param


def _solver(**fields):
    with captured_log():
        s = solvers.create_solver(tiny_solver_param(**fields))
    feed_solver(s)
    return s


def _warnings(text: str) -> list[str]:
    return [m for m in messages(text, "W") if "non-finite" in m]


def test_a_huge_learning_rate_is_reported_once_with_iteration_and_layer():
    s = _solver(base_lr=1e12, max_iter=12)
    with captured_log() as buf:
        s.solve()
    lines = _warnings(buf.getvalue())
    assert len(lines) == 1, lines
    assert lines[0].startswith("Iteration ")
    assert "of layer '" in lines[0]
    assert s.iter == 12  # as Caffe: training goes on


def test_the_first_layer_in_forward_order_is_named():
    s = _solver(max_iter=1)
    s.net.forward_backward()
    assert first_nonfinite(s.net) is None and gradients_finite(s.net)
    s.net.params["ip2"][0].data[0, 0] = np.inf
    s.net.forward_backward()
    where = first_nonfinite(s.net)
    assert where.startswith("top 'ip2' of layer 'ip2' (InnerProduct) in the forward pass"), where


def test_a_nonfinite_gradient_with_a_finite_loss_names_the_backward_layer():
    s = _solver(max_iter=1)
    s.net.forward_backward()
    s.net.params["ip1"][0].diff[1, 2] = np.nan
    assert not gradients_finite(s.net)
    where = first_nonfinite(s.net)
    assert where.startswith("gradient of parameter 0 of layer 'ip1' (InnerProduct) in the backward pass"), where
    assert "element 6" in where  # row 1, column 2 of a 4-wide weight: the flat index


def test_large_finite_gradients_are_not_divergence():
    s = _solver(max_iter=1)
    s.net.forward_backward()
    s.net.params["ip1"][0].diff[...] = 3e38  # the float32 sum overflows; every element is finite
    assert gradients_finite(s.net)


def test_stop_on_nan_snapshots_the_last_finite_state_and_raises(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = _solver(base_lr=1e12, max_iter=12, snapshot_prefix="snap")
    s.stop_on_nan = True
    with captured_log() as buf, pytest.raises(CctError, match=r"^Iteration \d+: training diverged .*-stop_on_nan"):
        s.solve()
    assert len(_warnings(buf.getvalue())) == 1
    model = tmp_path / f"snap_iter_{s.iter}.caffemodel"
    assert model.exists() and (tmp_path / f"snap_iter_{s.iter}.solverstate").exists()
    for layer in read_caffemodel(model).layer:
        for b in layer.blobs:
            assert np.isfinite(np.array(b.data)).all()


def test_cli_stop_on_nan_exits_non_zero_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    p = tiny_solver_param(base_lr=1e12, max_iter=20, snapshot_prefix="snap")
    net = p.net_param
    p.ClearField("net_param")
    # the CLI needs data the net can feed itself: a DummyData in place of the Input layers
    text_format.Parse("""
      layer { name: "data" type: "DummyData" top: "data" top: "label"
              dummy_data_param { shape { dim: 6 dim: 4 } shape { dim: 6 }
                                 data_filler { type: "gaussian" std: 1 }
                                 data_filler { type: "uniform" min: 0 max: 2.99 } } }
    """, p.net_param)
    for layer in net.layer:
        if layer.type != "Input":
            p.net_param.layer.add().CopyFrom(layer)
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(p))
    with captured_log() as buf:
        rc = main(["train", "-solver", "solver.prototxt", "-stop_on_nan"])
    text = buf.getvalue()
    assert rc != 0
    fatal = messages(text, "F")
    assert len(fatal) == 1 and "training diverged" in fatal[0] and "Traceback" not in text
    assert len(_warnings(text)) == 1
    assert list(tmp_path.glob("snap_iter_*.caffemodel"))
    with captured_log() as buf:
        rc = main(["train", "-solver", "solver.prototxt"])
    assert rc == 0 and len(_warnings(buf.getvalue())) == 1


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_finiteness_of_a_gradient_split_over_the_partitions(monkeypatch, native_on):
    """A gradient is tested by the compiled pass (a large one in ranges over the batch partitions) or by its sum
    (numpy): a non-finite value anywhere, in the first range or the last, is found either way."""
    from cct import native
    from cct.config import settings
    from cct.solvers.divergence import SPLIT_MIN_VALUES, _finite

    monkeypatch.setenv("CCT_NATIVE", native_on)
    compiled = native.kernels()
    settings.set("partitions", 2)
    for size in (1000, SPLIT_MIN_VALUES + 1):
        a = np.ones(size, np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            assert _finite(a, compiled)
            for at, bad in ((0, np.nan), (size - 1, np.inf), (size // 2, -np.inf)):
                b = a.copy()
                b[at] = bad
                assert not _finite(b, compiled), (size, at, bad)
            assert _finite(np.full(size, np.finfo(np.float32).max), compiled)  # a float32 sum overflows: finite
