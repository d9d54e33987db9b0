"""Numerical gradient checking for layers (Caffe's ``GradientChecker``, Chainer's ``check_backward``).

The objective is ``f = Σ_i <r_i, top_i>`` with fixed random projections ``r_i``: the analytic gradient is
what ``backward`` writes with ``top_i.diff = r_i``; the numerical one is the central difference of ``f``
for every element of every checked bottom and parameter blob.  Checks run in float64 by default (as
Caffe's tests run in double); analytic and numerical gradients are compared by the project's one rule
(:mod:`cct.compare.tolerance`: 1e-4 relative to the larger of the element and the scale of its blob).

Kinks (ReLU at 0, max ties, abs at 0): an element whose one-sided differences disagree strongly is a
point of non-differentiability and is skipped; so is any element within ``kink_range`` of ``kink``.
Stochastic layers are made deterministic by reseeding the global stream before every forward.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from google.protobuf import text_format

from cct.blob import Blob, default_dtype
from cct.compare.tolerance import allowance, compare_arrays
from cct.layers.base import Layer
from cct.layers.registry import create_layer
from cct.proto import caffe_pb2 as pb
from cct.rng import set_random_seed


def layer_param(text: str, phase: int = pb.TRAIN) -> pb.LayerParameter:
    """A LayerParameter from prototxt text (``name`` defaults to the type)."""
    p = text_format.Parse(text, pb.LayerParameter())
    if not p.HasField("phase"):
        p.phase = phase
    if not p.name:
        p.name = p.type
    return p


@dataclass
class LayerRun:
    """A layer set up on concrete bottoms: ``layer``, ``bottom`` and ``top`` blobs."""

    layer: Layer
    bottom: list[Blob]
    top: list[Blob]
    inputs: list[np.ndarray] = field(default_factory=list)

    def forward(self) -> list[np.ndarray]:
        for b, x in zip(self.bottom, self.inputs):
            b.data[...] = x
        self.layer.forward_layer(self.bottom, self.top)
        return [t.data.copy() for t in self.top]


def setup_layer(layer: Layer | str, bottoms: Sequence[np.ndarray], num_tops: int | None = None,
                in_place: bool = False, phase: int = pb.TRAIN, dtype=np.float32) -> LayerRun:
    """Create (from prototxt text) and set up a layer on arrays ``bottoms``; ``num_tops`` defaults to the
    layer's minimum top count (or 1).  ``in_place`` makes top 0 the same blob as bottom 0."""
    with default_dtype(dtype):
        if isinstance(layer, str):
            layer = create_layer(layer_param(layer, phase))
        bottom = []
        for x in bottoms:
            b = Blob(np.shape(x))
            b.data[...] = x
            bottom.append(b)
        if num_tops is None:
            num_tops = layer.exact_num_top if layer.exact_num_top is not None else max(layer.min_top or 1, 1)
        top = [Blob() for _ in range(num_tops)]
        if in_place:
            top[0] = bottom[0]
        layer.setup_layer(bottom, top)
    return LayerRun(layer, bottom, top, [np.array(x, dtype=dtype) for x in bottoms])


@dataclass
class GradientReport:
    checked: int = 0
    kinks: int = 0
    failures: list[str] = field(default_factory=list)


def check_gradient(layer: Layer | str, bottoms: Sequence[np.ndarray], *, num_tops: int | None = None,
                   check_bottoms: Sequence[int] | None = None, check_params: bool = True,
                   top_indices: Sequence[int] | None = None, in_place: bool = False,
                   phase: int = pb.TRAIN, step: float = 1e-3, rtol: float = 1e-4, atol: float = 1e-5,
                   kink: float | None = None, kink_range: float = -1.0, seed: int = 1701,
                   dtype=np.float64, max_elements: int = 4000) -> GradientReport:
    """Compare ``backward`` with central differences; raise AssertionError listing mismatches.

    ``check_bottoms``: bottom indices to check (default all); ``top_indices``: tops in the objective
    (default all); ``max_elements`` caps the elements checked per blob (a seeded random subset)."""
    set_random_seed(seed)
    run = setup_layer(layer, bottoms, num_tops, in_place=in_place, phase=phase, dtype=dtype)
    lay, bottom, top = run.layer, run.bottom, run.top
    rng = np.random.default_rng(seed)
    tops = list(range(len(top))) if top_indices is None else list(top_indices)
    checks = list(range(len(bottom))) if check_bottoms is None else list(check_bottoms)

    def forward() -> list[np.ndarray]:
        set_random_seed(seed)
        return run.forward()

    outs = forward()
    proj = [rng.standard_normal(o.shape) if i in tops else np.zeros(o.shape) for i, o in enumerate(outs)]

    def objective() -> float:
        return float(sum((o.astype(np.float64) * r).sum() for o, r in zip(forward(), proj)))

    # analytic
    forward()
    for t, r in zip(top, proj):
        t.diff[...] = r
    for b in lay.blobs:
        b.diff[...] = 0
    prop = [i in checks for i in range(len(bottom))]
    lay.backward_layer(top, prop, bottom)
    analytic = {f"bottom[{i}]": bottom[i].diff.copy() for i in checks}
    if check_params:
        analytic.update({f"param[{j}]": b.diff.copy() for j, b in enumerate(lay.blobs)})

    report = GradientReport()

    def numeric_check(name: str, values: np.ndarray, write) -> None:
        flat = values.reshape(-1)
        idx = np.arange(flat.size)
        if flat.size > max_elements:
            idx = np.sort(rng.choice(flat.size, max_elements, replace=False))
        grad = analytic[name].reshape(-1)
        checked, numerics = [], []
        for k in idx:
            x0 = flat[k]
            if kink is not None and abs(x0 - kink) < kink_range:
                report.kinks += 1
                continue
            f = []
            for delta in (step, -step, 0.0):
                flat[k] = x0 + delta
                write(flat)
                f.append(objective())
            flat[k] = x0
            write(flat)
            d_plus, d_minus = (f[0] - f[2]) / step, (f[2] - f[1]) / step
            scale = max(abs(d_plus), abs(d_minus), 1.0)
            if abs(d_plus - d_minus) > 0.1 * scale and abs(d_plus - d_minus) > 100 * step * scale:
                report.kinks += 1
                continue
            checked.append(k)
            numerics.append((f[0] - f[1]) / (2 * step))
        report.checked += len(checked)
        if not checked:
            return
        ours, numeric = grad[checked].astype(np.float64), np.array(numerics)
        c = compare_arrays(ours, numeric, rtol, atol)
        if not c.ok:
            outside = np.flatnonzero(np.abs(ours - numeric) > allowance(numeric, rtol, atol))
            for j in outside[:20 - len(report.failures)]:
                report.failures.append(f"{name}[{np.unravel_index(checked[j], values.shape)}]: "
                                       f"analytic {ours[j]:.8g} numeric {numeric[j]:.8g} "
                                       f"(blob scale {c.scale:.4g})")

    for i in checks:
        def write_bottom(flat, i=i):
            run.inputs[i][...] = flat.reshape(run.inputs[i].shape)
        numeric_check(f"bottom[{i}]", run.inputs[i].copy(), write_bottom)
    if check_params:
        for j, b in enumerate(lay.blobs):
            def write_param(flat, b=b):
                b.data[...] = flat.reshape(b.shape)
            numeric_check(f"param[{j}]", b.data.copy(), write_param)
    if report.failures:
        raise AssertionError(f"{lay.type} gradient mismatch ({len(report.failures)} shown, "
                             f"{report.checked} checked):\n  " + "\n  ".join(report.failures))
    if report.checked == 0 and (checks or (check_params and lay.blobs)):
        raise AssertionError(f"{lay.type}: no element was checked ({report.kinks} kinks skipped)")
    return report
