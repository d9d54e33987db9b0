"""The simulator of Lee et al.'s setting (``cct.distributed.simulate``): fitted on the two anchors of Fig. 6,
checked on the held-out figures of Figs. 8-9 and on the paper's qualitative findings."""
from __future__ import annotations

import pytest

from cct.distributed import simulate as sim


@pytest.fixture(scope="module")
def machine() -> sim.Machine:
    return sim.fit()


def test_the_fit_stays_in_plausible_ranges_and_near_the_anchors(machine):
    assert 1e-6 <= machine.alpha <= 2e-6 and 8e9 * (1 - 1e-9) <= 1 / machine.beta <= 10e9 * (1 + 1e-9)
    assert machine.speed <= sim.NODE_PEAK
    layers = sim.vgg()
    assert sum(x.params for x in layers) == pytest.approx(133e6, rel=0.01)  # the paper's 133 M parameters
    lee, dp = (sim.speedup(layers, 256, 128, machine, v) for v in ("Lee", "DP"))
    assert lee == pytest.approx(sim.ANCHORS["Lee"], rel=0.25)
    assert dp == pytest.approx(sim.ANCHORS["DP"], rel=0.35)
    assert lee > 2 * dp


@pytest.mark.parametrize("key", [("VGG-A", 512), ("VGG-128", 256), ("VGG-256", 256), ("VGG-512", 256)],
                         ids=lambda k: f"{k[0]}-N{k[1]}" if isinstance(k, tuple) else str(k))
def test_held_out_maximum_speedups_within_25_percent(machine, key):
    assert sim.max_speedup(key[0], key[1], machine) == pytest.approx(sim.HELD_OUT[key], rel=0.25)


@pytest.mark.xfail(strict=True, reason="Fig. 8's 17.82x at N = 128 needs an iteration on 128 nodes of one image "
                   "each slower than of two images each; no monotone compute model gives that (ours: ~46x)")
def test_held_out_n128(machine):
    assert sim.max_speedup("VGG-A", 128, machine) == pytest.approx(sim.HELD_OUT[("VGG-A", 128)], rel=0.25)


def test_the_papers_findings(machine):
    layers = sim.vgg()
    by_k = {k: sim.speedup(layers, 256, 128, machine, "Lee", k=k) for k in (3, 6, 9, 12)}
    assert max(by_k, key=by_k.get) == 9  # Fig. 11
    by_f = {f: sim.speedup(layers, 256, 128, machine, "Lee", f=f) for f in (0, 1, 2, 3)}
    assert max(by_f, key=by_f.get) == 2  # Fig. 10
    overlap = {p: sim.speedup(layers, 256, p, machine, "DP+Overlap") for p in (32, 128)}
    lee = {p: sim.speedup(layers, 256, p, machine, "Lee") for p in (32, 128)}
    assert overlap[128] < 1.3 * overlap[32] and lee[128] > 2 * lee[32]  # Fig. 12: DP+Overlap stalls past 32
    # Fig. 7: measurable (blocking) communication, above 0.5% of the iteration, first appears at 8 nodes
    exposed = [p for p in sim.NODES if (r := sim.simulate(layers, 256, p, machine, "Lee")).blocked > 0.005 * r.time]
    assert exposed[0] == 8


def test_the_table_and_the_eq11_ratio(machine):
    text = sim.table(machine)
    assert text.splitlines()[1].split() == ["P", "DP", "DP+Overlap", "Lee", "Lee", "R%"]
    assert len(text.splitlines()) == 2 + len(sim.NODES)
    r = sim.simulate(sim.vgg(), 256, 8, machine, "Lee")
    assert 0 < r.blocked < r.comm and r.ratio == pytest.approx(100 * (r.comm - r.blocked) / r.comm)
    assert sim.simulate(sim.vgg(), 256, 8, machine, "DP").ratio == pytest.approx(0.0, abs=1e-9)


def test_measured_profile_fits_a_line_per_layer():
    from google.protobuf import text_format

    from cct.net import NetCore
    from cct.proto import caffe_pb2 as pb
    from cct.pycaffe import Net

    param = pb.NetParameter()
    text_format.Parse("""force_backward: true
        layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 dim: 16 dim: 16 } } }
        layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 8 kernel_size: 3
                weight_filler { type: "gaussian" std: 0.1 } } }
        layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y" inner_product_param { num_output: 4
                weight_filler { type: "gaussian" std: 0.1 } } }""", param)
    net = Net.from_param(param, "<net>", None)
    assert isinstance(net, NetCore)
    profile = sim.measured_profile(net, ["x"], batches=(1, 3))
    assert set(profile) == {"x", "conv", "ip"}
    assert all(a >= 0 and b >= 0 for a, b in profile.values())
