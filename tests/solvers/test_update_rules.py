"""Every update rule, step by step, against a direct float64 numpy transcription of Caffe's formulas:
``iter_size`` normalisation, gradient clipping, L1/L2 decay with ``decay_mult``, ``lr_mult``.

Each solver step is checked from the state it started in (weights, gradients and history captured
in ``on_gradients_ready``), so rounding never accumulates into the comparison."""
from __future__ import annotations

import numpy as np
import pytest

from cct import solvers
from tests.solvers.helpers import captured_log, feed_solver, messages, tiny_solver_param

RULES = {
    "SGD": dict(momentum=0.9),
    "Nesterov": dict(momentum=0.9),
    "AdaGrad": dict(delta=1e-6),
    "RMSProp": dict(rms_decay=0.95, delta=1e-6),
    "AdaDelta": dict(momentum=0.95, delta=1e-6, base_lr=1.0),
    "Adam": dict(momentum=0.9, momentum2=0.999, delta=1e-8, base_lr=0.01),
}
VARIANTS = {
    "plain": dict(weight_decay=0.01),
    "accumulate+clip+L1": dict(weight_decay=0.02, regularization_type="L1", iter_size=3, clip_gradients=0.05,
                               lr_policy="multistep", stepvalue=[1, 3], gamma=0.5),
}


def _rule_step(kind, p, g, h, it, lr):
    """One parameter's step (returned) and its history (updated in place); float64, Caffe's formulas."""
    mu = np.float64(p.momentum)
    delta = np.float64(p.delta)
    if kind == "SGD":
        h[0][...] = mu * h[0] + lr * g
        return h[0].copy()
    if kind == "Nesterov":
        old = h[0].copy()
        h[0][...] = mu * h[0] + lr * g
        return (1 + mu) * h[0] - mu * old
    if kind == "AdaGrad":
        h[0] += g * g
        return lr * g / (np.sqrt(h[0]) + delta)
    if kind == "RMSProp":
        rd = np.float64(p.rms_decay)
        h[0][...] = rd * h[0] + (1 - rd) * g * g
        return lr * g / (np.sqrt(h[0]) + delta)
    if kind == "AdaDelta":
        h[0][...] = mu * h[0] + (1 - mu) * g * g
        u = g * np.sqrt((h[1] + delta) / (h[0] + delta))
        h[1][...] = mu * h[1] + (1 - mu) * u * u
        return lr * u
    if kind == "Adam":
        b1, b2, t = mu, np.float64(p.momentum2), it + 1
        h[0][...] = b1 * h[0] + (1 - b1) * g
        h[1][...] = b2 * h[1] + (1 - b2) * g * g
        return lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * h[0] / (np.sqrt(h[1]) + delta)
    raise AssertionError(kind)


def _reference_update(kind, p, ws, gs, hs, it, rate, lr_mults, decay_mults):
    """Caffe's ApplyUpdate on float64 copies: clip → normalize → regularize → rule → w -= step."""
    gs = [g.astype(np.float64) for g in gs]
    if p.clip_gradients >= 0:
        norm = np.sqrt(sum((g * g).sum() for g in gs))
        if norm > p.clip_gradients:
            gs = [g * (p.clip_gradients / norm) for g in gs]
    out = []
    for i, (w, g) in enumerate(zip(ws, gs)):
        w = w.astype(np.float64)
        g = g / p.iter_size
        decay = p.weight_decay * decay_mults[i]
        if decay:
            g = g + decay * (w if p.regularization_type == "L2" else np.sign(w))
        step = _rule_step(kind, p, g, [h[i] for h in hs], it, np.float64(rate) * lr_mults[i])
        out.append(w - step)
    return out


class _Capture:
    def __init__(self, solver):
        self.solver = solver

    def on_start(self):
        pass

    def on_gradients_ready(self):
        net = self.solver.net
        self.ws = [p.data.copy() for p in net.learnable_params]
        self.gs = [p.diff.copy() for p in net.learnable_params]
        self.hist = [h.data.astype(np.float64) for h in self.solver.history]
        self.iter = self.solver.iter
        self.current_step = self.solver.current_step


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", list(RULES))
def test_rule_matches_numpy_transcription(kind, variant):
    fields = dict(type=kind, **RULES[kind], **VARIANTS[variant])
    with captured_log() as buf:
        solver = solvers.create_solver(tiny_solver_param(**fields))
        assert type(solver).type == kind
        feed_solver(solver)
        cap = _Capture(solver)
        solver.add_callback(cap)
        net = solver.net
        n = len(net.learnable_params)
        sets = 2 if kind in ("AdaDelta", "Adam") else 1
        assert len(solver.history) == sets * n
        p = solver.param
        for _ in range(6):
            solver.step(1)
            from cct.solvers.lr_policy import learning_rate

            rate, _ = learning_rate(p, cap.iter, cap.current_step)
            hs = [cap.hist[k * n:(k + 1) * n] for k in range(sets)]
            expected = _reference_update(kind, p, cap.ws, cap.gs, hs, cap.iter, rate, net.params_lr,
                                         net.params_weight_decay)
            for i, param in enumerate(net.learnable_params):
                np.testing.assert_allclose(param.data, expected[i], rtol=2e-5, atol=1e-7,
                                           err_msg=f"{kind}/{variant} iter {cap.iter} param {i}")
                for k in range(sets):
                    np.testing.assert_allclose(solver.history[k * n + i].data, hs[k][i], rtol=2e-5, atol=1e-9,
                                               err_msg=f"{kind}/{variant} iter {cap.iter} history {k}/{i}")
            assert solver.iter == cap.iter + 1
    if variant != "plain":
        clip_lines = [m for m in messages(buf.getvalue()) if m.startswith("Gradient clipping")]
        assert clip_lines and clip_lines[0].endswith(f"> {0.05:g}) by scale factor " + clip_lines[0].split()[-1])


def test_gradients_accumulate_over_iter_size_and_loss_is_averaged():
    with captured_log():
        single = solvers.create_solver(tiny_solver_param(display=1))
        triple = solvers.create_solver(tiny_solver_param(display=1, iter_size=3))
    for s in (single, triple):
        feed_solver(s)
    triple.net.copy_trained_layers_from(single.net.to_proto())
    grads = {}
    for name, s in (("single", single), ("triple", triple)):
        cap = _Capture(s)
        s.add_callback(cap)
        with captured_log():
            s.step(1)
        grads[name] = cap.gs
        assert s.smoothed_loss == pytest.approx(float(single.smoothed_loss), rel=1e-6)
    for a, b in zip(grads["single"], grads["triple"]):
        np.testing.assert_allclose(b, 3 * a, rtol=1e-5, atol=1e-7)
    for a, b in zip(single.net.learnable_params, triple.net.learnable_params):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind, fields, message", [
    ("AdaGrad", dict(momentum=0.9), "Momentum cannot be used with AdaGrad."),
    ("RMSProp", dict(momentum=0.9), "Momentum cannot be used with RMSProp."),
    ("RMSProp", dict(rms_decay=1.0), "rms_decay should lie between 0 and 1"),
    ("SGD", dict(regularization_type="L3"), "Unknown regularization type: L3"),
    ("Adagrad", dict(), "Unknown solver type: Adagrad"),
])
def test_rule_settings_are_checked(kind, fields, message):
    from cct.errors import CctError

    with captured_log(), pytest.raises(CctError, match=message):
        solvers.create_solver(tiny_solver_param(type=kind, **fields))


def test_class_fixes_the_rule_and_get_solver_uses_type(tmp_path):
    from google.protobuf import text_format

    path = tmp_path / "solver.prototxt"
    path.write_text(text_format.MessageToString(tiny_solver_param(type="Adam")))
    with captured_log():
        assert type(solvers.get_solver(str(path))) is solvers.AdamSolver
        assert type(solvers.NesterovSolver(str(path))) is solvers.NesterovSolver
        assert type(solvers.SGDSolver(str(path))) is solvers.SGDSolver
    assert solvers.solver_type_list() == sorted(RULES)


def _four_steps(solver, overlapped: bool) -> None:
    """Four training steps on fed data: ``solver.step``, or with ``overlapped`` (where the rule updates each
    parameter on its own and nothing clips) what an overlapping executor does: each parameter's update alone."""
    feed_solver(solver)
    if overlapped and solver.updates_per_parameter() and solver.param.clip_gradients < 0:
        for _ in range(4):
            solver.net.clear_param_diffs()
            solver.net.forward_backward()
            rate = solver.get_learning_rate()
            for i in range(len(solver.net.learnable_params)):
                solver.update_param(i, rate)
            solver.iter += 1
    else:
        solver.step(4)


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", list(RULES))
def test_chunked_update_is_bitwise_the_whole_blob_update(monkeypatch, kind, variant, overlapped):
    """Large parameters are updated chunk by chunk (``UPDATE_CHUNK`` values, split over the batch partitions,
    or in the calling thread for the per-parameter updates that overlap backward): the same float32
    operations on every value, so weights and history are bitwise those of the whole-blob update."""
    from cct.solvers import sgd

    def train(chunk):
        monkeypatch.setattr(sgd, "UPDATE_CHUNK", chunk)
        solver = solvers.create_solver(tiny_solver_param(type=kind, **RULES[kind], **VARIANTS[variant]))
        _four_steps(solver, overlapped)
        return [p.data.copy() for p in solver.net.learnable_params] + [h.data.copy() for h in solver.history]

    whole = train(1 << 30)
    sizes = [a.size for a in whole]
    chunked = train(3)  # chunks of 3 values: every parameter of at least 6 is chunked
    assert max(sizes) >= 6
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("variant", [*VARIANTS, "no decay"])
def test_compiled_sgd_step_is_bitwise_the_numpy_body(monkeypatch, variant, overlapped):
    """SGD's step runs as one compiled pass per value range where the kernels are built: the numpy body's
    float32 operations in its order, so weights, history and the update left in the gradients are its bits."""
    from cct import native
    from cct.solvers import sgd

    if native.kernels() is None:
        pytest.skip("compiled kernels not built")
    fields = dict(weight_decay=0.0) if variant == "no decay" else VARIANTS[variant]
    calls = []

    class Counting:
        def sgd_update(self, *args):
            calls.append(args[0].size)
            native.kernels().sgd_update(*args)

    def train(kernels):
        monkeypatch.setattr(sgd, "kernels", kernels)
        solver = solvers.create_solver(tiny_solver_param(type="SGD", momentum=0.9, **fields))
        _four_steps(solver, overlapped)
        params = solver.net.learnable_params
        return [p.data.copy() for p in params] + [p.diff.copy() for p in params] + [h.data.copy() for h in
                                                                                   solver.history]

    numpy_body = train(lambda: None)
    compiled = train(Counting)
    assert sum(calls) == 4 * sum(p.size for p in numpy_body[:len(numpy_body) // 3])
    for a, b in zip(numpy_body, compiled):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_other_rules_do_not_take_sgds_compiled_step():
    """Nesterov (an SGD subclass with its own rule) and the other rules keep their numpy bodies."""
    for kind in RULES:
        solver = solvers.create_solver(tiny_solver_param(type=kind, **RULES[kind]))
        p = solver.net.learnable_params[0]
        fused = solver._fused_step(0, np.float32(0.1), p.data, p.diff, [solver.history[0].data],
                                   solvers.sgd.kernels())
        assert (fused is not None) == (kind == "SGD" and solvers.sgd.kernels() is not None), kind
