"""Settings, the cost model's choices, the autotune cache and the per-layer description."""
from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, replace

import numpy as np
import pytest

import cct.layers.conv  # noqa: F401  (registers the layers)
from cct import log
from cct.config import settings, tristate
from cct.engines import ConvGeometry, autotune, choice, cost_model, measured
from cct.engines.lowering import LoweringEngine
from cct.errors import CctError
from cct.gradient_check import setup_layer
from tests.helpers import use_flags


def _geo(c: int, o: int, n: int = 32, k: int = 3, stride: int = 1) -> ConvGeometry:
    return ConvGeometry(8, c, o, 1, (n, n), (k, k), (stride, stride), (k // 2, k // 2), (1, 1))


def test_cost_model_follows_the_channel_ratio(monkeypatch):
    """(At the default rates: calibrated on a machine in a noisy minute, the GEMM rate against the copies' can move
    the choice on these small layers.)"""
    from cct.engines.cost_model import DEFAULT_RATES

    monkeypatch.setattr(choice, "machine_rates", lambda *a, **k: DEFAULT_RATES)
    settings.set("autotune", False)  # the model alone (with autotune fast these layers' close calls are measured)
    # few inputs, many outputs: lowering is cheap, lifting expensive -> type 1
    assert choice.choose_strategy(_geo(4, 256, k=5)) == (1, "cost model")
    # many inputs, few outputs -> type 3
    assert choice.choose_strategy(_geo(256, 4, k=5)) == (3, "cost model")
    costs = {s: cost_model.layer_costs(_geo(64, 64), s) for s in (1, 2, 3)}
    assert costs[1].lowered_elems > costs[2].lowered_elems > costs[3].lowered_elems
    assert costs[1].lifted_elems == 0 < costs[2].lifted_elems < costs[3].lifted_elems
    assert cost_model.channel_ratio(_geo(96, 256)) == 96 / 256


def test_paper_table_counts():
    """Per image, 2-D, stride 1, no padding: the lowered matrix and GEMM sizes of Fig. 6."""
    n, k, d, o = 10, 3, 4, 6
    m = n - k + 1
    g = ConvGeometry(1, d, o, 1, (n, n), (k, k), (1, 1), (0, 0), (1, 1))
    c1, c2, c3 = (cost_model.layer_costs(g, s) for s in (1, 2, 3))
    assert c1.lowered_elems == 2 * m * m * k * k * d  # forward + weight gradient
    assert c2.lowered_elems == 2 * n * m * k * d
    assert c3.lowered_elems == 2 * n * n * d
    assert c1.gemm_flops == 3 * 2 * m * m * k * k * d * o
    assert c2.gemm_flops == 3 * 2 * n * m * k * d * k * o
    assert c3.gemm_flops == 3 * 2 * n * n * d * k * k * o
    assert c3.lifted_elems == 2 * k * k * o * n * n


def test_only_lowering_1_applies_to_strided_layers():
    assert choice.choose_strategy(_geo(3, 96, n=227, k=11, stride=4)) == (1, "cost model: only lowering 1 applies")


def test_settings_flags_and_errors():
    use_flags("2", "3")
    assert (settings.get("lowering"), settings.source("lowering")) == (2, "-lowering")
    assert (settings.get("partitions"), settings.source("partitions")) == (3, "-partitions")
    use_flags(None, "auto")
    assert settings.get("lowering") == 2 and settings.get("partitions") is None
    with pytest.raises(CctError, match="lowering must be"):
        use_flags("4", None)
    with pytest.raises(CctError, match="partitions must be"):
        use_flags(None, "0")


def test_settings_follow_the_environment_as_it_changes(monkeypatch):
    monkeypatch.delenv("CCT_PARTITIONS", raising=False)
    assert (settings.get("partitions"), settings.source("partitions")) == (None, "default")
    monkeypatch.setenv("CCT_PARTITIONS", "3")
    assert (settings.get("partitions"), settings.source("partitions")) == (3, "CCT_PARTITIONS")
    monkeypatch.setenv("CCT_PARTITIONS", "5")
    assert settings.get("partitions") == 5
    monkeypatch.setenv("CCT_PARTITIONS", "none of these")
    with pytest.raises(CctError, match="CCT_PARTITIONS: partitions must be"):
        settings.get("partitions")
    monkeypatch.delenv("CCT_PARTITIONS")
    assert settings.get("partitions") is None
    # an environment that is a plain mapping (no dictionary of bytes behind it) is read through the mapping
    monkeypatch.setattr(os, "environ", {"CCT_PARTITIONS": "4"})
    assert settings.get("partitions") == 4


def test_describe_layer_engine():
    x = np.zeros((2, 3, 9, 9), dtype=np.float32)
    use_flags("2", "1")
    run = setup_layer('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }', [x])
    assert choice.describe_layer_engine(run.layer) == "lowering 2 (forced by -lowering)"
    run = setup_layer('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 stride: 2 }', [x])
    # the engine setting is auto: the layer's line also says why the fft engine is not used
    assert choice.describe_layer_engine(run.layer) == "lowering 1 (fallback: stride 2); not fft: stride 2 > 1"
    use_flags("auto", "2")
    run = setup_layer('type: "Convolution" convolution_param { num_output: 64 kernel_size: 3 }', [x])
    assert choice.describe_layer_engine(run.layer) == "lowering 1 (cost model), 2 partitions"


def test_choice_is_logged_once_per_layer():
    x = np.zeros((2, 8, 9, 9), dtype=np.float32)
    use_flags("3", None)
    stream = io.StringIO()
    log.init_log(0, stream)
    try:
        run = setup_layer('name: "c" type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }', [x])
        run.forward()
        run.forward()
    finally:
        log.init_log()
    lines = [line for line in stream.getvalue().splitlines() if "lowering" in line]
    assert len(lines) == 1 and "] Convolution layer c: lowering 3 (forced by -lowering) [d/o = 8/4" in lines[0]


def test_autotune_writes_and_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "c"))
    rates = replace(cost_model.DEFAULT_RATES, gemm_flops=1.1e11)  # as calibrated (not the defaults themselves)
    for module in (autotune, choice):
        monkeypatch.setattr(module, "machine_rates", lambda *a, **k: rates)
    settings.set("autotune", True)
    g = _geo(8, 8, n=10)
    strategy, reason = choice.choose_strategy(g)
    assert reason == "autotuned" and strategy in (1, 2, 3)
    path = tmp_path / "c" / "autotune.json"
    data = json.loads(path.read_text())
    key = autotune.lowering_key(g, np.float32)
    assert set(data["autotune"][key]) == {"1", "2", "3"}
    errors = data["model_error"][autotune._model_error_key(g, np.float32)]  # and each lowering's model error
    assert set(errors) == {"lowering 1", "lowering 2", "lowering 3"} and all(r > 0 for r in errors.values())

    def fail(*a, **k):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(LoweringEngine, "forward", fail)
    assert choice.choose_strategy(g) == (strategy, "autotuned")
    eng = choice.SelectedEngine("lowering", lowering="auto")
    eng.configure(g)
    assert eng.describe() == f"lowering {strategy} (autotuned)"
    settings.set("autotune", False)
    assert choice.choose_strategy(g)[1] == "cost model"
    for text, value in (("auto", "auto"), ("", "auto"), ("1", True), ("never", False)):
        assert tristate(text, "autotune", "test") == value
    with pytest.raises(CctError, match="autotune must be"):
        tristate("sometimes", "autotune", "test")


def test_cache_dir_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("CCT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert measured.cache_path() == tmp_path / "cct" / "autotune.json"


def test_calibration_runs_once_per_machine_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "_rates_memo", {})
    assert autotune.machine_rates() == cost_model.DEFAULT_RATES  # not calibrated, not measured on demand
    rates = autotune.machine_rates(calibrate_if_missing=True)
    fields = cost_model.MachineRates.__dataclass_fields__
    assert all(getattr(rates, f) > 0 for f in fields)
    data = json.loads(measured.cache_path().read_text())
    assert data["rates"][autotune._rates_key()] == {f: getattr(rates, f) for f in fields}

    def fail(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(autotune, "calibrate", fail)
    monkeypatch.setattr(autotune, "_rates_memo", {})  # a new process: read from the cache
    assert autotune.machine_rates(calibrate_if_missing=True) == rates
    assert set(choice.predicted_seconds(_geo(8, 8))) == {1, 2, 3}


def test_measurements_are_cached_per_blas_kernel(monkeypatch):
    """A speed measured under one BLAS kernel (OPENBLAS_CORETYPE=Haswell's AVX2) is not reused under another
    (SkylakeX's AVX-512, about twice as fast) on the same machine."""
    from cct.device import query

    def kernel(name):
        monkeypatch.setattr(query, "blas_libraries",
                            lambda: [query.BlasLibrary("openblas", "0.3.30", name, 2, "libopenblas.so")])
        measured._machine_digest.cache_clear()
        return autotune._threads_key(), autotune._rates_key(), query.machine_key()

    try:
        haswell, skylake = kernel("Haswell"), kernel("SkylakeX")
        assert all(a != b for a, b in zip(haswell, skylake))
        assert kernel("Haswell") == haswell  # and stable
        numpys, scipys = (query.BlasLibrary("openblas", v, "SkylakeX", 2, f"lib{v}.so") for v in ("0.3.31", "0.3.30"))
        keys = []
        for libs in ([numpys, scipys], [scipys, numpys]):  # threadpoolctl lists them in no fixed order
            monkeypatch.setattr(query, "blas_libraries", lambda libs=libs: libs)
            keys.append(query.machine_key())
        assert keys[0] == keys[1]
        rates = replace(cost_model.DEFAULT_RATES, gemm_flops=1.0)
        autotune._write_cache({"rates": {haswell[1]: asdict(rates)}})
        kernel("SkylakeX")
        monkeypatch.setattr(autotune, "_rates_memo", {})
        assert autotune.machine_rates() == cost_model.DEFAULT_RATES  # Haswell's entry is not this kernel's
        kernel("Haswell")
        monkeypatch.setattr(autotune, "_rates_memo", {})
        assert autotune.machine_rates() == rates  # ... and is that kernel's
    finally:
        measured._machine_digest.cache_clear()


def test_the_fft_model_runs_at_the_machines_calibrated_fft_rates():
    """The FFT engine's predictions follow the calibrated transform rate and fixed cost per call (the
    constants fitted on an AVX2 machine overestimated a Zen 5 machine's FFT layers 2x, so auto never
    measured FFT on 3^3 3-D layers where it is the faster engine)."""
    from cct.engines.fft import FFTEngine

    g = ConvGeometry(1, 16, 16, 1, (30, 30, 30), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    base = cost_model.DEFAULT_RATES
    faster = replace(base, fft_flops=2 * base.fft_flops, fft_call_s=base.fft_call_s + 1e-3)
    a, b = FFTEngine.estimate(g, 4, base)["full"], FFTEngine.estimate(g, 4, faster)["full"]
    transforms = a["transform_flops"] / base.fft_flops
    assert b["seconds"] == pytest.approx(a["seconds"] - transforms / 2 + 1e-3)
    rates = autotune.calibrate(save=False)
    assert rates.fft_flops > 0 and 0 < rates.fft_call_s < 0.05
    assert 0 < rates.part_share <= 1  # one partition alone: at most the whole machine's copy rate


def test_gemm_speed_depends_on_shape():
    r = cost_model.DEFAULT_RATES
    square = cost_model.gemm_seconds(512, 512, 4096, r)
    assert 2 * 512 * 512 * 4096 / r.gemm_flops < square < 1.2 * 2 * 512 * 512 * 4096 / r.gemm_flops
    # the same flops with 16 output rows or a 16-long inner dimension run slower
    assert cost_model.gemm_seconds(16, 512, 32 * 4096, r) > 1.5 * square
    assert cost_model.gemm_seconds(512, 16, 32 * 4096, r) > 1.5 * square
    c = cost_model.layer_costs(_geo(8, 16), 1)
    assert c.gemm_shapes == ((16, 72, 8 * 32 * 32), (72, 16, 8 * 32 * 32), (72, 8 * 32 * 32, 16))
    # where one partition copies as fast as all, partitions share the machine: same time, give or take the GEMM
    # shapes
    whole = replace(r, part_share=1.0)
    one, two = cost_model.estimate_seconds(c, whole, 1), cost_model.estimate_seconds(c, whole, 2)
    assert one <= two < 1.1 * one


def test_fewer_partitions_than_the_machine_copy_at_their_share():
    """The copy passes run on the partitions' threads: a layer with fewer partitions than the machine (one 3-D
    volume on 16 cores) runs them at ``parts · part_share`` of the machine's rates (at most all of them), its GEMMs
    on all the cores still; one 2-D image's lowering runs over the cores (the compiled im2col splits its
    channels), its col2im does not."""
    r = replace(cost_model.DEFAULT_RATES, part_share=0.25)
    whole = replace(r, part_share=1.0)
    g = ConvGeometry(1, 8, 8, 1, (30, 30, 30), (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    c = cost_model.layer_costs(g, 1)
    assert not c.lowering_over_cores and c.col2im_elems > 0 and c.lowered_elems > 0
    for parts, scale in ((1, 4.0), (2, 2.0), (4, 1.0), (16, 1.0)):
        gemms = cost_model.pass_seconds(replace(c, lowered_elems=0.0, col2im_elems=0.0, transpose_elems=0.0), r,
                                        parts)
        copies = [a - b for a, b in zip(cost_model.pass_seconds(c, whole, parts), gemms)]
        forward, backward = cost_model.pass_seconds(c, r, parts)
        assert forward == pytest.approx(gemms[0] + scale * copies[0])
        assert backward == pytest.approx(gemms[1] + scale * copies[1])
    flat = ConvGeometry(1, 8, 8, 1, (30, 30), (3, 3), (1, 1), (1, 1), (1, 1))
    c2 = cost_model.layer_costs(flat, 1)
    assert c2.lowering_over_cores and not cost_model.layer_costs(replace(flat, num=2), 1).lowering_over_cores
    lowering = c2.lowered_elems / 2 / r.lower_elems
    others = cost_model.pass_seconds(replace(c2, lowered_elems=0.0), r, 1)
    assert cost_model.pass_seconds(c2, r, 1) == pytest.approx((others[0] + lowering, others[1] + lowering))
    assert others[1] > cost_model.pass_seconds(replace(c2, lowered_elems=0.0), whole, 1)[1]  # col2im: one thread



# rates calibrated on a 16-core Intel Xeon (AVX-512): GEMMs reach half speed only at 40 rows, a 54-long inner
# dimension and 194 columns
MANY_CORE_RATES = cost_model.MachineRates(gemm_flops=1.398e12, lower_elems=1.069e10, lift_elems=8.76e9,
                                          transpose_elems=5.91e9, gemm_m0=40.0, gemm_k0=54.5, gemm_n0=193.6,
                                          col2im_elems=1.266e10)
CAFFENET_CONV2 = ConvGeometry(64, 96, 256, 2, (27, 27), (5, 5), (1, 1), (2, 2), (1, 1))


def test_type_2_on_wide_outputs_is_costed_as_the_per_image_gemms_it_runs():
    """Type 2 on wide host outputs runs its forward and data gradient as one GEMM per image, group and lifted
    offset (O/group rows, an image's output cells), summing the lifting itself: the model counts those GEMMs
    and no forward lifting or transposing pass.  On a machine whose GEMMs need long rows to run fast (16
    partitions of the Xeon above) that ranks CaffeNet's conv2 as measured there: type 1 (97.7 ms forward +
    backward) ahead of type 2 (140.7 ms), which the model without the pieces had the other way round."""
    from cct.engines.lowering import lifts_per_image

    g = CAFFENET_CONV2
    assert lifts_per_image(g, 2) and not lifts_per_image(g, 1) and not lifts_per_image(g, 3)
    assert not lifts_per_image(replace(g, in_shape=(13, 13)), 2)  # narrow outputs: the images innermost
    plain, pieces = cost_model.layer_costs(g, 2), cost_model.layer_costs(g, 2, per_image_lifting=True)
    assert pieces.gemm_pieces == (64 * 5, 64 * 5) and plain.gemm_pieces == (1, 1)
    assert pieces.gemm_shapes[0] == (128, 48 * 5, 5 * 27 * 27 * 64) and pieces.gemm_shapes[2] == plain.gemm_shapes[2]
    assert pieces.lifted_forward == pieces.transpose_forward == 0 < pieces.lifted_elems == plain.lifted_elems / 2
    seconds = {s: cost_model.estimate_seconds(cost_model.layer_costs(g, s, per_image_lifting=s == 2),
                                              MANY_CORE_RATES, 16) for s in (1, 2)}
    assert seconds[1] < seconds[2]
    old = cost_model.estimate_seconds(plain, MANY_CORE_RATES, 16)
    assert old < seconds[1] < seconds[2]


def test_pointwise_layers_are_costed_as_gemms_on_the_blobs():
    """A 1x1 kernel of stride 1 without padding runs its GEMMs image by image on the blobs themselves: no
    lowering, col2im or transposition is counted, the forward and data GEMMs come in one piece per image; with a
    stride, the subsample's copies (forward and weight gradient) and its scatter back are counted, still no
    transposition; a padded 1x1 kernel is lowered as any other."""
    g = ConvGeometry(10, 512, 24, 1, (14, 14), (1, 1), (1, 1), (0, 0), (1, 1))
    c = cost_model.layer_costs(g, 1)
    assert c.lowered_elems == c.col2im_elems == c.transpose_elems == c.traffic_bytes == 0
    assert c.gemm_pieces == (10, 10) and c.gemm_shapes[0] == (24, 512, 10 * 14 * 14)
    strided = cost_model.layer_costs(replace(g, stride=(2, 2)), 1)
    assert strided.lowered_elems == 2 * 512 * 7 * 7 * 10 and strided.col2im_elems == 512 * 14 * 14 * 10
    assert strided.transpose_elems == 0 and strided.gemm_pieces == (10, 10)
    lowered = cost_model.layer_costs(replace(g, pad=(1, 1)), 1)
    assert lowered.lowered_elems > 0 and lowered.transpose_elems > 0 and lowered.gemm_pieces == (1, 1)
    forward, backward = cost_model.pass_seconds(c)
    assert forward == pytest.approx(10 * cost_model.gemm_seconds(24, 512, 14 * 14))
    (estimate,) = LoweringEngine.estimates(g)
    assert estimate.workspace_bytes == 0


def test_the_weight_gradient_is_costed_in_its_faster_orientation():
    """The engine measures ``col · dZᵀ`` against ``dZ · colᵀ`` and keeps the faster: a weight gradient with few
    output channels (few columns one way, few rows the other) costs the faster of the two."""
    r = MANY_CORE_RATES
    c = cost_model.layer_costs(CAFFENET_CONV2, 1)
    rows, inner, cols = c.gemm_shapes[2]
    assert cols == 128 < rows
    _, backward = cost_model.pass_seconds(c, r, 16)
    forward_like = replace(c, gemm_shapes=c.gemm_shapes[:2] + ((cols, inner, rows),))
    swapped = replace(c, gemm_shapes=c.gemm_shapes[:2] + ((rows, inner, cols),))
    assert cost_model.pass_seconds(forward_like, r, 16)[1] == backward == cost_model.pass_seconds(swapped, r, 16)[1]
    slow = c.groups * 16 * cost_model.gemm_seconds(rows, inner / 16, cols, r)
    fast = c.groups * 16 * cost_model.gemm_seconds(cols, inner / 16, rows, r)
    assert fast < 0.8 * slow

def _fixed_model(monkeypatch, seconds: dict[int, float]) -> list:
    """The model predicts ``seconds``; autotune records its candidates and measures type 2 fastest."""
    calls = []
    monkeypatch.setattr(choice, "predicted_seconds", lambda g, rates=None: dict(seconds))
    monkeypatch.setattr(choice, "machine_rates", lambda calibrate_if_missing=False: cost_model.DEFAULT_RATES)

    def fake_autotune(g, dtype=np.float32, candidates=None, images=None):
        calls.append(sorted(candidates or (1, 2, 3)))
        return {s: (0.5 if s == 2 else 1.0) for s in (candidates or (1, 2, 3))}

    monkeypatch.setattr(choice, "autotune", fake_autotune)
    return calls


def test_auto_measures_only_close_calls_on_big_layers(monkeypatch):
    g = _geo(64, 64)
    calls = _fixed_model(monkeypatch, {1: 0.105, 2: 0.1, 3: 0.5})  # big, 1 and 2 within the window
    assert choice.choose_strategy(g) == (2, "autotuned") and calls == [[1, 2]]
    calls = _fixed_model(monkeypatch, {1: 0.35, 2: 0.1, 3: 0.5})  # big, a clear winner: no measurement
    assert choice.choose_strategy(g) == (2, "cost model") and calls == []
    # the others within the model's error between lowerings (on a 16-core Xeon lowering 3 was predicted 2.6x
    # faster than lowering 2 and ran slower): measured
    calls = _fixed_model(monkeypatch, {1: 0.35, 2: 0.07, 3: 0.027})
    assert choice.choose_strategy(g) == (2, "autotuned") and calls == [[2, 3]]
    # type 1 predicted fastest, type 2 within the model's error (the CcT sweep at d/o = 1/4 on an Intel Xeon:
    # predicted 93 vs 94 ms, ran 96 vs 86): measured too
    calls = _fixed_model(monkeypatch, {1: 0.1, 2: 0.12, 3: 0.5})
    assert choice.choose_strategy(g) == (2, "autotuned") and calls == [[1, 2]]
    calls = _fixed_model(monkeypatch, {1: 0.0106, 2: 0.01, 3: 0.05})  # medium: measured as well (16 cores)
    assert choice.choose_strategy(g) == (2, "autotuned") and calls == [[1, 2]]
    calls = _fixed_model(monkeypatch, {1: 0.0042, 2: 0.004, 3: 0.02})  # small: the model, type 1 within 5%
    assert choice.choose_strategy(g) == (1, "cost model") and calls == []
    calls = _fixed_model(monkeypatch, {1: 0.0048, 2: 0.0025, 3: 0.02})
    assert choice.choose_strategy(g) == (2, "cost model") and calls == []
    calls = _fixed_model(monkeypatch, {1: 0.0009, 2: 0.0001, 3: 0.0002})  # saves < 1 ms: Caffe's order
    assert choice.choose_strategy(g) == (1, "cost model") and calls == []
    settings.set("autotune", False)
    calls = _fixed_model(monkeypatch, {1: 0.105, 2: 0.1, 3: 0.5})
    assert choice.choose_strategy(g) == (1, "cost model") and calls == []


def test_lowering_predictions_are_scaled_by_their_measured_error(monkeypatch):
    """Each lowering's prediction is scaled by the median error measured for it on this machine (the lowerings'
    measurements keep measured / predicted per strategy): lowering 3 running 2x its model loses a layer the model
    alone gave it."""
    g = _geo(64, 64)
    settings.set("autotune", False)  # the models alone (scaled)
    _fixed_model(monkeypatch, {1: 0.2, 2: 0.15, 3: 0.1})
    assert choice.choose_strategy(g) == (3, "cost model")
    for other in (_geo(8, 8), _geo(16, 16), _geo(32, 32)):
        measured._write_cache({"model_error": {autotune._model_error_key(other, np.float32): {"lowering 3": 2.0}}})
    assert autotune.model_errors() == {"lowering 3": 2.0}
    assert choice.choose_strategy(g) == (2, "cost model")  # 0.15 against 2 x 0.1
    settings.set("autotune", "auto")  # all three within 3x of the best scaled (0.15): a close call, measured
    calls = _fixed_model(monkeypatch, {1: 0.2, 2: 0.15, 3: 0.1})
    assert choice.choose_strategy(g) == (2, "autotuned") and calls == [[1, 2, 3]]


def test_autotune_measures_one_chunk_of_the_layer(monkeypatch):
    g = ConvGeometry(64, 8, 8, 1, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1))
    settings.set("partitions", 2)
    sizes = []
    real_configure = LoweringEngine.configure

    def spy(self, geometry, dtype=None):
        sizes.append(geometry.num)
        return real_configure(self, geometry, dtype)

    monkeypatch.setattr(LoweringEngine, "configure", spy)
    monkeypatch.setattr(autotune, "AUTOTUNE_BYTES", 0)
    times = autotune.autotune(g, np.float32, [2, 3])
    assert set(times) == {2, 3} and all(t > 0 for t in times.values())
    # 1024 GEMM columns per partition at 144 per image: 8 images each, 16 of the 64
    assert sizes[2:4] == [16, 16] and set(sizes[4:]) <= {16, 64}  # (after each engine's configure on the layer;
    # a close call is measured again on the chunk, then on the whole batch: which lowerings are close is the
    # machine's timing)
    cached = json.loads(measured.cache_path().read_text())["autotune"][autotune.lowering_key(g, np.float32)]
    assert set(cached) == {"2", "3"}
    # enough images for 64 MB of buffers: more than a partition's chunk (32 images), so one chunk each
    monkeypatch.setattr(autotune, "AUTOTUNE_BYTES", 64 << 20)
    sizes.clear()
    autotune.autotune(replace(g, in_channels=4), np.float32, [1, 2])
    assert sizes[2:4] == [64, 64] and set(sizes[4:]) <= {64}
    # the largest of the candidates' chunks: within 1 MiB per partition type 1 lowers 2 images of this layer at a
    # time (389 KB each), type 2 eight (130 KB): 8 images per partition, 16 of the 64 (type 1's chunk: 4)
    settings.set("lowering_max_mb", 2)
    sizes.clear()
    monkeypatch.setattr(autotune, "AUTOTUNE_BYTES", 0)
    monkeypatch.setattr(autotune, "AUTOTUNE_COLUMNS", 4096)
    autotune.autotune(ConvGeometry(64, 64, 64, 1, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1)), np.float32, [1, 2])
    assert sizes[2:4] == [16, 16]


def test_every_engine_prices_a_geometry_through_one_contract():
    from cct.engines import ConvGeometry, estimate_convolution

    g = ConvGeometry(4, 16, 32, 1, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1))
    est = estimate_convolution(g)
    assert set(est) == {"lowering 1", "lowering 2", "lowering 3", "fft full", "fft lifted", "winograd 2", "winograd 4"}
    for variant, e in est.items():
        assert e.variant == variant and e.engine == variant.split()[0]
        assert 0 < e.forward_seconds < e.seconds and e.workspace_bytes > 0
    strided = ConvGeometry(4, 16, 32, 1, (12, 12), (3, 3), (2, 2), (1, 1), (1, 1))
    assert set(estimate_convolution(strided)) == {"lowering 1", "fft full", "fft lifted"}
    pointwise = ConvGeometry(4, 16, 32, 1, (12, 12), (1, 1), (1, 1), (0, 0), (1, 1))
    assert "lowering 2" not in estimate_convolution(pointwise)
    # more images cost more, in time and (up to the chunk budget) in lowering workspace
    big = estimate_convolution(ConvGeometry(16, 16, 32, 1, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1)))
    assert big["lowering 1"].seconds > est["lowering 1"].seconds
    assert big["lowering 1"].workspace_bytes > est["lowering 1"].workspace_bytes


def test_a_net_that_runs_no_backward_chooses_each_convolution_by_its_forward_time(monkeypatch, tmp_path):
    """TEST phase without force_backward (``cct test``, a solver's test nets, a deploy net in pycaffe): the models
    predict the forward alone (a lowering with the cheaper forward wins where its backward would have lost it the
    training step), the layer says so, and a TRAIN net, or a TEST one with force_backward, keeps the training
    step's choice."""
    from cct.engines.base import Estimate, choosing_for_forward_only, forward_only

    # type 1: forward 50 ms, backward 200; type 2: 100 and 50; type 3: 300 and 300 (the models alone)
    passes = {1: (0.05, 0.2), 2: (0.1, 0.05), 3: (0.3, 0.3)}
    monkeypatch.setattr(choice, "layer_costs", lambda g, s, per_image_lifting=False: s)
    monkeypatch.setattr(cost_model, "pass_seconds", lambda s, rates=None, parts=1: passes[s])
    monkeypatch.setattr(choice, "machine_rates", lambda calibrate_if_missing=False: cost_model.DEFAULT_RATES)
    settings.set("autotune", False)
    use_flags("auto", conv_engine="lowering")
    g = _geo(64, 64)
    assert not forward_only() and choice.choose_strategy(g) == (2, "cost model")
    with choosing_for_forward_only(True):
        assert forward_only() and choice.predicted_seconds(g) == {1: 0.05, 2: 0.1, 3: 0.3}
        assert choice.choose_strategy(g) == (1, "cost model, forward pass")
        assert Estimate("lowering", "lowering 2", 0.1, 0.05, 0).chosen_seconds == 0.1
    assert Estimate("lowering", "lowering 2", 0.25, 0.5, 0).chosen_seconds == 0.75

    net_file = tmp_path / "net.prototxt"
    conv = ('layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
            'convolution_param { num_output: 64 kernel_size: 3 pad: 1 } }')
    for phase, force, forward in (("TEST", False, True), ("TRAIN", False, False), ("TEST", True, False)):
        net_file.write_text(f'force_backward: {str(force).lower()}\n'
                            'layer { name: "data" type: "Input" top: "data" '
                            'input_param { shape { dim: 2 dim: 64 dim: 32 dim: 32 } } }\n' + conv)
        net = cct.Net(str(net_file), getattr(cct, phase))
        layer = net.layers[1]
        assert layer.engine.forward_only == forward
        assert layer.engine.strategy == (1 if forward else 2)
        assert ("(cost model, forward pass)" in choice.describe_layer_engine(layer)) == forward
        net.blobs["data"].reshape(1, 64, 32, 32)  # chosen again at the new geometry, for the same passes
        net.reshape()
        assert layer.engine.strategy == (1 if forward else 2)


def test_a_forward_only_measurement_times_the_forward_alone_and_is_kept_apart(monkeypatch):
    """The lowerings measured for a net that runs no backward: forward steps only, cached under a key of their
    own (a training net's measurement of the same layer is another), and no model error recorded (the errors
    kept are of training steps)."""
    from cct.engines.base import choosing_for_forward_only

    g = ConvGeometry(8, 8, 8, 1, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1))
    backward_calls = []
    real_backward = LoweringEngine.backward

    def spy(self, *args, **kwargs):
        backward_calls.append(1)
        return real_backward(self, *args, **kwargs)

    monkeypatch.setattr(LoweringEngine, "backward", spy)
    recorded = []
    calibrated = replace(cost_model.DEFAULT_RATES)  # rates of this machine's (not the defaults): errors recorded
    monkeypatch.setattr(autotune, "machine_rates", lambda calibrate_if_missing=False: calibrated)
    monkeypatch.setattr(autotune, "_write_cache", lambda entry, real=autotune._write_cache: (
        recorded.extend(entry), real(entry)))
    with choosing_for_forward_only(True):
        key = autotune.lowering_key(g, np.float32)
        assert key.endswith("-fwd") and autotune.autotune(g, np.float32, [1, 2])
    assert not backward_calls and "model_error" not in recorded
    cached = json.loads(measured.cache_path().read_text())["autotune"]
    assert set(cached) == {key}
    assert autotune.autotune(g, np.float32, [1, 2]) and backward_calls
    assert set(json.loads(measured.cache_path().read_text())["autotune"]) == {key, autotune.lowering_key(g, np.float32)}
    assert "model_error" in recorded
