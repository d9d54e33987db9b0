"""Every test runs with its own cache dir and with the settings as the environment gives them: whatever a test
(or the command line it runs) sets explicitly is forgotten afterwards (:meth:`cct.config.Settings.reset`), and
no device split is inherited from the environment, nor a log level (tests read Caffe's INFO lines, also from
the commands they run)."""
from __future__ import annotations

import os

import pytest

from cct import log
from cct.config import settings


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): a worker per core, at most 4 — each test's own BLAS and partition
    threads use the cores too, and every worker holds its own nets in memory."""
    from cct.runtime.threads import cpu_cores

    return min(cpu_cores(), 4)


@pytest.fixture(autouse=True)
def _isolated_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CCT_DEVICES", raising=False)
    monkeypatch.delenv("CCT_SPLIT", raising=False)
    if "GLOG_minloglevel" in os.environ:
        monkeypatch.delenv("GLOG_minloglevel")
        log.init_log()
    settings.reset()
    yield
    settings.reset()
