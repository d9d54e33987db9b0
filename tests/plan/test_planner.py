"""Plans of AlexNet, VGG-16 and Inception-v3: never worse than image parallelism or OWT in the same cost model,
Inception-v3's reduction and search time, and the qualitative picture of DeePa's Section 7.1 under a K80-like
model."""
from __future__ import annotations

import os

import pytest

from cct.plan.config import Config
from cct.plan.cost import CostModel
from cct.plan.graph import layer_graph
from cct.plan.planner import format_text, plan_net

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("alexnet", "vgg16", "inception_v3")
# A K80-like worker, DeePa's 16-GPU machine: 2.5 TFLOP/s sustained (57% of one GK210's 4.37 TFLOP/s peak) and
# 4.5 GB/s between workers, the bandwidth Table 2's update column implies (16 replicas of fc6's 151 MB, both
# ways, in 1075 ms).
K80 = CostModel(gflops=2500.0, bandwidth=4.5)
BATCH = 512  # DeePa's minibatch on 16 GPUs


@pytest.fixture(scope="module")
def graphs():
    return {m: layer_graph(os.path.join(REPO, "models", m, "deploy.prototxt"), batch=BATCH) for m in MODELS}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("workers", [1, 2, 4, 8, 16])
def test_never_worse_than_image_parallelism_or_owt(graphs, model, workers):
    p = plan_net(graphs[model], workers, K80)
    image, owt = p.baselines
    assert (image.name, owt.name) == ("image parallelism", "OWT")
    assert p.plan.cost_ms <= image.cost_ms * (1 + 1e-12) and p.plan.cost_ms <= owt.cost_ms * (1 + 1e-12)
    graph = p.costs.cost_graph()
    assert graph.cost(p.plan.assignment) == pytest.approx(p.plan.cost_ms, rel=1e-9)  # Eq. 1 of the assignment
    assert len(p.result.residue) == 2
    if workers == 1:
        assert all(p.config(n) == Config(1, 1, 1, 1) for n in graphs[model].nodes)
        assert p.plan.cost_ms == pytest.approx(image.cost_ms) and p.plan.moved_bytes == 0
    else:  # the baselines are what they say
        for name, node in graphs[model].nodes.items():
            configs = p.costs.nodes[name].configs
            assert configs[image.assignment[name]] == Config(min(workers, BATCH))
            want = Config(1, workers) if node.type == "InnerProduct" else Config(min(workers, BATCH))
            assert configs[owt.assignment[name]] == want


@pytest.mark.parametrize("workers", [3, 6, 12])
def test_worker_counts_that_are_not_powers_of_two(graphs, workers):
    p = plan_net(graphs["alexnet"], workers, K80)
    assert all(p.config(n).workers <= workers for n in p.graph.nodes)
    assert p.costs.nodes["conv1"].configs[0] == Config(workers)  # image parallelism on all of them comes first
    assert p.plan.cost_ms <= min(s.cost_ms for s in p.baselines) * (1 + 1e-12)


@pytest.mark.parametrize("model", ["alexnet", "vgg16"])
def test_chains_match_a_viterbi_pass(graphs, model):
    """AlexNet and VGG-16 are chains: a plain dynamic programme over the layers in order is an independent
    check of the optimum (70 configurations per convolution at 16 workers: too many for brute force)."""
    p = plan_net(graphs[model], 16, K80)
    graph = p.costs.cost_graph()
    order = list(graph.costs)
    assert [(e.src, e.dst) for e in graph.edges] == list(zip(order, order[1:]))
    best = graph.costs[order[0]].copy()
    for e in graph.edges:
        best = (best[:, None] + e.xfer).min(axis=0) + graph.costs[e.dst]
    assert p.plan.cost_ms == pytest.approx(float(best.min()), rel=1e-9)


def test_inception_v3_reduces_to_two_nodes_and_searches_fast(graphs):
    p = plan_net(graphs["inception_v3"], 16, K80)
    r = p.result
    assert len(p.graph.nodes) == 122
    assert r.residue == ["data", "prob"] and r.node_eliminations == 120 and r.edge_eliminations > 0
    big = [n for n, node in p.graph.nodes.items() if node.type == "Convolution" and min(node.extent[1:]) >= 16]
    assert big and all(len(p.costs.nodes[n].configs) == 70 for n in big)
    print(f"Inception-v3, 16 workers: {len(p.graph.nodes)} nodes -> {len(r.residue)}, search "
          f"{r.seconds * 1e3:.1f} ms")
    assert r.seconds < 3.0  # about 0.2 s on a loaded 2-core machine; DeePa reports about 0.1 s


def test_qualitative_picture_of_section_7_1(graphs):
    alexnet = plan_net(graphs["alexnet"], 16, K80)
    # AlexNet: every convolution and pooling layer image-parallel on all 16 workers
    for name, node in graphs["alexnet"].nodes.items():
        if node.type in ("Convolution", "Pooling", "LRN"):
            assert alexnet.config(name) == Config(16), name
    # fully-connected layers: channel (model) parallelism on 2-4 workers, as in Table 2
    for model, p in (("alexnet", alexnet), ("vgg16", plan_net(graphs["vgg16"], 16, K80))):
        for fc in ("fc6", "fc7"):
            c = p.config(fc)
            assert c.n == 1 and c.c in (2, 4) and c.h == c.w == 1, (model, fc, str(c))
    image, owt = alexnet.baselines
    assert image.moved_bytes >= 3 * alexnet.plan.moved_bytes and owt.moved_bytes >= 3 * alexnet.plan.moved_bytes
    # Inception-v3: the first layers on all workers, the last (8x8, 2048 channels) on fewer
    inception = plan_net(graphs["inception_v3"], 16, K80)
    assert inception.config("conv1_3x3_s2") == Config(16)
    assert inception.config("mixed_7c/1x1").workers < 16


def test_measured_costs_price_convolutions_with_the_engines(graphs):
    graph = layer_graph(os.path.join(REPO, "models", "alexnet", "deploy.prototxt"), batch=32)
    measured = plan_net(graph, 4, CostModel(gflops=100.0, bandwidth=10.0, kind="measured"))
    analytic = plan_net(graph, 4, CostModel(gflops=100.0, bandwidth=10.0))
    assert measured.plan.cost_ms <= min(s.cost_ms for s in measured.baselines) * (1 + 1e-12)
    conv = measured.costs.nodes["conv2"].compute_ms
    assert conv.shape == analytic.costs.nodes["conv2"].compute_ms.shape
    assert (conv != analytic.costs.nodes["conv2"].compute_ms).all()
    assert (measured.costs.nodes["pool1"].compute_ms == analytic.costs.nodes["pool1"].compute_ms).all()


def test_the_table_has_one_row_per_layer_and_a_footer(graphs):
    p = plan_net(graphs["vgg16"], 8, K80)
    text = format_text(p).splitlines()
    assert text[0].split()[:4] == ["layer", "type", "shape", "n"]
    rows = text[1:1 + len(p.graph.nodes)]
    assert [r.split()[0] for r in rows] == list(p.graph.nodes)
    fc6 = next(r for r in rows if r.startswith("fc6 ")).split()
    c = p.config("fc6")
    assert fc6[1:8] == ["InnerProduct", "512x4096", str(c.n), str(c.c), str(c.h), str(c.w), str(c.workers)]
    footer = text[1 + len(p.graph.nodes):]
    assert footer[0] == "" and "8 workers, batch 512" in footer[1]
    for label, s in zip(("plan", "image parallelism", "OWT"), [p.plan] + p.baselines):
        line = next(f for f in footer if f.startswith(label + " "))
        assert f"{s.cost_ms:.3f} ms/step" in line and f"{s.moved_bytes / 1e6:.1f} MB/step" in line
    assert footer[-1].startswith("search: 23 nodes -> 2 after 21 node and 0 edge eliminations (data, prob)")
