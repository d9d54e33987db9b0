"""Freed memory kept for reuse: glibc's thresholds set once per process, unless the setting is off, by the
FFT engine's first configuration."""
from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from cct.engines import ConvGeometry
from cct.engines.fft import FFTEngine
from cct.runtime import memory


@pytest.fixture
def fresh(monkeypatch):
    """The module as if nothing had asked yet, with the allocator calls recorded instead of made."""
    calls = []
    monkeypatch.setattr(memory, "_state", None)
    monkeypatch.setattr(memory, "_set_glibc_thresholds", lambda: calls.append(1) or True)
    return calls


@pytest.mark.parametrize("value", [None, "1"])
def test_asked_once_per_process(fresh, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CCT_RETAIN_MEMORY", raising=False)  # on by default
    else:
        monkeypatch.setenv("CCT_RETAIN_MEMORY", value)
    assert memory.retain_freed_memory() and memory.retain_freed_memory()
    assert fresh == [1]


def test_the_setting_turns_it_off(fresh, monkeypatch):
    monkeypatch.setenv("CCT_RETAIN_MEMORY", "0")
    assert not memory.retain_freed_memory()
    assert fresh == []


def test_the_fft_engine_asks_when_configured(fresh, monkeypatch):
    monkeypatch.delenv("CCT_RETAIN_MEMORY", raising=False)
    FFTEngine().configure(ConvGeometry(1, 2, 2, 1, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1)), np.float32)
    assert fresh == [1]


def test_glibc_accepts_the_thresholds(monkeypatch):
    """On glibc both mallopt calls succeed (answered by glibc itself: this test process keeps large freed blocks
    from here on); elsewhere nothing is changed."""
    if platform.libc_ver()[0] != "glibc":
        assert not memory._set_glibc_thresholds()
        return
    seen = []
    real = ctypes.CDLL(None).mallopt

    class Spy:  # records what mallopt is asked, and answers as glibc does
        def __init__(self):
            self.argtypes = self.restype = None

        def __call__(self, param, value):
            seen.append((param, value))
            return real(param, value)

    class Lib:
        gnu_get_libc_version = object()
        mallopt = Spy()

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Lib())
    assert memory._set_glibc_thresholds()
    assert seen == [(memory.M_MMAP_THRESHOLD, memory.MMAP_THRESHOLD), (memory.M_TRIM_THRESHOLD, memory.TRIM_THRESHOLD)]
