"""The project's one rule for "these two arrays agree": used by the tests against real Caffe's outputs, by
the numerical gradient checks and by ``cct compare``.

**The rule.**  For a blob ``ours`` compared with a reference ``ref`` (Caffe's values, or the numerical
gradient), every element must satisfy ::

    |ours_i - ref_i|  <=  atol + rtol · max(|ref_i|, S),      S = sqrt(mean(ref²))   (the blob's scale)

with ``rtol = 1e-4`` and ``atol = 1e-5`` by default; a non-finite value must be non-finite in both.  In
words: 1e-4 relative, where "relative" is measured against the larger of the element itself and the scale
of the blob it belongs to.

**Why the blob's scale.**  Nearly every element of a ConvNet blob is a sum: a convolution or inner-product
output sums K products, a normalisation subtracts a mean, an Eltwise adds blobs, a gradient sums over the
outputs an input fed.  Float32 evaluates a sum of terms ``t_k`` with an error of a few ``u·Σ|t_k|``
(``u = 2^-24``; the order of the additions, which differs between BLAS kernels, thread counts and between
Caffe and us, decides the exact digits), so an element's error scales with *what was summed*, not with the
element: an element that cancels to -14 from terms near 6.5e4 (Caffe's batchnorm_block, TEST phase) is only
known to about ``u·6.5e4·√K`` ≈ 0.03 in float32, and an elementwise 1e-4 test of it passes or fails
depending on the machine.  The elements of one blob are sums of the same number of terms drawn from the
same inputs and weights, so their summed magnitudes share one scale: for K terms of random sign and size
``t``, ``S ≈ √K·t`` and ``Σ|t_k| ≈ K·t``.  Adding them one by one in float32 rounds every partial sum
(size ``√j·t`` after j terms), so the error of an element is about ``u·t·√(Σ_j j) ≈ u·K·t/√2 ≈ 0.7·u·√K·S``:
about ``4e-6·S`` for K = 10⁴ (CaffeNet's largest fan-in is 9216), 25 times inside ``1e-4·S``; BLAS kernels
sum in blocks and do better.  Errors carried in from upstream blobs are scaled by the same weights as the
values, so they stay inside the same allowance downstream (a normalisation divides value and error alike).

**What it still catches.**  A bug changes elements by amounts of the order of the blob's own values: a
wrong pad or an off-by-one pooling window changes border or window elements by a term of the sum, a flipped
kernel or a wrong bias moves whole channels; each is many times ``1e-4·S`` (tests in
``tests/compare/test_tolerance.py`` inject each one into a reference net and see it fail).  What the rule
gives up is elementwise relative accuracy for elements far below their blob's RMS, which float32 does not
have either.

``atol`` keeps all-zero blobs (labels, diffs Caffe did not back-propagate) from demanding exact zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RTOL = 1e-4
ATOL = 1e-5


def blob_scale(ref: np.ndarray) -> float:
    """The blob's scale ``S``: the root mean square of its finite elements (0 for an empty blob)."""
    r = np.asarray(ref, dtype=np.float64)
    finite = r[np.isfinite(r)]
    return float(np.sqrt(np.mean(finite * finite))) if finite.size else 0.0


def _reach(r: np.ndarray) -> np.ndarray:
    """``max(|ref_i|, S)`` per element: what the error of element i is measured against."""
    return np.maximum(np.abs(np.where(np.isfinite(r), r, 0.0)), blob_scale(r))


def allowance(ref, rtol: float = RTOL, atol: float = ATOL) -> np.ndarray:
    """Per element of ``ref``, the largest ``|ours - ref|`` the rule accepts: ``atol + rtol·max(|ref|, S)``."""
    return atol + rtol * _reach(np.asarray(ref, dtype=np.float64))


@dataclass(frozen=True)
class Comparison:
    """How ``ours`` compares with ``ref`` under the rule (see the module docstring).

    ``max_abs``: the largest ``|ours - ref|``; ``max_rel``: the largest ``|ours - ref| / max(|ref|, S)``
    (the error relative to the blob's scale); ``bad``: elements outside the allowance; ``worst``: the
    index of the element furthest outside it (relative to its allowance), or None for an empty blob."""

    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    scale: float
    bad: int
    worst: tuple[int, ...] | None
    ours_worst: float
    ref_worst: float
    rtol: float
    atol: float
    shape_mismatch: tuple[int, ...] | None = None

    @property
    def ok(self) -> bool:
        return self.shape_mismatch is None and self.bad == 0

    def describe(self, what: str, reference: str = "Caffe") -> str:
        """One line: what differs and where (for assertion messages and ``cct compare``)."""
        if self.shape_mismatch is not None:
            return f"{what}: shape {self.shape_mismatch} != {reference}'s {self.shape}"
        if self.ok:
            return f"{what}: max abs error {self.max_abs:.3g}, {self.max_rel:.3g} of scale {self.scale:.4g}"
        return (f"{what}: {self.bad}/{int(np.prod(self.shape))} elements differ; worst at {self.worst}: ours "
                f"{self.ours_worst:.8g} {reference} {self.ref_worst:.8g} (allowed {self.atol:g} + {self.rtol:g} x "
                f"max(|{reference}|, blob scale {self.scale:.4g}))")


def compare_arrays(ours, ref, rtol: float = RTOL, atol: float = ATOL) -> Comparison:
    """Compare ``ours`` with the reference ``ref`` under the project's rule (evaluated in float64)."""
    o = np.asarray(ours, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    shape = tuple(r.shape)
    if o.shape != r.shape:
        return Comparison(shape, np.inf, np.inf, 0.0, int(r.size), None, np.nan, np.nan, rtol, atol,
                          shape_mismatch=tuple(o.shape))
    if r.size == 0:
        return Comparison(shape, 0.0, 0.0, 0.0, 0, None, np.nan, np.nan, rtol, atol)
    scale = blob_scale(r)
    both_finite = np.isfinite(o) & np.isfinite(r)
    same_nonfinite = ~np.isfinite(o) & ~np.isfinite(r) & ((o == r) | (np.isnan(o) & np.isnan(r)))
    with np.errstate(invalid="ignore"):
        err = np.where(both_finite, np.abs(o - r), np.where(same_nonfinite, 0.0, np.inf))
    reach = _reach(r)
    excess = err / (atol + rtol * reach)
    bad = int((excess > 1.0).sum())
    k = np.unravel_index(int(np.argmax(excess)), shape) if shape else ()
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(reach > 0, err / np.where(reach > 0, reach, 1.0), np.where(err > 0, np.inf, 0.0))
    return Comparison(shape, float(err.max()), float(rel.max()), scale, bad, tuple(int(i) for i in k),
                      float(o[k]), float(r[k]), rtol, atol)


def assert_close(ours, ref, what: str, rtol: float = RTOL, atol: float = ATOL, reference: str = "Caffe") -> None:
    """Raise AssertionError (one line naming the worst element) unless ``ours`` agrees with ``ref``."""
    c = compare_arrays(ours, ref, rtol, atol)
    if not c.ok:
        raise AssertionError(c.describe(what, reference))
