"""Small JSON caches of machine measurements (calibrated rates, autotune picks, device peak FLOPS).

They live in ``$CCT_CACHE_DIR``, else ``$XDG_CACHE_HOME/cct``, else ``~/.cache/cct``; writes are atomic and a
cache that cannot be read or written is treated as empty (with a warning), never as an error.
"""
from __future__ import annotations

import json
import os
import threading
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


def update_json(name: str, update: dict[str, dict[str, Any]]) -> None:
    """Merge ``{section: {key: value}}`` into the cache file ``name`` (read-modify-write, atomic)."""
    with _lock:
        data = read_json(name)
        for section, entries in update.items():
            data.setdefault(section, {}).update(entries)
        path = cache_dir() / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:
            from cct import log

            log.warning("cannot write the cache %s: %s", path, e)
