"""The planner's files: a user's cost graph (``cct plan -costs GRAPH.json``) and the plan file
(``cct plan -model NET -workers P -format json [-output plan.json]``), with one-line errors.

**Cost graph** — a DAG with costs in ms, parallel edges allowed, a pair missing from ``xfer`` costing 0::

    {"nodes": {"conv": {"n=4": 12.0, "c=4": 15.5}, "fc": {"c=2": 3.0, "c=1": 5.0}},
     "edges": [{"from": "conv", "to": "fc", "xfer": {"n=4|c=2": 1.5, "c=4|c=1": 0.5}}]}

The answer (:func:`search_document`): ``{"assignment": {NAME: CONFIG}, "cost": Eq. 1 of it, "search_ms": t}``.

**Plan file** (:func:`plan_document`, read back by :func:`read_plan`)::

    {"format": "cct-plan", "version": 1, "model": "models/alexnet/deploy.prototxt", "net": "AlexNet",
     "workers": 16, "batch": 512,
     "cost_model": {"cost": "analytic", "gflops": 2500.0, "bandwidth_gbs": 4.5, "halo": "exact"},
     "layers": {"conv1": {"n": 16, "c": 1, "h": 1, "w": 1, "workers": 16, "type": "Convolution",
                          "node": "conv1", "shape": [512, 96, 55, 55],
                          "compute_ms": 8.103, "update_ms": 0.994, "xfer_ms": 0.0},
                "relu1": {"n": 16, "c": 1, "h": 1, "w": 1, "workers": 16, "type": "ReLU", "node": "conv1"},
                ...
                "fc6": {"n": 1, "c": 2, "h": 1, "w": 1, "workers": 2, ...}, ...},
     "totals": {"plan": {"cost_ms": 177.3, "moved_mb": 405.1}, "image parallelism": {"cost_ms": 1789.9,
                "moved_mb": 7803.5}, "OWT": {"cost_ms": 360.7, "moved_mb": 1372.1}},
     "search": {"ms": 1.6, "nodes": 15, "residue": ["data", "prob"], "node_eliminations": 13,
                "edge_eliminations": 0, "enumerated": 25}}

Every layer of the net has an entry keyed by its name: its degrees ``n, c, h, w`` (the split of its output
over images, channels, rows and columns; part ``(i_n, i_c, i_h, i_w)`` on device ``((i_n·c + i_c)·h +
i_h)·w + i_w``, see :mod:`cct.plan.config`) and ``workers = n·c·h·w``; an in-place layer names the layer it
is fused into as its ``node`` and shares its degrees; costs are per node (ms per training step).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from cct.errors import CctError
from cct.plan.search import CostEdge, CostGraph, SearchResult

PLAN_FORMAT, PLAN_VERSION = "cct-plan", 1


def _load_json(path: str | os.PathLike[str]) -> Any:
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CctError(f"{source}: cannot read: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CctError(f"{source}: line {e.lineno} column {e.colno}: invalid JSON ({e.msg})") from None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CctError(f"{where}: expected a finite number, got {json.dumps(value)}")
    return float(value)


def _object(value: Any, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise CctError(f"{where}: expected {what}, got {type(value).__name__}")
    return value


def read_cost_graph(path: str | os.PathLike[str]) -> tuple[CostGraph, dict[str, list[str]]]:
    """``(graph, configuration names per node)`` from a cost-graph file (format in the module docstring)."""
    source = os.fspath(path)
    doc = _object(_load_json(source), source, "an object with \"nodes\" and \"edges\"")
    unknown = sorted(set(doc) - {"nodes", "edges"})
    if unknown:
        raise CctError(f"{source}: unknown key \"{unknown[0]}\" (a cost graph has \"nodes\" and \"edges\")")
    nodes = _object(doc.get("nodes"), f"{source}: \"nodes\"", "an object of node name -> {config: cost_ms}")
    if not nodes:
        raise CctError(f"{source}: \"nodes\" is empty")
    costs, labels = {}, {}
    for name, configs in nodes.items():
        where = f"{source}: node \"{name}\""
        configs = _object(configs, where, "an object of configuration -> cost_ms")
        if not configs:
            raise CctError(f"{where}: has no configurations")
        for label in configs:
            if "|" in label or not label:
                raise CctError(f"{where}: configuration name \"{label}\" must be non-empty and free of '|'")
        labels[name] = list(configs)
        costs[name] = np.array([_number(v, f"{where} configuration \"{k}\"") for k, v in configs.items()])
    edges_doc = doc.get("edges", [])
    if not isinstance(edges_doc, list):
        raise CctError(f"{source}: \"edges\": expected a list, got {type(edges_doc).__name__}")
    edges = []
    for k, e in enumerate(edges_doc):
        where = f"{source}: edge {k}"
        e = _object(e, where, "an object with \"from\", \"to\" and \"xfer\"")
        extra = sorted(set(e) - {"from", "to", "xfer"})
        if extra:
            raise CctError(f"{where}: unknown key \"{extra[0]}\" (an edge has \"from\", \"to\" and \"xfer\")")
        for end in ("from", "to"):
            if e.get(end) not in labels:
                raise CctError(f"{where}: \"{end}\": unknown node {json.dumps(e.get(end))}")
        u, v = e["from"], e["to"]
        where = f"{source}: edge {k} ({u} -> {v})"
        table = np.zeros((len(labels[u]), len(labels[v])))
        for pair, ms in _object(e.get("xfer", {}), f"{where}: \"xfer\"", "an object of \"CU|CV\" -> ms").items():
            cu, sep, cv = pair.partition("|")
            if not sep or cu not in labels[u] or cv not in labels[v]:
                raise CctError(f"{where}: xfer key \"{pair}\" is not CONFIG_OF_{u}|CONFIG_OF_{v} "
                               f"({u}: {', '.join(labels[u])}; {v}: {', '.join(labels[v])})")
            table[labels[u].index(cu), labels[v].index(cv)] = _number(ms, f"{where}: xfer \"{pair}\"")
        edges.append(CostEdge(u, v, table))
    graph = CostGraph(costs, edges)
    graph.check(source)
    return graph, labels


def search_document(result: SearchResult, labels: dict[str, list[str]]) -> dict:
    """``cct plan -costs`` output: configuration names, Eq. 1 cost, search time."""
    return {"assignment": {v: labels[v][i] for v, i in result.assignment.items()}, "cost": result.cost,
            "search_ms": result.seconds * 1e3}


def plan_document(plan: Any, model: str) -> dict:
    """The plan file of a :class:`cct.plan.planner.NetPlan` of the net in file ``model``."""
    m, r = plan.costs.model, plan.result
    layers: dict[str, dict] = {}
    for row in plan.rows():
        degrees = {k: row[k] for k in ("n", "c", "h", "w", "workers")}
        layers[row["name"]] = dict(degrees, type=row["type"], node=row["name"], shape=row["shape"],
                                   compute_ms=row["compute_ms"], update_ms=row["update_ms"], xfer_ms=row["xfer_ms"])
        for fused in plan.graph.nodes[row["name"]].fused:
            layers[fused.lp.name] = dict(degrees, type=fused.lp.type, node=row["name"])
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION, "model": model, "net": plan.graph.name,
        "workers": plan.workers, "batch": plan.graph.batch,
        "cost_model": {"cost": m.kind, "gflops": m.gflops, "bandwidth_gbs": m.bandwidth, "halo": m.halo},
        "layers": layers,
        "totals": {s.name: {"cost_ms": s.cost_ms, "moved_mb": s.moved_bytes / 1e6}
                   for s in [plan.plan] + plan.baselines},
        "search": {"ms": r.seconds * 1e3, "nodes": len(plan.graph.nodes), "residue": r.residue,
                   "node_eliminations": r.node_eliminations, "edge_eliminations": r.edge_eliminations,
                   "enumerated": r.enumerated},
    }


def write_json(path: str | os.PathLike[str], doc: dict) -> None:
    source = os.fspath(path)
    try:
        with open(source, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise CctError(f"{source}: cannot write: {e.strerror or e}") from None


@dataclass(frozen=True)
class LayerPlan:
    """One layer's degrees in a plan file (``node``: the layer it is fused into, or itself)."""

    name: str
    n: int
    c: int
    h: int
    w: int
    workers: int
    node: str


@dataclass(frozen=True)
class Plan:
    """A plan file: ``workers`` devices, ``layers`` by name (net order), the file's whole ``document``."""

    path: str
    model: str
    workers: int
    layers: dict[str, LayerPlan]
    document: dict


def _positive(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CctError(f"{where}: expected a positive integer, got {json.dumps(value)}")
    return value


def read_plan(path: str | os.PathLike[str]) -> Plan:
    """A plan file written by ``cct plan -model NET -workers P -format json -output PATH``, checked: every
    layer's degrees are positive integers with ``n·c·h·w = workers <= `` the plan's workers."""
    source = os.fspath(path)
    doc = _object(_load_json(source), source, "a cct plan (a JSON object)")
    if doc.get("format") != PLAN_FORMAT:
        raise CctError(f"{source}: not a cct plan file (\"format\" is {json.dumps(doc.get('format'))}, "
                       f"expected \"{PLAN_FORMAT}\")")
    if doc.get("version") != PLAN_VERSION:
        raise CctError(f"{source}: plan file version {json.dumps(doc.get('version'))}; this cct reads version "
                       f"{PLAN_VERSION}")
    workers = _positive(doc.get("workers"), f"{source}: \"workers\"")
    layers_doc = _object(doc.get("layers"), f"{source}: \"layers\"", "an object of layer name -> degrees")
    layers = {}
    for name, entry in layers_doc.items():
        where = f"{source}: layer \"{name}\""
        entry = _object(entry, where, "an object with n, c, h, w and workers")
        n, c, h, w, count = (_positive(entry.get(k), f"{where}: \"{k}\"") for k in ("n", "c", "h", "w", "workers"))
        if n * c * h * w != count:
            raise CctError(f"{where}: n*c*h*w = {n * c * h * w} but \"workers\" is {count}")
        if count > workers:
            raise CctError(f"{where}: {count} workers exceed the plan's {workers}")
        node = entry.get("node", name)
        if not isinstance(node, str) or node not in layers_doc:
            raise CctError(f"{where}: \"node\" {json.dumps(node)} is not a layer of the plan")
        layers[name] = LayerPlan(name, n, c, h, w, count, node)
    return Plan(source, str(doc.get("model", "")), workers, layers, doc)
