"""Real Caffe's outputs: caffe-reference/data_layer and the solver cases' LMDBs."""
from __future__ import annotations

import lmdb
import numpy as np
import pytest
from google.protobuf import text_format

from cct.proto import caffe_pb2 as pb
from tests.data.helpers import REFERENCE, forward, make_layer, prefetch_threads, wait_no_prefetch_threads

DATA_LAYER = REFERENCE / "data_layer"
SOLVERS = REFERENCE / "solvers"
pytestmark = pytest.mark.skipif(not DATA_LAYER.is_dir(), reason=f"Caffe reference outputs not found at {REFERENCE}")


def test_data_layer_reference_four_forwards(monkeypatch):
    """Both Data layers of data_layer/net.prototxt (mean_file + crop + scale; per-channel mean_value +
    scale) give Caffe's TEST-phase tops bit for bit over four forwards, across the database's wrap."""
    monkeypatch.chdir(DATA_LAYER)
    existing = set(prefetch_threads())
    net = text_format.Parse((DATA_LAYER / "net.prototxt").read_text(), pb.NetParameter())
    ref = np.load(DATA_LAYER / "test_forward.npz")
    layers = [(make_layer(text_format.MessageToString(lp), len(lp.top), pb.TEST), list(lp.top))
              for lp in net.layer]
    for it in range(4):
        for (layer, top), names in layers:
            for name, got in zip(names, forward(layer, top)):
                want = ref[f"iter{it}/{name}"]
                assert got.shape == want.shape, (it, name)
                np.testing.assert_array_equal(got, want, err_msg=f"iter{it}/{name}")
    for (layer, _), _ in layers:
        layer.close()
    assert not wait_no_prefetch_threads(existing)


def _records(path):
    env = lmdb.open(str(path), readonly=True, lock=False, readahead=False)
    with env.begin() as txn:
        out = []
        for k, v in txn.cursor():
            d = pb.Datum()
            d.ParseFromString(v)
            out.append((k, d))
    env.close()
    return out


@pytest.mark.parametrize("case", ["sgd_step", "adam_exp"])
def test_solver_lmdbs_read_as_caffe(monkeypatch, case):
    """The solver cases' Data layers (scale + mean_value, batch 8 / 6) serve the records in key order,
    1x12x12, with their labels, wrapping at the end of the 40 / 12 records."""
    folder = SOLVERS / case
    if not folder.is_dir():
        pytest.skip(f"{folder} not found")
    monkeypatch.chdir(folder)
    net = text_format.Parse((folder / "net.prototxt").read_text(), pb.NetParameter())
    for lp in [lp for lp in net.layer if lp.type == "Data"]:
        phase = lp.include[0].phase
        records = _records(folder / lp.data_param.source)
        keys = [k for k, _ in records]
        assert keys == sorted(keys)
        assert keys[0].startswith(b"00000000_")
        batch = lp.data_param.batch_size
        layer, top = make_layer(text_format.MessageToString(lp), 2, phase)
        assert top[0].shape == (batch, 1, 12, 12)
        pos = 0
        for _ in range(len(records) // batch + 2):
            data, label = forward(layer, top)
            for i in range(batch):
                d = records[pos % len(records)][1]
                assert (d.channels, d.height, d.width) == (1, 12, 12)
                img = np.frombuffer(d.data, np.uint8).reshape(1, 12, 12).astype(np.float32)
                expect = (img - np.float32(lp.transform_param.mean_value[0])) * np.float32(
                    lp.transform_param.scale)
                np.testing.assert_array_equal(data[i], expect)
                assert label[i] == d.label
                pos += 1
        layer.close()
