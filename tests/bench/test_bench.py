"""``cct bench``: it measures what ``cct time`` measures (proven with a simulated clock, so exactly and on any
machine), the derived figures follow their formulas, the JSON has exactly the documented keys, nets resolve
by name, and ``-report`` renders the side-by-side table and the chart."""
from __future__ import annotations

import json
import os
import re
import sys
import types

import pytest

import cct
from cct import cli
from cct.bench import bench, timing
from cct.bench.bench import RESULT_KEYS, load_result, report_rows, report_table, resolve_model
from cct.errors import CctError
from cct.exec.serial import LayerRunner
from tests.solvers.helpers import captured_log, messages

TINY = """name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 12 dim: 12 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
"""
ENGINE = ["-conv_engine", "lowering", "-lowering", "1"]


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.prototxt"
    path.write_text(TINY)
    return str(path)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with captured_log() as buf:
        rc = cli.main(list(args))
    return rc, capsys.readouterr().out, buf.getvalue()


@pytest.fixture
def simulated_clock(monkeypatch):
    """Layer i's forward takes (i+1) ms and its backward 2(i+1) ms of a clock that only layers advance (a
    convolution and the ReLU run as one step forward, both layers' times): the timing loop reads it instead of the
    wall clock, so every pass lasts exactly the same."""
    now = [0.0]
    forward, backward = LayerRunner.forward_layer, LayerRunner.backward_layer
    rectified = LayerRunner.forward_rectified

    def fwd(self, net, i):
        now[0] += (i + 1) * 1e-3
        return forward(self, net, i)

    def fwd_rectified(self, net, i, relu):
        now[0] += (i + 1 + relu + 1) * 1e-3
        return rectified(self, net, i, relu)

    def bwd(self, net, i):
        now[0] += 2 * (i + 1) * 1e-3
        return backward(self, net, i)

    monkeypatch.setattr(LayerRunner, "forward_layer", fwd)
    monkeypatch.setattr(LayerRunner, "forward_rectified", fwd_rectified)
    monkeypatch.setattr(LayerRunner, "backward_layer", bwd)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_bench_measures_what_time_measures(capsys, tiny, simulated_clock, phase) -> None:
    n_layers = 5  # data conv1 relu1 ip1 prob
    fwd_ms = sum(range(1, n_layers + 1))
    rc, _, log_text = run_cli(capsys, "time", "-model", tiny, "-iterations", "3", "-phase", phase, *ENGINE)
    assert rc == 0
    time_ms = float(re.search(r"Average Forward-Backward: ([\d.]+) ms", log_text).group(1))
    time_fwd = float(re.search(r"Average Forward pass: ([\d.]+) ms", log_text).group(1))
    assert time_ms == 3 * fwd_ms and time_fwd == fwd_ms
    rc, out, _ = run_cli(capsys, "bench", "-model", tiny, "-iterations", "3", "-phase", phase, "-format", "json",
                         *ENGINE)
    assert rc == 0
    result = json.loads(out)
    expected_ms = time_ms if phase == "TRAIN" else time_fwd  # forward + backward in TRAIN, forward in TEST
    assert result["seconds_per_iteration"] == pytest.approx(expected_ms / 1e3)
    assert result["images_per_second"] == pytest.approx(4 / (expected_ms / 1e3))


def test_json_keys_and_derived_figures(capsys, tiny, simulated_clock) -> None:
    rc, out, _ = run_cli(capsys, "bench", "-model", tiny, "-iterations", "2", "-format", "json",
                         "-price_per_hour", "0.68", "-instance", "c4.4xlarge", "-batch", "8", *ENGINE)
    r = json.loads(out)
    assert rc == 0 and tuple(r) == RESULT_KEYS
    assert r["batch"] == 8 and r["instance"] == "c4.4xlarge" and r["cct_version"]
    assert r["seconds_per_iteration"] == pytest.approx(45e-3)  # 15 ms forward + 30 ms backward
    assert r["images_per_second"] == pytest.approx(8 / 45e-3)
    assert r["usd_per_million_images"] == pytest.approx(1e6 / r["images_per_second"] / 3600 * 0.68)
    assert r["achieved_gflops"] == pytest.approx(r["gflop_per_image"] * r["images_per_second"])
    assert r["percent_of_peak"] == pytest.approx(100 * r["achieved_gflops"] / r["peak_gflops"])
    # conv1: 6·10·10 outputs of 27 products + bias, weights' gradient too (no loss: no data gradients);
    # ip1: 10 outputs of 600; relu, softmax per element
    conv = 6 * 100 * (2 * 27 + 1)
    ip = 10 * (2 * 600 + 1)
    expected = (conv + 600 + ip + 4 * 10) + (conv + ip)
    assert r["gflop_per_image"] == pytest.approx(expected / 1e9)
    assert r["cpu"]["model"] and r["cpu"]["cores"] >= 1 and isinstance(r["cpu"]["blas"], list)
    assert [d["device"] for d in r["devices"]] == ["cpu:" + str(r["cpu"]["usable_cores"])]
    assert r["peak_gflops"] == pytest.approx(sum(d["peak_gflops"] for d in r["devices"]))
    rc, out, _ = run_cli(capsys, "bench", "-model", tiny, "-iterations", "2", "-format", "json", *ENGINE)
    assert json.loads(out)["usd_per_million_images"] is None


def test_devices_add_their_peaks(capsys, tiny) -> None:
    rc, out, _ = run_cli(capsys, "bench", "-model", tiny, "-iterations", "1", "-format", "json",
                         "-devices", "cpu:1,cpu:1", *ENGINE)
    r = json.loads(out)
    assert rc == 0 and [d["device"] for d in r["devices"]] == ["cpu:1", "cpu:1"]
    assert r["peak_gflops"] == pytest.approx(2 * r["devices"][0]["peak_gflops"])


def test_text_output_and_output_file(capsys, tiny, tmp_path) -> None:
    rc, out, _ = run_cli(capsys, "bench", "-model", tiny, "-iterations", "2", "-price_per_hour", "1.5", *ENGINE)
    assert rc == 0
    for label in ("images per second", "GFLOP per image", "achieved GFLOP/s", "% of peak", "$ per million images",
                  "CPU", "BLAS", "cct version"):
        assert re.search(rf"^{re.escape(label)}\s", out, re.M), label
    assert "at $1.5/hour" in out and re.search(r"^\s+conv1\s+Convolution", out, re.M)
    result = tmp_path / "r.json"
    rc, out, _ = run_cli(capsys, "bench", "-model", tiny, "-iterations", "1", "-output", str(result), *ENGINE)
    assert rc == 0 and out == "" and tuple(json.loads(result.read_text())) == RESULT_KEYS  # .json: JSON


def test_models_by_name(monkeypatch, tmp_path) -> None:
    assert resolve_model("caffenet").endswith("models/caffenet/deploy.prototxt")
    assert resolve_model("GoogLeNet").endswith("models/googlenet/deploy.prototxt")
    for name in bench.MODELS:
        assert os.path.isfile(resolve_model(name)), name
    monkeypatch.setattr(bench, "MODELS_DIR", tmp_path)  # a tree without alexnet's file
    with pytest.raises(CctError, match=r"-model alexnet: the alexnet benchmark net .* is missing"):
        resolve_model("alexnet")
    with pytest.raises(CctError, match=r"no such file, and not a benchmark net name \(alexnet, caffenet, googlenet, "
                                       r"inception_v3, resnet50, vgg16\)"):
        resolve_model("resnet")


def test_batch_is_set_in_the_net(tiny) -> None:
    net = bench.build_net(tiny, cct.TEST, batch=3)
    assert net.blobs["data"].shape[0] == 3 and net.blobs["prob"].shape == (3, 10)


@pytest.mark.parametrize("args, message", [
    (["bench"], "Need a model definition to bench"),
    (["bench", "-model", "nonet"], "-model nonet: no such file, and not a benchmark net name"),
    (["bench", "-model", "caffenet", "-format", "xml"], "-format xml: must be text or json"),
    (["bench", "-model", "caffenet", "-price_per_hour", "-1"], "-price_per_hour -1: must not be negative"),
    (["bench", "-model", "caffenet", "-plot", "x.png"], "-plot goes with -report"),
    (["bench", "-report"], "-report needs the JSON results"),
    (["bench", "-model", "caffenet", "extra.json"], "bench takes no arguments without -report"),
])
def test_user_errors_are_one_line(capsys, args, message) -> None:
    rc, _, log_text = run_cli(capsys, *args)
    fatal = messages(log_text, "F")
    assert rc == 1 and len(fatal) == 1 and message in fatal[0] and "Traceback" not in log_text


def _result(instance: str, ips: float, price: float | None, peak: float = 100.0) -> dict:
    gflop = 2.9
    return {"images_per_second": ips, "seconds_per_iteration": 256 / ips, "batch": 256, "gflop_per_image": gflop,
            "achieved_gflops": gflop * ips, "peak_gflops": peak, "percent_of_peak": 100 * gflop * ips / peak,
            "usd_per_million_images": bench.usd_per_million_images(ips, price), "instance": instance,
            "cpu": {"model": "x", "cores": 8, "usable_cores": 8, "blas": []}, "devices": [], "cct_version": "0"}


def test_report_table_is_relative_to_the_first() -> None:
    results = [_result("g2.2xlarge", 100.0, 0.47), _result("c4.4xlarge", 50.0, 0.68), _result("laptop", 25.0, None)]
    rows = report_rows(results)
    assert [r["relative_speed"] for r in rows] == [1.0, 0.5, 0.25]
    assert rows[1]["relative_cost"] == pytest.approx((0.68 / 50) / (0.47 / 100))  # 2.89x the GPU's price
    assert rows[2]["relative_cost"] is None
    table = report_table(results).splitlines()
    assert table[0].split()[:3] == ["instance", "images/s", "vs"]
    assert table[2].split()[:3] == ["c4.4xlarge", "50", "0.50x"] and "2.89x" in table[2]
    assert table[3].split()[0] == "laptop" and table[3].split()[4] == "-"


def test_report_command_with_plot(capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    paths = []
    for name, ips, price in (("c4.4xlarge", 20.0, 0.68), ("c4.8xlarge", 38.0, 1.37)):
        paths.append(str(tmp_path / f"{name}.json"))
        (tmp_path / f"{name}.json").write_text(json.dumps(_result(name, ips, price)))
    png = tmp_path / "report.png"
    rc, out, log_text = run_cli(capsys, "bench", "-report", *paths, "-plot", str(png))
    assert rc == 0, log_text
    lines = out.splitlines()
    assert lines[1].split()[0] == "c4.4xlarge" and lines[2].split()[:3] == ["c4.8xlarge", "38", "1.90x"]
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 600 and im.size[1] > 300
        colours = im.convert("RGB").getcolors(1 << 20)
        assert len(colours) > 50  # bars, labels and text, not a blank canvas
    rc, out, _ = run_cli(capsys, "bench", "-report", *paths, "-format", "json")
    assert [r["instance"] for r in json.loads(out)] == ["c4.4xlarge", "c4.8xlarge"]


def test_report_errors(capsys, tmp_path, monkeypatch) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"images_per_second": 3}))
    rc, _, log_text = run_cli(capsys, "bench", "-report", str(bad))
    assert rc == 1 and "not a cct bench result (missing seconds_per_iteration" in messages(log_text, "F")[0]
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_result("a", 1.0, None)))
    assert load_result(str(good))["instance"] == "a"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, log_text = run_cli(capsys, "bench", "-report", str(good), "-plot", str(tmp_path / "p.png"))
    assert rc == 1 and "plotting needs matplotlib (pip install 'cct[plot]')" in messages(log_text, "F")[0]


def test_time_warms_every_layers_backward_up_untimed(capsys, tiny, monkeypatch) -> None:
    """``cct time`` runs one untimed pass of its per-layer loop first: Net::Backward skips the layers no loss
    needs (all of a deploy net), yet the timed loop calls each one's backward, whose first call may do one-time
    setup (a GEMM layout measured for the machine) that would otherwise land in the first timed pass."""
    calls: list[int] = []
    backward = LayerRunner.backward_layer

    def spy(self, net, i):
        calls.append(i)
        return backward(self, net, i)

    monkeypatch.setattr(LayerRunner, "backward_layer", spy)
    seen: list[int] = []
    real = timing.time_layers

    def recorded(net, iterations, *a, **k):
        result = real(net, iterations, *a, **k)
        seen.append(len(result.iteration_ms))
        return result

    monkeypatch.setattr(timing, "time_layers", recorded)
    rc, _, log_text = run_cli(capsys, "time", "-model", tiny, "-iterations", "2", "-phase", "TEST", *ENGINE)
    assert rc == 0 and seen == [2]  # two timed passes ...
    assert calls.count(1) == 3  # ... after one untimed: conv1's backward ran three times
    assert log_text.count("forward-backward time") == 2


def _conv_net(name: str, middle: str, last: str) -> str:
    """A 2x3x8x8 input, conv1, ``middle`` layers, an InnerProduct on blob ``last`` and a softmax loss."""
    return f"""name: "{name}"
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 2 dim: 3 dim: 8 dim: 8 }} shape {{ dim: 2 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 4 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
{middle}
layer {{ name: "ip1" type: "InnerProduct" bottom: "{last}" top: "ip1"
        inner_product_param {{ num_output: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }}
"""


POOLED = _conv_net("pooled", """layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }""", "pool1")
NORMALIZED = _conv_net("normalized", """layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }""", "conv1")


def test_time_runs_a_fused_forward_pair_as_training_does(capsys, tmp_path, monkeypatch) -> None:
    """A BatchNorm, the in-place Scale and ReLU after it run as one step each way in training (compiled kernels):
    ``cct time`` times those steps on the BatchNorm and says so; the Scale's and the ReLU's lines read 0."""
    from cct import native

    if native.kernels() is None:
        pytest.skip("compiled kernels not built (the pair runs as two layers)")
    path = tmp_path / "normalized.prototxt"
    path.write_text(NORMALIZED)
    paired: list[int] = []
    real = LayerRunner.forward_normalized

    def spy(self, net, i, j, relu=None):
        done = real(self, net, i, j, relu)
        if done:
            paired.append(i)
        return done

    monkeypatch.setattr(LayerRunner, "forward_normalized", spy)
    rc, _, log_text = run_cli(capsys, "time", "-model", str(path), "-iterations", "2", *ENGINE)
    assert rc == 0
    assert paired.count(2) == 4  # bn1 (index 2) ran the pair in Net::Forward, the warm-up and both timed passes
    assert re.search(r"scale1\tforward: 0 ms", log_text) and re.search(r"relu1\tforward: 0 ms", log_text)
    assert re.search(r"bn1\tforward includes scale1's forward", log_text)
    assert re.search(r"bn1\tforward includes relu1's forward", log_text)
    # backward too, the three layers' steps block by block: timed on the BatchNorm
    assert re.search(r"scale1\tbackward: 0 ms", log_text) and re.search(r"relu1\tbackward: 0 ms", log_text)
    assert re.search(r"bn1\tbackward includes relu1's backward", log_text)
    assert re.search(r"bn1\tbackward includes scale1's backward", log_text)


def test_time_runs_a_fused_pair_as_training_does(capsys, tmp_path, monkeypatch) -> None:
    """A max pooling doing the in-place ReLU's backward below it is one step in training: ``cct time`` times
    that step on the pooling layer and the ReLU's backward takes no time of its own."""
    path = tmp_path / "pooled.prototxt"
    path.write_text(POOLED)
    single: list[int] = []
    paired: list[int] = []
    backward, rectified = LayerRunner.backward_layer, LayerRunner.backward_rectified
    monkeypatch.setattr(LayerRunner, "backward_layer", lambda self, net, i: single.append(i) or backward(self, net, i))
    monkeypatch.setattr(LayerRunner, "backward_rectified",
                        lambda self, net, i: paired.append(i) or rectified(self, net, i))
    rc, _, log_text = run_cli(capsys, "time", "-model", str(path), "-iterations", "2", *ENGINE)
    assert rc == 0
    assert paired.count(3) == 4  # pool1 (index 3) ran the pair in Net::Backward, the warm-up and both timed passes
    assert 2 not in single  # ... and relu1's own backward never ran
    assert re.search(r"relu1\tbackward: 0 ms", log_text)
    # ... and says so after the per-layer lines (benchmarks/caffenet_vs_caffe.py compares the pair with Caffe's two)
    assert re.search(r"pool1\tbackward includes relu1's backward", log_text)
    assert log_text.index("backward includes") > log_text.index("relu1\tbackward: 0 ms")
