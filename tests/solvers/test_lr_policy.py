"""Each learning-rate policy against a direct numpy transcription of Caffe's ``GetLearningRate``."""
from __future__ import annotations

import numpy as np
import pytest

from cct.errors import CctError
from cct.proto import caffe_pb2 as pb
from cct.solvers import SGDSolver, lr_policy
from tests.solvers.helpers import captured_log, messages, set_fields, tiny_solver_param


def _param(**fields) -> pb.SolverParameter:
    return set_fields(pb.SolverParameter(base_lr=0.01, gamma=0.9, power=0.75, stepsize=5, max_iter=40), **fields)


def _reference(p: pb.SolverParameter, it: int, step: int) -> tuple[float, int]:
    base, gamma, power = np.float64(p.base_lr), np.float64(p.gamma), np.float64(p.power)
    if p.lr_policy == "fixed":
        return base, step
    if p.lr_policy == "step":
        step = it // p.stepsize
        return base * gamma ** step, step
    if p.lr_policy == "exp":
        return base * gamma ** it, step
    if p.lr_policy == "inv":
        return base * (1 + gamma * it) ** -power, step
    if p.lr_policy == "multistep":
        if step < len(p.stepvalue) and it >= p.stepvalue[step]:
            step += 1
        return base * gamma ** step, step
    if p.lr_policy == "poly":
        return base * (1 - it / p.max_iter) ** power, step
    if p.lr_policy == "sigmoid":
        return base / (1 + np.exp(-gamma * (it - p.stepsize))), step
    raise AssertionError(p.lr_policy)


@pytest.mark.parametrize("policy", ["fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid"])
def test_policy_matches_transcription(policy):
    p = _param(lr_policy=policy, stepvalue=[3, 7, 8, 20] if policy == "multistep" else [])
    step = ref_step = 0
    for it in range(40):
        rate, step = lr_policy.learning_rate(p, it, step)
        expected, ref_step = _reference(p, it, ref_step)
        assert rate.dtype == np.float32
        assert step == ref_step, f"{policy} iter {it}: current_step {step} != {ref_step}"
        assert np.isclose(rate, expected, rtol=1e-6, atol=0), f"{policy} iter {it}: {rate} != {expected}"


def test_multistep_advances_once_per_call_and_logs():
    p = _param(lr_policy="multistep", stepvalue=[2, 2, 5])
    with captured_log() as buf:
        steps = []
        step = 0
        for it in range(7):
            _, step = lr_policy.learning_rate(p, it, step)
            steps.append(step)
    # iteration 2 passes both stepvalues 2 and 2, but only one step per call
    assert steps == [0, 0, 1, 2, 2, 3, 3]
    assert [m for m in messages(buf.getvalue()) if m.startswith("MultiStep")] == [
        "MultiStep Status: Iteration 2, step = 1", "MultiStep Status: Iteration 3, step = 2",
        "MultiStep Status: Iteration 5, step = 3"]


def test_rate_is_computed_in_double_then_rounded_to_float32():
    p = _param(lr_policy="exp", base_lr=0.1, gamma=0.97)
    rate, _ = lr_policy.learning_rate(p, 17, 0)
    assert rate == np.float32(np.float64(np.float32(0.1)) * np.float64(np.float32(0.97)) ** 17)


@pytest.mark.parametrize("fields, message", [
    (dict(lr_policy=""), "Unknown learning rate policy: (lr_policy not set)"),
    (dict(lr_policy="cosine"), "Unknown learning rate policy: cosine"),
    (dict(lr_policy="step", stepsize=0), "needs stepsize > 0"),
    (dict(lr_policy="sigmoid", stepsize=0), "needs stepsize > 0"),
    (dict(lr_policy="exp", gamma=-1.0), "needs gamma >= 0"),
])
def test_bad_policy_settings_fail_at_construction(fields, message):
    with captured_log(), pytest.raises(CctError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SGDSolver(tiny_solver_param(**fields))


def test_solver_lr_property_and_settable_base_lr():
    with captured_log():
        s = SGDSolver(tiny_solver_param(lr_policy="step", base_lr=0.5, gamma=0.1, stepsize=2))
    assert s.lr == pytest.approx(0.5)
    s.param.base_lr = 0.25  # pycaffe HEAD: settable, takes effect at once
    assert s.lr == pytest.approx(0.25)
    s.iter = 4
    assert s.lr == pytest.approx(0.25 * 0.01)
    assert s.current_step == 2
