"""Every test runs with its own engine cache dir, restores the process-wide engine settings (the command
line and some tests change them) and leaves no device split behind (``set_devices`` and ``CCT_DEVICES`` are
process wide)."""
from __future__ import annotations

import pytest

from cct.engines import select
from cct.exec import device_split as devices
from cct.runtime import partition


@pytest.fixture(autouse=True)
def _isolated_engine_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CCT_DEVICES", raising=False)
    monkeypatch.delenv("CCT_SPLIT", raising=False)
    devices.set_devices(None)
    saved = (select.lowering_setting(), select.autotune_setting(), partition.partitions_setting(),
             select.conv_engine_setting())
    yield
    (lowering, lsrc), autotune, (parts, psrc), (engine, esrc) = saved
    select.set_lowering(lowering, lsrc)
    select.set_autotune(autotune)
    partition.set_partitions(parts, psrc)
    select.set_conv_engine(engine, esrc)
    devices.set_devices(None)
