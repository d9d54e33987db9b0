"""The ``cct`` command line: Caffe's verbs, gflags syntax, log formats of ``test``/``time``, signals, and
one-line errors (never a traceback)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import types

import pytest
from google.protobuf import text_format

from cct import cli
from cct.compare.tolerance import compare_arrays
from cct.device import cupy_available
from cct.errors import CctError
from tests.reference import REFERENCE
from tests.solvers.helpers import TINY_NET, captured_log, copy_case, messages, split_numbers, tiny_solver_param

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> tuple[int, str]:
    with captured_log() as buf:
        rc = cli.main(list(args))
    return rc, buf.getvalue()


def one_fatal_line(text: str) -> str:
    """The single F line of a failed run (and no traceback)."""
    assert "Traceback" not in text
    fatal = messages(text, "F")
    assert len(fatal) == 1, text
    assert len([line for line in text.splitlines() if line.startswith("F")]) == 1
    return fatal[0]


@pytest.fixture
def tiny_case(tmp_path, monkeypatch):
    """A solver + Input-fed net in tmp_path (the working directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(TINY_NET)
    p = tiny_solver_param(display=1, max_iter=8, snapshot_prefix="snap", snapshot_after_train=True,
                          solver_mode=0, momentum=0.9)
    p.ClearField("net_param")
    p.net = "net.prototxt"
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(p))
    return tmp_path


# ---- flags and usage -------------------------------------------------------------------------------

def test_caffe_flags_and_defaults():
    flags, pos = cli.parse_flags(["-solver=a.prototxt", "train", "--weights", "w1,w2", "-level", "3",
                                  "--logtostderr", "--", "-x"], cli.FLAGS)
    assert pos == ["train", "-x"]
    assert (flags.solver, flags.weights, flags.level) == ("a.prototxt", "w1,w2", 3)
    assert flags.iterations == 50 and flags.sigint_effect == "stop" and flags.sighup_effect == "snapshot"
    with pytest.raises(CctError, match="illegal value 'x' specified for int32 flag 'iterations'"):
        cli.parse_flags(["-iterations=x"], cli.FLAGS)


def test_usage_without_a_command(capsys):
    rc, text = run()
    assert rc == 1
    err = capsys.readouterr().err
    assert ("command line brew\nusage: caffe <command> <args>\n\ncommands:\n"
            "  train           train or finetune a model\n  test            score a model\n"
            "  device_query    show GPU diagnostic information\n"
            "  time            benchmark model execution time") in err
    assert "-solver (The solver definition protocol buffer text file.) type: string" in err
    rc, _ = run("-help")
    assert rc == 0


@pytest.mark.parametrize("args, message", [
    (["frobnicate"], "Unknown action: frobnicate (available caffe actions: "),
    (["train"], "Need a solver definition to train."),
    (["train", "-solver", "missing.prototxt"], "Could not open file missing.prototxt"),
    (["train", "-solver", "s.prototxt", "-snapshot", "a", "-weights", "b"],
     "Give a snapshot to resume training or weights to finetune but not both."),
    (["train", "-solver", "s.prototxt", "-sigint_effect", "quit"], 'Invalid signal effect "quit" was specified'),
    (["test", "-model", "m.prototxt"], "Need model weights to score."),
    (["test", "-weights", "w"], "Need a model definition to score."),
    (["time"], "Need a model definition to time."),
    (["time", "-model", "m.prototxt", "-phase", "VAL"], 'phase must be "TRAIN" or "TEST"'),
    (["train", "-iterations", "many"], "illegal value 'many' specified for int32 flag 'iterations'"),
    (["train", "--bogus"], "unknown command line flag 'bogus'"),
])
def test_user_errors_are_one_line(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, text = run(*args)
    assert rc != 0
    assert message in one_fatal_line(text)


def test_solver_naming_a_missing_net_is_one_line(tiny_case):
    text = (tiny_case / "solver.prototxt").read_text().replace("net.prototxt", "absent_net.prototxt")
    (tiny_case / "solver.prototxt").write_text(text)
    rc, out = run("train", "-solver", "solver.prototxt")
    assert rc == 1 and "absent_net.prototxt" in one_fatal_line(out)


def test_a_bad_net_is_one_line(tiny_case):
    (tiny_case / "net.prototxt").write_text(TINY_NET.replace('bottom: "ip1" top: "ip2"', 'bottom: "nope" top: "ip2"'))
    rc, out = run("train", "-solver", "solver.prototxt")
    assert rc == 1 and "nope" in one_fatal_line(out)


@pytest.mark.skipif(cupy_available, reason="checks the message given without cupy")
def test_gpu_without_cupy_is_one_line(tiny_case):
    for args in (["train", "-solver", "solver.prototxt", "-gpu", "0"], ["device_query", "-gpu", "0"],
                 ["test", "-model", "net.prototxt", "-weights", "w", "-gpu", "all"]):
        rc, out = run(*args)
        assert rc == 1 and "GPU mode needs cupy" in one_fatal_line(out)


@pytest.mark.skipif(cupy_available, reason="checks the CPU fallback")
def test_solver_mode_gpu_without_cupy_falls_back_to_cpu(tiny_case):
    text = (tiny_case / "solver.prototxt").read_text().replace("solver_mode: CPU", "solver_mode: GPU")
    (tiny_case / "solver.prototxt").write_text(text)
    rc, out = run("train", "-solver", "solver.prototxt")
    assert rc == 0
    assert any("training on the CPU" in m for m in messages(out, "W")) and "Use CPU." in messages(out)


def test_unexpected_errors_are_one_line_with_a_hint(monkeypatch, capsys):
    def broken(flags):
        raise ValueError("something odd\non two lines")

    monkeypatch.setitem(cli.COMMANDS, "train", broken)
    monkeypatch.delenv("CCT_TRACEBACK", raising=False)
    rc, out = run("train")
    line = one_fatal_line(out)
    assert rc == 1 and "ValueError: something odd on two lines" in line and "CCT_TRACEBACK=1" in line
    monkeypatch.setenv("CCT_TRACEBACK", "1")
    rc, out = run("train")
    assert rc == 1 and "Traceback" in capsys.readouterr().err


def test_python_dash_m_cct_reports_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CCT_TRACEBACK", None)
    r = subprocess.run([sys.executable, "-m", "cct", "train", "-solver", "nothing.prototxt"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].endswith("Could not open file nothing.prototxt")
    assert "Traceback" not in r.stderr


# ---- train ----------------------------------------------------------------------------------------

def test_train_logs_and_snapshots(tiny_case):
    rc, out = run("train", "-solver", "solver.prototxt", "-level", "2", "-stage", "s1,s2")
    assert rc == 0
    msgs = messages(out)
    assert msgs[0] == "Use CPU."
    assert "Starting Optimization" in msgs and msgs[-1] == "Optimization Done." and msgs[-2] == "Optimization Done."
    assert 'train_state {\n  level: 2\n  stage: "s1"\n  stage: "s2"\n}' in out  # -level/-stage reach train_state
    assert (tiny_case / "snap_iter_8.caffemodel").exists() and (tiny_case / "snap_iter_8.solverstate").exists()


def test_weights_list_and_resume(tiny_case):
    rc, _ = run("train", "-solver", "solver.prototxt")
    assert rc == 0
    rc, out = run("train", "-solver", "solver.prototxt", "-weights", "snap_iter_8.caffemodel, snap_iter_8.caffemodel")
    assert rc == 0 and messages(out).count("Finetuning from snap_iter_8.caffemodel") == 2
    rc, out = run("train", "-solver", "solver.prototxt", "-snapshot", "snap_iter_8.solverstate")
    assert rc == 0 and "Resuming from snap_iter_8.solverstate" in messages(out)


def _raise_signal_at(monkeypatch, signum: int, at_iter: int) -> None:
    from cct.solvers.sgd import SGDSolver

    real = SGDSolver.apply_update

    def apply_update(self):
        real(self)
        if self.iter == at_iter:
            signal.raise_signal(signum)

    monkeypatch.setattr(SGDSolver, "apply_update", apply_update)


def test_sigint_snapshots_and_stops(tiny_case, monkeypatch):
    before = signal.getsignal(signal.SIGINT)  # Python's default handler, or SIG_IGN in a background job
    _raise_signal_at(monkeypatch, signal.SIGINT, 3)
    rc, out = run("train", "-solver", "solver.prototxt")
    msgs = messages(out)
    assert rc == 0 and "Optimization stopped early." in msgs
    assert sorted(p.name for p in tiny_case.glob("snap_*")) == ["snap_iter_3.caffemodel", "snap_iter_3.solverstate"]
    assert signal.getsignal(signal.SIGINT) is before  # restored afterwards


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_sighup_snapshots_and_goes_on(tiny_case, monkeypatch):
    _raise_signal_at(monkeypatch, signal.SIGHUP, 3)
    rc, out = run("train", "-solver", "solver.prototxt")
    assert rc == 0 and "Optimization stopped early." not in messages(out)
    assert sorted(p.name for p in tiny_case.glob("snap_*.caffemodel")) == ["snap_iter_3.caffemodel",
                                                                          "snap_iter_8.caffemodel"]


def test_sigint_effect_none_ignores_the_signal(tiny_case, monkeypatch):
    _raise_signal_at(monkeypatch, signal.SIGINT, 3)
    rc, out = run("train", "-solver", "solver.prototxt", "-sigint_effect", "none")
    assert rc == 0 and "Optimization stopped early." not in messages(out)
    assert sorted(p.name for p in tiny_case.glob("snap_*.caffemodel")) == ["snap_iter_8.caffemodel"]


def test_sigterm_effect_snapshot_snapshots_once_and_stops(tiny_case, monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    _raise_signal_at(monkeypatch, signal.SIGTERM, 3)
    rc, out = run("train", "-solver", "solver.prototxt", "-sigterm_effect", "snapshot")
    msgs = messages(out)
    assert rc == 0 and "Optimization stopped early." in msgs
    assert msgs.count("Snapshotting to binary proto file snap_iter_3.caffemodel") == 1
    assert sorted(p.name for p in tiny_case.glob("snap_*")) == ["snap_iter_3.caffemodel", "snap_iter_3.solverstate"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_is_left_to_the_os_without_the_flag(tiny_case, monkeypatch):
    from cct.solvers.sgd import SGDSolver

    seen = []
    real = SGDSolver.apply_update

    def apply_update(self):
        seen.append(signal.getsignal(signal.SIGTERM))
        real(self)

    monkeypatch.setattr(SGDSolver, "apply_update", apply_update)
    before = signal.getsignal(signal.SIGTERM)
    rc, _ = run("train", "-solver", "solver.prototxt")
    assert rc == 0 and seen and all(h is before for h in seen)


def test_a_failed_snapshot_write_is_one_line_and_keeps_the_previous_snapshot(tiny_case, monkeypatch):
    import errno

    p = tiny_solver_param(max_iter=8, snapshot=2, snapshot_prefix="snap", solver_mode=0)
    p.ClearField("net_param")
    p.net = "net.prototxt"
    (tiny_case / "solver.prototxt").write_text(text_format.MessageToString(p))
    real_replace = os.replace

    def replace(src, dst):  # the disk fills up while the iteration-4 solver state is written
        if str(dst).endswith("snap_iter_4.solverstate"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    rc, out = run("train", "-solver", "solver.prototxt")
    assert rc == 1
    line = one_fatal_line(out)
    assert "snap_iter_4.solverstate" in line and "No space left on device" in line
    assert sorted(q.name for q in tiny_case.glob("snap_*")) == ["snap_iter_2.caffemodel", "snap_iter_2.solverstate"]
    assert not [q for q in tiny_case.iterdir() if q.name.startswith(".")]  # no temporary files left
    monkeypatch.setattr(os, "replace", real_replace)
    rc, out = run("train", "-solver", "solver.prototxt", "-snapshot", "snap_iter_2.solverstate")
    assert rc == 0 and (tiny_case / "snap_iter_8.solverstate").exists()


# ---- test, time, device_query, tools -------------------------------------------------------------

def _reference_or_skip(*parts: str):
    path = REFERENCE.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"Caffe reference outputs not found at {path}")
    return path


def test_test_command_matches_caffe(tmp_path, monkeypatch):
    case = copy_case(_reference_or_skip("solvers", "sgd_step"), tmp_path / "case")
    monkeypatch.chdir(case)
    rc, out = run("test", "-model", "net.prototxt", "-weights", "caffe_snapshot_iter_12.caffemodel",
                  "-iterations", "2")
    assert rc == 0
    keep = ("Use CPU.", "Running for", "Batch ", "Loss: ", "acc = ", "loss = ")
    ours = [m for m in messages(out) if m.startswith(keep)]
    theirs = [m for m in messages(_reference_or_skip("logs", "caffe_test_sgd_step.log").read_text())
              if m.startswith(keep)]
    assert len(ours) == len(theirs) == 9
    for a, b in zip(ours, theirs):
        (ta, na), (tb, nb) = split_numbers(a), split_numbers(b)
        assert ta == tb and compare_arrays(na, nb).ok, (a, b)


def test_time_command_has_caffes_format(monkeypatch):
    model = _reference_or_skip("nets", "lenet", "net.prototxt")
    rc, out = run("time", "-model", str(model), "-iterations", "3")
    assert rc == 0

    def shape(text):
        msgs = messages(text)
        start = msgs.index("Performing Forward")
        # cct adds one "<layer>\tengine: ..." line per conv/partitioned layer before the benchmark block
        return [split_numbers(m)[0] for m in msgs[start:] if "caffe.cpp" not in m and "\tengine: " not in m]

    ours, theirs = shape(out), shape(_reference_or_skip("logs", "caffe_time_lenet.log").read_text())
    assert ours == theirs
    assert "      data\tforward: " in out and "     conv1\tbackward: " in out


def test_device_query_describes_the_cpu():
    rc, out = run("device_query")
    msgs = messages(out)
    assert rc == 0 and msgs[0] == "Querying GPUs "
    assert any(m.startswith("CPU cores:") for m in msgs) and any(m.startswith("BLAS:") for m in msgs)
    assert any(m.startswith("Kernels:") for m in msgs)


def test_data_tools_are_dispatched(monkeypatch):
    calls = []
    fake = types.ModuleType("cct.data.tools")
    fake.convert_imageset_main = lambda argv: calls.append(("convert", argv)) or 0
    fake.compute_image_mean_main = lambda argv: calls.append(("mean", argv)) or 3
    monkeypatch.setitem(sys.modules, "cct.data.tools", fake)
    import cct.data

    monkeypatch.setattr(cct.data, "tools", fake, raising=False)
    assert cli.main(["convert_imageset", "--shuffle", "root/", "list.txt", "db"]) == 0
    assert cli.main(["compute_image_mean", "db", "mean.binaryproto"]) == 3
    assert calls == [("convert", ["--shuffle", "root/", "list.txt", "db"]), ("mean", ["db", "mean.binaryproto"])]


def test_time_measures_every_close_call_as_a_long_run_does(tmp_path, monkeypatch):
    """``cct time`` builds its net as a long training run would choose its engines: an unbounded measuring budget
    (``expecting_iterations(inf)``), so that it times what training runs."""
    from cct.engines import autotune

    seen = []
    monkeypatch.setattr(autotune.Ledger, "measure_deferred", lambda self: seen.append(self.iterations))
    model = tmp_path / "net.prototxt"
    model.write_text('layer { name: "d" type: "Input" top: "x" '
                     'input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } } }\n'
                     'layer { name: "c" type: "Convolution" bottom: "x" top: "y" '
                     'convolution_param { num_output: 2 kernel_size: 3 } }\n')
    rc, _ = run("time", "-model", str(model), "-iterations", "1")
    assert rc == 0 and seen == [float("inf")]


def test_time_prints_the_engine_of_each_conv_layer(tmp_path):
    model = tmp_path / "net.prototxt"
    model.write_text('layer { name: "d" type: "Input" top: "x" '
                     'input_param { shape { dim: 2 dim: 8 dim: 9 dim: 9 } } }\n'
                     'layer { name: "c" type: "Convolution" bottom: "x" top: "y" '
                     'convolution_param { num_output: 4 kernel_size: 3 } }\n')
    rc, out = run("time", "-model", str(model), "-iterations", "1", "-lowering", "3", "-partitions", "1")
    assert rc == 0
    assert re.search(r"\s+c\tengine: lowering 3 \(forced by -lowering\)", out)
    rc, _ = run("time", "-model", str(model), "-lowering", "7")
    assert rc == 1
