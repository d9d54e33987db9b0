"""Locating and comparing against the outputs of real Caffe (``../shared/caffe-reference``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cct.compare.tolerance import ATOL, RTOL, assert_close  # noqa: F401 - the project's one rule

REPO = Path(__file__).resolve().parents[1]
REFERENCE = Path(os.environ.get("CCT_CAFFE_REFERENCE", REPO.parent / "shared" / "caffe-reference"))


def reference_dir(*parts: str) -> Path:
    """A folder of the reference outputs; skips the test when they are not beside the checkout."""
    path = REFERENCE.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"Caffe reference outputs not found at {path} (set CCT_CAFFE_REFERENCE)")
    return path
