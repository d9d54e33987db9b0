"""``cct plan``: DeePa's per-layer parallelism search (:mod:`cct.plan`).

``cct plan -model NET -workers P [-cost analytic|measured] [-bandwidth GB/s] [-gflops G] [-batch N]
[-halo exact|ignore] [-format text|json] [-output plan.json]`` prices every configuration of every layer of
NET on P workers, finds the one minimising the step time (Eq. 1) and prints one row per layer with the
totals of the plan, image parallelism and OWT and the search time; ``-output`` writes the plan file
(:mod:`cct.plan.files`); ``-phase``, ``-level`` and ``-stage`` pick the net's layers as for ``cct time`` (TRAIN by
default).  ``cct plan -costs GRAPH.json [-format json]`` runs the same search on a cost graph.
"""
from __future__ import annotations

import json
import sys

from cct import log
from cct.cli.common import phase, stages
from cct.errors import CctError
from cct.flags import Flag, Flags

SUMMARY = "find the per-layer parallelism (DeePa) of a net on N workers"
FLAGS = [
    Flag("workers", int, 0, "plan: the number of workers (devices) to split each layer over."),
    Flag("cost", str, "analytic", "plan: compute costs from FLOPs and -gflops (analytic) or from the "
                                  "convolution engines' cost estimates (measured)."),
    Flag("gflops", float, 0.0, "plan: GFLOP/s of one worker (default: this machine's measured sgemm peak)."),
    Flag("bandwidth", float, 0.0, "plan: GB/s between workers (default: 10)."),
    Flag("batch", int, 0, "plan: plan for this batch size instead of the net's Input batch."),
    Flag("halo", str, "exact", "plan: exact (equal configurations exchange the halos a window reads) or ignore "
                               "(equal configurations move nothing, DeePa's rule)."),
    Flag("costs", str, "", "plan: search a cost graph (JSON: nodes, configurations, edges) instead of a net."),
    Flag("format", str, "text", "Output format: text or json."),
    Flag("output", str, "", "Optional; write the result (the plan file, JSON) to this path."),
]


def _emit(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _format(flags: Flags) -> str:
    if flags.format not in ("text", "json"):
        raise CctError(f"-format {flags.format}: the output format is text or json")
    return flags.format


def _search_costs(flags: Flags, fmt: str) -> int:
    from cct.plan.files import read_cost_graph, search_document, write_json
    from cct.plan.search import search

    graph, labels = read_cost_graph(flags.costs)
    try:
        result = search(graph)
    except CctError as e:
        raise CctError(f"{flags.costs}: {e}") from None
    doc = search_document(result, labels)
    if flags.output:
        write_json(flags.output, doc)
    if fmt == "json":
        _emit(json.dumps(doc, indent=2))
    else:
        width = max(len(v) for v in doc["assignment"])
        lines = [f"{v:<{width}}  {c}" for v, c in doc["assignment"].items()]
        lines.append(f"cost {doc['cost']:.6g} ms; {len(graph.costs)} nodes -> {len(result.residue)} after "
                     f"elimination; search {doc['search_ms']:.3f} ms")
        _emit("\n".join(lines))
    return 0


def main(flags: Flags) -> int:
    fmt = _format(flags)
    if flags.costs:
        return _search_costs(flags, fmt)
    from cct.plan.cost import DEFAULT_BANDWIDTH_GBS, CostModel, machine_gflops
    from cct.plan.files import plan_document, write_json
    from cct.plan.graph import layer_graph
    from cct.plan.planner import format_text, plan_net

    if not flags.model:
        raise CctError("cct plan needs -model NET and -workers P, or -costs GRAPH.json")
    if flags.workers < 1:
        raise CctError(f"-workers {flags.workers}: cct plan -model needs -workers P with P >= 1")
    if flags.batch < 0:
        raise CctError(f"-batch {flags.batch}: must be positive")
    gflops = flags.gflops
    if gflops == 0:
        gflops = machine_gflops()
        log.info("plan: %s GFLOP/s per worker (this machine's sgemm peak; set -gflops to change)", f"{gflops:.1f}")
    model = CostModel(gflops, flags.bandwidth or DEFAULT_BANDWIDTH_GBS, flags.cost, flags.halo)
    graph = layer_graph(flags.model, phase(flags.phase), flags.batch or None, flags.level, stages(flags.stage))
    try:
        plan = plan_net(graph, flags.workers, model)
    except CctError as e:
        raise CctError(f"{flags.model}: {e}") from None
    doc = plan_document(plan, flags.model)
    if flags.output:
        write_json(flags.output, doc)
        log.info("plan: wrote %s", flags.output)
    _emit(json.dumps(doc, indent=2) if fmt == "json" else format_text(plan))
    return 0
