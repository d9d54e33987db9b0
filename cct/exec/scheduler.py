"""The task-graph scheduler of ZNN (Zlateski et al., Alg. 1-4): tasks, a ready queue ordered by priority, a
pool of worker threads, FORCE for lazily applied updates, and the almost wait-free concurrent sum.

A :class:`Task` is a body, a priority key and its successors; a graph is a list of tasks whose dependency
counters are reset at every run.  :meth:`Scheduler.run` puts the tasks without dependencies in the queue and
then works on the queue itself, with ``workers - 1`` pool threads beside it, until every task of the graph
has run: each finished task decrements its successors' counters and queues those that reach zero.  The pool
threads stay alive between runs and keep working on the *background* tasks (weight updates), which sit below
every graph task; a task that must see an update done first calls :meth:`Scheduler.force`:

* the update is done: go on;
* it is queued: take it out of the queue and run it here, then go on;
* another worker runs it: attach the task to the update (it is queued again when the update finishes) and
  take other work — no thread ever waits for another.

Queue policies: ``priority`` (ZNN's: a heap of the distinct priority keys, each with a FIFO list of its
tasks, so pushing costs log K for K distinct keys), ``fifo`` and ``lifo`` (for comparison).  The numpy,
BLAS and scipy.fft calls in task bodies release the GIL, so two workers run two bodies at once.
"""
from __future__ import annotations

import collections
import heapq
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

WAITING, QUEUED, RUNNING, DONE = range(4)
DEFERRED = object()  #: a body's return value: attached to a running update, not finished

POLICIES = ("priority", "fifo", "lifo")


class Task:
    """One unit of work: ``body()`` (returns :data:`DEFERRED` when it must wait for an update), a priority key
    (smaller runs first), successors, and the updates it forces before running (``forces``)."""

    __slots__ = ("name", "body", "key", "successors", "num_deps", "remaining", "state", "forces",
                 "continuations", "graph")

    def __init__(self, name: str, body: Callable[[], Any], key: tuple = (0,)):
        self.name = name
        self.body = body
        self.key = key
        self.successors: list[Task] = []
        self.num_deps = 0
        self.remaining = 0
        self.state = WAITING
        self.forces: list[Task] = []
        self.continuations: list[Task] = []
        self.graph: _Run | None = None

    def then(self, *tasks: Task) -> None:
        """Make every task of ``tasks`` depend on this one."""
        for t in tasks:
            self.successors.append(t)
            t.num_deps += 1

    def __repr__(self) -> str:
        return f"Task({self.name})"


class ConcurrentSum:
    """ZNN's almost wait-free sum (Alg. 4) of ``required`` arrays: :meth:`add` swaps pointers under the lock
    and adds outside it, so the critical section does not grow with the array size.  ``add(v)`` returns True
    for the call that completes the sum (then :attr:`value` holds it).  ``v`` must belong to the caller (it
    is added into).  ``deterministic``: keep the parts and add them in index order at the end instead
    (the same rounding in every run)."""

    def __init__(self, required: int, deterministic: bool = False):
        self.required = int(required)
        self.deterministic = deterministic
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.value: Any = None
        self.total = 0
        self._parts: dict[int, Any] = {}

    def add(self, v: Any, index: int = 0) -> bool:
        if self.deterministic:
            with self._lock:
                if index in self._parts:
                    raise RuntimeError(f"sum part {index} added twice")
                self._parts[index] = v
                self.total += 1
                if self.total != self.required:
                    return False
            parts = [self._parts[i] for i in sorted(self._parts)]
            acc = parts[0]
            for p in parts[1:]:
                np.add(acc, p, out=acc)
            self.value, self._parts = acc, {}
            return True
        while True:
            with self._lock:
                if self.value is None:
                    self.value = v
                    self.total += 1
                    return self.total == self.required
                other, self.value = self.value, None
            np.add(v, other, out=v)


class _Run:
    """One run of a graph: how many of its tasks have not finished, and the first error."""

    def __init__(self, count: int):
        self.pending = count
        self.error: BaseException | None = None


class _ReadyQueue:
    """Graph tasks by policy, background tasks (updates) below all of them in FIFO order."""

    def __init__(self, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"queue policy must be one of {', '.join(POLICIES)} (got {policy!r})")
        self.policy = policy
        self._heap: list[tuple] = []
        self._lists: dict[tuple, collections.deque] = {}
        self._plain: collections.deque = collections.deque()
        self._background: collections.deque = collections.deque()
        self.size = 0

    def push(self, task: Task, background: bool = False) -> None:
        self.size += 1
        if background:
            self._background.append(task)
        elif self.policy == "priority":
            bucket = self._lists.get(task.key)
            if bucket is None:
                bucket = self._lists[task.key] = collections.deque()
                heapq.heappush(self._heap, task.key)
            bucket.append(task)
        else:
            self._plain.append(task)

    def pop(self) -> Task | None:
        """The next queued task (entries taken out by FORCE are skipped), or None."""
        while self.size:
            task = self._pop_any()
            self.size -= 1
            if task.state == QUEUED:
                return task
        return None

    def _pop_any(self) -> Task:
        if self.policy == "priority" and self._heap:
            key = self._heap[0]
            bucket = self._lists[key]
            task = bucket.popleft()
            if not bucket:
                heapq.heappop(self._heap)
                del self._lists[key]
            return task
        if self._plain:
            return self._plain.popleft() if self.policy == "fifo" else self._plain.pop()
        return self._background.popleft()


class Scheduler:
    """``workers`` threads (the caller of :meth:`run` and ``workers - 1`` pool threads) on one ready queue;
    ``thread_budget``: a context manager factory each worker runs its bodies in (BLAS/FFT threads)."""

    def __init__(self, workers: int = 1, policy: str = "priority",
                 thread_budget: Callable[[], Any] | None = None):
        self.workers = max(1, int(workers))
        self._queue = _ReadyQueue(policy)
        self._cv = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._budget = thread_budget
        self._closed = False
        self.background_error: BaseException | None = None

    @property
    def policy(self) -> str:
        return self._queue.policy

    # ---- pool -------------------------------------------------------------------------------------
    def _start(self) -> None:
        while len(self._threads) < self.workers - 1:
            t = threading.Thread(target=self._worker, name=f"cct-taskgraph-{len(self._threads) + 1}", daemon=True)
            self._threads.append(t)
            t.start()

    def _worker(self) -> None:
        """A pool thread: runs queued tasks inside its thread budget, which it gives back while it waits (an
        idle pool must not hold the process's BLAS threads down)."""
        ctx = None
        try:
            while True:
                with self._cv:
                    task = self._queue.pop()
                    if task is None and ctx is not None:
                        ctx.__exit__(None, None, None)
                        ctx = None
                    while task is None:
                        if self._closed:
                            return
                        self._cv.wait()
                        task = self._queue.pop()
                    task.state = RUNNING
                if ctx is None and self._budget is not None:
                    ctx = self._budget()
                    ctx.__enter__()
                self._execute(task)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def close(self) -> None:
        """Finish the background work and stop the pool threads."""
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []
        self._closed = False

    # ---- running ----------------------------------------------------------------------------------
    def _execute(self, task: Task) -> None:
        run = task.graph
        try:
            for u in task.forces:
                if not self.force(u, task):
                    return  # queued again when u finishes
            result = task.body()
        except BaseException as e:  # noqa: BLE001 - handed to the caller of run()
            result = None
            if run is not None:
                with self._cv:
                    run.error = run.error or e
            else:
                self.background_error = self.background_error or e
        if result is DEFERRED:
            return
        self._finish(task)

    def _finish(self, task: Task) -> None:
        with self._cv:
            task.state = DONE
            ready = 0
            for s in task.successors:
                s.remaining -= 1
                if s.remaining == 0:
                    s.state = QUEUED
                    self._queue.push(s)
                    ready += 1
            for c in task.continuations:
                c.state = QUEUED
                self._queue.push(c)
                ready += 1
            task.continuations = []
            run = task.graph
            if run is not None:
                run.pending -= 1
            self._cv.notify_all()

    def force(self, update: Task, waiter: Task) -> bool:
        """ZNN's FORCE: True when ``update`` is done (run here if it was queued); False when another worker
        runs it — ``waiter`` is then queued again when it finishes."""
        with self._cv:
            if update.state == DONE:
                return True
            if update.state == RUNNING:
                update.continuations.append(waiter)
                waiter.state = WAITING
                return False
            update.state = RUNNING  # its queue entry is skipped from now on
        self._execute(update)
        return True

    def submit_background(self, tasks: Iterable[Task]) -> None:
        """Queue ``tasks`` (no dependencies) below every graph task; the pool runs them when idle."""
        with self._cv:
            for t in tasks:
                t.graph = None
                t.state = QUEUED
                self._queue.push(t, background=True)
            self._cv.notify_all()
        if self.workers > 1:
            self._start()

    def drain(self, tasks: Iterable[Task] = ()) -> None:
        """Make sure the given background tasks are done (running the queued ones here)."""
        for t in tasks:
            while True:
                with self._cv:
                    if t.state == DONE:
                        break
                    if t.state == RUNNING:
                        self._cv.wait(0.05)
                        continue
                    t.state = RUNNING
                self._execute(t)
                break
        if self.background_error is not None:
            e, self.background_error = self.background_error, None
            raise e

    def run(self, tasks: list[Task]) -> None:
        """Run a graph: every task once, each after its dependencies; raises the first error of a body."""
        if not tasks:
            return
        run = _Run(len(tasks))
        with self._cv:
            for t in tasks:
                t.remaining = t.num_deps
                t.graph = run
                t.continuations = []
                t.state = WAITING
            for t in tasks:
                if t.remaining == 0:
                    t.state = QUEUED
                    self._queue.push(t)
            self._cv.notify_all()
        if self.workers > 1:
            self._start()
        ctx = self._budget() if self._budget is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            while True:
                with self._cv:
                    while True:
                        if run.error is not None or run.pending == 0:
                            task = None
                            break
                        task = self._queue.pop()
                        if task is not None:
                            task.state = RUNNING
                            break
                        self._cv.wait()
                if task is None:
                    break
                self._execute(task)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        if run.error is not None:
            with self._cv:  # let the other workers finish what they hold, drop the rest
                while any(t.state == RUNNING for t in tasks):
                    self._cv.wait(0.05)
                for t in tasks:
                    if t.state == QUEUED:
                        t.state = DONE
            raise run.error
