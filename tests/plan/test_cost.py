"""The cost functions: transfers against an element-by-element oracle, parameter synchronisation, analytic and
measured compute."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cct.engines import ConvGeometry, estimate_convolution
from cct.errors import CctError
from cct.io.prototxt import parse_net_param
from cct.plan.config import Config, enumerate_configs, part_boxes
from cct.plan.cost import CostModel, edge_bytes, node_costs, plan_costs
from cct.plan.graph import layer_graph

NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 4 dim: 9 dim: 9 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "grouped" type: "Convolution" bottom: "conv" top: "grouped"
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2 } }
layer { name: "norm" type: "LRN" bottom: "conv" top: "norm" lrn_param { local_size: 3 } }
layer { name: "pool" type: "Pooling" bottom: "norm" top: "pool"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "grouped" bottom: "pool" top: "cat" }
layer { name: "ip" type: "InnerProduct" bottom: "cat" top: "ip" inner_product_param { num_output: 5 } }
"""
MODEL = CostModel(gflops=50.0, bandwidth=2.0)


def graph():
    return layer_graph(parse_net_param(NET))


def _rows(out_lo: int, out_hi: int, size: int, kernel: int, stride: int, pad: int) -> set[int]:
    """Input indices read by output indices [out_lo, out_hi) of a window, one output at a time."""
    return {i for o in range(out_lo, out_hi) for i in range(o * stride - pad, o * stride - pad + kernel)
            if 0 <= i < size}


def needed_mask(node, bottom: int, lo, hi) -> np.ndarray:
    """The oracle: which elements of bottom ``bottom`` an output box reads, from each layer's definition."""
    shape = node.model.bottoms[bottom] + (1,) * (4 - len(node.model.bottoms[bottom]))
    mask = np.zeros(shape, dtype=bool)
    if np.any(np.asarray(hi) <= np.asarray(lo)):
        return mask
    lp = node.model.lp
    if node.type == "Convolution":
        p = lp.convolution_param
        og, cg = p.num_output // max(p.group, 1), shape[1] // max(p.group, 1)
        groups = {o // og for o in range(lo[1], hi[1])}
        chans = sorted(c for g in groups for c in range(g * cg, (g + 1) * cg))
        k, s, q = p.kernel_size[0], (p.stride[0] if p.stride else 1), (p.pad[0] if p.pad else 0)
        rows, cols = _rows(lo[2], hi[2], shape[2], k, s, q), _rows(lo[3], hi[3], shape[3], k, s, q)
        mask[np.ix_(range(lo[0], hi[0]), chans, sorted(rows), sorted(cols))] = True
        return mask
    if node.type == "Pooling":
        p = lp.pooling_param
        rows = _rows(lo[2], hi[2], shape[2], p.kernel_size, p.stride, p.pad)
        cols = _rows(lo[3], hi[3], shape[3], p.kernel_size, p.stride, p.pad)
        mask[np.ix_(range(lo[0], hi[0]), range(lo[1], hi[1]), sorted(rows), sorted(cols))] = True
        return mask
    if node.type == "LRN":
        half = (lp.lrn_param.local_size - 1) // 2
        chans = [c for c in range(lo[1] - half, hi[1] + half) if 0 <= c < shape[1]]
        mask[np.ix_(range(lo[0], hi[0]), chans, range(lo[2], hi[2]), range(lo[3], hi[3]))] = True
        return mask
    if node.type == "Concat":
        offset = sum(b[1] for b in node.model.bottoms[:bottom])
        chans = [c - offset for c in range(lo[1], hi[1]) if 0 <= c - offset < shape[1]]
        mask[np.ix_(range(lo[0], hi[0]), chans, range(lo[2], hi[2]), range(lo[3], hi[3]))] = True
        return mask
    mask[lo[0]:hi[0]] = True  # InnerProduct: whole images
    return mask


def oracle_bytes(g, edge, cu: Config, cv: Config) -> float:
    src, dst = g.nodes[edge.src], g.nodes[edge.dst]
    shape = src.model.tops[edge.top] + (1,) * (4 - len(src.model.tops[edge.top]))
    owner = np.full(shape, -1)
    for j, (lo, hi) in enumerate(zip(*part_boxes(cu, shape))):
        owner[tuple(slice(a, b) for a, b in zip(lo, hi))] = j
    moved = 0
    for j, (lo, hi) in enumerate(zip(*part_boxes(cv, dst.extent))):
        need = needed_mask(dst, edge.bottom, lo, hi)
        moved += int(np.count_nonzero(need & (owner != j)))
    return 2 * 4 * moved


@pytest.mark.parametrize("workers", [2, 4])
def test_transfers_match_an_element_by_element_oracle(workers):
    g = graph()
    for edge in g.edges:
        src, dst = g.nodes[edge.src], g.nodes[edge.dst]
        cu = enumerate_configs(workers, src.extent, src.splits)
        cv = enumerate_configs(workers, dst.extent, dst.splits)
        table = edge_bytes(edge, src, cu, dst, cv, workers)
        for (i, a), (j, b) in itertools.product(enumerate(cu), enumerate(cv)):
            assert table[i, j] == oracle_bytes(g, edge, a, b), (edge.src, edge.dst, str(a), str(b))


def test_halos_between_equal_configurations_and_the_papers_rule():
    g = graph()
    edge = next(e for e in g.edges if e.dst == "grouped")
    src, dst = g.nodes["conv"], g.nodes["grouped"]
    configs = [Config(1, 1, 2, 1), Config(2, 1, 1, 1)]
    exact = edge_bytes(edge, src, configs, dst, configs, 2)
    # rows split in two: grouped (3x3, stride 2, pad 1: 5x5 out of 9x9) output rows [0, 2) read conv rows [0, 4),
    # which worker 0 holds; rows [2, 5) read [3, 9) where worker 1 holds [4, 9): one row of 4 images x 6 channels
    # x 9 columns moves, forward and backward
    assert exact[0, 0] == 2 * 4 * (4 * 6 * 9) and exact[1, 1] == 0
    ignored = edge_bytes(edge, src, configs, dst, configs, 2, halo="ignore")
    assert ignored[0, 0] == 0 and ignored[0, 1] == exact[0, 1] > 0


def test_parameter_synchronisation_counts_replicas_not_channel_parts():
    g = graph()
    conv = g.nodes["conv"]
    params = 6 * 4 * 9 + 6
    assert conv.params() == params
    nc = node_costs(conv, 8, MODEL)
    for c, nbytes, ms in zip(nc.configs, nc.update_bytes, nc.update_ms):
        replicas = c.n * c.h * c.w
        assert nbytes == (2 * replicas * params * 4 if replicas > 1 else 0)
        assert ms == pytest.approx(nbytes / 2e9 * 1e3)
    assert nc.update_bytes[nc.configs.index(Config(1, 2, 1, 1))] == 0
    assert nc.update_bytes[nc.configs.index(Config(2, 2, 1, 1))] == 2 * 2 * params * 4


def test_analytic_compute_is_the_largest_parts_flops_fused_layers_included():
    g = graph()
    conv = g.nodes["conv"]
    nc = node_costs(conv, 4, MODEL)
    for c, ms in zip(nc.configs, nc.compute_ms):
        n, ch, h, w = (-(-s // d) for s, d in zip((4, 6, 9, 9), c.degrees))
        flops = 6 * 4 * 9 * n * ch * h * w + 2 * n * ch * h * w  # convolution + fused ReLU
        assert ms == pytest.approx(flops / 50e9 * 1e3)
    ip = node_costs(g.nodes["ip"], 4, MODEL)
    k = (4 + 6) * 5 * 5  # cat: grouped's 4 and pool's 6 channels of 5x5
    assert ip.configs[:3] == [Config(4, 1), Config(2, 2), Config(2, 1)]
    for c, ms in zip(ip.configs, ip.compute_ms):
        assert ms == pytest.approx(6 * k * (4 // c.n) * -(-5 // c.c) / 50e9 * 1e3)


def test_measured_compute_takes_the_engines_fastest_variant_on_the_parts_geometry():
    g = graph()
    model = CostModel(gflops=50.0, bandwidth=2.0, kind="measured")
    node = g.nodes["grouped"]
    nc = node_costs(node, 4, model)
    c = Config(1, 2, 2, 1)
    part = (4, 2, 3, 5)  # 4 images, 2 of 4 channels (one group), 3 of 5 rows, 5 columns
    geometry = ConvGeometry(4, 3, 2, 1, (7, 11), (3, 3), (2, 2), (0, 0), (1, 1))
    assert node.model.conv_geometry(part) == geometry
    best = min(e.seconds for e in estimate_convolution(geometry).values())
    assert nc.compute_ms[nc.configs.index(c)] == pytest.approx(best * 1e3)
    ip = g.nodes["ip"]
    assert ip.model.conv_geometry((4, 5, 1, 1)) == ConvGeometry(4, 250, 5, 1, (1, 1), (1, 1), (1, 1), (0, 0), (1, 1))


def test_eq1_and_bytes_moved_of_a_whole_assignment():
    costs = plan_costs(graph(), 4, MODEL)
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = {name: int(rng.integers(len(nc.configs))) for name, nc in costs.nodes.items()}
        eq1 = sum(nc.compute_ms[a[n]] + nc.update_ms[a[n]] for n, nc in costs.nodes.items()) + \
            sum(ec.ms[a[ec.edge.src], a[ec.edge.dst]] for ec in costs.edges)
        assert costs.cost_graph().cost(a) == pytest.approx(eq1)
        moved = sum(nc.update_bytes[a[n]] for n, nc in costs.nodes.items()) + \
            sum(ec.bytes[a[ec.edge.src], a[ec.edge.dst]] for ec in costs.edges)
        assert costs.moved_bytes(a) == pytest.approx(moved)
        assert sum(costs.xfer_in_ms(a).values()) == pytest.approx(moved_ms(costs, a))


def moved_ms(costs, a):
    return sum(ec.ms[a[ec.edge.src], a[ec.edge.dst]] for ec in costs.edges)


def test_bad_cost_models_are_one_line_errors():
    with pytest.raises(CctError, match="-cost fast: the cost model is analytic or measured"):
        CostModel(10.0, kind="fast")
    with pytest.raises(CctError, match="-gflops -1"):
        CostModel(-1.0)
    with pytest.raises(CctError, match="-bandwidth 0"):
        CostModel(1.0, bandwidth=0.0)
    with pytest.raises(CctError, match="-halo some"):
        CostModel(1.0, halo="some")
    with pytest.raises(CctError, match="-workers 0"):
        plan_costs(graph(), 0, MODEL)
