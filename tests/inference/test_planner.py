"""The planner: valid sizes only, within the budget, the fastest fitting primitive per layer, what it prints,
the one-line error for a budget too small, MPF preferred with two or more poolings, -plan measure."""
from __future__ import annotations

import re

import pytest

from cct.engines.cost_model import DEFAULT_RATES
from cct.errors import CctError
from cct.inference import load_spec
from cct.inference.memory import run_memory
from cct.inference.planner import candidates, plan_inference
from tests.inference.helpers import deploy_param


@pytest.fixture(scope="module")
def n337():
    return load_spec(deploy_param("n337_w8"))


def test_candidates_are_valid_and_fit_the_budget(n337):
    budget = 512 << 20
    plans, _ = candidates(n337, (150, 150, 150), budget, rates=DEFAULT_RATES)
    assert plans and plans == sorted(plans, key=lambda p: -p.throughput)
    for p in plans:
        assert p.memory <= budget
        assert n337.output_size(p.mpf, p.run_input) == p.out_size  # only valid sizes
        assert p.tile == tuple(8 * j for j in p.out_size)
        assert p.shifts == 8 ** (3 - sum(p.mpf))
        run = run_memory(n337, p.mpf, p.batch, p.run_input, p.primitives)
        assert run.peak <= p.memory
    assert any(all(p.mpf) for p in plans) and any(not any(p.mpf) for p in plans)


def test_mpf_wins_on_the_two_pooling_net():
    """ctm_valid at a 48^3 output and a generous budget: all pooling as MPF, batch 1, one 73^3 patch."""
    spec = load_spec(deploy_param("ctm_valid"))
    plan = plan_inference(spec, (48, 48, 48), 1 << 30, rates=DEFAULT_RATES, report=lambda line: None)
    assert all(plan.mpf) and plan.batch == 1 and plan.run_input == (73, 73, 73) and plan.tiles == 1


def test_bigger_budgets_give_bigger_patches(n337):
    sizes = []
    for mib in (192, 512, 2048):
        plan = plan_inference(n337, (300, 300, 300), mib << 20, rates=DEFAULT_RATES, report=lambda line: None)
        assert plan.memory <= mib << 20
        sizes.append(plan.run_input[0])
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_engine_restriction(n337):
    for engine in ("lowering", "fft"):
        plan = plan_inference(n337, (100,) * 3, 1 << 30, engine=engine, rates=DEFAULT_RATES, report=lambda line: None)
        assert all(v.startswith(engine) for v in plan.primitives.values())
    with pytest.raises(CctError, match="-engine cudnn: expected auto, lowering or fft"):
        plan_inference(n337, (100,) * 3, 1 << 30, engine="cudnn", rates=DEFAULT_RATES)


def test_prints_the_plan(n337):
    lines: list[str] = []
    plan = plan_inference(n337, (192, 192, 192), 2 << 30, rates=DEFAULT_RATES, report=lines.append)
    assert re.fullmatch(r"planner: net n337_w8, FOV 85x85x85, 3 pooling -> MPF x512, batch \d, budget 2048\.0 MiB",
                        lines[0])
    cands = [line for line in lines if line.startswith("candidate ")]
    assert 1 <= len(cands) <= 5
    assert all(re.fullmatch(r"candidate input \d+\^3 -> output \d+\^3( \(.*\))?: [0-9.e-]+ s, [0-9,]+ vox/s, "
                            r"peak [0-9.]+ MiB", line) for line in cands), cands
    chosen = next(line for line in lines if line.startswith("chosen "))
    tiles = plan.tiles
    assert re.fullmatch(rf"chosen input (\d+)x\1x\1 -> output (\d+)x\2x\2, {tiles} tiles for volume 276\^3, peak "
                        rf"[0-9.]+ MiB of 2048\.0 MiB \([0-9.]+%\), predicted [0-9,]+ vox/s", chosen), chosen
    layers = lines[lines.index(chosen) + 1:]
    assert re.fullmatch(rf"conv1 \(1->8, 2\^3, in \d+\^3 x{plan.batch}\): (lowering [123]|fft full|fft lifted) "
                        r"[0-9.]+ [KM]iB [0-9.e-]+ s", layers[0]), layers[0]
    assert f"pool1: mpf 2^3 (batch {plan.batch} -> {8 * plan.batch})" in layers
    assert sum(line.startswith("conv") for line in layers) == 7


def test_budget_too_small_is_one_line_naming_the_layer_and_the_minimum(n337):
    with pytest.raises(CctError) as e:
        plan_inference(n337, (200, 200, 200), 4 << 20, rates=DEFAULT_RATES)
    msg = str(e.value)
    m = re.fullmatch(r"memory budget 4\.0 MiB is too small for net n337_w8: the smallest valid patch \(input (\d+)\^3, "
                     r"output (\d+)\^3\) needs ([0-9.]+) MiB at layer (\w+)( \([a-z0-9 ]+\))?; use -memory_budget >= "
                     r"(\d+) MiB", msg)
    assert m, msg
    need = int(m.group(6))
    plan = plan_inference(n337, (200, 200, 200), need << 20, rates=DEFAULT_RATES, report=lambda line: None)
    assert plan.memory <= need << 20, "the minimum named in the message is enough"


def test_measure_takes_the_fastest_measured(n337):
    lines: list[str] = []
    measured = []

    def fake(plan):  # the second best predicted runs fastest
        measured.append(plan)
        return 1.0 if len(measured) != 2 else 0.01
    plan = plan_inference(n337, (150,) * 3, 1 << 30, mode="measure", measure=fake, rates=DEFAULT_RATES,
                          report=lines.append)
    assert plan is measured[1] and len(measured) == 5
    assert any("measured" in line for line in lines if line.startswith("candidate"))
    with pytest.raises(CctError, match="-plan fast: expected auto or measure"):
        plan_inference(n337, (150,) * 3, 1 << 30, mode="fast", rates=DEFAULT_RATES)


def test_one_pooling_net_considers_batches():
    """With one pooling layer ZNNi finds S > 1 worth trying (Fig. 4): the candidates include batches."""
    from cct.io.prototxt import parse_net_param

    spec = load_spec(parse_net_param("""
name: "one"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 9 dim: 9 dim: 9 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "p1" type: "Pooling" bottom: "c1" top: "p1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "c2" type: "Convolution" bottom: "p1" top: "c2" convolution_param { num_output: 2 kernel_size: 3 } }
"""))
    plans, _ = candidates(spec, (64, 64, 64), 256 << 20, rates=DEFAULT_RATES)
    assert {p.batch for p in plans} >= {1, 2}
    assert {p.mpf for p in plans} == {(True,), (False,)}


def test_forward_factors_are_measured_once_and_cached(monkeypatch):
    """The per-primitive forward factors: measured on the probe layers, then read from the cache."""
    from cct.engines import ConvGeometry
    from cct.inference import planner

    monkeypatch.setattr(planner, "_PROBES", (ConvGeometry(2, 2, 3, 1, (9, 9, 9), (3, 3, 3), (1,) * 3, (0,) * 3,
                                                          (1,) * 3),))
    assert planner.forward_factors(DEFAULT_RATES, measure=False) == {p: 1.0 for p in planner.PRIMITIVES}
    factors = planner.forward_factors(DEFAULT_RATES)
    assert set(factors) == set(planner.PRIMITIVES) and all(f > 0 for f in factors.values())
    monkeypatch.setattr(planner, "_PROBES", ())  # a second call must not measure
    assert planner.forward_factors(DEFAULT_RATES) == factors
    spec = load_spec(deploy_param("ctm_valid"))
    scaled = plan_inference(spec, (48,) * 3, 1 << 30, rates=DEFAULT_RATES, factors={p: 2.0 for p in factors},
                            report=lambda line: None)
    plain = plan_inference(spec, (48,) * 3, 1 << 30, rates=DEFAULT_RATES, factors={p: 1.0 for p in factors},
                           report=lambda line: None)
    assert scaled.primitives == plain.primitives
    assert scaled.seconds > 1.5 * plain.seconds
