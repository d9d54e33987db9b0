"""Every cct setting, resolved in one place: the command line's flags, the Python API's ``set_*`` functions and
the ``CCT_*`` environment variables, with one parse/validate path and one-line errors.

A setting's value is, in this order: what was set explicitly (a flag, or the API: the later wins), else its
environment variable, else its default.  The environment is read when the setting is used (so a test or a
program may change it), parsed once per distinct value; an invalid value is a one-line
:class:`~cct.errors.CctError` naming where it came from — ``CCT_LOWERING: lowering must be 1, 2, 3 or auto
(got '7')`` — raised where the setting is used (the command line validates every setting at start, so a bad
variable fails before any work).  Tests reset the one object (:meth:`Settings.reset`).

====================  ===================  ===============  ==================================================
setting               environment          flag             values
====================  ===================  ===============  ==================================================
conv_engine           CCT_CONV_ENGINE      -conv_engine     lowering | fft | winograd | depthwise | auto (default)
lowering              CCT_LOWERING         -lowering        1 | 2 | 3 | auto (default)
partitions            CCT_PARTITIONS       -partitions      N | auto (default; None)
autotune              CCT_AUTOTUNE         -autotune        fast (default) | full | off (or auto | 1 | 0)
devices               CCT_DEVICES          -devices         cpu, cpu:T, gpu:N list (default: none)
split                 CCT_SPLIT            -split           auto (default) | fractions f1,f2,...
executor              CCT_EXECUTOR         -executor        layer (default) | taskgraph
workers               CCT_WORKERS          -workers         N | auto (default: the cores), task-graph workers
share_diffs           CCT_SHARE_DIFFS      -share_diffs     1 (default) | 0: train/time share the memory of
                                                            gradients never alive at once (cct.exec.diff_memory)
lowering_max_mb       CCT_LOWERING_MAX_MB                   MiB of lowered matrices, Winograd tiles per call (32;
                                                            on the CPU <= 6 per batch partition at a time)
fft_memoize           CCT_FFT_MEMOIZE                       1 (default) | 0: keep spectra between passes
fft_memo_mb           CCT_FFT_MEMO_MB                       MiB of kept spectra per layer (1024)
fft_workers           CCT_FFT_WORKERS                       FFT threads (default: the thread's BLAS budget)
retain_memory         CCT_RETAIN_MEMORY                     1 (default) | 0: the FFT engine has glibc keep freed
                                                            large blocks for reuse (cct.runtime.memory)
native                CCT_NATIVE                            1 (default) | 0: the compiled kernels (cct.native) where
                                                            built, else the numpy bodies everywhere
cache_dir             CCT_CACHE_DIR                         default $XDG_CACHE_HOME/cct or ~/.cache/cct
traceback             CCT_TRACEBACK                         0 (default) | 1: tracebacks from the command line
====================  ===================  ===============  ==================================================
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cct.errors import CctError

_AUTO = ("", "auto")


# ---- parsers: (raw value, where it came from) -> value; a CctError naming the source otherwise ---------------

def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


def choice(*choices: str) -> Callable[[Any, str, str], str]:
    """One of ``choices`` (case-insensitive; empty or None: the last, the default)."""
    def parse(value: Any, name: str, source: str) -> str:
        v = _text(value).lower() or choices[-1]
        if v in choices:
            return v
        raise CctError(f"{source}: {name} must be {', '.join(choices[:-1])} or {choices[-1]} (got {value!r})")
    return parse


def lowering_choice(value: Any, name: str, source: str) -> int | str:
    v = _text(value).lower()
    if v in _AUTO:
        return "auto"
    if v in ("1", "2", "3"):
        return int(v)
    raise CctError(f"{source}: {name} must be 1, 2, 3 or auto (got {value!r})")


def count_or_auto(value: Any, name: str, source: str) -> int | None:
    """A positive integer, or None for ``auto``."""
    v = _text(value).lower()
    if v in _AUTO:
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise CctError(f"{source}: {name} must be a positive integer or 'auto' (got {value!r})")
    return n


def tristate(value: Any, name: str, source: str) -> bool | str:
    """True (always), False (never) or "auto"."""
    if isinstance(value, bool):
        return value
    v = _text(value).lower()
    if v in _AUTO:
        return "auto"
    if v in ("1", "true", "yes", "on", "always"):
        return True
    if v in ("0", "false", "no", "off", "never"):
        return False
    raise CctError(f"{source}: {name} must be auto, 1 or 0 (got {value!r})")


def autotune_mode(value: Any, name: str, source: str) -> bool | str:
    """fast (= auto: "auto"), full (= 1: True), off (= 0: False)."""
    v = _text(value).lower() if not isinstance(value, bool) else value
    aliases = {"fast": "auto", "full": True, "off": False}
    if v in aliases:
        return aliases[v]
    try:
        return tristate(value, name, source)
    except CctError:
        raise CctError(f"{source}: {name} must be fast, full or off (got {value!r})") from None


def boolean(value: Any, name: str, source: str) -> bool:
    if isinstance(value, bool):
        return value
    v = _text(value).lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise CctError(f"{source}: {name} must be 1 or 0 (got {value!r})")


def number(minimum: float, integer: bool = False) -> Callable[[Any, str, str], float | None]:
    """A number ``>= minimum`` (None when empty: the caller's default)."""
    def parse(value: Any, name: str, source: str) -> float | None:
        v = _text(value)
        if not v:
            return None
        try:
            x = float(v)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < minimum or (integer and x != int(x)):
            kind = "an integer" if integer else "a number"
            raise CctError(f"{source}: {name} must be {kind} >= {minimum:g} (got {value!r})")
        return int(x) if integer else x
    return parse


def raw_text(value: Any, name: str, source: str) -> Any:
    """Kept as given, checked where it is used (the devices and their split, together:
    :func:`cct.exec.device_split.device_setting`)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return value.strip() if isinstance(value, str) else tuple(value)


def path_or_none(value: Any, name: str, source: str) -> str | None:
    v = _text(value)
    return os.path.expanduser(v) if v else None


# ---- the settings ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One setting: its name, environment variable, command-line flag, parser and what it does."""

    name: str
    env: str | None
    flag: str | None
    parse: Callable[[Any, str, str], Any]
    help: str

    @property
    def api(self) -> str:
        return f"set_{self.name}"


SETTINGS = (
    Setting("conv_engine", "CCT_CONV_ENGINE", "conv_engine",
            choice("lowering", "fft", "winograd", "depthwise", "auto"),
            "convolution engine: lowering, fft, winograd (3x3 stride-1 layers; lowering elsewhere), depthwise "
            "(one input channel per group; lowering elsewhere), or auto (measured per layer where fft or winograd "
            "may gain, depthwise where its model beats the lowering's)"),
    Setting("lowering", "CCT_LOWERING", "lowering", lowering_choice,
            "the lowering convolutions use: 1, 2, 3, or auto (per layer, by the calibrated cost model)"),
    Setting("partitions", "CCT_PARTITIONS", "partitions", count_or_auto,
            "batch partitions per layer: N, or auto (by the work per item)"),
    Setting("autotune", "CCT_AUTOTUNE", "autotune", autotune_mode,
            "whether engine choices measure candidates: fast (close calls, a few seconds per net), full (every "
            "layer), off (the cost models alone)"),
    Setting("devices", "CCT_DEVICES", "devices", raw_text,
            "split each batch across these devices, e.g. cpu:1,cpu:1 or cpu,gpu:0"),
    Setting("split", "CCT_SPLIT", "split", raw_text,
            "with devices, each device's share of a batch: auto (by peak FLOPS) or fractions summing to 1"),
    Setting("executor", "CCT_EXECUTOR", "executor", choice("taskgraph", "layer"),
            "how passes run: layer (Caffe's loop, default) or taskgraph (ZNN's task graph, a worker pool)"),
    Setting("workers", "CCT_WORKERS", "workers", count_or_auto,
            "task-graph worker threads: N, or auto (the cores)"),
    Setting("share_diffs", "CCT_SHARE_DIFFS", "share_diffs", lambda v, n, s: boolean("1" if v is None else v, n, s),
            "cct train and cct time: blobs whose gradients are never alive at once share their memory (default 1; "
            "cct.exec.diff_memory); the Python API keeps every blob's gradient as Caffe does"),
    Setting("lowering_max_mb", "CCT_LOWERING_MAX_MB", None, number(1e-6),
            "MiB of lowered matrices (and Winograd tiles) a convolution holds per call (default 32; on the CPU a "
            "batch partition lowers at most 6 at a time)"),
    Setting("fft_memoize", "CCT_FFT_MEMOIZE", None, lambda v, n, s: boolean("1" if v is None else v, n, s),
            "keep FFT spectra between a layer's passes (default 1)"),
    Setting("fft_memo_mb", "CCT_FFT_MEMO_MB", None, number(0.0),
            "MiB of kept spectra per layer above which a layer does not memoize (default 1024)"),
    Setting("fft_workers", "CCT_FFT_WORKERS", None, number(1, integer=True),
            "scipy.fft threads (default: the calling thread's BLAS thread budget)"),
    Setting("retain_memory", "CCT_RETAIN_MEMORY", None, lambda v, n, s: boolean("1" if v is None else v, n, s),
            "let the FFT engine tell glibc's allocator to keep large freed blocks for reuse (default 1; "
            "cct.runtime.memory)"),
    Setting("native", "CCT_NATIVE", None, lambda v, n, s: boolean("1" if v is None else v, n, s),
            "run the compiled kernels of cct.native where they are built (default 1); 0: the numpy bodies"),
    Setting("cache_dir", "CCT_CACHE_DIR", None, path_or_none,
            "where measurements are cached (default $XDG_CACHE_HOME/cct or ~/.cache/cct)"),
    Setting("traceback", "CCT_TRACEBACK", None, boolean,
            "print tracebacks of internal errors from the command line"),
)


def _environ_bytes(name: bytes) -> bytes | None:
    """The environment variable ``name``'s value as bytes: on POSIX a lookup in ``os.environ``'s own dictionary,
    where ``os.environ.get`` encodes the name and decodes the value (a setting read 1.5 -> 0.5 us; settings are
    read some forty times a LeNet training iteration); elsewhere through the mapping."""
    data = getattr(os.environ, "_data", None)
    if type(data) is dict and os.supports_bytes_environ:
        return data.get(name)
    value = os.environ.get(os.fsdecode(name))
    return None if value is None else os.fsencode(value)


class Settings:
    """The resolved settings (see the module docstring).  Thread-safe; reads are a dictionary lookup and,
    for a setting from the environment, one lookup of the variable (:func:`_environ_bytes`)."""

    def __init__(self, specs: tuple[Setting, ...] = SETTINGS):
        self.specs = {s.name: s for s in specs}
        self._explicit: dict[str, tuple[Any, str]] = {}
        self._env_cache: dict[str, tuple[bytes | None, Any]] = {}  # the variable's raw value -> the parsed value
        self._env_names: dict[str, bytes] = {}  # setting -> its variable's name as bytes (b"": none)
        self._lock = threading.Lock()

    def spec(self, name: str) -> Setting:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"no setting named {name!r} (known: {', '.join(self.specs)})") from None

    def get(self, name: str) -> Any:
        """The value in effect (explicit, else the environment's, else the default)."""
        explicit = self._explicit.get(name)
        if explicit is not None:
            return explicit[0]
        variable = self._env_names.get(name)
        if variable is None:
            env = self.spec(name).env
            variable = self._env_names[name] = os.fsencode(env) if env else b""
        raw = _environ_bytes(variable) if variable else None
        cached = self._env_cache.get(name)
        if cached is not None and cached[0] == raw:
            return cached[1]
        spec = self.spec(name)
        text = None if raw is None else os.fsdecode(raw)
        value = spec.parse(text, spec.name, spec.env if text is not None else "default")
        self._env_cache[name] = (raw, value)
        return value

    def source(self, name: str) -> str:
        """Where the value in effect comes from: ``-flag``, ``set_x``, the variable's name, or ``default``."""
        explicit = self._explicit.get(name)
        if explicit is not None:
            return explicit[1]
        spec = self.spec(name)
        return spec.env if spec.env and os.environ.get(spec.env) is not None else "default"

    def set(self, name: str, value: Any, source: str | None = None) -> None:
        """Set ``name`` explicitly (``None``: back to the environment / default).  ``source`` names the caller
        in messages (``-lowering``, ``set_lowering``)."""
        spec = self.spec(name)
        if value is None:
            self.unset(name)
            return
        source = source or spec.api
        parsed = spec.parse(value, spec.name, source)
        with self._lock:
            self._explicit[name] = (parsed, source)

    def unset(self, name: str) -> None:
        with self._lock:
            self._explicit.pop(name, None)

    def apply_flags(self, flags: Any, skip: Any = ()) -> None:
        """The command line's flags for every setting that has one (empty: leave the setting as it is);
        ``skip``: flag names that mean something else to the command (its own flags of the same name)."""
        for spec in self.specs.values():
            if spec.flag is not None and spec.flag not in skip:
                value = flags.get(spec.flag)
                if value not in (None, ""):
                    self.set(spec.name, value, f"-{spec.flag}")

    def validate(self) -> None:
        """Resolve every setting now: the first invalid one raises its one-line error."""
        for name in self.specs:
            self.get(name)

    def reset(self) -> None:
        """Forget every explicit value (tests)."""
        with self._lock:
            self._explicit.clear()
            self._env_cache.clear()

    @contextlib.contextmanager
    def override(self, **values: Any) -> Iterator[None]:
        """Set values for the duration of the block (then restore what was explicit before)."""
        with self._lock:
            saved = {k: self._explicit.get(k) for k in values}
        try:
            for k, v in values.items():
                self.set(k, v, "override")
            yield
        finally:
            with self._lock:
                for k, old in saved.items():
                    if old is None:
                        self._explicit.pop(k, None)
                    else:
                        self._explicit[k] = old


settings = Settings()
