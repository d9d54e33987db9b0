"""InnerProduct: forward against a per-element reference, gradients for every mode, stored blobs, errors."""
from __future__ import annotations

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.errors import CctError, ParamError
from cct.gradient_check import check_gradient, setup_layer

RNG = np.random.default_rng(2)
FILLERS = 'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 }'


def ip(params: str = "") -> str:
    return f'type: "InnerProduct" inner_product_param {{ num_output: 5 {FILLERS} {params} }}'


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, axis: int, transpose: bool):
    m = int(np.prod(x.shape[:axis]))
    k = int(np.prod(x.shape[axis:]))
    rows = x.reshape(m, k)
    n = w.shape[1] if transpose else w.shape[0]
    y = np.zeros((m, n))
    for i in range(m):
        for o in range(n):
            acc = 0.0
            for j in range(k):
                acc += rows[i, j] * (w[j, o] if transpose else w[o, j])
            y[i, o] = acc + (b[o] if b is not None else 0.0)
    return y.reshape(x.shape[:axis] + (n,))


CASES = [  # (params, bottom shape, canonical axis)
    ("", (2, 3, 4), 1),
    ("axis: 2", (2, 3, 4), 2),
    ("axis: -1", (2, 3, 4), 2),
    ("axis: 0", (3, 2), 0),
    ("transpose: true", (2, 3, 4), 1),
    ("bias_term: false", (4, 6), 1),
    ("transpose: true bias_term: false axis: -2", (2, 3, 4), 1),
]


@pytest.mark.parametrize("params,shape,axis", CASES)
def test_forward(params, shape, axis):
    x = RNG.standard_normal(shape)
    run = setup_layer(ip(params), [x], dtype=np.float64)
    lay = run.layer
    k = int(np.prod(shape[axis:]))
    transpose = "transpose: true" in params
    assert lay.blobs[0].shape == ((k, 5) if transpose else (5, k))
    bias = lay.blobs[1].data if len(lay.blobs) > 1 else None
    assert (bias is None) == ("bias_term: false" in params)
    y = run.forward()[0]
    assert y.shape == shape[:axis] + (5,)
    np.testing.assert_allclose(y, reference(x, lay.blobs[0].data, bias, axis, transpose), rtol=1e-10)


@pytest.mark.parametrize("params,shape,axis", CASES)
def test_gradient(params, shape, axis):
    check_gradient(ip(params), [RNG.standard_normal(shape)])


def test_default_fillers_are_zero_and_param_diffs_accumulate():
    x = RNG.standard_normal((2, 3))
    run = setup_layer('type: "InnerProduct" inner_product_param { num_output: 4 }', [x], dtype=np.float64)
    w, b = run.layer.blobs
    assert w.shape == (4, 3) and b.shape == (4,)
    np.testing.assert_array_equal(w.data, 0)
    np.testing.assert_array_equal(b.data, 0)
    w.data[...] = RNG.standard_normal((4, 3))
    run.forward()
    dy = RNG.standard_normal((2, 4))
    run.top[0].diff[...] = dy
    for _ in range(2):
        run.layer.backward_layer(run.top, [True], run.bottom)
    np.testing.assert_allclose(w.diff, 2 * dy.T @ x, rtol=1e-12)
    np.testing.assert_allclose(b.diff, 2 * dy.sum(0), rtol=1e-12)
    np.testing.assert_allclose(run.bottom[0].diff, dy @ w.data, rtol=1e-12)  # overwritten, not summed


def test_stored_blobs():
    stored = ('type: "InnerProduct" inner_product_param { num_output: 2 } '
              'blobs { shape { dim: 2 dim: 3 } data: [1, 2, 3, 4, 5, 6] } '
              'blobs { shape { dim: 2 } data: [10, 20] }')
    x = np.array([[1.0, 0.0, -1.0]])
    run = setup_layer(stored, [x], dtype=np.float64)
    np.testing.assert_allclose(run.forward()[0], [[8.0, 18.0]])
    legacy = ('type: "InnerProduct" inner_product_param { num_output: 2 bias_term: false } '
              'blobs { num: 1 channels: 1 height: 2 width: 3 data: [1, 2, 3, 4, 5, 6] }')
    run = setup_layer(legacy, [x], dtype=np.float64)
    assert run.layer.blobs[0].shape == (2, 3)
    np.testing.assert_allclose(run.forward()[0], [[-2.0, -2.0]])
    wrong = ('type: "InnerProduct" inner_product_param { num_output: 2 bias_term: false } '
             'blobs { shape { dim: 3 dim: 2 } data: [1, 2, 3, 4, 5, 6] }')
    with pytest.raises(ParamError, match=r"expected \(2 3\)"):
        setup_layer(wrong, [x])
    with pytest.raises(ParamError, match="blob"):
        setup_layer(wrong.replace(" bias_term: false", ""), [x])


def test_float32():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    run = setup_layer(ip(), [x], dtype=np.float32)
    y = run.forward()[0]
    assert y.dtype == np.float32 and run.layer.blobs[0].dtype == np.float32
    w, b = run.layer.blobs[0].data, run.layer.blobs[1].data
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64) + b, rtol=1e-5, atol=1e-5)


def test_errors():
    x = RNG.standard_normal((2, 3, 4))
    with pytest.raises(ParamError, match="inner_product_param.num_output"):
        setup_layer('type: "InnerProduct"', [x])
    run = setup_layer(ip(), [x])
    run.bottom[0].reshape((2, 3, 5))
    with pytest.raises(CctError, match="incompatible"):
        run.layer.forward_layer(run.bottom, run.top)
    run.bottom[0].reshape((6, 3, 4))  # another batch size is fine
    run.layer.forward_layer(run.bottom, run.top)
    assert run.top[0].shape == (6, 5)


def test_against_caffe_lenet():
    """ip1 (800 -> 500, followed by an in-place ReLU) and ip2 (500 -> 10) of the reference LeNet."""
    from google.protobuf import text_format

    from cct.layers.registry import create_layer
    from cct.proto import caffe_pb2 as pb
    from tests.reference import assert_close, reference_dir

    folder = reference_dir("nets", "lenet")
    net = text_format.Parse((folder / "net.prototxt").read_text(), pb.NetParameter())
    z = np.load(folder / "train.npz")
    layers = {lay.name: lay for lay in net.layer}

    def run(name: str, bottom: str):
        r = setup_layer(create_layer(layers[name]), [z[f"data/{bottom}"]], dtype=np.float32)
        for j, blob in enumerate(r.layer.blobs):
            blob.data[...] = z[f"param/{name}/{j}"]
        y = r.forward()[0]
        r.top[0].diff[...] = z[f"diff/{name}"]
        r.layer.backward_layer(r.top, [True], r.bottom)
        for j, blob in enumerate(r.layer.blobs):
            assert_close(blob.diff, z[f"param_diff/{name}/{j}"], f"{name} param diff {j}")
        return y, r.bottom[0].diff

    # ip1's top blob was then rectified in place, and its diff is what ip1's backward read.
    y1, dx1 = run("ip1", "pool2")
    assert_close(np.maximum(y1, 0), z["data/ip1"], "ip1 top (after relu1)")
    assert_close(dx1, z["diff/pool2"], "ip1 bottom diff")
    y2, dx2 = run("ip2", "ip1")
    assert_close(y2, z["data/ip2"], "ip2 top")
    assert_close(dx2 * (z["data/ip1"] > 0), z["diff/ip1"], "ip2 bottom diff (after relu1's backward)")


@pytest.mark.parametrize("way,weight_way", [("direct", "split"), ("swapped", "split"),
                                            ("direct, one call", "split, one call"),
                                            ("swapped, one call", "split, one call")])
@pytest.mark.parametrize("params,shape,axis", CASES)
def test_each_gemm_way(monkeypatch, way, weight_way, params, shape, axis):
    """Big products run the way measured faster on the machine (``x Wᵀ`` split over the partitions, ``(W xᵀ)ᵀ``
    through a transposed scratch copy, or one call on the BLAS's threads; the weight gradient split or in one
    call): forced each way, on every layer mode, forward and gradients are right."""
    from cct.engines import measured
    from cct.layers import inner_product

    monkeypatch.setattr(inner_product, "ORIENTATION_MIN_FLOPS", 0)
    monkeypatch.setattr(inner_product, "blas_workers_sleep", lambda: True)
    asked = []

    def choose(kind, key, ways, between=None):
        asked.append(key)
        assert kind == "inner_product_gemm"
        return way if way in ways else weight_way
    monkeypatch.setattr(measured, "measured_choice", choose)
    x = RNG.standard_normal(shape)
    run = setup_layer(ip(params), [x], dtype=np.float64)
    lay = run.layer
    bias = lay.blobs[1].data if len(lay.blobs) > 1 else None
    np.testing.assert_allclose(run.forward()[0], reference(x, lay.blobs[0].data, bias, axis,
                                                           "transpose: true" in params), rtol=1e-10)
    assert asked and asked[0].startswith("forward-")
    check_gradient(ip(params), [x])
    assert any(k.startswith("data-") for k in asked) and any(k.startswith("weights-") for k in asked)


@pytest.mark.parametrize("sleeping", [True, False])
def test_one_threaded_blas_call_is_offered_only_where_blas_workers_sleep(monkeypatch, sleeping):
    """OpenBLAS's workers spinning after a threaded call would share the cores with the partitioned layers that
    run next: the one-call ways are candidates only where the workers sleep after each call."""
    from cct.engines import measured
    from cct.layers import inner_product

    monkeypatch.setattr(inner_product, "ORIENTATION_MIN_FLOPS", 0)
    monkeypatch.setattr(inner_product, "blas_workers_sleep", lambda: sleeping)
    offered = {}

    def choose(kind, key, ways, between=None):
        offered.setdefault(key.split("-")[0], set(ways))
        return next(iter(ways))
    monkeypatch.setattr(measured, "measured_choice", choose)
    check_gradient(ip(), [RNG.standard_normal((4, 6))])
    one_call = {"direct, one call", "swapped, one call"} if sleeping else set()
    assert offered == {"forward": {"direct", "swapped"} | one_call, "data": {"direct", "swapped"} | one_call,
                       "weights": {"split", "split, one call"} if sleeping else {"split"}}


def test_the_weight_gradient_is_measured_only_on_a_zero_gradient(monkeypatch):
    """Measuring the weight gradient's ways runs each several times into the gradient itself: it is measured
    only while the gradient holds zeros (as a solver leaves it before each pass) and left holding one product;
    a gradient that already holds values gets one product added, unmeasured, until a pass finds it zero."""
    from cct.engines import measured
    from cct.layers import inner_product

    monkeypatch.setattr(inner_product, "ORIENTATION_MIN_FLOPS", 0)
    measuring = []
    real = measured.measured_choice

    def choose(kind, key, ways, **kw):
        measuring.append(key.split("-")[0])
        return real(kind, key, ways, **kw)
    monkeypatch.setattr(measured, "measured_choice", choose)
    x = RNG.standard_normal((4, 6))
    run = setup_layer(ip(), [x], dtype=np.float64)
    w_diff = run.layer.blobs[0].diff
    dy = RNG.standard_normal((4, 5))
    run.forward()
    run.top[0].diff[...] = dy
    held = RNG.standard_normal(w_diff.shape)
    w_diff[...] = held
    run.layer.backward(run.top, [True], run.bottom)
    np.testing.assert_allclose(w_diff, held + dy.T @ x, rtol=1e-12)
    assert "weights" not in measuring
    w_diff[...] = 0
    run.layer.backward(run.top, [True], run.bottom)
    np.testing.assert_allclose(w_diff, dy.T @ x, rtol=1e-12)
    assert measuring.count("weights") == 1
    run.layer.backward(run.top, [True], run.bottom)  # chosen once: the next pass just accumulates
    np.testing.assert_allclose(w_diff, 2 * (dy.T @ x), rtol=1e-12)
    assert measuring.count("weights") == 1


def test_measured_choice_keeps_the_faster_way_per_machine(monkeypatch):
    """The faster candidate is measured, cached on disk and measured once more by the next process; once the two
    agree it is not measured again; with ``-autotune off`` nothing is measured and the first candidate runs."""
    import time

    from cct.config import settings
    from cct.engines import measured

    runs = {"slow": 0, "fast": 0}

    def slow():
        runs["slow"] += 1
        time.sleep(0.02)

    def fast():
        runs["fast"] += 1

    ways = {"slow": slow, "fast": fast}
    assert measured.measured_choice("test_choice", "k1", ways) == "fast"
    counted = dict(runs)
    assert counted["slow"] == counted["fast"] == 1 + measured.CHOICE_ROUNDS
    assert measured.measured_choice("test_choice", "k1", ways) == "fast"  # this process keeps what it measured
    assert runs == counted
    monkeypatch.setattr(measured, "_choice_memo", {})  # a new process: measures again, the two agree
    assert measured.measured_choice("test_choice", "k1", ways) == "fast"
    assert runs == {name: 2 * n for name, n in counted.items()}
    counted = dict(runs)
    monkeypatch.setattr(measured, "_choice_memo", {})  # the next: read back from the cache file
    assert measured.measured_choice("test_choice", "k1", ways) == "fast"
    assert runs == counted
    with settings.override(autotune=False):
        assert measured.measured_choice("test_choice", "k2", ways) == "slow"
    assert runs == counted


def test_one_disturbed_measurement_does_not_settle_a_choice(monkeypatch):
    """A measurement caught in a burst of the machine's load (here: the faster way slowed once) is kept only until
    the next processes' measurements outvote it; a process that may not measure runs the latest measured."""
    from cct.config import settings
    from cct.engines import measured

    clock = [0.0]
    monkeypatch.setattr(measured.time, "perf_counter", lambda: clock[0])
    burst = [True]

    def way(seconds, disturbed=False):
        def run():
            clock[0] += seconds * (10 if disturbed and burst[0] else 1)
        return run

    ways = {"blas": way(1e-3), "panels": way(0.7e-3, disturbed=True)}
    assert measured.measured_choice("test_choice", "k", ways) == "blas"  # the burst
    burst[0] = False
    monkeypatch.setattr(measured, "_choice_memo", {})
    with settings.override(autotune=False):
        assert measured.measured_choice("test_choice", "k", ways) == "blas"  # not measuring: what was measured
    assert measured.known_choice("test_choice", "k", ways) is None  # unsettled
    assert measured.measured_choice("test_choice", "k", ways) == "panels"
    monkeypatch.setattr(measured, "_choice_memo", {})
    assert measured.known_choice("test_choice", "k", ways) is None  # one each: a third measurement decides
    assert measured.measured_choice("test_choice", "k", ways) == "panels"
    monkeypatch.setattr(measured, "_choice_memo", {})
    assert measured.known_choice("test_choice", "k", ways) == "panels"


def test_measured_choice_times_long_runs_fewer_rounds(monkeypatch):
    """Candidates that take long are timed ``CHOICE_MIN_ROUNDS`` times (their median still decides), short ones
    ``CHOICE_ROUNDS``: a fake clock, each run taking the time its candidate says."""
    from cct.engines import measured

    clock = [0.0]
    monkeypatch.setattr(measured.time, "perf_counter", lambda: clock[0])
    runs = {"a": 0, "b": 0}

    def way(name, seconds):
        def run():
            runs[name] += 1
            clock[0] += seconds
        return run

    long_run = measured.CHOICE_SECONDS / 2  # two rounds of two take more than CHOICE_SECONDS
    assert measured.measured_choice("test_choice", "long", {"a": way("a", long_run),
                                                             "b": way("b", 0.9 * long_run)}) == "b"
    assert runs == {"a": 1 + measured.CHOICE_MIN_ROUNDS, "b": 1 + measured.CHOICE_MIN_ROUNDS}
    runs.update(a=0, b=0)
    short = measured.CHOICE_SECONDS / (4 * measured.CHOICE_ROUNDS)
    assert measured.measured_choice("test_choice", "short", {"a": way("a", short), "b": way("b", 2 * short)}) == "a"
    assert runs == {"a": 1 + measured.CHOICE_ROUNDS, "b": 1 + measured.CHOICE_ROUNDS}


def test_a_cached_way_runs_on_a_gradient_that_holds_values(monkeypatch):
    """A choice measured by an earlier run (the cache) is taken as it is: the gradient is neither scanned nor
    measured on, whatever it holds."""
    from cct.engines import measured
    from cct.layers import inner_product

    monkeypatch.setattr(inner_product, "ORIENTATION_MIN_FLOPS", 0)
    monkeypatch.setattr(inner_product, "blas_workers_sleep", lambda: True)
    key = f"weights-m4-k6-n5-n-float64-2ways-{measured._threads_key()}"
    measured._write_cache({"inner_product_gemm": {key: "split, one call"}})
    one_calls = []
    real = inner_product._one_call
    monkeypatch.setattr(inner_product, "_one_call", lambda *a: one_calls.append(1) or real(*a))
    monkeypatch.setattr(measured, "measured_choice", lambda *a, **k: pytest.fail("measured again"))
    x = RNG.standard_normal((4, 6))
    run = setup_layer(ip(), [x], dtype=np.float64)
    run.top[0].diff[...] = dy = RNG.standard_normal((4, 5))
    held = RNG.standard_normal(run.layer.blobs[0].diff.shape)
    run.layer.blobs[0].diff[...] = held
    run.layer.backward(run.top, [False], run.bottom)
    assert one_calls == [1]
    np.testing.assert_allclose(run.layer.blobs[0].diff, held + dy.T @ x, rtol=1e-12)


def test_measured_choice_runs_between_before_every_run(monkeypatch):
    """``between`` (a cache eviction) runs untimed before each of the candidates' runs, warm-up included."""
    from cct.engines import measured

    order = []
    ways = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    measured.measured_choice("test_choice", "between", ways, between=lambda: order.append("-"))
    runs = 2 * (1 + measured.CHOICE_ROUNDS)
    assert order == ["-", "a", "-", "b"] * (runs // 2)


def test_the_last_level_cache_is_the_highest_data_cache_listed(tmp_path):
    from cct.device.query import DEFAULT_LAST_LEVEL_CACHE, last_level_cache_bytes

    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                             (3, "Unified", "32768K"), (4, "Instruction", "1M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert last_level_cache_bytes(str(tmp_path / "none")) == DEFAULT_LAST_LEVEL_CACHE
