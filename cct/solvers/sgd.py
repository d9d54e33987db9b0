"""The six update rules: SGD and its subclasses Nesterov, AdaGrad, RMSProp, AdaDelta, Adam.

Shared by all (Caffe's ``SGDSolver::ApplyUpdate``), per iteration:

1. ``rate = lr_policy(iter)`` (:mod:`cct.solvers.lr_policy`); logged as ``Iteration <iter>, lr = <rate>``
   on display iterations.
2. Gradient clipping: if ``clip_gradients >= 0`` and the L2 norm of all learnable diffs (still summed
   over the ``iter_size`` passes) exceeds it, every diff is scaled by ``clip_gradients / norm``.
3. For each learnable parameter ``w`` with gradient ``g`` (its diff):
   normalize ``g *= 1 / iter_size`` → regularize (``d = weight_decay * decay_mult``; L2 ``g += d * w``,
   L1 ``g += d * sign(w)``) → the rule below, with ``lr = rate * lr_mult``, which leaves the step in
   ``g``.
4. ``w -= g`` for every learnable parameter (``Net::Update``), then ``iter += 1``.

Everything is float32, in place, one vectorised pass per step over each parameter blob, or over each
cache-sized chunk of a large one (``UPDATE_CHUNK``: the same operations on every value).  History blobs (the
solverstate's ``history``) have the parameters' shapes, in learnable-parameter order; AdaDelta and
Adam keep a second set after the first.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from cct import log
from cct.blob import Blob, blob_from_proto, blob_to_proto
from cct.device import get_array_module
from cct.errors import CctError
from cct.native import kernels, takes
from cct.proto import caffe_pb2 as pb
from cct.runtime.partition import partitions_for, run_batch
from cct.solvers.lr_policy import check_lr_policy, learning_rate
from cct.solvers.solver import Solver, register_solver

f32 = np.float32
# host parameters of at least two chunks are updated chunk by chunk, every step of the rule on a chunk while it is
# in the cache (the same float32 operations on every value, in the same order: bitwise the whole-array update),
# the chunks split over the batch partitions: CaffeNet's fc6 (37.7M values) SGD step 46 -> 17 ms on 2 cores
UPDATE_CHUNK = 1 << 17
# operations per value of an update step, for the partition cost model (memory-bound: three arrays read, written)
UPDATE_WORK_PER_VALUE = 16.0


class _Slab(NamedTuple):
    """What an update rule works on: a parameter's values ``w``, gradient ``g`` and history arrays ``h`` (the
    whole blobs, or one chunk of each), and ``t(k)``: scratch array ``k`` of the same size."""

    w: Any
    g: Any
    h: tuple[Any, ...]
    t: Callable[[int], Any]


@register_solver
class SGDSolver(Solver):
    r"""Stochastic gradient descent with momentum, Caffe's way.

    .. math::
        h \leftarrow \mu h + \mathrm{lr}\, g, \qquad w \leftarrow w - h

    (``momentum`` μ; ``h`` is the history).  Unlike PyTorch/TF (``v = μv + g; w -= lr·v``), Caffe
    puts the learning rate *inside* the momentum buffer, so changing ``lr`` does not rescale the
    velocity already accumulated; the two agree only for a constant rate.
    """

    type = "SGD"
    history_sets = 1  #: how many history blobs per learnable parameter
    _update_iter: int | None = None  #: the iteration whose gradient :meth:`update_params` is applying

    def _check_param(self) -> None:
        check_lr_policy(self.param, self._source)
        if self.param.regularization_type not in ("L1", "L2"):
            raise CctError(f"{self._source}: Unknown regularization type: {self.param.regularization_type} "
                           "(known: L1, L2)")

    def _pre_solve(self) -> None:
        params = self.net.learnable_params
        self.history: list[Blob] = [Blob(p.shape, xp=p.xp, dtype=p.dtype)
                                    for _ in range(self.history_sets) for p in params]
        self._temp: dict[tuple[int, int], Any] = {}
        self._chunk_temp: dict[tuple[int, int], Any] = {}

    def _scratch(self, i: int, k: int = 0, like: Any = None) -> Any:
        """Work array ``k`` shaped like learnable parameter ``i`` (Caffe's ``temp_``/``update_``), where ``like``
        (an array the update works on) lives: the parameter's own place by default."""
        p = self.net.learnable_params[i]
        xp = p.xp if like is None else _xp(like)
        t = self._temp.get((i, k))
        if t is None or t.shape != p.shape or _xp(t) is not xp:
            t = self._temp[i, k] = xp.empty(p.shape, dtype=p.dtype)
        return t

    # ---- rate --------------------------------------------------------------------------------
    def get_learning_rate(self) -> np.float32:
        rate, self.current_step = learning_rate(self.param, self.iter, self.current_step)
        return rate

    @property
    def lr(self) -> float:
        """The current learning rate (pycaffe HEAD's ``solver.lr``)."""
        return float(self.get_learning_rate())

    # ---- update ------------------------------------------------------------------------------
    def apply_update(self) -> None:
        rate = self.get_learning_rate()
        p = self.param
        if p.display and self.iter % p.display == 0:
            log.info("Iteration %d, lr = %s", self.iter, log.fmt(rate))
        groups = self.update_groups(rate)
        if p.clip_gradients >= 0:  # the norm needs every gradient: wait for all, then one group
            for wait, _ in groups:
                if wait is not None:
                    wait()
            groups = [(None, [i for _, ids in groups for i in ids])]
            self.clip_gradients()
        for wait, ids in groups:
            if wait is not None:
                wait()
            self.update_params(ids, rate)
        self.iter += 1

    def update_params(self, ids: list[int], rate: np.float32, iteration: int | None = None) -> None:
        """Steps 3-4 of the update for learnable parameters ``ids`` at learning rate ``rate``: normalize,
        regularize, the rule, ``w -= g``.  ``iteration``: the iteration whose gradient this is (default the
        current one; a delayed update passes its own, for the rules that count steps)."""
        self._update_iter = self.iter if iteration is None else int(iteration)
        compiled = kernels()  # once for all of them (a setting read per parameter cost LeNet's update 10%)
        for i in ids:
            self._update(i, rate, parallel=True, compiled=compiled)
        self._update_iter = None

    def updates_per_parameter(self) -> bool:
        return type(self).apply_update is SGDSolver.apply_update

    def update_param(self, i: int, rate: Any) -> None:
        """Learnable parameter ``i`` alone: normalize, regularize, the rule at ``rate``, ``data -= diff`` (what
        :meth:`apply_update` does for every parameter, when no step needs them all: no clipping).  Called
        while backward goes on (overlapped updates): its chunks run in the calling thread."""
        self._update(i, rate, parallel=False, compiled=kernels())

    def _update(self, i: int, rate: Any, parallel: bool, compiled: Any) -> None:
        """One parameter's update: on the whole blobs, or (host parameters of ``2 * UPDATE_CHUNK`` values or
        more) chunk by chunk, the chunks split over the batch partitions when ``parallel``; ``compiled``: the
        compiled kernels (:func:`cct.native.kernels`) or None."""
        p = self.net.learnable_params[i]
        n = len(self.net.learnable_params)
        kept = [self.history[k * n + i] for k in range(self.history_sets)]

        def on_device(arrays: list[Any]) -> None:
            w, g, hs = arrays[0], arrays[1], tuple(arrays[2:])
            self._step(i, rate, _Slab(w, g, hs, lambda k: self._scratch(i, k, w)))

        # where the passes keep the parameter on a device (GPU mode), the update runs there
        if self.net.executor.update_on_device([(p, "data"), (p, "diff")] + [(h, "data") for h in kept], on_device):
            return
        history = [h.data for h in kept]
        fused = self._fused_step(i, rate, p.data, p.diff, history, compiled)
        if fused is not None:
            parts = partitions_for(p.count, UPDATE_WORK_PER_VALUE) if parallel else 1
            if parts > 1:
                run_batch(p.count, fused, parts=parts)
            else:  # (no ranges, no pool: most of a small net's parameters)
                fused(0, 0, p.count)
            return
        if p.xp is not np or p.count < 2 * UPDATE_CHUNK:
            self._step(i, rate, _Slab(p.data, p.diff, tuple(history), lambda k: self._scratch(i, k)))
            return
        w, g = p.data.reshape(-1), p.diff.reshape(-1)
        hs = [h.reshape(-1) for h in history]

        def body(_part: int, a0: int, a1: int) -> None:
            for a in range(a0, a1, UPDATE_CHUNK):
                b = min(a + UPDATE_CHUNK, a1)
                self._step(i, rate, _Slab(w[a:b], g[a:b], tuple(h[a:b] for h in hs),
                                          lambda k, size=b - a: self._chunk_scratch(k, w)[:size]))
        if parallel:
            run_batch(p.count, body, work=UPDATE_WORK_PER_VALUE)
        else:
            body(0, 0, p.count)

    def _fused_step(self, i: int, rate: Any, w: Any, g: Any, history: list[Any],
                    compiled: Any) -> Callable[[int, int, int], None] | None:
        """The whole step (:meth:`_step`) of SGD's own rule as one compiled pass over values ``[a0, a1)``
        (``fn(part, a0, a1)``), for host float arrays when the compiled kernels are on; None otherwise (another
        rule, cupy, no kernels): the numpy body runs.  The kernel makes the numpy body's float operations in
        its order, so either gives the same bits."""
        cls = type(self)
        if not (cls._step is SGDSolver._step and cls._rule is SGDSolver._rule and cls._normalize is
                SGDSolver._normalize and cls._regularize is SGDSolver._regularize):
            return None
        k = compiled
        if k is None or not takes(w, g, *history):
            return None
        w, g, h = w.reshape(-1), g.reshape(-1), history[0].reshape(-1)
        iter_size = self.param.iter_size
        norm = f32(1) / f32(iter_size)
        decay = f32(self.param.weight_decay) * f32(self.net.params_weight_decay[i])
        l1 = self.param.regularization_type == "L1"
        local_rate = self._local_rate(i, rate)
        momentum = f32(self.param.momentum)

        def fused(_part: int, a0: int, a1: int) -> None:
            k.sgd_update(w[a0:a1], g[a0:a1], h[a0:a1], iter_size != 1, norm, decay, l1, local_rate, momentum)
        return fused

    def _step(self, i: int, rate: Any, s: _Slab) -> None:
        self._normalize(i, s)
        self._regularize(i, s)
        self._rule(i, rate, s)
        _xp(s.w).subtract(s.w, s.g, out=s.w)  # Caffe's Blob::Update

    def _chunk_scratch(self, k: int, like: Any) -> Any:
        """Scratch array ``k`` of one chunk, the calling thread's own (partitions and overlapped updates run
        on several threads at once)."""
        key = (threading.get_ident(), k)
        t = self._chunk_temp.get(key)
        if t is None or t.dtype != like.dtype or t.size < UPDATE_CHUNK:
            t = self._chunk_temp[key] = np.empty(UPDATE_CHUNK, dtype=like.dtype)
        return t

    def clip_gradients(self) -> None:
        clip = f32(self.param.clip_gradients)
        if clip < 0:
            return
        params = self.net.learnable_params
        sumsq = f32(sum(float(_xp(p.diff).vdot(p.diff.ravel(), p.diff.ravel())) for p in params))
        norm = f32(np.sqrt(sumsq))
        if norm > clip:
            scale = clip / norm
            log.info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale factor %s",
                     log.fmt(norm), log.fmt(clip), log.fmt(scale))
            for q in params:
                d = q.diff
                d *= scale

    def _normalize(self, i: int, s: _Slab) -> None:
        """``g *= 1 / iter_size`` (undo the accumulation over ``iter_size`` passes)."""
        if self.param.iter_size != 1:
            g = s.g
            g *= f32(1) / f32(self.param.iter_size)

    def _regularize(self, i: int, s: _Slab) -> None:
        """Weight decay ``d = weight_decay * decay_mult``: L2 ``g += d w``; L1 ``g += d sign(w)``."""
        decay = f32(self.param.weight_decay) * f32(self.net.params_weight_decay[i])
        if not decay:
            return
        t = s.t(0)
        xp = _xp(s.w)
        if self.param.regularization_type == "L2":
            xp.multiply(s.w, decay, out=t)
        elif self.param.regularization_type == "L1":
            xp.sign(s.w, out=t)
            t *= decay
        else:
            raise CctError(f"Unknown regularization type: {self.param.regularization_type}")
        xp.add(s.g, t, out=s.g)

    def _scaled_by_root(self, i: int, rate: np.float32, g: Any, h: Any, t: Any) -> None:
        """``g[...] = local_rate · g / (sqrt(h) + delta)`` (AdaGrad's and RMSProp's step; ``t`` is scratch)."""
        xp = _xp(g)
        xp.sqrt(h, out=t)
        t += f32(self.param.delta)
        xp.divide(g, t, out=t)
        xp.multiply(t, self._local_rate(i, rate), out=g)

    def _local_rate(self, i: int, rate: np.float32) -> np.float32:
        return f32(rate) * f32(self.net.params_lr[i])

    def _rule(self, i: int, rate: np.float32, s: _Slab) -> None:
        """``h = μ h + lr g``; ``g = h``."""
        g, h = s.g, s.h[0]
        g *= self._local_rate(i, rate)
        h *= f32(self.param.momentum)
        h += g
        g[...] = h

    # ---- solver state ------------------------------------------------------------------------
    def snapshot_solver_state(self, model_filename: str) -> None:
        fmt = self.param.snapshot_format
        if fmt == pb.SolverParameter.HDF5:
            from cct.io.hdf5 import write_hdf5_solverstate

            filename = self._snapshot_filename(".solverstate.h5")
            log.info("Snapshotting solver state to HDF5 file %s", filename)
            write_hdf5_solverstate(filename, self.iter, model_filename, self.current_step,
                                   [h.data for h in self.history], self.resume_state())
            return
        from cct.io.weights import write_solverstate

        state = pb.SolverState()
        state.iter = self.iter
        state.learned_net = model_filename
        state.current_step = self.current_step
        for h in self.history:
            blob_to_proto(h, state.history.add())
        state.cct_resume_state = self.resume_state()
        filename = self._snapshot_filename(".solverstate")
        log.info("Snapshotting solver state to binary proto file %s", filename)
        write_solverstate(filename, state)

    def restore_solver_state_from_binary_proto(self, state_file: str) -> None:
        from cct.io.weights import read_solverstate

        self._restore_state(read_solverstate(state_file), state_file)

    def restore_solver_state_from_hdf5(self, state_file: str) -> None:
        from cct.io.hdf5 import read_hdf5_solverstate

        self._restore_state(read_hdf5_solverstate(state_file), state_file)

    def _restore_state(self, state: pb.SolverState, source: str) -> None:
        if len(state.history) != len(self.history):
            raise CctError(f"{source}: Incorrect length of history blobs (the file has {len(state.history)}, "
                           f"a {self.type} solver for this net has {len(self.history)})")
        self.iter = state.iter
        if state.HasField("learned_net"):
            if not os.path.exists(state.learned_net):
                raise CctError(f"{source}: its weights file {state.learned_net} (learned_net, relative to "
                               f"the working directory {os.getcwd()}) does not exist")
            self.net.copy_trained_layers_from(state.learned_net)
        self.current_step = state.current_step
        log.info("SGDSolver: restoring history")
        for h, proto in zip(self.history, state.history):
            try:
                blob_from_proto(proto, h)
            except CctError as e:
                raise CctError(f"{source}: history: {e}") from None
        from cct.solvers.resume import restore

        restore(self, state.cct_resume_state, source)


@register_solver
class NesterovSolver(SGDSolver):
    r"""Nesterov's accelerated gradient, in Caffe's form (Sutskever et al., lr inside the momentum).

    .. math::
        h' = \mu h + \mathrm{lr}\, g, \qquad w \leftarrow w - \big((1+\mu) h' - \mu h\big), \qquad h \leftarrow h'

    PyTorch's ``nesterov=True`` steps ``lr (g + μ v')`` with ``v' = μ v + g``; equal for a constant rate.
    """

    type = "Nesterov"

    def _rule(self, i: int, rate: np.float32, s: _Slab) -> None:
        g, h, t = s.g, s.h[0], s.t(0)
        momentum = f32(self.param.momentum)
        t[...] = h                                        # h_old
        g *= self._local_rate(i, rate)                    # h = μ h_old + lr g
        h *= momentum
        h += g
        t *= -momentum                                    # g = (1+μ) h - μ h_old
        _xp(g).multiply(h, f32(1) + momentum, out=g)
        g += t


@register_solver
class AdaGradSolver(SGDSolver):
    r"""AdaGrad (Duchi et al.).  Needs ``momentum == 0``.

    .. math::
        h \leftarrow h + g^2, \qquad w \leftarrow w - \mathrm{lr}\, \frac{g}{\sqrt{h} + \delta}

    ``δ`` = ``delta`` is added to the square root (PyTorch: ``eps`` likewise; TF adds it inside).
    """

    type = "AdaGrad"

    def _check_param(self) -> None:
        super()._check_param()
        if self.param.momentum != 0:
            raise CctError(f"{self._source}: Momentum cannot be used with AdaGrad.")

    def _rule(self, i: int, rate: np.float32, s: _Slab) -> None:
        g, h, t = s.g, s.h[0], s.t(0)
        xp = _xp(g)
        xp.multiply(g, g, out=t)
        h += t
        self._scaled_by_root(i, rate, g, h, t)


@register_solver
class RMSPropSolver(SGDSolver):
    r"""RMSProp (Tieleman & Hinton).  ``rms_decay`` ρ in [0, 1); needs ``momentum == 0``.

    .. math::
        h \leftarrow \rho h + (1-\rho) g^2, \qquad w \leftarrow w - \mathrm{lr}\, \frac{g}{\sqrt{h} + \delta}

    No momentum term and ``δ`` outside the square root (PyTorch ``RMSprop`` with ``alpha = ρ``).
    """

    type = "RMSProp"

    def _check_param(self) -> None:
        super()._check_param()
        if self.param.momentum != 0:
            raise CctError(f"{self._source}: Momentum cannot be used with RMSProp.")
        if not 0 <= self.param.rms_decay < 1:
            raise CctError(f"{self._source}: rms_decay should lie between 0 and 1 "
                           f"(got {log.fmt(self.param.rms_decay)}).")

    def _rule(self, i: int, rate: np.float32, s: _Slab) -> None:
        g, h, t = s.g, s.h[0], s.t(0)
        xp = _xp(g)
        decay = f32(self.param.rms_decay)
        xp.multiply(g, g, out=t)
        t *= f32(1) - decay
        h *= decay
        h += t
        self._scaled_by_root(i, rate, g, h, t)


@register_solver
class AdaDeltaSolver(SGDSolver):
    r"""AdaDelta (Zeiler); the decay ρ is ``momentum``, ``δ`` is ``delta``.  Two history sets:
    ``h`` (mean squared gradient) then ``s`` (mean squared update).

    .. math::
        h \leftarrow \rho h + (1-\rho) g^2, \quad
        u = g \sqrt{\frac{s + \delta}{h + \delta}}, \quad
        s \leftarrow \rho s + (1-\rho) u^2, \quad
        w \leftarrow w - \mathrm{lr}\, u

    Zeiler's method has no learning rate; Caffe multiplies by ``lr`` (use ``base_lr: 1``), as PyTorch.
    """

    type = "AdaDelta"
    history_sets = 2

    def _rule(self, i: int, rate: np.float32, slab: _Slab) -> None:
        g, (h, s) = slab.g, slab.h
        t, u = slab.t(0), slab.t(1)
        xp = _xp(g)
        rho, delta = f32(self.param.momentum), f32(self.param.delta)
        one_minus = f32(1) - rho
        xp.multiply(g, g, out=t)                          # h = ρ h + (1-ρ) g²
        t *= one_minus
        h *= rho
        h += t
        xp.add(s, delta, out=u)                           # u = sqrt((s + δ) / (h + δ))
        xp.add(h, delta, out=t)
        u /= t
        xp.sqrt(u, out=u)
        g *= u                                            # g = u ⊙ g (the unscaled step)
        xp.multiply(g, g, out=t)                          # s = ρ s + (1-ρ) step²
        t *= one_minus
        s *= rho
        s += t
        g *= self._local_rate(i, rate)


@register_solver
class AdamSolver(SGDSolver):
    r"""Adam (Kingma & Ba): β1 = ``momentum``, β2 = ``momentum2``, ε = ``delta``; history ``m`` then ``v``.

    .. math::
        m \leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2, \quad
        w \leftarrow w - \mathrm{lr} \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t} \frac{m}{\sqrt{v} + \varepsilon}

    with ``t = iter + 1``.  As the paper's "efficient" form (and TF), ε is added to the *uncorrected*
    ``sqrt(v)``; PyTorch adds it to the bias-corrected one.
    """

    type = "Adam"

    def updates_per_parameter(self) -> bool:
        return False  # the rule reads the iteration count
    history_sets = 2

    def _rule(self, i: int, rate: np.float32, s: _Slab) -> None:
        g, (m, v), t = s.g, s.h, s.t(0)
        xp = _xp(g)
        beta1, beta2 = f32(self.param.momentum), f32(self.param.momentum2)
        step = (self.iter if self._update_iter is None else self._update_iter) + 1
        correction = f32(np.sqrt(1.0 - np.float64(beta2) ** step) / (1.0 - np.float64(beta1) ** step))
        xp.multiply(g, f32(1) - beta1, out=t)             # m = β1 m + (1-β1) g
        m *= beta1
        m += t
        xp.multiply(g, g, out=t)                          # v = β2 v + (1-β2) g²
        t *= f32(1) - beta2
        v *= beta2
        v += t
        xp.sqrt(v, out=t)                                 # g = lr·corr · m / (sqrt(v) + ε)
        t += f32(self.param.delta)
        xp.divide(m, t, out=t)
        xp.multiply(t, self._local_rate(i, rate) * correction, out=g)


def _xp(a: Any):
    return get_array_module(a)


__all__ = ["SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver"]
