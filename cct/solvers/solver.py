"""The solver loop: Caffe's ``Solver`` (``src/caffe/solver.cpp``) — nets, Step, Test, Solve, snapshots.

Construction (Caffe's ``Solver::Init``): log the parameters, check ``average_loss``, probe the snapshot
prefix, seed the global RNG from ``random_seed``, build the train net (exactly one of ``net``,
``net_param``, ``train_net``, ``train_net_param``; state = TRAIN ⊕ file state ⊕ ``train_state``) and
the test nets (each ``test_net_param``, each ``test_net``, then copies of the generic net; state =
TEST ⊕ file state ⊕ ``test_state[i]``), then load ``weights`` into all of them.

One iteration of :meth:`Solver.step` is, in order: zero the param diffs → TestAll when
``iter % test_interval == 0`` (and ``iter > 0`` or ``test_initialization``) → ``on_start`` callbacks →
``iter_size`` forward/backward passes (diffs accumulate; loss averaged) → smoothed loss and the display
lines → ``on_gradients_ready`` callbacks → :meth:`apply_update` (the update rule; increments ``iter``)
→ snapshot on ``iter % snapshot == 0`` or a SNAPSHOT request → stop on a STOP request.

A solver built while ``cct.mode.solver_rank() != 0`` is a non-root replica of data-parallel training
(:mod:`cct.distributed.replicas`; ``is_root`` is False): as Caffe's, it builds no test nets and never
tests, displays or snapshots — it only trains.

The update rule, history, solverstate layout and restore are the subclasses' (:mod:`cct.solvers.sgd`).
The lines logged are Caffe's, character for character (``tools/extra/parse_log.py`` reads them).
"""
from __future__ import annotations

import abc
import contextlib
import enum
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import numpy as np

from cct import log
from cct.device import to_host
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb

f32 = np.float32


class SolverAction(enum.IntEnum):
    """What an action function (signals, a scheduler) asks the solver to do (Caffe's ``SolverAction``)."""

    NONE = 0
    STOP = 1
    SNAPSHOT = 2
    SNAPSHOT_AND_STOP = 3  # cct: snapshot now, then stop (-sigterm_effect snapshot)


class SolverCallback(Protocol):
    """Hook points in every iteration; multi-device and MPI gradient exchange plug in here."""

    def on_start(self) -> None:
        """Before the forward/backward passes of an iteration (after any test pass)."""

    def on_gradients_ready(self) -> None:
        """After the gradients are accumulated, before the update rule runs."""


# Optional callback methods (looked up with getattr; a callback may define any of them):
#
# * ``update_groups(rate) -> list[(wait, ids)] | None`` — the update in groups of learnable parameter ids, each
#   preceded by ``wait()`` (None: nothing to wait for): how gradient reductions still in flight when the update
#   starts are waited for chunk by chunk (the first callback that returns a list decides; ids left out are
#   updated by the callback itself, later, with :meth:`Solver.update_params`).
# * ``on_weights_needed()`` — before a test pass, before a snapshot and at the end of :meth:`Solver.step`: a
#   callback that delays part of an update applies it now.


class _FunctionCallback:
    """pycaffe's ``add_callback(on_start, on_gradients_ready)`` with two plain callables."""

    def __init__(self, on_start: Callable[[], Any] | None, on_gradients_ready: Callable[[], Any] | None):
        self._on_start = on_start
        self._on_gradients_ready = on_gradients_ready

    def on_start(self) -> None:
        if self._on_start is not None:
            self._on_start()

    def on_gradients_ready(self) -> None:
        if self._on_gradients_ready is not None:
            self._on_gradients_ready()


class _CpuTimer:
    """The display interval's timer.  Caffe's CPU timer counts whole milliseconds, so an interval under 1 ms
    reads 0 s and Caffe prints "(1 iter/s, 0s/1 iters)"; this one keeps microseconds, so the rate (iterations
    over the lapse, as Caffe computes it) always agrees with the lapse printed beside it."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def start(self) -> None:
        self._start = time.perf_counter()

    def seconds(self) -> np.float32:
        return f32(max(time.perf_counter() - self._start, 1e-6))


# ------------------------------------------------------------------------------------------------
# Reading a solver file (HEAD's snapshot_prefix rule)
# ------------------------------------------------------------------------------------------------

def read_solver_file(path: str | os.PathLike[str]) -> pb.SolverParameter:
    """Caffe's ``ReadSolverParamsFromTextFileOrDie``: parse + upgrade, then HEAD's snapshot_prefix rule:
    unset → the solver file's path without its extension; an existing directory → ``dir/<solver stem>``."""
    from cct.io.prototxt import read_solver_param

    path = os.fspath(path)
    param = read_solver_param(path)
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = os.path.splitext(path)[0]
        log.info("snapshot_prefix was not specified and is set to %s", param.snapshot_prefix)
    elif os.path.isdir(param.snapshot_prefix):
        stem = os.path.splitext(os.path.basename(path))[0]
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, stem)
        log.info("snapshot_prefix is a directory and is set to %s", param.snapshot_prefix)
    return param


def _text(param: pb.SolverParameter) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(param).rstrip("\n")  # glog adds the final newline itself


# ------------------------------------------------------------------------------------------------
# The solver
# ------------------------------------------------------------------------------------------------

class Solver(abc.ABC):
    """Caffe's ``Solver``: builds the nets and runs the training loop; subclasses supply the update.

    ``Solver(solver_file)`` or ``Solver(solver_parameter)``.  Members as pycaffe: ``net`` (train net),
    ``test_nets``, ``iter``, ``param`` (the live SolverParameter: ``solver.param.base_lr = …`` takes
    effect at the next update), ``step(n)``, ``solve(resume_file=None)``, ``restore(file)``,
    ``snapshot()``, ``share_weights(net)``, ``add_callback(...)``, ``apply_update()``.  ``is_root``: built
    as solver rank 0 (the only one that tests, displays and snapshots).
    """

    type: ClassVar[str] = ""

    def __init__(self, param: str | os.PathLike[str] | pb.SolverParameter, *, source: str | None = None,
                 executor_factory: Callable[[], Any] | None = None):
        if isinstance(param, pb.SolverParameter):
            p = pb.SolverParameter()
            p.CopyFrom(param)
            self._source = source or "<SolverParameter>"
        elif isinstance(param, (str, os.PathLike)):
            self._source = os.fspath(param)
            p = read_solver_file(param)
        else:
            raise CctError(f"a solver needs a solver file or a SolverParameter, got {type(param).__name__}")
        self.callbacks: list[SolverCallback] = []
        self._action_function: Callable[[], SolverAction] | None = None
        self.requested_early_exit = False
        self.iter = 0
        self.current_step = 0
        self._losses: list[np.float32] = []
        self.smoothed_loss = f32(0)
        self._iterations_last = 0
        self._iteration_timer = _CpuTimer()
        self._executor_factory = executor_factory
        self.stop_on_nan = False  #: on the first non-finite loss or gradient: snapshot and stop (an error)
        self._diverged = False
        self._snapshot_iter = -1  # the iteration of the last snapshot written
        self._init(p)

    # ---- construction ------------------------------------------------------------------------
    def _init(self, param: pb.SolverParameter) -> None:
        from cct.mode import solver_count, solver_rank
        from cct.rng import set_random_seed

        self.rank, self.solver_count = solver_rank(), solver_count()
        self.is_root = self.rank == 0
        self.replicas: list[Solver] | None = None  # under data parallelism, every rank's solver (the root's)
        # MPI ranks: every rank's resume state (bytes) to the root, called by all ranks at each snapshot
        self.state_gather: Callable[[bytes], list[bytes]] | None = None
        log.info("Initializing solver from parameters: \n%s", _text(param))
        self.param = param
        if param.average_loss < 1:
            raise CctError(f"{self._source}: average_loss should be at least 1 (got {param.average_loss})")
        self._check_param()
        if param.snapshot_format == pb.SolverParameter.HDF5 and importlib.util.find_spec("h5py") is None:
            raise CctError(f"{self._source}: snapshot_format HDF5 needs h5py (pip install 'cct[hdf5]')")
        self._check_snapshot_write_permissions()
        if param.random_seed >= 0:
            set_random_seed(param.random_seed + solver_rank())
        self.net = self._init_train_net()
        self.test_nets = self._init_test_nets() if self.is_root else []
        log.info("Solver scaffolding done.")
        self.iter = 0
        self.current_step = 0
        self._pre_solve()

    def _check_param(self) -> None:
        """Checks of the update rule's settings (subclasses); run before any net is built."""
        return None

    def _pre_solve(self) -> None:
        """Allocate the update rule's state once the nets exist (subclasses)."""
        return None

    def _check_snapshot_write_permissions(self) -> None:
        p = self.param
        if not p.snapshot or not self.is_root:  # as Caffe: the root alone writes snapshots and checks
            return
        if not p.HasField("snapshot_prefix"):
            raise CctError(f"{self._source}: In solver params, snapshot is specified but snapshot_prefix is not")
        probe = self._snapshot_filename(f".{os.getpid()}.tempfile")  # several processes may probe at once
        try:
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError:
            raise CctError(f"Cannot write to snapshot prefix '{p.snapshot_prefix}'.  Make sure that the "
                           "directory exists and is writeable.") from None

    def _build_net(self, net_param: pb.NetParameter, phase: int, extra_state: pb.NetState | None,
                   source: str):
        from cct.pycaffe import Net

        state = pb.NetState()
        state.phase = phase
        state.MergeFrom(net_param.state)
        if extra_state is not None:
            state.MergeFrom(extra_state)
        net_param.state.CopyFrom(state)
        return Net.from_param(net_param, source, self._executor_factory() if self._executor_factory else None)

    def _read_net(self, field: str, path: str) -> pb.NetParameter:
        """The net file a solver field names; a missing file names the solver file and the field."""
        from cct.io.prototxt import read_net_param

        if not os.path.isfile(path):
            raise CctError(f"{self._source}: {field}: no such net file {path!r} (relative to the working directory "
                           f"{os.getcwd()})")
        return read_net_param(path)

    def _init_train_net(self):
        p = self.param
        fields = ("net", "net_param", "train_net", "train_net_param")
        given = [f for f in fields if p.HasField(f)]
        if not given:
            raise CctError(f"{self._source}: SolverParameter must specify a train net using one of these "
                           f"fields: {', '.join(fields)}")
        if len(given) > 1:
            raise CctError(f"{self._source}: SolverParameter must not contain more than one of these fields "
                           f"specifying a train_net: {', '.join(fields)} (found {', '.join(given)})")
        net_param = pb.NetParameter()
        source = "<train_net_param>"
        if p.HasField("train_net_param"):
            log.info("Creating training net specified in train_net_param.")
            net_param.CopyFrom(p.train_net_param)
        elif p.HasField("train_net"):
            log.info("Creating training net from train_net file: %s", p.train_net)
            net_param, source = self._read_net("train_net", p.train_net), p.train_net
        if p.HasField("net_param"):
            log.info("Creating training net specified in net_param.")
            net_param.CopyFrom(p.net_param)
            source = "<net_param>"
        if p.HasField("net"):
            log.info("Creating training net from net file: %s", p.net)
            net_param, source = self._read_net("net", p.net), p.net
        from cct.engines.autotune import expecting_iterations

        with expecting_iterations(p.max_iter):  # its engines run the whole training: measured more
            net = self._build_net(net_param, pb.TRAIN, p.train_state, source)
        for weights in p.weights:
            load_net_weights(net, weights)
        return net

    def _init_test_nets(self) -> list:
        p = self.param
        if p.HasField("net") and p.HasField("net_param"):
            raise CctError(f"{self._source}: Both net_param and net_file may not be specified.")
        generic = p.HasField("net") or p.HasField("net_param")
        explicit = len(p.test_net_param) + len(p.test_net)
        if (len(p.test_iter) < explicit) if generic else (len(p.test_iter) != explicit):
            raise CctError(f"{self._source}: test_iter must be specified for each test network "
                           f"({len(p.test_iter)} test_iter for {explicit} test_net/test_net_param)")
        n = len(p.test_iter)
        if p.test_state and len(p.test_state) != n:
            raise CctError(f"{self._source}: test_state must be unspecified or specified once per test net "
                           f"({len(p.test_state)} test_state for {n} test nets)")
        if n and p.test_interval <= 0:
            raise CctError(f"{self._source}: test nets need test_interval > 0 (got {p.test_interval})")
        specs: list[tuple[str, pb.NetParameter, str]] = []
        for tp in p.test_net_param:
            q = pb.NetParameter()
            q.CopyFrom(tp)
            specs.append(("test_net_param", q, "<test_net_param>"))
        for f in p.test_net:
            specs.append((f"test_net file: {f}", self._read_net("test_net", f), f))
        remaining = n - len(specs)
        for _ in range(remaining):
            if p.HasField("net_param"):
                q = pb.NetParameter()
                q.CopyFrom(p.net_param)
                specs.append(("net_param", q, "<net_param>"))
            else:
                specs.append((f"net file: {p.net}", self._read_net("net", p.net), p.net))
        nets = []
        for i, (label, net_param, source) in enumerate(specs):
            log.info("Creating test net (#%d) specified by %s", i, label)
            net = self._build_net(net_param, pb.TEST, p.test_state[i] if p.test_state else None, source)
            net.debug_info = p.debug_info
            for weights in p.weights:
                load_net_weights(net, weights)
            nets.append(net)
        return nets

    # ---- pycaffe surface ---------------------------------------------------------------------
    @property
    def max_iter(self) -> int:
        return self.param.max_iter

    def add_callback(self, on_start: Any = None, on_gradients_ready: Callable[[], Any] | None = None) -> None:
        """Register a callback object (``on_start()``/``on_gradients_ready()`` methods) or, as pycaffe,
        two callables."""
        if on_gradients_ready is None and hasattr(on_start, "on_start") and hasattr(on_start, "on_gradients_ready"):
            self.callbacks.append(on_start)
        else:
            self.callbacks.append(_FunctionCallback(on_start, on_gradients_ready))

    def set_action_function(self, func: Callable[[], SolverAction] | None) -> None:
        """``func()`` is asked after every update (and between test batches) for a SolverAction."""
        self._action_function = func

    def get_requested_action(self) -> SolverAction:
        return SolverAction(self._action_function()) if self._action_function else SolverAction.NONE

    def share_weights(self, net) -> None:
        """Let ``net`` use the train net's parameter memory (pycaffe's ``solver.share_weights``)."""
        net.share_trained_layers_with(self.net)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self, iters: int) -> None:
        """Run ``iters`` iterations (tests, display and snapshots included)."""
        p = self.param
        start_iter = self.iter
        stop_iter = self.iter + int(iters)
        self._losses = []
        self.smoothed_loss = f32(0)
        self._iteration_timer.start()
        while self.iter < stop_iter:
            self.net.clear_param_diffs()
            if p.test_interval and self.iter % p.test_interval == 0 and (self.iter > 0 or p.test_initialization):
                if self.is_root:
                    self.test_all()
                if self.requested_early_exit:
                    break
            for cb in self.callbacks:
                cb.on_start()
            display = self.is_root and bool(p.display) and self.iter % p.display == 0
            self.net.debug_info = display and p.debug_info
            loss = f32(0)
            eager = self._eager_updates() and not self.net.debug_info
            if eager:  # the executor applies each parameter's update as soon as its gradient is complete
                rate = self.get_learning_rate()
                self.net.executor.arm_updates(lambda i, rate=rate: self.update_param(i, rate))
            try:
                for _ in range(p.iter_size):
                    loss += f32(self.net.forward_backward())
            finally:
                if eager:
                    self.net.executor.arm_updates(None)
            loss /= f32(p.iter_size)
            self._update_smoothed_loss(loss, start_iter, p.average_loss)
            if display:
                self._display()
            for cb in self.callbacks:
                cb.on_gradients_ready()
            self._watch_divergence(loss)
            if eager:
                if p.display and self.iter % p.display == 0:
                    log.info("Iteration %d, lr = %s", self.iter, log.fmt(rate))
                self.iter += 1
            else:
                self.apply_update()
            request = self.get_requested_action()
            if self._snapshots() and ((p.snapshot and self.iter % p.snapshot == 0)
                                      or request in (SolverAction.SNAPSHOT, SolverAction.SNAPSHOT_AND_STOP)):
                self.snapshot()
            if request in (SolverAction.STOP, SolverAction.SNAPSHOT_AND_STOP):
                self.requested_early_exit = True
                break
        self.net.executor.sync()
        self.weights_needed()

    def weights_needed(self) -> None:
        """Let every callback that delays part of an update apply it (``on_weights_needed``)."""
        for cb in self.callbacks:
            flush = getattr(cb, "on_weights_needed", None)
            if flush is not None:
                flush()

    def update_groups(self, rate: Any) -> list[tuple[Callable[[], Any] | None, list[int]]]:
        """The update's groups of learnable parameter ids, each after its ``wait`` (see the callbacks above);
        by default one group of every parameter."""
        for cb in self.callbacks:
            groups = getattr(cb, "update_groups", None)
            found = groups(rate) if groups is not None else None
            if found is not None:
                return found
        return [(None, list(range(len(self.net.learnable_params))))]

    def _watch_divergence(self, loss: np.float32) -> None:
        """Report the first non-finite loss or gradient of the run (one W line naming the iteration and the
        layer it came from); with ``stop_on_nan``, snapshot the last finite weights and stop."""
        from cct.solvers.divergence import first_nonfinite, gradients_finite

        if self._diverged or (np.isfinite(loss) and gradients_finite(self.net)):
            return
        self._diverged = True
        where = first_nonfinite(self.net) or "the loss only"
        rank = f" (solver rank {self.rank})" if self.solver_count > 1 else ""
        log.warning("Iteration %d%s: loss = %s; the first non-finite value: %s", self.iter, rank, log.fmt(loss),
                    where)
        if self.stop_on_nan:
            if self.is_root and self.param.snapshot_prefix:
                self.snapshot()  # the update has not been applied: these are the last finite weights
            raise CctError(f"Iteration {self.iter}: training diverged (the first non-finite value: {where}); "
                           "stopped by -stop_on_nan" + (", the last finite state is snapshotted"
                                                        if self.param.snapshot_prefix else ""))

    def _eager_updates(self) -> bool:
        """Whether the train net's executor applies updates during backward (ZNN's eager updates): it can
        (``arm_updates``) and nothing needs all gradients first; the reasons against are logged once as
        ``barrier updates: ...``."""
        decided = getattr(self, "_eager_decision", None)
        executor = self.net.executor
        if decided is not None and decided[0] is executor:
            return decided[1]
        eager = False
        if hasattr(executor, "arm_updates"):
            reasons = self.barrier_reasons()
            if reasons:
                log.info("barrier updates: %s", ", ".join(reasons))
            eager = not reasons
        self._eager_decision = (executor, eager)
        return eager

    def update_param(self, i: int, rate: Any) -> None:
        """One learnable parameter's update at ``rate`` (eager updates; barrier ones: :meth:`apply_update`)."""
        raise NotImplementedError(f"{type(self).__name__} updates all parameters together")

    def updates_per_parameter(self) -> bool:
        """Whether :meth:`update_param` applies this solver's rule to one parameter exactly as
        :meth:`apply_update` would (no rule needs all gradients or the iteration count)."""
        return False

    def barrier_reasons(self) -> list[str]:
        """Why the updates must wait for the whole pass (empty: each may run as its gradient is complete)."""
        reasons = []
        p = self.param
        if p.clip_gradients >= 0:
            reasons.append("clip_gradients")
        if p.iter_size > 1:
            reasons.append("iter_size > 1")
        if any(o >= 0 for o in self.net._param_owners):
            reasons.append("shared parameters")
        if self.callbacks:
            reasons.append("on_gradients_ready callbacks")
        if self.stop_on_nan:
            reasons.append("stop_on_nan (the last finite weights must still be there to snapshot)")
        if not self.updates_per_parameter():
            reasons.append(f"{self.type} solver")
        return reasons

    def _display(self) -> None:
        p = self.param
        lapse = self._iteration_timer.seconds()
        per_s = f32(self.iter - self._iterations_last) / (lapse if lapse else f32(1))
        log.info("Iteration %d (%s iter/s, %ss/%d iters), loss = %s", self.iter, log.fmt(per_s),
                 log.fmt(lapse), p.display, log.fmt(self.smoothed_loss))
        self._iteration_timer.start()
        self._iterations_last = self.iter
        index = 0
        for name, blob, weight in zip(self.net.output_blob_names, self.net.output_blobs,
                                      self.net.output_loss_weights):
            for v in np.asarray(to_host(blob.data), dtype=f32).ravel():
                log.info("    Train net output #%d: %s = %s%s", index, name, log.fmt(v), _loss_note(weight, v))
                index += 1

    def _update_smoothed_loss(self, loss: np.float32, start_iter: int, average_loss: int) -> None:
        if len(self._losses) < average_loss:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = (self.smoothed_loss * f32(size - 1) + loss) / f32(size)
        else:
            idx = (self.iter - start_iter) % average_loss
            self.smoothed_loss += (loss - self._losses[idx]) / f32(average_loss)
            self._losses[idx] = loss

    def solve(self, resume_file: str | os.PathLike[str] | None = None) -> None:
        """Train to ``max_iter`` (from ``resume_file``'s state if given), snapshot, final display/test."""
        p = self.param
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", p.lr_policy)
        self.requested_early_exit = False
        if resume_file:
            log.info("Restoring previous solver status from %s", os.fspath(resume_file))
            self.restore(resume_file)
        start_iter = self.iter
        self.step(p.max_iter - self.iter)
        if self._snapshots() and p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0) \
                and self._snapshot_iter != self.iter:
            self.snapshot()
        if self.requested_early_exit:
            log.info("Optimization stopped early.")
            return
        if p.display and self.iter % p.display == 0:
            loss = f32(self.net.forward_prefilled())
            self._update_smoothed_loss(loss, start_iter, p.average_loss)
            log.info("Iteration %d, loss = %s", self.iter, log.fmt(self.smoothed_loss))
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    def test_all(self) -> None:
        self.net.executor.sync()
        self.weights_needed()
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            self.test(i)

    def test(self, test_net_id: int = 0) -> None:
        """Run test net ``test_net_id`` for ``test_iter`` batches and log the mean of every output."""
        p = self.param
        log.info("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        test_net = self.test_nets[test_net_id]
        test_net.share_trained_layers_with(self.net)
        scores: list[np.ndarray] = []
        loss = f32(0)
        n = p.test_iter[test_net_id]
        for i in range(n):
            request = self.get_requested_action()
            while request != SolverAction.NONE:
                if request in (SolverAction.SNAPSHOT, SolverAction.SNAPSHOT_AND_STOP):
                    self.snapshot()
                if request in (SolverAction.STOP, SolverAction.SNAPSHOT_AND_STOP):
                    self.requested_early_exit = True
                request = self.get_requested_action()
            if self.requested_early_exit:
                break
            iter_loss = test_net.forward_prefilled()
            if p.test_compute_loss:
                loss += f32(iter_loss)
            values = [np.array(to_host(b.data), dtype=f32).ravel() for b in test_net.output_blobs]
            if i == 0:
                scores = values
            else:
                for acc, v in zip(scores, values):
                    acc += v
        if self.requested_early_exit:
            log.info("Test interrupted.")
            return
        if p.test_compute_loss:
            loss /= f32(n)
            log.info("Test loss: %s", log.fmt(loss))
        index = 0
        for name, acc, weight in zip(test_net.output_blob_names, scores, test_net.output_loss_weights):
            for total in acc:
                mean = total / f32(n)
                log.info("    Test net output #%d: %s = %s%s", index, name, log.fmt(mean), _loss_note(weight, mean))
                index += 1

    # ---- update (subclasses) -----------------------------------------------------------------
    @abc.abstractmethod
    def apply_update(self) -> None:
        """Turn the accumulated gradients into a parameter update and increment ``iter``."""

    # ---- snapshots ---------------------------------------------------------------------------
    def _snapshot_filename(self, extension: str) -> str:
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{extension}"

    def _snapshots(self) -> bool:
        """Whether this solver takes part in snapshots: the root writes them; MPI ranks hand it their state."""
        return self.is_root or self.state_gather is not None

    def snapshot(self) -> None:
        """Write ``<prefix>_iter_<iter>.caffemodel[.h5]`` and the matching ``.solverstate[.h5]``."""
        if not self.is_root:
            if self.state_gather is not None:
                from cct.solvers.resume import share

                share(self)
                self._snapshot_iter = self.iter
            return
        self.net.executor.sync()
        self.weights_needed()
        fmt = self.param.snapshot_format
        if fmt == pb.SolverParameter.BINARYPROTO:
            from cct.io.weights import write_proto_binary

            model_filename = self._snapshot_filename(".caffemodel")
            log.info("Snapshotting to binary proto file %s", model_filename)
            write_proto_binary(model_filename, self.net.to_proto(write_diff=self.param.snapshot_diff))
        elif fmt == pb.SolverParameter.HDF5:
            model_filename = self._snapshot_filename(".caffemodel.h5")
            log.info("Snapshotting to HDF5 file %s", model_filename)
            self.net.to_hdf5(model_filename, write_diff=self.param.snapshot_diff)
        else:
            raise CctError(f"Unsupported snapshot format {fmt}.")
        try:
            self.snapshot_solver_state(model_filename)
            self._snapshot_iter = self.iter
        except BaseException:
            # never leave a model without its state: the pair is the snapshot (earlier pairs are untouched)
            with contextlib.suppress(OSError):
                os.remove(model_filename)
            raise

    def resume_state(self) -> bytes:
        """cct's resume document for the solverstate (:mod:`cct.solvers.resume`)."""
        from cct.solvers.resume import capture

        return capture(self, gather=not self._diverged)  # a diverged rank does not meet the others

    @abc.abstractmethod
    def snapshot_solver_state(self, model_filename: str) -> None:
        """Write the update rule's state next to ``model_filename``."""

    def restore(self, state_file: str | os.PathLike[str]) -> None:
        """Resume from a ``.solverstate`` (or ``.solverstate.h5``): iter, weights, history."""
        state_file = os.fspath(state_file)
        if state_file.endswith(".h5"):
            self.restore_solver_state_from_hdf5(state_file)
        else:
            self.restore_solver_state_from_binary_proto(state_file)

    @abc.abstractmethod
    def restore_solver_state_from_binary_proto(self, state_file: str) -> None:
        """Load iter, weights and history from a binary ``.solverstate``."""

    @abc.abstractmethod
    def restore_solver_state_from_hdf5(self, state_file: str) -> None:
        """Load iter, weights and history from a ``.solverstate.h5``."""


def _loss_note(weight: float, value: Any) -> str:
    if not weight:
        return ""
    w = f32(weight)
    return f" (* {log.fmt(w)} = {log.fmt(w * f32(value))} loss)"


def load_net_weights(net, model_list: str) -> None:
    """HEAD's ``LoadNetWeights``: each comma-separated (trimmed) weights file, in order."""
    for name in model_list.split(","):
        name = name.strip()
        log.info("Finetuning from %s", name)
        net.copy_trained_layers_from(name)


# ------------------------------------------------------------------------------------------------
# Registry: solver type string -> class
# ------------------------------------------------------------------------------------------------

_registry: dict[str, type[Solver]] = {}


def register_solver(cls: type[Solver]) -> type[Solver]:
    """Class decorator: register ``cls`` under ``cls.type`` (duplicates refused)."""
    if not cls.type:
        raise RuntimeError(f"{cls.__name__} has no solver type name")
    if cls.type in _registry:
        raise RuntimeError(f"solver type {cls.type} registered twice")
    _registry[cls.type] = cls
    return cls


def solver_type_list() -> list[str]:
    return sorted(_registry)


def solver_class(type_name: str, source: str = "solver") -> type[Solver]:
    cls = _registry.get(type_name)
    if cls is None:
        raise CctError(f"{source}: Unknown solver type: {type_name} (known types: "
                       f"{', '.join(solver_type_list())})")
    return cls


def create_solver(param: pb.SolverParameter | str | os.PathLike[str], source: str | None = None,
                  executor_factory: Callable[[], Any] | None = None) -> Solver:
    """The solver ``param.type`` names (Caffe's ``SolverRegistry::CreateSolver``).  ``source`` names
    where ``param`` came from in error messages; ``executor_factory()`` gives each net it builds its executor
    (default: :func:`cct.exec.executor_from_settings`)."""
    if isinstance(param, (str, os.PathLike)):
        source = os.fspath(param)
        param = read_solver_file(param)
    else:
        source = source or "<SolverParameter>"
    return solver_class(param.type, source)(param, source=source, executor_factory=executor_factory)


def get_solver(solver_file: str | os.PathLike[str]) -> Solver:
    """pycaffe's ``caffe.get_solver(file)``: the solver class chosen by the file's ``type``."""
    return create_solver(solver_file)
