"""The prefetch thread: cursor continuity, order, sharding and clean shutdown."""
from __future__ import annotations

import gc
import time

import numpy as np
import pytest

from cct import mode
from cct.data import prefetch as prefetch_module
from cct.data.prefetch import SYNC_SAMPLE, SYNC_SKIP, Prefetcher
from cct.errors import CctError
from cct.proto import caffe_pb2 as pb
from tests.data.helpers import (
    captured_log,
    forward,
    make_layer,
    prefetch_threads,
    random_images,
    raw_datum,
    wait_no_prefetch_threads,
    write_lmdb,
)


def small_db(tmp_path, n=7):
    imgs = random_images(n, (1, 2, 3))
    return write_lmdb(tmp_path / "db", [(f"{i:08d}".encode(), raw_datum(im, i)) for i, im in enumerate(imgs)])


def data_text(src, batch, prefetch=4, extra=""):
    return (f'type: "Data" data_param {{ source: "{src}" batch_size: {batch} backend: LMDB prefetch: {prefetch} '
            f'{extra} }}')


def test_order_wrap_and_continuity(tmp_path):
    src = small_db(tmp_path)
    for prefetch in (1, 4):
        with captured_log() as buf:  # from setup on: the thread may wrap before the first forward
            layer, top = make_layer(data_text(src, 3, prefetch), 2)
            labels = [forward(layer, top)[1].tolist() for _ in range(5)]
        assert sum(labels, []) == [i % 7 for i in range(15)]
        # Caffe logs the wrap with DLOG: only its debug builds print it, so a default log does not
        assert "Restarting data prefetching from start." not in buf.getvalue()
        layer.close()


def test_lmdb_batches_wrap_like_records_one_by_one(tmp_path):
    """``take(n)`` is ``next()`` n times: batches longer than the database, ending on its last record, after
    a seek, and mixed with single reads."""
    from cct.data.db import LmdbReader

    src = small_db(tmp_path)
    keys = [f"{i:08d}".encode() for i in range(7)]
    reader = LmdbReader(src)
    got = []
    for n in (3, 4, 7, 1, 15, 2):
        got += [bytes(k) for k, _ in reader.take(n)]
        got.append(reader.next()[0])
    assert got == [keys[i % 7] for i in range(len(got))]
    reader.seek(5)
    assert [bytes(k) for k, _ in reader.take(4)] == [keys[5], keys[6], keys[0], keys[1]]
    reader.close()


def test_single_top_and_rand_skip_logged(tmp_path):
    src = small_db(tmp_path)
    with captured_log() as buf:
        layer, top = make_layer(data_text(src, 2, extra="rand_skip: 5"), 1)
    assert "rand_skip" in buf.getvalue()
    assert forward(layer, top)[0].shape == (2, 1, 2, 3)
    layer.close()


def test_multi_rank_sharding(tmp_path):
    src = small_db(tmp_path, 8)
    try:
        mode.set_solver_count(2)
        got = []
        for rank in (0, 1):
            mode.set_solver_rank(rank)
            layer, top = make_layer(data_text(src, 3), 2, phase=pb.TRAIN)
            got.append(sum((forward(layer, top)[1].tolist() for _ in range(2)), []))
            layer.close()
        mode.set_solver_rank(1)
        layer, top = make_layer(data_text(src, 3), 2, phase=pb.TEST)  # TEST: no sharding
        test_labels = forward(layer, top)[1].tolist()
        layer.close()
    finally:
        mode.set_solver_count(1)
        mode.set_solver_rank(0)
    assert got == [[0, 2, 4, 6, 0, 2], [1, 3, 5, 7, 1, 3]]
    assert test_labels == [0, 1, 2]


def test_threads_end_when_layers_and_nets_are_dropped(tmp_path):
    src = small_db(tmp_path)
    existing = set(prefetch_threads())
    for i in range(10):
        layer, top = make_layer(data_text(src, 2), 2)
        if i % 2:
            forward(layer, top)  # a queue that is full or being filled both stop
        assert prefetch_threads()
        del layer, top
    assert not wait_no_prefetch_threads(existing)
    try:
        from cct.pycaffe import Net
    except ImportError:
        return
    text = f'layer {{ name: "d" top: "data" top: "label" {data_text(src, 2)} }}'
    proto = tmp_path / "net.prototxt"
    proto.write_text(text)
    for _ in range(5):
        net = Net(str(proto), pb.TEST)
        for first in (0, 2):  # the layer keeps its cursor between forwards (test passes)
            net.forward()
            np.testing.assert_array_equal(net.blobs["label"].data, [first, first + 1])
        del net
        gc.collect()
    assert not wait_no_prefetch_threads(existing)


SWITCH = SYNC_SKIP + SYNC_SAMPLE  # batches consumed before the producer may move into the consuming thread


class Counter:
    """A producer of consecutive integers (one per batch) with a cursor to save and restore; ``burn`` seconds of
    CPU per batch; fails at ``fail_at``."""

    def __init__(self, burn: float = 0.0, fail_at: int | None = None):
        self.next_value, self.burn, self.fail_at, self.closed = 0, burn, fail_at, 0

    def next_batch(self, recycled):
        if self.next_value == self.fail_at:
            raise ValueError(f"bad record {self.next_value}")
        end = time.thread_time() + self.burn
        while time.thread_time() < end:
            pass
        self.next_value += 1
        return self.next_value - 1

    def state(self):
        return {"next": self.next_value}

    def restore(self, state):
        self.next_value = state["next"]

    def close(self):
        self.closed += 1


def test_a_producer_with_next_to_no_work_runs_in_the_consuming_thread_without_losing_a_batch(monkeypatch):
    """Once its first batches took next to no CPU, the producer runs batch by batch in the consumer's thread:
    the sequence goes on where the net's last batch left it (the read-ahead dropped, the cursor put back), the
    thread ends, the resume state follows each batch, and stopping closes the producer once."""
    monkeypatch.setattr(prefetch_module, "SYNC_BATCH_CPU_SECONDS", 1.0)  # whatever the machine's speed
    producer = Counter()
    p = Prefetcher(producer, 4)
    got = [p.get() for _ in range(SWITCH + SYNC_SAMPLE + 5)]  # past its trial there
    assert got == list(range(SWITCH + SYNC_SAMPLE + 5))
    assert p.synchronous and not p.thread.is_alive()
    assert p.consumed_state == {"next": SWITCH + SYNC_SAMPLE + 5}
    p.rewind({"next": 2})
    assert [p.get(), p.get()] == [2, 3]
    p.stop()
    p.stop()
    assert producer.closed == 1


def test_a_producer_that_works_keeps_its_thread():
    producer = Counter(burn=2 * prefetch_module.SYNC_TRIAL_CPU_SECONDS)
    p = Prefetcher(producer, 2)
    assert [p.get() for _ in range(SWITCH + 3)] == list(range(SWITCH + 3))
    assert not p.synchronous and p.thread.is_alive()
    p.stop()
    assert not p.thread.is_alive() and producer.closed == 1


def test_a_producer_that_works_in_the_consuming_thread_too_goes_back_to_its_thread(monkeypatch):
    """Tried in the consuming thread (its reading thread measured it cheap), a producer whose batches cost more
    there than SYNC_BATCH_CPU_SECONDS gets its thread back after SYNC_SAMPLE batches, the sequence unbroken."""
    monkeypatch.setattr(prefetch_module, "SYNC_TRIAL_CPU_SECONDS", 1.0)
    producer = Counter(burn=3 * prefetch_module.SYNC_BATCH_CPU_SECONDS)
    p = Prefetcher(producer, 2)
    assert [p.get() for _ in range(SWITCH)] == list(range(SWITCH))
    assert p.synchronous and not p.thread.is_alive()  # on trial
    assert [p.get() for _ in range(SYNC_SAMPLE + 3)] == list(range(SWITCH, SWITCH + SYNC_SAMPLE + 3))
    assert not p.synchronous and p.thread.is_alive()
    assert p.consumed_state == {"next": SWITCH + SYNC_SAMPLE + 3}
    p.stop()
    assert not p.thread.is_alive() and producer.closed == 1


def test_a_synchronous_producers_error_is_one_line_every_time(monkeypatch):
    monkeypatch.setattr(prefetch_module, "SYNC_BATCH_CPU_SECONDS", 1.0)
    p = Prefetcher(Counter(fail_at=SWITCH + 2), 4)
    assert [p.get() for _ in range(SWITCH + 2)] == list(range(SWITCH + 2))
    assert p.synchronous
    for _ in range(2):
        with pytest.raises(CctError, match=f"^ValueError: bad record {SWITCH + 2}$"):
            p.get()
    p.stop()


def test_data_layer_batches_continue_across_the_switch(tmp_path, monkeypatch):
    """A Data layer on a small LMDB: records in order, wrapping, across the producer's move into the net's
    thread."""
    monkeypatch.setattr(prefetch_module, "SYNC_BATCH_CPU_SECONDS", 1.0)
    src = small_db(tmp_path)
    layer, top = make_layer(data_text(src, 3, 4), 2)
    labels = [forward(layer, top)[1].tolist() for _ in range(SWITCH + 6)]
    assert sum(labels, []) == [i % 7 for i in range(3 * (SWITCH + 6))]
    assert layer._prefetcher.synchronous
    layer.close()
