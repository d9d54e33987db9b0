"""Freed memory kept for reuse: glibc's thresholds set once per process, unless the setting is off, by the
FFT engine's first configuration; one arena for all threads unless the environment says otherwise; a net's
autotune hands what its candidates freed back to the kernel, and measures Winograd in buffers of its own."""
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


class _FakeGlibc:
    """A C library that records its mallopt and malloc_trim calls (answering as glibc does on success)."""

    gnu_get_libc_version = object()

    def __init__(self):
        self.calls = []
        lib = self

        class Fn:
            def __init__(self, name, answer):
                self.name, self.answer, self.argtypes, self.restype = name, answer, None, None

            def __call__(self, *args):
                lib.calls.append((self.name,) + args)
                return self.answer
        self.mallopt, self.malloc_trim = Fn("mallopt", 1), Fn("malloc_trim", 1)


def test_one_arena_unless_the_environment_sets_one(monkeypatch):
    lib = _FakeGlibc()
    monkeypatch.setattr(memory, "_glibc", lambda: lib)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert memory.one_malloc_arena()
    assert lib.calls == [("mallopt", memory.M_ARENA_MAX, 1)]
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # glibc read it at start: left as it is
    assert not memory.one_malloc_arena()
    assert len(lib.calls) == 1
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setattr(memory, "_glibc", lambda: None)  # another C library: nothing changed
    assert not memory.one_malloc_arena() and not memory.release_freed_memory()


def test_glibc_trims_through_the_real_call():
    """On glibc the real malloc_trim runs with its declared argument types (the arena count set at import is
    checked in a subprocess below)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert memory._glibc() is not None and memory.release_freed_memory()


@pytest.mark.parametrize("measured", [0, 1])
def test_a_net_build_that_measured_hands_freed_memory_back(monkeypatch, measured):
    from cct.engines import autotune

    trims = []
    monkeypatch.setattr(autotune, "release_freed_memory", lambda: trims.append(1) or True)
    with autotune.measuring_session() as ledger:
        with autotune.measuring_session() as inner:  # a nested net's session is the outer one's
            assert inner is ledger
            ledger.measured = measured
        assert trims == []
    assert trims == [1] * measured


def test_the_autotunes_winograd_candidates_keep_their_buffers_to_themselves():
    """A candidate measured with a workspace of its own (as the autotune measures them) leaves the net's shared
    workspace as it was — its weight gradient's lowering engine included; the engine in a net shares it."""
    from cct.engines.lowering import Workspace, shared_workspace
    from cct.engines.winograd import WinogradEngine

    g = ConvGeometry(4, 6, 8, 1, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6, 9, 9)).astype(np.float32)
    w = rng.standard_normal((8, 6, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((4, 8, 9, 9)).astype(np.float32)
    shared = shared_workspace(np.float32)
    before = shared.nbytes()
    private = Workspace()
    for method in ("winograd", "lowering"):
        eng = WinogradEngine(2, workspace=private)
        eng.configure(g, np.float32)
        eng._wgrad_method = method
        eng.forward(x, w, None, np.empty_like(dy))
        eng.backward(x, dy, w, np.empty_like(x), np.zeros_like(w))
    assert shared.nbytes() == before and private.nbytes() > 0
    assert eng._workspace is private and eng._weights().workspace is private
    net_engine = WinogradEngine(2)
    net_engine.configure(g, np.float32)
    assert net_engine._workspace is shared and net_engine._weights().workspace is shared


ARENAS_AFTER_THREADS = r"""
import ctypes, sys, tempfile, threading
{prelude}
import numpy as np

def work():
    for _ in range(3):
        a = np.ones(1 << 18)
        del a
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(open(f.name).read().count("<heap nr="))
"""


@pytest.mark.parametrize("first", ["import cct", ""])
def test_threads_allocate_from_one_arena_once_cct_is_imported(first):
    """glibc's malloc_info lists one heap where cct was imported before the threads allocated, one per thread
    (here: more than one) where it was not."""
    import os
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", ARENAS_AFTER_THREADS.format(prelude=first)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert (int(out) == 1) == bool(first), out
