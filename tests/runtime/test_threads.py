"""Thread budgets: concurrent and nested BLAS thread requests, with their interleavings forced by events;
OpenBLAS's worker spin set on import."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cct.runtime.threads import BLAS_WORKER_SPIN, BUDGET, ThreadBudget, _knob, blas_threads, thread_budget


class FakeLibrary:
    """A BLAS library's thread count, as threadpoolctl's controllers expose it."""

    def __init__(self, n: int):
        self.n = n

    def get_num_threads(self) -> int:
        return self.n

    def set_num_threads(self, n: int) -> None:
        self.n = n


@pytest.fixture
def budget():
    b = ThreadBudget()
    libs = [FakeLibrary(8), FakeLibrary(8)]
    b.libraries = lambda: libs  # type: ignore[method-assign]
    return b, libs


def _counts(libs) -> list[int]:
    return [lib.n for lib in libs]


def test_nested_requests_in_one_thread(budget):
    b, libs = budget
    b.acquire(4)
    assert _counts(libs) == [4, 4] and b.thread_budget() == 4
    b.acquire(1)
    assert _counts(libs) == [1, 1] and b.thread_budget() == 1
    b.release(1)
    assert _counts(libs) == [4, 4] and b.thread_budget() == 4
    b.release(4)
    assert _counts(libs) == [8, 8] and b.thread_budget() is None


def test_concurrent_requests_run_with_the_smallest_and_restore_when_all_end(budget):
    """A asks for 1, then B for 2 while A is inside: the libraries stay at 1 (B may not oversubscribe A's
    promise); A leaves first: B alone, 2; B leaves: back to 8.  Setting and restoring per thread (the last
    writer wins) would give A 2 threads, and leave the process at 1 after A's and B's restores cross."""
    b, libs = budget
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, list[int]] = {}

    def thread_a() -> None:
        b.acquire(1)
        a_in.set()
        b_in.wait(5)
        seen["a with b"] = _counts(libs)
        b.release(1)
        a_out.set()

    t = threading.Thread(target=thread_a)
    t.start()
    a_in.wait(5)
    b.acquire(2)
    seen["b with a"] = _counts(libs)
    assert b.thread_budget() == 2  # B's own budget (its FFTs use it) is still what it asked for
    b_in.set()
    a_out.wait(5)
    seen["b alone"] = _counts(libs)
    b.release(2)
    t.join()
    assert seen == {"b with a": [1, 1], "a with b": [1, 1], "b alone": [2, 2]}
    assert _counts(libs) == [8, 8]


def test_many_threads_leave_no_trace(budget):
    b, libs = budget
    start = threading.Barrier(6)

    def worker(n: int) -> None:
        start.wait(5)
        for _ in range(200):
            b.acquire(n)
            assert min(lib.n for lib in libs) <= n
            b.release(n)

    threads = [threading.Thread(target=worker, args=(k % 3 + 1,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _counts(libs) == [8, 8]


def test_the_real_libraries_follow_requests_from_any_thread():
    """OpenBLAS through threadpoolctl: a request from a worker thread takes effect too (threadpoolctl alone
    lets only its first caller thread change the count), and many threads leave the count where it was."""
    import numpy  # noqa: F401
    import scipy.linalg  # noqa: F401  (its own OpenBLAS)

    before = BUDGET.process_count()
    with blas_threads(1):
        assert BUDGET.process_count() == 1 and thread_budget() == 1
    assert BUDGET.process_count() == before
    seen: list[tuple[int, int]] = []
    start = threading.Barrier(4)

    def worker(n: int) -> None:
        start.wait(5)
        for _ in range(300):
            with blas_threads(n):
                seen.append((n, BUDGET.process_count()))

    threads = [threading.Thread(target=worker, args=(k % 2 + 1,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(count <= n for n, count in seen)
    assert BUDGET.process_count() == before
    solo: list[int] = []

    def alone() -> None:
        with blas_threads(1):
            solo.append(BUDGET.process_count())

    t = threading.Thread(target=alone)
    t.start()
    t.join()
    assert solo == [1] and BUDGET.process_count() == before


def test_each_real_library_knob_reads_and_sets_what_threadpoolctl_sees():
    """The budget's direct handles on each BLAS library (:func:`_knob`: OpenBLAS's own C functions where it runs
    its own threads) agree with threadpoolctl's controller on the count, both ways."""
    import numpy  # noqa: F401
    import scipy.linalg  # noqa: F401

    libs = BUDGET.libraries()
    assert libs
    for lib in libs:
        get, put = _knob(lib)
        before = lib.get_num_threads()
        assert get() == before
        try:
            put(1)
            assert lib.get_num_threads() == 1 and get() == 1
        finally:
            put(before)
        assert lib.get_num_threads() == before


def _spin_after_import(env_value: str | None, numpy_first: bool) -> tuple[str, str, bool]:
    """(OPENBLAS_THREAD_TIMEOUT, blas_worker_spin(), blas_workers_sleep()) in a fresh interpreter that imports
    cct."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if env_value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = env_value
    code = ("import numpy\n" if numpy_first else "") + (
        "import os, cct\nfrom cct.runtime.threads import blas_worker_spin, blas_workers_sleep\n"
        "print(os.environ['OPENBLAS_THREAD_TIMEOUT']); print(blas_worker_spin()); print(blas_workers_sleep())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    value, state, sleep = out.stdout.splitlines()
    return value, state, sleep == "True"


def test_importing_cct_first_puts_openblas_workers_to_sleep():
    value, state, sleep = _spin_after_import(None, numpy_first=False)
    assert value == BLAS_WORKER_SPIN and "set by cct" in state and sleep


@pytest.mark.parametrize("value,sleep", [("12", True), ("16", True), ("28", False), ("x", False)])
def test_the_environments_spin_setting_wins(value, sleep):
    """The environment's value is kept; workers count as asleep up to 2^16 cycles of spin."""
    got, state, asleep = _spin_after_import(value, numpy_first=False)
    assert got == value and "the environment's" in state and asleep == sleep


def test_numpy_loaded_first_is_reported():
    value, state, sleep = _spin_after_import(None, numpy_first=True)
    assert value == BLAS_WORKER_SPIN  # still set: scipy's OpenBLAS and child processes read it
    assert "numpy was loaded before cct" in state and "OPENBLAS_THREAD_TIMEOUT=4" in state and not sleep
