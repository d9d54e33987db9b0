"""Small JSON caches of machine measurements (calibrated rates, autotune picks, device peak FLOPS).

They live in ``$CCT_CACHE_DIR``, else ``$XDG_CACHE_HOME/cct``, else ``~/.cache/cct``; writes are atomic and a
cache that cannot be read or written is treated as empty (with a warning), never as an error.  An update is a
read, a merge and a write under a lock file beside the cache, so processes measuring at the same time (the ranks
of a data-parallel run on one host) keep each other's entries.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_lock = threading.Lock()


def cache_dir() -> Path:
    """The ``cache_dir`` setting (``CCT_CACHE_DIR``), else ``$XDG_CACHE_HOME/cct``, else ``~/.cache/cct``."""
    from cct.config import settings

    base = settings.get("cache_dir")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "cct")
    return Path(base)


def read_json(name: str) -> dict[str, Any]:
    """The cache file ``name`` as a dict (empty if missing or unreadable)."""
    try:
        data = json.loads((cache_dir() / name).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Other processes' updates of ``path`` kept out (an advisory lock on ``path`` + ``.lock``; none where the
    platform or the folder offers none — then an update may lose a concurrent one's entries, which are measured
    again later)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # a file system without locks
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def update_json(name: str, update: dict[str, dict[str, Any]]) -> None:
    """Merge ``{section: {key: value}}`` into the cache file ``name`` (read-modify-write under :func:`_locked`,
    atomic)."""
    path = cache_dir() / name
    with _lock, _locked(path):
        data = read_json(name)
        for section, entries in update.items():
            data.setdefault(section, {}).update(entries)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:
            from cct import log

            log.warning("cannot write the cache %s: %s", path, e)
