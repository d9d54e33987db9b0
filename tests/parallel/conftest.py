"""Split tests leave no device split behind (``set_devices`` and ``CCT_DEVICES`` are process wide)."""
from __future__ import annotations

import pytest

from cct.parallel import devices


@pytest.fixture(autouse=True)
def _no_device_split_left_behind(monkeypatch):
    monkeypatch.delenv("CCT_DEVICES", raising=False)
    monkeypatch.delenv("CCT_SPLIT", raising=False)
    devices.set_devices(None)
    yield
    devices.set_devices(None)
