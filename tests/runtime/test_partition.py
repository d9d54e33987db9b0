"""Batch partitions: the facility itself, and partitioned layers equal to unpartitioned ones."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import cct.layers  # noqa: F401  (registers the layers)
from cct.config import settings
from cct.gradient_check import setup_layer
from cct.rng import set_random_seed
from cct.runtime import partition


def test_batch_ranges_cover_the_batch():
    assert partition.batch_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert partition.batch_ranges(2, 5) == [(0, 1), (1, 2)]
    assert partition.batch_ranges(0, 2) == [(0, 0)]


def test_run_partitions_is_concurrent_and_reraises():
    seen, barrier = [], threading.Barrier(2, timeout=10)

    def body(part, n0, n1):
        barrier.wait()  # both partitions must be running at the same time
        seen.append((part, n0, n1, partition.in_partition()))

    partition.run_partitions([(0, 2), (2, 4)], body)
    assert sorted(seen) == [(0, 0, 2, True), (1, 2, 4, True)]
    assert not partition.in_partition()

    def boom(part, n0, n1):
        if part == 1:
            raise ValueError("partition 1 failed")

    with pytest.raises(ValueError, match="partition 1"):
        partition.run_partitions([(0, 1), (1, 2)], boom)


def test_partitions_run_with_a_short_switch_interval_and_restore_it():
    before = sys.getswitchinterval()
    seen = []

    def body(part, n0, n1):
        seen.append(sys.getswitchinterval())

    partition.run_partitions([(0, 1), (1, 2)], body)
    assert seen == [partition.PARTITION_SWITCH_INTERVAL] * 2
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError):
        partition.run_partitions([(0, 1), (1, 2)], lambda part, n0, n1: (_ for _ in ()).throw(ValueError(part)))
    assert sys.getswitchinterval() == before


def test_concurrent_partition_runs_restore_the_interval_once_all_are_done():
    """Two threads' runs overlap: the first restores nothing while the second is still inside."""
    before = sys.getswitchinterval()
    first_inside, second_done = threading.Event(), threading.Event()
    after_second = []

    def first(part, n0, n1):
        if part == 0:
            first_inside.set()
            assert second_done.wait(10)
            after_second.append(sys.getswitchinterval())

    def second(part, n0, n1):
        pass

    t = threading.Thread(target=partition.run_partitions, args=([(0, 1), (1, 2)], first))
    t.start()
    assert first_inside.wait(10)
    partition.run_concurrently(2, lambda k: second(k, 0, 0))
    second_done.set()
    t.join()
    assert after_second == [partition.PARTITION_SWITCH_INTERVAL]
    assert sys.getswitchinterval() == before


def test_more_calls_than_cores_each_run_once_inside_a_partition():
    seen, lock = [], threading.Lock()

    def body(k):
        with lock:
            seen.append((k, partition.in_partition()))

    for count in (2, 3, 4 * partition.cpu_cores() + 1):
        seen.clear()
        partition.run_concurrently(count, body)
        assert sorted(seen) == [(k, True) for k in range(count)]
    assert not partition.in_partition()


def test_an_exception_is_raised_after_every_call_has_finished():
    finished, slow_may_end = [], threading.Event()

    def body(k):
        if k == 0:
            raise KeyError("the caller's own call")
        if k == 1:
            assert slow_may_end.wait(10)
        finished.append(k)

    threading.Timer(0.2, slow_may_end.set).start()
    with pytest.raises(KeyError, match="the caller's own call"):
        partition.run_concurrently(3, body)
    assert sorted(finished) == [1, 2]

    def two_fail(k):
        if k:
            raise ValueError(k)

    with pytest.raises(ValueError):
        partition.run_concurrently(3, two_fail)
    partition.run_concurrently(3, lambda k: None)  # the partition threads are all back at work


def test_a_call_inside_a_partition_leaves_it_marked():
    marks = []

    def body(k):
        partition.run_concurrently(1, lambda _k: None)
        marks.append(partition.in_partition())

    partition.run_concurrently(2, body)
    assert marks == [True, True]


def test_a_forked_child_runs_partitions_on_threads_of_its_own():
    import multiprocessing as mp

    partition.run_concurrently(2, lambda k: None)  # the parent's partition threads exist before the fork
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_child_runs_partitions)
    child.start()
    child.join(30)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0


def _child_runs_partitions() -> None:
    barrier = threading.Barrier(2, timeout=10)
    partition.run_concurrently(2, lambda k: barrier.wait())


@pytest.mark.parametrize("cores, parts, threads", [(16, 1, 16), (16, 2, 1), (16, 8, 1), (16, 16, 1), (2, 1, 2),
                                                   (2, 2, 1)])
def test_concurrent_partitions_run_one_blas_thread_each(monkeypatch, cores, parts, threads):
    monkeypatch.setattr(partition, "cpu_cores", lambda: cores)
    assert partition.blas_threads_per_partition(parts) == threads


MANY_CORES_NET = """
name: "small" layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 32 dim: 8 dim: 32 dim: 32 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 64 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "Reduction" bottom: "ip" top: "loss" loss_weight: 1 }
"""


def test_no_partition_calls_a_multi_threaded_blas_on_a_many_core_machine(monkeypatch, tmp_path):
    """On 16 (emulated) cores, every matrix product made inside a partition runs while the BLAS libraries are at
    one thread: a multi-threaded OpenBLAS call from concurrent partitions is serialised by OpenBLAS's lock and
    leaves its workers spinning into the next layer (a convolution's bias gradient did so)."""
    import cct
    from cct.engines import autotune, fft_plan, measured
    from cct.engines.cost_model import DEFAULT_RATES
    from cct.runtime import threads

    for module in (threads, partition, fft_plan, measured):
        monkeypatch.setattr(module, "cpu_cores", lambda: 16)
    # the models' default rates: calibrating 16 emulated cores on this machine takes seconds and is beside the point
    monkeypatch.setattr(autotune, "calibrate", lambda save=True: DEFAULT_RATES)
    settings.set("partitions", "auto")
    seen = []
    matmul = np.matmul

    def checked(*args, **kwargs):
        if partition.in_partition():
            seen.append(threads.BUDGET.process_count())
        return matmul(*args, **kwargs)

    path = tmp_path / "net.prototxt"
    path.write_text(MANY_CORES_NET)
    set_random_seed(1)
    net = cct.Net(str(path), cct.TRAIN)
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
    monkeypatch.setattr(np, "matmul", checked)
    net.forward()
    net.clear_param_diffs()
    net.backward()
    assert seen, "no product ran inside a partition"
    assert set(seen) == {1}, f"BLAS thread counts inside partitions: {sorted(set(seen))}"


def test_blas_threads_are_divided_and_nesting_is_sequential():
    from threadpoolctl import threadpool_info

    inner = []

    def body(part, n0, n1):
        inner.append(partition.partitions_for(8))
        if part == 0:
            inner.append([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"])

    settings.set("partitions", 2)
    partition.run_partitions(partition.batch_ranges(8, 2), body)
    expected = 1  # concurrent partitions: one BLAS thread each
    assert inner.count(1) == 2  # no nested partitions
    threads = next(x for x in inner if isinstance(x, list))
    assert threads and all(t == expected for t in threads)


def test_auto_partitions_skip_small_work(monkeypatch):
    settings.set("partitions", "auto")
    monkeypatch.setattr(partition, "cpu_cores", lambda: 4)
    assert partition.partitions_for(64, 1e6) == 4
    assert partition.partitions_for(64, 10) == 1
    assert partition.partitions_for(2, 1e9) == 2
    settings.set("partitions", 3)
    assert partition.partitions_for(64, 10) == 3 and partition.partitions_for(2) == 2


LAYERS = [
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', 1),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }', 2),
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }', 1),
    ('type: "LRN" lrn_param { local_size: 5 alpha: 0.1 beta: 0.75 }', 1),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.1 norm_region: WITHIN_CHANNEL }', 1),
    ('type: "ReLU"', 1),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', 1),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 group: 2 '
     'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 } }', 1),
]


def _forward_backward(text, num_tops, x, dy_seed=2):
    run = setup_layer(text, [x], num_tops=num_tops)
    (y, *_) = run.forward()
    dy = np.random.default_rng(dy_seed).standard_normal(y.shape).astype(np.float32)
    run.top[0].diff[...] = dy
    for b in run.layer.blobs:
        b.diff[...] = 0
    run.layer.backward(run.top, [True], run.bottom)
    return [y, run.bottom[0].diff.copy()] + [b.diff.copy() for b in run.layer.blobs]


@pytest.mark.parametrize("text,num_tops", LAYERS, ids=[f"layer{i}" for i in range(len(LAYERS))])
def test_partitioned_layers_equal_unpartitioned(text, num_tops):
    x = np.random.default_rng(1).standard_normal((5, 4, 9, 8)).astype(np.float32)
    settings.set("partitions", 1)
    set_random_seed(0)
    whole = _forward_backward(text, num_tops, x)
    settings.set("partitions", 3)
    set_random_seed(0)
    parts = _forward_backward(text, num_tops, x)
    for a, b in zip(whole, parts):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)  # weight grads: partial sums in float32


@pytest.mark.parametrize("text,num_tops", LAYERS[:3], ids=["max", "max-mask", "ave"])
def test_one_image_is_pooled_over_the_partitions_by_its_channel_planes(text, num_tops):
    """Pooling partitions the batch's channel planes, not its images: one image (inference of a single input) is
    pooled on every partition, with the bits of one partition (each plane is pooled alone)."""
    x = np.random.default_rng(1).standard_normal((1, 6, 9, 8)).astype(np.float32)
    outputs = []
    for parts in (1, 3):
        settings.set("partitions", parts)
        run = setup_layer(text, [x], num_tops=num_tops)
        tops = [t.copy() for t in run.forward()]
        assert run.layer.last_partitions == parts
        run.top[0].diff[...] = np.random.default_rng(2).standard_normal(tops[0].shape).astype(np.float32)
        run.layer.backward(run.top, [True], run.bottom)
        outputs.append(tops + [run.bottom[0].diff.copy()])
    for a, b in zip(*outputs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))

def test_small_gemms_run_on_one_blas_thread(monkeypatch):
    """InnerProduct and the lowering engine run GEMMs below SMALL_GEMM_FLOPS on one BLAS thread (robust on a
    busy machine), bigger ones with the current setting (where their flops would keep more threads busy)."""
    from threadpoolctl import threadpool_info

    from cct.engines import gemm

    seen = []
    real = np.matmul

    def spy(*a, **k):
        seen.append(max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"))
        return real(*a, **k)

    x = np.random.default_rng(0).standard_normal((4, 3, 6, 6)).astype(np.float32)
    monkeypatch.setattr(gemm, "GEMM_FLOPS_PER_THREAD", 1.0)
    with partition.blas_threads(2):
        for flops_limit, expected in ((1e12, 1), (0.0, 2)):
            monkeypatch.setattr(gemm, "SMALL_GEMM_FLOPS", flops_limit)
            for text in ('type: "InnerProduct" inner_product_param { num_output: 5 }',
                         'type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 }'):
                run = setup_layer(text, [x])
                monkeypatch.setattr(np, "matmul", spy)
                seen.clear()
                run.forward()
                monkeypatch.setattr(np, "matmul", real)
                assert seen and set(seen) == {expected}, (text, seen)


@pytest.mark.parametrize("flops,budget,threads", [
    (1e6, 16, 1),      # small: one thread
    (1e7, 16, 5),      # one thread per GEMM_FLOPS_PER_THREAD, fewer than the budget
    (3.3e7, 16, 16),   # enough for every thread of the budget: the current setting
    (1e7, 2, 2),       # on 2 threads the same as SMALL_GEMM_FLOPS alone
    (1e7, 4, 4),
])
def test_gemm_threads_one_per_share_of_flops_never_above_the_budget(monkeypatch, flops, budget, threads):
    """A GEMM's BLAS threads: one below SMALL_GEMM_FLOPS, then one per GEMM_FLOPS_PER_THREAD (2 MFLOP) up to the
    calling thread's budget — which it never raises (no block where the budget is the limit)."""
    from cct.engines import gemm

    monkeypatch.setattr(gemm, "thread_budget", lambda: budget)
    block = gemm.gemm_threads(flops)
    got = block.n if isinstance(block, partition.blas_threads) else budget
    assert got == threads


@pytest.mark.parametrize("size", [0, 5, 3 * (1 << 20) + 7])
def test_zero_fills_any_array_and_splits_large_host_ones(monkeypatch, size):
    """``zero`` clears every value: small arrays and other layouts in one call, a large contiguous host array in
    value ranges over the partitions (forced to 3 here)."""
    a = np.arange(size, dtype=np.float32).reshape(-1, 1) + 1
    seen = []
    real = partition.run_batch
    monkeypatch.setattr(partition, "run_batch", lambda n, fn, work: seen.append(n) or real(n, fn, work, parts=3))
    partition.zero(a)
    assert not a.any()
    assert seen == ([size] if size >= 2 * partition.MIN_WORK_PER_PARTITION else [])
    b = np.ones((2 * partition.MIN_WORK_PER_PARTITION + 2, 2), np.float64)[:, ::2]  # not contiguous: one call
    partition.zero(b)
    assert not b.any() and len(seen) <= 1
