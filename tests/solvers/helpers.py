"""Shared by the solver and command-line tests: capturing the glog stream, small solvable nets, and
reading the messages out of glog lines (ours ``I<mmdd>``, Caffe's newer ``I<yyyymmdd>``)."""
from __future__ import annotations

import contextlib
import io
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import text_format

from cct import log
from cct.proto import caffe_pb2 as pb

GLOG = re.compile(r"^([IWEF])\d{4}(?:\d{4})? \d\d:\d\d:\d\d\.\d{6}\s+\d+ [^:\s]+:\d+\] (.*)$")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)")


@contextlib.contextmanager
def captured_log() -> Iterator[io.StringIO]:
    """Route cct's glog lines, every level whatever ``GLOG_minloglevel`` says, into a StringIO for the duration
    (then back to stderr)."""
    buf = io.StringIO()
    log.init_log(0, stream=buf)
    try:
        yield buf
    finally:
        log.init_log()


def messages(text: str, levels: str = "IWEF") -> list[str]:
    """The message part of each glog line of ``text`` (continuation lines dropped)."""
    out = []
    for line in text.splitlines():
        m = GLOG.match(line)
        if m and m.group(1) in levels:
            out.append(m.group(2))
    return out


KEY_LINES = re.compile(r"^(Iteration \d+|    Test net output|    Train net output|Test loss|Snapshotting|"
                       r"Optimization Done|Optimization stopped|Solving|Learning Rate Policy|Gradient clipping|"
                       r"MultiStep)")


def key_lines(text: str) -> list[str]:
    """The solver's progress lines, with the wall-clock part of display lines removed."""
    out = []
    for msg in messages(text, "I"):
        if KEY_LINES.match(msg):
            out.append(re.sub(r" \([-\d.e+]+ iter/s, [-\d.e+]+s/(\d+) iters\)", r" (<time>/\1 iters)", msg))
    return out


def split_numbers(line: str) -> tuple[str, list[float]]:
    """A line's text with every number replaced by '#', and the numbers."""
    nums = [float(x) for x in NUMBER.findall(line)]
    return NUMBER.sub("#", line), nums


def assert_same_progress(ours: list[str], theirs: list[str], rtol: float = 1e-3, atol: float = 1e-6) -> None:
    """Line by line: same text, numbers within ``rtol``."""
    assert len(ours) == len(theirs), (f"{len(ours)} progress lines vs Caffe's {len(theirs)}:\n"
                                      + "\n".join(f"{a!r:80} | {b!r}" for a, b in zip(ours, theirs)))
    for a, b in zip(ours, theirs):
        ta, na = split_numbers(a)
        tb, nb = split_numbers(b)
        assert ta == tb, f"line differs:\n  ours:  {a}\n  Caffe: {b}"
        assert np.allclose(na, nb, rtol=rtol, atol=atol, equal_nan=True), f"numbers differ:\n  ours:  {a}\n  Caffe: {b}"


def copy_case(src: Path, dst: Path) -> Path:
    """A writable copy of a reference folder."""
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)
    return dst


# ------------------------------------------------------------------------------------------------
# A small deterministic net fed by a Python-less Input layer
# ------------------------------------------------------------------------------------------------

TINY_NET = """
name: "Tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 6 dim: 4 } shape { dim: 6 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        param { lr_mult: 0.5 decay_mult: 2 }
        inner_product_param { num_output: 3 bias_term: false weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" include { phase: TEST } }
"""


def tiny_solver_param(**fields) -> pb.SolverParameter:
    """A SolverParameter training TINY_NET (net_param), with ``fields`` set (lists extend, messages
    are copied)."""
    p = pb.SolverParameter()
    text_format.Parse(TINY_NET, p.net_param)
    p.base_lr = 0.1
    p.lr_policy = "fixed"
    p.max_iter = 10
    p.random_seed = 7
    p.snapshot_after_train = False
    return set_fields(p, **fields)


def set_fields(message: Any, **fields: Any) -> Any:
    """``message`` with ``fields`` set (lists extend repeated fields, messages are copied); returns it."""
    for k, v in fields.items():
        if isinstance(v, (list, tuple)):
            getattr(message, k).extend(v)
        elif hasattr(v, "DESCRIPTOR"):
            getattr(message, k).CopyFrom(v)
        else:
            setattr(message, k, v)
    return message


def feed(net, seed: int = 0) -> None:
    """Fixed inputs for TINY_NET."""
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal((6, 4)).astype(np.float32)
    net.blobs["label"].data[...] = np.array([0, 1, 2, 0, 1, 2], dtype=np.float32)


def feed_solver(solver) -> None:
    feed(solver.net)
    for t in solver.test_nets:
        feed(t, 1)
