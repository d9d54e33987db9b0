"""``cct bench``: how fast a net trains (or runs) on this machine, what that costs, and a side-by-side report.

**Measurement** (:func:`measure`): the same passes as ``cct time`` (Caffe's per-layer loop,
:func:`cct.bench.timing.time_layers`): an initial forward and backward, one more untimed warm-up pass, then
``iterations`` timed passes; the figure is the *median* pass — forward + backward in TRAIN, the forward in
TEST.  From it:

* ``images_per_second = batch / seconds_per_iteration``;
* ``gflop_per_image``: the net's arithmetic per image (:mod:`cct.bench.flops`), forward + backward in TRAIN;
* ``achieved_gflops = gflop_per_image · images_per_second``, ``percent_of_peak = 100 · achieved / peak``
  with ``peak_gflops`` the sum of the devices' measured single-precision GEMM peaks
  (:meth:`cct.device.Device.peak_gflops`);
* ``usd_per_million_images = 1e6 / images_per_second / 3600 · price_per_hour`` (null without a price),
  the CcT paper's price analysis per image rather than per iteration.

**Results** are JSON objects with exactly the keys of :data:`RESULT_KEYS`; :func:`report_table` puts several
side by side (relative to the first) and :func:`plot_report` draws them (matplotlib, the ``plot`` extra).

**Models by name**: ``-model caffenet`` (``alexnet``, ``googlenet``) is ``models/<name>/deploy.prototxt`` of
the source tree (:data:`MODELS`).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cct.errors import CctError

RESULT_KEYS = ("images_per_second", "seconds_per_iteration", "batch", "gflop_per_image", "achieved_gflops",
               "peak_gflops", "percent_of_peak", "usd_per_million_images", "instance", "cpu", "devices",
               "cct_version")

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MODELS = {name: f"{name}/deploy.prototxt" for name in ("caffenet", "alexnet", "googlenet", "inception_v3", "resnet50",
                                                       "vgg16")}


def resolve_model(model: str) -> str:
    """A prototxt path as given, or a benchmark name (:data:`MODELS`, any case) → its deploy file."""
    if os.path.exists(model):
        return model
    name = model.lower()
    if name in MODELS:
        path = MODELS_DIR / MODELS[name]
        if not path.is_file():
            raise CctError(f"-model {model}: the {name} benchmark net {path} is missing (models/ of the cct "
                           "source tree)")
        return str(path)
    raise CctError(f"-model {model}: no such file, and not a benchmark net name ({', '.join(sorted(MODELS))})")


def set_batch(param, batch: int) -> int:
    """Set the batch size of every input of a NetParameter: Input shapes' first dimension and the data
    layers' ``batch_size``.  Returns how many inputs were changed (0: the net has none to change)."""
    changed = 0
    for layer in list(param.layer):
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                if len(shape.dim):
                    shape.dim[0] = batch
                    changed += 1
        elif layer.type == "DummyData":
            for shape in layer.dummy_data_param.shape:
                if len(shape.dim):
                    shape.dim[0] = batch
                    changed += 1
        for field_name in ("data_param", "image_data_param", "memory_data_param", "hdf5_data_param",
                           "window_data_param"):
            if layer.HasField(field_name):
                getattr(layer, field_name).batch_size = batch
                changed += 1
    return changed


def build_net(model: str, phase: int, batch: int = 0, weights: Sequence[str] = (), level: int = 0,
              stages: Sequence[str] | None = None):
    """The net to bench: ``model`` (a path or a name) in ``phase``, with batch size ``batch`` if > 0."""
    from cct.io.prototxt import read_net_param
    from cct.net import net_state
    from cct.pycaffe import Net

    path = resolve_model(model)
    param = read_net_param(path)
    if batch > 0 and not set_batch(param, batch):
        raise CctError(f"-batch {batch}: {path} has no Input or data layer whose batch size could be set")
    param.state.CopyFrom(net_state(phase, level, stages, param.state))
    net = Net.from_param(param, path)
    for w in weights:
        net.copy_from(w)
    return net


def cpu_facts() -> dict:
    """CPU model, cores (all, and usable by this process) and the BLAS libraries with their kernel."""
    from cct.device.query import blas_libraries, cpu_model
    from cct.runtime.partition import cpu_cores

    return {"model": cpu_model(), "cores": os.cpu_count(), "usable_cores": cpu_cores(),
            "blas": [lib.describe() for lib in blas_libraries()]}


def load_average() -> str:
    """``load average 1.02 0.87 0.90`` (1, 5, 15 minutes): what a benchmark prints beside its figures on a machine
    others may share."""
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load average unknown"


def cct_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("cct")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class BenchResult:
    """One measurement.  :meth:`to_json` gives the keys of :data:`RESULT_KEYS`; the rest is for the text."""

    images_per_second: float
    seconds_per_iteration: float
    batch: int
    gflop_per_image: float
    peak_gflops: float
    usd_per_hour: float | None
    instance: str
    cpu: dict
    devices: list[dict]
    model: str = ""
    phase: str = "TRAIN"
    iterations: int = 0
    forward_gflop_per_image: float = 0.0
    layer_gflop: list[tuple[str, str, float, float]] = field(default_factory=list)
    uncounted: list[str] = field(default_factory=list)
    version: str = field(default_factory=cct_version)

    @property
    def achieved_gflops(self) -> float:
        return self.gflop_per_image * self.images_per_second

    @property
    def percent_of_peak(self) -> float:
        return 100.0 * self.achieved_gflops / self.peak_gflops if self.peak_gflops > 0 else 0.0

    @property
    def usd_per_million_images(self) -> float | None:
        return usd_per_million_images(self.images_per_second, self.usd_per_hour)

    def to_json(self) -> dict:
        return {"images_per_second": self.images_per_second, "seconds_per_iteration": self.seconds_per_iteration,
                "batch": self.batch, "gflop_per_image": self.gflop_per_image,
                "achieved_gflops": self.achieved_gflops, "peak_gflops": self.peak_gflops,
                "percent_of_peak": self.percent_of_peak, "usd_per_million_images": self.usd_per_million_images,
                "instance": self.instance, "cpu": self.cpu, "devices": self.devices, "cct_version": self.version}


def usd_per_million_images(images_per_second: float, usd_per_hour: float | None) -> float | None:
    """What a million images cost at ``usd_per_hour``: ``1e6 / images_per_second / 3600 · usd_per_hour``."""
    if usd_per_hour is None:
        return None
    return 1e6 / images_per_second / 3600.0 * usd_per_hour


def measure(net, iterations: int, devices: Sequence, train: bool, usd_per_hour: float | None = None,
            instance: str = "", model: str = "", warmup: int = 1) -> BenchResult:
    """Time ``net`` (see the module doc) and describe the result; ``devices`` are the
    :class:`cct.device.Device` s the net runs on (their peaks add up)."""
    from cct.bench.flops import count_net
    from cct.bench.timing import device_synchronizer, time_layers

    if iterations < 1:
        raise CctError(f"-iterations {iterations}: at least one iteration is needed")
    sync = device_synchronizer()
    net.forward_prefilled()
    net.backward_all()
    if warmup > 0:
        time_layers(net, warmup, sync)
    timing = time_layers(net, iterations, sync)
    per_pass = timing.iteration_ms if train else timing.forward_ms
    seconds = statistics.median(per_pass) / 1e3
    flops = count_net(net)
    peaks = []
    for d in devices:
        gflops, source = d.peak_gflops()
        peaks.append({"device": str(d), "description": d.describe(), "peak_gflops": gflops, "peak_source": source})
    return BenchResult(
        images_per_second=flops.batch / seconds, seconds_per_iteration=seconds, batch=flops.batch,
        gflop_per_image=flops.per_image(train) / 1e9, peak_gflops=sum(p["peak_gflops"] for p in peaks),
        usd_per_hour=usd_per_hour, instance=instance or platform.node() or "this machine", cpu=cpu_facts(),
        devices=peaks, model=model, phase="TRAIN" if train else "TEST", iterations=iterations,
        forward_gflop_per_image=flops.forward / flops.batch / 1e9,
        layer_gflop=[(lf.name, lf.type, lf.forward / 1e9, lf.backward / 1e9) for lf in flops.layers],
        uncounted=flops.uncounted)


def format_text(r: BenchResult) -> str:
    """The result as aligned lines (and the layers that do the arithmetic)."""
    usd = r.usd_per_million_images
    rows = [
        ("instance", r.instance),
        ("net", f"{r.model} ({r.phase}, batch {r.batch}, median of {r.iterations} iterations)"),
        ("seconds per iteration", f"{r.seconds_per_iteration:.4g}"),
        ("images per second", f"{r.images_per_second:.4g}"),
        ("GFLOP per image", f"{r.gflop_per_image:.4g}" + (
            f" (forward {r.forward_gflop_per_image:.4g}, backward "
            f"{r.gflop_per_image - r.forward_gflop_per_image:.4g})" if r.phase == "TRAIN" else "")),
        ("achieved GFLOP/s", f"{r.achieved_gflops:.4g}"),
        ("peak GFLOP/s", f"{r.peak_gflops:.4g} (" + ", ".join(
            f"{d['device']}: {d['peak_gflops']:.4g}" for d in r.devices) + ", sgemm)"),
        ("% of peak", f"{r.percent_of_peak:.3g}"),
        ("$ per million images", "-" if usd is None else f"{usd:.4g} (at ${r.usd_per_hour:g}/hour)"),
        ("CPU", f"{r.cpu['model']}, {r.cpu['cores']} cores ({r.cpu['usable_cores']} usable)"),
        ("BLAS", "; ".join(r.cpu["blas"]) or "none found"),
        ("devices", ", ".join(f"{d['device']} ({d['description']})" for d in r.devices)),
        ("cct version", r.version),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    heavy = sorted(r.layer_gflop, key=lambda x: -(x[2] + x[3]))
    total = sum(f + b for _, _, f, b in r.layer_gflop) or 1.0
    lines.append("GFLOP per batch by layer (forward, backward), largest first:")
    for name, kind, f, b in heavy:
        if f + b < 0.005 * total:
            break
        lines.append(f"  {name:<24} {kind:<14} {f:9.4g} {b:9.4g}  {100 * (f + b) / total:5.1f}%")
    if r.uncounted:
        lines.append(f"layers of types without a FLOP count (counted as 0): {', '.join(r.uncounted)}")
    return "\n".join(lines)


# ---- reports of several results ----------------------------------------------------------------------

def load_result(path: str) -> dict:
    """A result written by ``cct bench -format json``; a one-line error for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise CctError(f"-report {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CctError(f"-report {path}: not JSON ({e}); write results with cct bench -format json") from None
    if not isinstance(doc, dict) or any(k not in doc for k in RESULT_KEYS):
        missing = [k for k in RESULT_KEYS if not isinstance(doc, dict) or k not in doc]
        raise CctError(f"-report {path}: not a cct bench result (missing {', '.join(missing)})")
    if not doc["images_per_second"] or doc["images_per_second"] <= 0:
        raise CctError(f"-report {path}: images_per_second must be positive")
    return doc


def _ratio(x: float | None, base: float | None) -> str:
    if x is None or base is None or base == 0:
        return "-"
    return f"{x / base:.2f}x"


def report_rows(results: Sequence[dict]) -> list[dict]:
    """Per result: instance, images/s, % of peak, $/1M images and the ratios to the first result."""
    base = results[0]
    rows = []
    for r in results:
        rows.append({"instance": r["instance"], "images_per_second": r["images_per_second"],
                     "relative_speed": r["images_per_second"] / base["images_per_second"],
                     "percent_of_peak": r["percent_of_peak"], "usd_per_million_images": r["usd_per_million_images"],
                     "relative_cost": (r["usd_per_million_images"] / base["usd_per_million_images"]
                                       if r["usd_per_million_images"] is not None
                                       and base["usd_per_million_images"] else None),
                     "batch": r["batch"], "gflop_per_image": r["gflop_per_image"]})
    return rows


def report_table(results: Sequence[dict]) -> str:
    """The side-by-side table (speed and cost relative to the first instance)."""
    header = ("instance", "images/s", "vs first", "% of peak", "$/1M images", "vs first", "batch", "GFLOP/image")
    body = []
    for row in report_rows(results):
        usd = row["usd_per_million_images"]
        body.append((row["instance"], f"{row['images_per_second']:.4g}", f"{row['relative_speed']:.2f}x",
                     f"{row['percent_of_peak']:.3g}", "-" if usd is None else f"{usd:.4g}",
                     "-" if row["relative_cost"] is None else f"{row['relative_cost']:.2f}x",
                     str(row["batch"]), f"{row['gflop_per_image']:.4g}"))
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header] + body]
    flops = {round(r["gflop_per_image"], 3) for r in results}
    if len(flops) > 1:
        lines.append("note: the results count different GFLOP per image (different nets or phases)")
    return "\n".join(lines)


def plot_report(results: Sequence[dict], path: str) -> None:
    """A bar chart of images/s (and $/1M images where priced) per instance, labelled relative to the first."""
    try:
        import matplotlib
    except ImportError:
        raise CctError(f"-plot {path}: plotting needs matplotlib (pip install 'cct[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report_rows(results)
    names = [r["instance"] for r in rows]
    priced = [r for r in rows if r["usd_per_million_images"] is not None]
    panels = 2 if priced else 1
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels + 0.4 * len(rows), 4.2), squeeze=False)
    ax = axes[0][0]
    bars = ax.bar(names, [r["images_per_second"] for r in rows], color="#4C72B0")
    for b, r in zip(bars, rows):
        ax.annotate(f"{r['images_per_second']:.3g}\n{r['relative_speed']:.2f}x, {r['percent_of_peak']:.0f}% peak",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("images per second")
    ax.set_title("Throughput (higher is better)")
    ax.margins(y=0.25)
    if priced:
        ax2 = axes[0][1]
        usd = [r["usd_per_million_images"] if r["usd_per_million_images"] is not None else math.nan for r in rows]
        bars = ax2.bar(names, usd, color="#DD8452")
        for b, r in zip(bars, rows):
            if r["usd_per_million_images"] is not None:
                rel = "" if r["relative_cost"] is None else f"\n{r['relative_cost']:.2f}x"
                ax2.annotate(f"${r['usd_per_million_images']:.3g}{rel}",
                             (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
        ax2.set_ylabel("US$ per million images")
        ax2.set_title("Cost (lower is better)")
        ax2.margins(y=0.25)
    for a in axes[0]:
        a.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as e:
        raise CctError(f"-plot {path}: cannot write ({e})") from None
    finally:
        plt.close(fig)
