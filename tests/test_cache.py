"""The measurement caches: merged updates, kept by processes writing at the same time."""
from __future__ import annotations

import multiprocessing as mp

from cct import cache
from cct.config import settings

UPDATES = 60


def _write_entries(folder: str, writer: int) -> None:
    settings.set("cache_dir", folder, "test")
    for k in range(UPDATES):
        cache.update_json("shared.json", {"entries": {f"{writer}-{k}": k}})


def test_updates_merge_sections_and_entries(tmp_path):
    settings.set("cache_dir", str(tmp_path), "test")
    cache.update_json("c.json", {"a": {"x": 1}})
    cache.update_json("c.json", {"a": {"y": 2}, "b": {"z": 3}})
    assert cache.read_json("c.json") == {"a": {"x": 1, "y": 2}, "b": {"z": 3}}
    assert cache.read_json("missing.json") == {}


def test_processes_updating_at_once_keep_each_others_entries(tmp_path):
    ctx = mp.get_context("fork")
    writers = [ctx.Process(target=_write_entries, args=(str(tmp_path), w)) for w in range(3)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0
    settings.set("cache_dir", str(tmp_path), "test")
    entries = cache.read_json("shared.json")["entries"]
    assert len(entries) == 3 * UPDATES
