"""Locating and comparing against the outputs of real Caffe (``../shared/caffe-reference``)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE = Path(os.environ.get("CCT_CAFFE_REFERENCE", REPO.parent / "shared" / "caffe-reference"))

RTOL = 1e-4
ATOL = 1e-5


def reference_dir(*parts: str) -> Path:
    """A folder of the reference outputs; skips the test when they are not beside the checkout."""
    path = REFERENCE.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"Caffe reference outputs not found at {path} (set CCT_CAFFE_REFERENCE)")
    return path


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Elementwise ``|ours - ref| <= atol + rtol * |ref|``; the message names the worst element."""
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != Caffe's {ref.shape}"
    err = np.abs(ours - ref) - (atol + rtol * np.abs(ref))
    if ours.size and (err.max() > 0 or not np.all(np.isfinite(ours) == np.isfinite(ref))):
        k = np.unravel_index(int(np.nanargmax(err)), ref.shape)
        bad = int((err > 0).sum())
        raise AssertionError(f"{what}: {bad}/{ref.size} elements differ; worst at {k}: ours {ours[k]:.8g} "
                             f"Caffe {ref[k]:.8g}")
