"""Every test runs with its own cache dir and with the settings as the environment gives them: whatever a test
(or the command line it runs) sets explicitly is forgotten afterwards (:meth:`cct.config.Settings.reset`), and
no device split is inherited from the environment."""
from __future__ import annotations

import pytest

from cct.config import settings


@pytest.fixture(autouse=True)
def _isolated_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CCT_DEVICES", raising=False)
    monkeypatch.delenv("CCT_SPLIT", raising=False)
    settings.reset()
    yield
    settings.reset()
