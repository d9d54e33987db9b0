"""What this machine measured once and keeps: the measurement cache, the measuring budget of a net, and measured
choices between ways to run one computation.

* the cache — one small JSON file, ``autotune.json`` in the cache directory (``CCT_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/cct``, else ``~/.cache/cct``: :mod:`cct.cache`); every entry is keyed by the machine and
  thread setting (:func:`_threads_key`: host, CPU, cores, the BLAS libraries and the kernels they run, and the
  partition setting);
* the budget — the ledger of the net being built (:mod:`cct.engines.autotune`'s ``measuring_session``): what a
  measurement costs is charged to it (:func:`_charged`), and once it is spent nothing more is measured
  (:func:`_may_measure`);
* :func:`measured_choice` — the faster of a few ways to run one computation (a GEMM's operand orientation),
  measured on the caller's operands (or stand-ins) and cached once two processes' measurements agree.

It imports no engine, so that engines and layers can ask for measured choices and the engine autotune
(:mod:`cct.engines.autotune`, which measures engines) can keep its entries here too.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cct.cache import cache_dir, read_json, update_json
from cct.config import settings
from cct.runtime.threads import cpu_cores

CACHE_FILE = "autotune.json"

# the ledger of the net being built (an autotune.Ledger: may_measure(), spent, measured), None outside one
_ledger: contextvars.ContextVar[Any] = contextvars.ContextVar("cct_autotune_ledger", default=None)


def _may_measure() -> bool:
    ledger = _ledger.get()
    return ledger is None or ledger.may_measure()


@contextlib.contextmanager
def _charged() -> Iterator[None]:
    """Charge the block's time to the net's ledger (a measurement made inside another one, e.g. a GEMM layout
    measured in an engine's warm-up step, is the outer one's)."""
    if _charging.get():
        yield
        return
    token = _charging.set(True)
    t = time.perf_counter()
    try:
        yield
    finally:
        _charging.reset(token)
        ledger = _ledger.get()
        if ledger is not None:
            ledger.spent += time.perf_counter() - t
            ledger.measured += 1


_charging: contextvars.ContextVar[bool] = contextvars.ContextVar("cct_autotune_charging", default=False)


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    return read_json(CACHE_FILE)


def _write_cache(update: dict[str, Any]) -> None:
    update_json(CACHE_FILE, update)


def _threads_key() -> str:
    """The machine (:func:`cct.device.query.machine_key`, as a short digest: a cache directory shared by
    machines, or one machine run with another BLAS kernel, keeps one entry per machine) and thread setting
    a measurement holds for."""
    forced = settings.get("partitions")
    return f"cores{cpu_cores()}-p{forced or 'auto'}-m{_machine_digest()}"


@functools.lru_cache(maxsize=1)
def _machine_digest() -> str:
    from cct.device.query import machine_key

    return hashlib.sha1(machine_key().encode()).hexdigest()[:10]


# measured_choice: an untimed run of each candidate, then this many timed runs each, alternated (median kept) —
# CHOICE_MIN_ROUNDS only where those have taken CHOICE_SECONDS (Winograd's weight-gradient methods on
# CaffeNet's conv4 at 64 images, ~100 ms a run, took 1.2 s in six rounds of two)
CHOICE_ROUNDS = 5
CHOICE_MIN_ROUNDS = 3
CHOICE_SECONDS = 0.5
# ... and a choice is kept for good once CHOICE_CONFIRMATIONS measurements (each in a process of its own) agree, or
# by the majority of CHOICE_MEASUREMENTS: until then the cache holds the names measured so far and the next process
# measures again.  One measurement caught in a burst of the shared machine's load had put CaffeNet's conv1 forward
# on BLAS for good, 1.5x the panel GEMM's time, which three measurements afterwards all chose.
CHOICE_CONFIRMATIONS = 2
CHOICE_MEASUREMENTS = 3


def measured_choice(kind: str, key: str, candidates: dict[str, Callable[[], Any]],
                    between: Callable[[], Any] | None = None) -> str:
    """The name of the fastest of ``candidates`` — callables each running one way of the same computation once,
    on the caller's own operands —, measured alternately (one untimed run each, then ``CHOICE_ROUNDS`` timed,
    ``CHOICE_MIN_ROUNDS`` where those took ``CHOICE_SECONDS``; the medians compared) and cached under ``kind``,
    until that is settled on this machine and thread setting (:data:`CHOICE_CONFIRMATIONS`: once per process
    until then; a process keeps what it measured).  ``between``, where given, runs untimed before every run
    (:func:`cache_evictor`: the operands as cold as a net leaves them).  Without measuring (``-autotune off``, or
    a net's measuring budget spent): what was measured before, else the first candidate.  The candidates' last
    runs are the timed ones: the caller runs the chosen one again when its result must be that one's."""
    names = list(candidates)
    known = known_choice(kind, key, candidates)
    if known is not None:
        return known
    full_key = f"{key}-{_threads_key()}"
    memo_key = (str(cache_path()), kind, full_key)
    so_far = _measured_so_far(kind, full_key, candidates)
    if settings.get("autotune") is False or not _may_measure():
        return so_far[-1] if so_far else names[0]
    with _charged():
        for name in names:
            if between is not None:
                between()
            candidates[name]()
        times: dict[str, list[float]] = {name: [] for name in names}
        for done in range(CHOICE_ROUNDS):
            if done >= CHOICE_MIN_ROUNDS and sum(map(sum, times.values())) >= CHOICE_SECONDS:
                break
            for name in names:
                if between is not None:
                    between()
                t = time.perf_counter()
                candidates[name]()
                times[name].append(time.perf_counter() - t)
    best = min(names, key=lambda name: statistics.median(times[name]))
    _write_cache({kind: {full_key: _settled(so_far + [best])}})
    _choice_memo[memo_key] = best
    return best


def _settled(measured: list[str]) -> str | list[str]:
    """What the cache keeps after ``measured`` (in order): the name once its last :data:`CHOICE_CONFIRMATIONS`
    agree or :data:`CHOICE_MEASUREMENTS` were made (the most frequent, the latest of those tied), else the list."""
    last = measured[-CHOICE_CONFIRMATIONS:]
    if len(last) == CHOICE_CONFIRMATIONS and len(set(last)) == 1:
        return last[0]
    if len(measured) >= CHOICE_MEASUREMENTS:
        return max(reversed(measured), key=measured.count)
    return measured


def _measured_so_far(kind: str, full_key: str, candidates: Any) -> list[str]:
    """The unsettled measurements of ``full_key`` in the cache (see :func:`_settled`), those naming ``candidates``."""
    entry = _read_cache().get(kind, {}).get(full_key)
    return [name for name in entry if name in candidates] if isinstance(entry, list) else []


_choice_memo: dict[tuple[str, str, str], str] = {}  # (cache file, kind, key): read once per process


def known_choice(kind: str, key: str, candidates: Any) -> str | None:
    """What :func:`measured_choice` settled for ``key`` on this machine and thread setting (in the cache), or
    measured in this process; None where it would measure."""
    full_key = f"{key}-{_threads_key()}"
    memo_key = (str(cache_path()), kind, full_key)
    memo = _choice_memo.get(memo_key)
    if memo is not None and memo in candidates:
        return memo
    cached = _read_cache().get(kind, {}).get(full_key)
    if isinstance(cached, str) and cached in candidates:
        _choice_memo[memo_key] = cached
        return cached
    return None


def cache_evictor() -> Callable[[], None]:
    """A callable that reads and writes a buffer the size of the CPU's last-level cache
    (:func:`cct.device.query.last_level_cache_bytes`; plain loads and stores, which a large ``memset``'s
    non-temporal ones would not be): run before each timed run, it leaves a layer's operands as cold as the
    layers between two calls of it leave them in a net.  CaffeNet's fc8 forward, 2 cores, AVX-512 kernels:
    warm, the split and one-call ways of its swapped product measure 1.54-1.62 ms alike; cold, 1.80-1.87
    against 1.73-1.75 ms, and in the net 2.06-2.15 against 1.87-1.90 ms."""
    import numpy as np

    from cct.device.query import last_level_cache_bytes

    held: list[Any] = []  # the buffer, made on the first run (a choice found in the cache makes none)

    def evict() -> None:
        if not held:
            held.append(np.zeros(last_level_cache_bytes() // 4, np.float32))
        np.add(held[0], 1.0, out=held[0])
    return evict


def stand_in(rng: Any, shape: tuple[int, ...], dtype: Any, scale: float = 1.0) -> Any:
    """Operands for timing a computation: uniform in [-scale/2, scale/2), drawn in the array's own precision where
    the generator has it — 6x faster than float64 normals cast down (two 25M-value stand-ins of VGG16's conv1_2
    took 1.6 s of a 2 s autotune budget); a product's or a transform's time does not depend on the values."""
    import numpy as np

    dtype = np.dtype(dtype)
    a = rng.random(shape, dtype=dtype if dtype in (np.float32, np.float64) else np.float32).astype(dtype, copy=False)
    a -= 0.5
    if scale != 1.0:
        a *= scale
    return a


def _concurrent(parts: int, make: Any) -> Any:
    """A callable running ``make(part)()`` in every batch partition at once (as a layer's partitions run)."""
    from cct.runtime.partition import run_partitions

    bodies = [make(p) for p in range(parts)]
    ranges = [(p, p + 1) for p in range(parts)]
    return lambda: run_partitions(ranges, lambda part, a, b: bodies[part]())
