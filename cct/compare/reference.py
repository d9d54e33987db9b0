"""Layer-by-layer comparison of a cct net with a reference file written by real Caffe (``cct compare``).

**The reference file** (REF) is an ``.npz`` or an HDF5 file (``.h5``/``.hdf5``) holding arrays under these
names, the layout of ``caffe-reference/nets/*/{train,test}.npz`` and of what ``tools/caffe_dump.py`` writes
under pycaffe:

``input/<blob>``             what was fed to each input blob before the forward;
``data/<blob>``              every blob after the forward (pycaffe's ``net.blobs[<blob>].data``);
``diff/<blob>``              every blob's diff after the backward (TRAIN only);
``param/<layer>/<i>``        learnable blob ``i`` of a layer after the forward;
``param_diff/<layer>/<i>``   its gradient after the backward (TRAIN only).

Blob names may contain ``/`` (GoogLeNet's ``inception_3a/1x1``): the kind is what precedes the first
``/``, a parameter's index what follows the last one.  In HDF5 the names are nested groups.

**The run** (:func:`compare_with_reference`): build the net in its phase with the weights, feed each
``input/`` array into its blob (reshaping the blob when the recorded shape differs, as a pycaffe user
would), run the forward and, in TRAIN, clear the parameter gradients and run the backward.  Then every
array is compared under the project's one rule (:func:`cct.compare.tolerance.compare_arrays`), in net
order: data in blob order, then diffs in blob order, then parameters and their gradients in layer order.
An array the net has but the file lacks is ``missing``; one the file has but the net lacks is ``extra``
(listed after the rest, in file order).  Neither stops the comparison; both count as disagreement.

**The phase**, when not given: TRAIN if the file holds any ``diff/`` or ``param_diff/`` array, else TEST.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cct.compare.tolerance import ATOL, RTOL, Comparison, compare_arrays
from cct.errors import CctError

KINDS = ("input", "data", "diff", "param", "param_diff")
OK, FAIL, MISSING, EXTRA = "ok", "FAIL", "missing", "extra"


def read_reference(path: str) -> dict[str, np.ndarray]:
    """Every array of a reference file by its name (``data/conv1``, ``param/conv1/0`` ...), in file order."""
    if not os.path.isfile(path):
        raise CctError(f"-reference {path}: no such file")
    lower = path.lower()
    if lower.endswith((".h5", ".hdf5")):
        return _read_hdf5(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: np.asarray(z[name]) for name in z.files}
    except (OSError, ValueError) as e:
        raise CctError(f"-reference {path}: not an .npz or HDF5 reference file ({e})") from None
    _check_names(path, arrays)
    return arrays


def _read_hdf5(path: str) -> dict[str, np.ndarray]:
    try:
        import h5py
    except ImportError:
        raise CctError(f"-reference {path}: reading HDF5 needs h5py (pip install 'cct[hdf5]')") from None
    arrays: dict[str, np.ndarray] = {}
    try:
        with h5py.File(path, "r") as f:
            def visit(name: str, obj) -> None:
                if isinstance(obj, h5py.Dataset):
                    arrays[name] = np.asarray(obj[()])

            f.visititems(visit)
    except OSError as e:
        raise CctError(f"-reference {path}: cannot read as HDF5 ({e})") from None
    _check_names(path, arrays)
    return arrays


def _check_names(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    for name in arrays:
        kind, sep, rest = name.partition("/")
        if kind not in KINDS or not sep or not rest:
            raise CctError(f"-reference {path}: array '{name}' is not named input/<blob>, data/<blob>, "
                           "diff/<blob>, param/<layer>/<i> or param_diff/<layer>/<i>")
        if kind.startswith("param"):
            layer, _, index = rest.rpartition("/")
            if not layer or not index.isdigit():
                raise CctError(f"-reference {path}: array '{name}' should be {kind}/<layer>/<index>")


def reference_phase(arrays: Mapping[str, np.ndarray]) -> int:
    """TRAIN when the file holds gradients, else TEST."""
    from cct.pycaffe import TEST, TRAIN

    return TRAIN if any(k.startswith(("diff/", "param_diff/")) for k in arrays) else TEST


@dataclass
class Row:
    """One compared array: ``name`` as in the file (``data/conv1``), its reference shape (or the net's, when
    missing), the comparison (None when missing or extra) and the status."""

    name: str
    shape: tuple[int, ...]
    status: str
    comparison: Comparison | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    def detail(self) -> str:
        if self.status == MISSING:
            return f"{self.name}: in the net but not in the reference file"
        if self.status == EXTRA:
            return f"{self.name}: in the reference file but the net has no such blob or parameter"
        assert self.comparison is not None
        return self.comparison.describe(self.name)


@dataclass
class Report:
    """The rows of one comparison, in net order, and what was compared."""

    model: str
    weights: str
    reference: str
    phase: int
    rtol: float
    atol: float
    rows: list[Row] = field(default_factory=list)
    unfed_inputs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def first_failure(self) -> Row | None:
        return next((r for r in self.rows if not r.ok), None)

    def counts(self) -> dict[str, int]:
        out = {OK: 0, FAIL: 0, MISSING: 0, EXTRA: 0}
        for r in self.rows:
            out[r.status] += 1
        return out


def feed_inputs(net, arrays: Mapping[str, np.ndarray]) -> tuple[list[str], list[str]]:
    """Copy ``input/<blob>`` arrays into the net's blobs (reshaping a blob whose shape differs, then the
    net).  Returns (inputs of the net the file does not feed, ``input/`` names the net has no blob for)."""
    fed: dict[str, np.ndarray] = {}
    extra: list[str] = []
    for name, value in arrays.items():
        if name.startswith("input/"):
            blob = name[len("input/"):]
            if net.has_blob(blob):
                fed[blob] = value
            else:
                extra.append(name)
    reshaped = False
    for blob, value in fed.items():
        target = net.blobs[blob]
        if tuple(target.shape) != tuple(value.shape):
            target.reshape(*value.shape)
            reshaped = True
    if reshaped:
        net.reshape()
    for blob, value in fed.items():
        net.blobs[blob].data[...] = value
    unfed = [b for b in net.inputs if b not in fed]
    return unfed, extra


def run_net(net, arrays: Mapping[str, np.ndarray], phase: int) -> tuple[list[str], list[str]]:
    """Feed the inputs, forward, and in TRAIN backward from cleared parameter gradients (a fresh pycaffe net's
    state).  Returns what :func:`feed_inputs` returns."""
    from cct.pycaffe import TRAIN

    unfed, extra = feed_inputs(net, arrays)
    net.forward_prefilled()
    if phase == TRAIN:
        net.clear_param_diffs()
        net.backward_all()
    return unfed, extra


def net_arrays(net, phase: int) -> list[tuple[str, np.ndarray]]:
    """The net's arrays under their reference names, in comparison order (see the module doc)."""
    from cct.pycaffe import TRAIN

    blobs = list(net.blobs.items())
    params = list(net.params.items())
    out = [(f"data/{name}", b.data) for name, b in blobs]
    if phase == TRAIN:
        out += [(f"diff/{name}", b.diff) for name, b in blobs]
    out += [(f"param/{layer}/{i}", b.data) for layer, bs in params for i, b in enumerate(bs)]
    if phase == TRAIN:
        out += [(f"param_diff/{layer}/{i}", b.diff) for layer, bs in params for i, b in enumerate(bs)]
    return out


def compare_rows(ours: Sequence[tuple[str, np.ndarray]], arrays: Mapping[str, np.ndarray],
                 rtol: float = RTOL, atol: float = ATOL, extra_names: Sequence[str] = ()) -> list[Row]:
    """One row per array of ``ours`` (in its order), then one ``extra`` row per file array that ``ours``
    lacks (inputs excepted: they were fed, not computed) and per name in ``extra_names``."""
    rows: list[Row] = []
    seen = set()
    for name, value in ours:
        seen.add(name)
        ref = arrays.get(name)
        if ref is None:
            rows.append(Row(name, tuple(np.shape(value)), MISSING))
            continue
        c = compare_arrays(value, ref, rtol, atol)
        rows.append(Row(name, tuple(ref.shape), OK if c.ok else FAIL, c))
    for name in list(extra_names) + [n for n in arrays if n not in seen and not n.startswith("input/")]:
        rows.append(Row(name, tuple(arrays[name].shape), EXTRA))
    return rows


def compare_with_reference(model: str, weights: Sequence[str], reference: str, phase: int | None = None,
                           rtol: float = RTOL, atol: float = ATOL, level: int = 0,
                           stages: Sequence[str] | None = None) -> Report:
    """Build ``model`` with ``weights``, run it on the reference's inputs and compare every array."""
    from cct.pycaffe import Net

    arrays = read_reference(reference)
    if phase is None:
        phase = reference_phase(arrays)
    net = Net(model, phase, level=level, stages=stages)
    for w in weights:
        net.copy_from(w)
    unfed, extra_inputs = run_net(net, arrays, phase)
    report = Report(model, ",".join(weights), reference, phase, rtol, atol, unfed_inputs=unfed)
    report.rows = compare_rows(net_arrays(net, phase), arrays, rtol, atol, extra_inputs)
    return report


# ---- rendering ---------------------------------------------------------------------------------------

def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def _num(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def format_text(report: Report) -> str:
    """The table (blob, shape, max abs error, error relative to the blob's scale, status) and a verdict."""
    from cct.pycaffe import TRAIN

    header = ("blob", "shape", "max abs err", "rel to scale", "status")
    body = []
    for r in report.rows:
        c = r.comparison
        if c is None or c.shape_mismatch is not None:
            abs_text = rel_text = "-"
            status = r.status if c is None else f"{FAIL} (shape {_shape_text(c.shape_mismatch)})"
        else:
            abs_text, rel_text, status = _num(c.max_abs), _num(c.max_rel), r.status
        body.append((r.name, _shape_text(r.shape), abs_text, rel_text, status))
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header] + body]
    phase = "TRAIN" if report.phase == TRAIN else "TEST"
    counts = report.counts()
    summary = (f"{len(report.rows)} arrays compared ({phase}, tolerance {report.rtol:g} relative to "
               f"max(|Caffe|, blob scale) + {report.atol:g}): {counts[OK]} ok, {counts[FAIL]} differ, "
               f"{counts[MISSING]} missing, {counts[EXTRA]} extra")
    lines.append(summary)
    if report.unfed_inputs:
        lines.append(f"inputs not in the reference file (left as the net set them): {', '.join(report.unfed_inputs)}")
    first = report.first_failure
    lines.append("PASS" if first is None else f"FAIL: first disagreement: {first.detail()}")
    return "\n".join(lines)


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def to_json(report: Report) -> dict:
    """The report as plain JSON values (non-finite numbers as null)."""
    from cct.pycaffe import TRAIN

    rows = []
    for r in report.rows:
        c = r.comparison
        rows.append({
            "blob": r.name, "shape": list(r.shape), "status": r.status,
            "max_abs": None if c is None else _finite_or_none(c.max_abs),
            "max_rel": None if c is None else _finite_or_none(c.max_rel),
            "scale": None if c is None else c.scale,
            "elements_outside": None if c is None else c.bad,
            "detail": None if r.ok else r.detail(),
        })
    first = report.first_failure
    return {"model": report.model, "weights": report.weights, "reference": report.reference,
            "phase": "TRAIN" if report.phase == TRAIN else "TEST", "rtol": report.rtol, "atol": report.atol,
            "ok": report.ok, "first_failure": None if first is None else first.name,
            "counts": report.counts(), "unfed_inputs": report.unfed_inputs, "rows": rows}
