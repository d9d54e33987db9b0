"""Devices a batch can run on: the CPU with a number of BLAS/FFT threads, or one CUDA GPU.

A :class:`Device` is named as on the command line: ``cpu`` (every usable core), ``cpu:T`` (T threads) or
``gpu:N`` (CUDA device N; ``gpu`` is ``gpu:0``).  Several CPU devices are a real configuration — e.g.
``cpu:1,cpu:1`` runs two halves of every batch concurrently, one thread each — while a GPU may be listed
once.  What a device offers:

* ``xp`` — the array module of its memory (numpy, or cupy for a GPU; :mod:`cct.device.backend` is the one
  place that imports cupy); :meth:`holds` tells whether an array already lives there;
* memory helpers — :meth:`allocate`, :meth:`to_device`, :meth:`copy_in` (from anywhere), :meth:`to_host`;
* :meth:`context` — run code with the device's limits: a CPU device sets the BLAS thread count (process
  wide, threadpoolctl via :func:`cct.runtime.threads.blas_threads`) and scipy.fft's workers (per thread);
  a GPU device makes itself cupy's current device.  :meth:`thread_context` is the per-thread part only, for
  code running concurrently with other devices under one process-wide BLAS setting;
* :meth:`peak_gflops` — single-precision GEMM speed: for a CPU measured by a short sgemm probe with the
  device's thread count (the best of three or more square products, 1024 wide on one thread, 1536 on two or
  three, 2048 from four; about 0.3-0.6 s), cached per machine, device and thread count in
  ``devices.json`` of the user cache dir (``$CCT_CACHE_DIR``, else ``$XDG_CACHE_HOME/cct``, else
  ``~/.cache/cct``); for a GPU the vendor's FP32 figure from :data:`GPU_PEAK_TFLOPS` when the product is
  listed there, else a measured cupy sgemm (cached the same way).

:func:`parse_devices` turns ``"cpu:1,gpu:0"`` into devices; a mistake (an unknown item, a GPU without cupy,
a GPU id this machine does not have) is one :class:`~cct.errors.CctError` line naming the item.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from cct.cache import cache_dir, read_json, update_json
from cct.device import backend
from cct.device.query import cpu_model, machine_key
from cct.errors import CctError

CACHE_FILE = "devices.json"
PROBE_SECONDS = 0.4  # timed sgemm calls stop after this (at least two, three on a CPU, always run)
PROBE_VERSION = 2  # part of the cache key: figures of an earlier probe (768-wide on 2 threads) are not reused

# Vendor FP32 (non-tensor-core) peaks, TFLOP/s, matched as substrings of the CUDA device name (longest key first).
GPU_PEAK_TFLOPS: dict[str, float] = {
    "H200": 66.9, "H100 PCIe": 51.2, "H100 NVL": 60.0, "H100": 66.9, "GH200": 66.9,
    "A100": 19.5, "A40": 37.4, "A30": 10.3, "A10G": 31.2, "A10": 31.2,
    "L40S": 91.6, "L40": 90.5, "L4": 30.3, "V100": 15.7, "T4": 8.1, "P100": 9.3, "P40": 11.8,
    "RTX 4090": 82.6, "RTX 3090": 35.6, "RTX 3080": 29.8, "RTX 2080 Ti": 13.4, "K80": 4.4, "K40": 4.3,
}

_cache_lock = threading.Lock()


@dataclass(frozen=True)
class Device:
    """Where (a share of) a batch runs.

    ``kind``: ``"cpu"`` or ``"gpu"``; ``index``: the CUDA device id (0 for the CPU); ``threads``: BLAS/FFT
    threads of a CPU device (0 for a GPU).
    """

    kind: str
    index: int = 0
    threads: int = 0

    @property
    def name(self) -> str:
        """The command-line spelling: ``cpu:2``, ``gpu:0``."""
        return f"cpu:{self.threads}" if self.kind == "cpu" else f"gpu:{self.index}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    # ---- memory ------------------------------------------------------------------------------
    @property
    def xp(self) -> ModuleType:
        """numpy for the CPU, cupy for a GPU."""
        return backend.cupy if self.is_gpu else np

    def holds(self, a: Any) -> bool:
        """Whether array ``a`` lives in this device's memory."""
        where = backend.array_gpu(a)
        return where is None if not self.is_gpu else where == self.index

    def allocate(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """A zero-filled array on this device."""
        with self._selected():
            return self.xp.zeros(shape, dtype=dtype)

    def to_device(self, a: Any) -> Any:
        """``a`` on this device (``a`` itself when it is there already)."""
        if self.holds(a):
            return a
        if not self.is_gpu:
            return backend.to_host(a)
        with self._selected():
            return backend.cupy.asarray(a)

    def copy_in(self, dst: Any, src: Any) -> None:
        """``dst[...] = src`` for ``dst`` on this device and ``src`` anywhere (same shape)."""
        copy_into(dst, src)

    @staticmethod
    def to_host(a: Any) -> np.ndarray:
        return backend.to_host(a)

    def synchronize(self) -> None:
        """Wait for this device's queued work (a no-op on the CPU)."""
        if self.is_gpu:
            with self._selected():
                backend.cupy.cuda.Device(self.index).synchronize()

    # ---- running code ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _selected(self) -> Iterator[None]:
        if self.is_gpu:
            with backend.cupy.cuda.Device(self.index):
                yield
        else:
            yield

    @contextlib.contextmanager
    def thread_context(self) -> Iterator[None]:
        """The per-thread part of :meth:`context`: scipy.fft workers (CPU) or the current CUDA device (GPU)."""
        if self.is_gpu:
            with self._selected():
                yield
            return
        try:
            import scipy.fft
        except ImportError:  # pragma: no cover - scipy is a dependency
            yield
            return
        with scipy.fft.set_workers(self.threads):
            yield

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Run the block on this device: its BLAS threads (process wide) and :meth:`thread_context`."""
        if self.is_gpu:
            with self.thread_context():
                yield
            return
        from cct.runtime.threads import blas_threads

        with blas_threads(self.threads), self.thread_context():
            yield

    # ---- description and speed ---------------------------------------------------------------
    def describe(self) -> str:
        """``CPU (AMD EPYC), 1 BLAS thread`` / ``NVIDIA H100 80GB HBM3``."""
        if self.is_gpu:
            return backend.gpu_name(self.index)
        return f"CPU ({cpu_model()}), {self.threads} BLAS thread{'s' if self.threads != 1 else ''}"

    def peak_gflops(self) -> tuple[float, str]:
        """(single-precision GEMM GFLOP/s, where the figure comes from: ``measured``, ``cached`` or
        ``spec sheet``)."""
        if self.is_gpu:
            name = backend.gpu_name(self.index)
            for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
                if key.lower() in name.lower():
                    return GPU_PEAK_TFLOPS[key] * 1e3, "spec sheet"
            key = f"{machine_key()}|gpu|{name}"
            return _cached_or_measured(key, lambda: _probe_gpu(self.index))
        key = f"{machine_key()}|probe{PROBE_VERSION}|cpu|threads={self.threads}"
        return _cached_or_measured(key, lambda: _probe_cpu(self.threads))


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` wherever either lives (host↔GPU transfers with ``.set`` / ``cupy.asnumpy``)."""
    to, frm = backend.array_gpu(dst), backend.array_gpu(src)
    if to == frm:
        dst[...] = src
    elif to is None:
        dst[...] = backend.to_host(src)
    else:
        with backend.cupy.cuda.Device(to):
            if frm is None:
                dst.set(np.ascontiguousarray(src))
            else:
                dst[...] = backend.cupy.asarray(src)


# ------------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------------

_ITEM = re.compile(r"(cpu|gpu)(?::(\d+))?")


def parse_devices(text: str, source: str = "-devices") -> list[Device]:
    """``"cpu:1,cpu:1"`` → two one-thread CPU devices.  Items: ``cpu`` (all usable cores), ``cpu:T``,
    ``gpu`` (= ``gpu:0``), ``gpu:N``.  Errors name ``source`` (the flag or variable) and the item."""
    from cct.runtime.threads import cpu_cores

    text = str(text).strip()
    if not text:
        raise CctError(f"{source}: no devices given (e.g. cpu:1,cpu:1 or cpu,gpu:0)")
    devices: list[Device] = []
    for item in (s.strip() for s in text.split(",")):
        m = _ITEM.fullmatch(item.lower())
        if not m:
            raise CctError(f"{source} {text}: unknown device '{item}' (devices are cpu, cpu:THREADS, gpu:ID)")
        kind, number = m.group(1), m.group(2)
        if kind == "cpu":
            threads = int(number) if number is not None else cpu_cores()
            if threads < 1:
                raise CctError(f"{source} {text}: '{item}': a CPU device needs at least one thread")
            devices.append(Device("cpu", 0, threads))
            continue
        if not backend.cupy_available:
            raise CctError(f"{source} {text}: '{item}' needs cupy and a CUDA device (pip install 'cct[gpu]'); "
                           "none is available")
        index = int(number) if number is not None else 0
        count = backend.gpu_count()
        if index >= count:
            raise CctError(f"{source} {text}: '{item}': no such GPU (this machine has {count}: "
                           f"gpu:0..gpu:{count - 1})")
        device = Device("gpu", index, 0)
        if device in devices:
            raise CctError(f"{source} {text}: '{item}' is listed twice (a GPU can take one share)")
        devices.append(device)
    return devices


# ------------------------------------------------------------------------------------------------
# Peak FLOPS: probes and their cache
# ------------------------------------------------------------------------------------------------

def cache_file() -> Path:
    return cache_dir() / CACHE_FILE


def _cached_or_measured(key: str, probe: Any) -> tuple[float, str]:
    with _cache_lock:
        cached = read_json(CACHE_FILE).get("peak_gflops", {}).get(key)
        if isinstance(cached, (int, float)) and cached > 0:
            return float(cached), "cached"
        value = float(probe())
        update_json(CACHE_FILE, {"peak_gflops": {key: value}})
        return value, "measured"


def _best_gflops(n: int, run: Any, sync: Any = lambda: None, min_reps: int = 2) -> float:
    run()  # warm-up (and the BLAS thread pool's start)
    sync()
    best, reps, stop = float("inf"), 0, time.perf_counter() + PROBE_SECONDS
    while reps < min_reps or (reps < 20 and time.perf_counter() < stop):
        t = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return 2.0 * n ** 3 / best / 1e9


def _probe_size(threads: int) -> int:
    """The probe's square size: big enough that every thread gets whole cache blocks and the thread pool's
    start-up is a few per cent of a call — ~0.1 s per call at peak."""
    return 1024 if threads <= 1 else 1536 if threads < 4 else 2048


def sgemm_gflops(n: int, min_reps: int = 3) -> float:
    """sgemm GFLOP/s of ``n``³ float32 products on the host with the BLAS threads the caller runs now: the best
    of at least ``min_reps`` after a warm-up (more while ``PROBE_SECONDS`` allow)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty_like(a)
    return _best_gflops(n, lambda: np.matmul(a, b, out=c), min_reps=min_reps)


def _probe_cpu(threads: int) -> float:
    """sgemm GFLOP/s with ``threads`` BLAS threads: the best of at least three square products of
    :func:`_probe_size` (smaller ones, 768 on two threads, read a third of the peak: the threads' hand-off
    and cache fills dominate them)."""
    from cct.runtime.threads import blas_threads

    with blas_threads(threads):
        return sgemm_gflops(_probe_size(threads))


def _probe_gpu(index: int) -> float:  # pragma: no cover - needs a GPU
    cp = backend.cupy
    n = 4096
    with cp.cuda.Device(index):
        a = cp.random.standard_normal((n, n), dtype=cp.float32)
        b = cp.random.standard_normal((n, n), dtype=cp.float32)
        c = cp.empty_like(a)
        return _best_gflops(n, lambda: cp.matmul(a, b, out=c), cp.cuda.Device(index).synchronize)
