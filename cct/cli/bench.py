"""``cct bench``: images per second, FLOPs, % of the devices' peak and $ per million images of a net on this
machine (the measurement of ``cct time``, as a median); ``cct bench -report a.json b.json ... [-plot p.png]``
puts saved results side by side.  See :mod:`cct.bench.bench`."""
from __future__ import annotations

import json
import sys

from cct import log
from cct.cli.common import parse_gpus, phase, stages, use_single_device
from cct.errors import CctError
from cct.flags import Flag, Flags

SUMMARY = "benchmark a net: images/s, GFLOP/s, % of peak, $ per million images"
ARGUMENTS = "[-report RESULT.json ...]"
FLAGS = [
    Flag("batch", int, 0, "bench: batch size (default: the net's own)."),
    Flag("price_per_hour", float, 0.0, "bench: the instance's price in US$ per hour (gives $ per million images)."),
    Flag("instance", str, "", "bench: a name for this machine in results and reports (default: the host name)."),
    Flag("output", str, "", "bench: write the result (or the report) to this file instead of standard output."),
    Flag("report", bool, False, "bench: put the JSON results given as arguments side by side (relative to the "
                                "first)."),
    Flag("plot", str, "", "bench -report: also draw the results as a bar chart (PNG/SVG/PDF; needs matplotlib)."),
    Flag("format", str, "", "bench: output format, text or json (default: json when -output ends in .json, "
                            "else text)."),
]


def _format(flags: Flags) -> str:
    fmt = flags.format or ("json" if flags.output.lower().endswith(".json") else "text")
    if fmt not in ("text", "json"):
        raise CctError(f"-format {fmt}: must be text or json")
    return fmt


def _emit(text: str, output: str) -> None:
    if output:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise CctError(f"-output {output}: cannot write ({e.strerror})") from None
        log.info("Wrote %s", output)
    else:
        print(text)
        sys.stdout.flush()


def _devices(flags: Flags) -> list:
    from cct.device import Device, parse_devices

    if flags.devices:
        return parse_devices(flags.devices, "-devices")
    gpus = parse_gpus(flags.gpu)
    if gpus:
        return [Device("gpu", gpus[0])]
    return parse_devices("cpu", "cpu")


def _report(flags: Flags) -> int:
    from cct.bench.bench import load_result, plot_report, report_rows, report_table

    paths = list(flags.args)
    if not paths:
        raise CctError("-report needs the JSON results to compare (cct bench -report a.json b.json ...)")
    results = [load_result(p) for p in paths]
    if _format(flags) == "json":
        _emit(json.dumps(report_rows(results), indent=1), flags.output)
    else:
        _emit(report_table(results), flags.output)
    if flags.plot:
        plot_report(results, flags.plot)
        log.info("Wrote %s", flags.plot)
    return 0


def main(flags: Flags) -> int:
    from cct.bench.bench import build_net, format_text, measure, resolve_model
    from cct.pycaffe import TRAIN

    if flags.report:
        return _report(flags)
    if flags.args:
        raise CctError(f"bench takes no arguments without -report (got {' '.join(flags.args)})")
    if flags.plot:
        raise CctError("-plot goes with -report (draw saved results)")
    if not flags.model:
        raise CctError("Need a model definition to bench (-model: a prototxt, or caffenet, alexnet, googlenet).")
    if flags.price_per_hour < 0:
        raise CctError(f"-price_per_hour {flags.price_per_hour:g}: must not be negative")
    if flags.batch < 0:
        raise CctError(f"-batch {flags.batch}: must be positive")
    fmt = _format(flags)
    net_phase = phase(flags.phase)
    use_single_device(parse_gpus(flags.gpu))
    devices = _devices(flags)
    model = resolve_model(flags.model)
    weights = [w for w in flags.weights.split(",") if w] if flags.weights else []
    net = build_net(model, net_phase, flags.batch, weights, flags.level, stages(flags.stage))
    log.info("Benchmarking %s (%s) for %d iterations", model, "TRAIN" if net_phase == TRAIN else "TEST",
             flags.iterations)
    result = measure(net, flags.iterations, devices, net_phase == TRAIN,
                     flags.price_per_hour if flags.price_per_hour > 0 else None, flags.instance, model)
    _emit(json.dumps(result.to_json(), indent=1) if fmt == "json" else format_text(result), flags.output)
    return 0
