"""Raw Datum records read a batch at a time (``raw_batch``) exactly as one at a time (``raw_view`` and protobuf)."""
from __future__ import annotations

import numpy as np
import pytest

from cct.data.datum import datum_to_array, parse_datum, raw_batch, raw_view
from cct.proto import caffe_pb2 as pb


def _record(pixels: np.ndarray, label: int | None, encoded_false: bool = True) -> bytes:
    d = pb.Datum(channels=pixels.shape[0], height=pixels.shape[1], width=pixels.shape[2], data=pixels.tobytes())
    if label is not None:
        d.label = label
    if encoded_false:
        d.encoded = False  # Caffe's convert_imageset writes it explicitly
    return d.SerializeToString()


def _one_by_one(values):
    pixels, labels = [], []
    for v in values:
        d = parse_datum(v)
        pixels.append(datum_to_array(d))
        labels.append(d.label)
    return np.stack(pixels), np.array(labels)


@pytest.mark.parametrize("labels", [[3, 0, 9, 127], [128, 300, 16000, 200], [2**31 - 1, 2**30, 2**29, 2**28],
                                    [None, None, None, None]], ids=["1-byte", "2-byte", "5-byte", "absent"])
@pytest.mark.parametrize("encoded_false", [True, False])
def test_batch_equals_record_by_record(labels, encoded_false):
    rng = np.random.default_rng(0)
    ims = rng.integers(0, 256, (4, 3, 5, 6), dtype=np.uint8)
    values = [memoryview(_record(im, lab, encoded_false)) for im, lab in zip(ims, labels)]
    got = raw_batch(values)
    assert got is not None
    want = _one_by_one(values)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[0].dtype == np.uint8 and got[0].shape == (4, 3, 5, 6)


def test_records_laid_out_differently_fall_back():
    rng = np.random.default_rng(1)
    ims = rng.integers(0, 256, (3, 1, 4, 4), dtype=np.uint8)
    cases = {
        "label widths differ": [_record(ims[0], 5), _record(ims[1], 500), _record(ims[2], 5)],
        "shapes differ": [_record(ims[0], 1), _record(ims[1].reshape(1, 2, 8), 1), _record(ims[2], 1)],
        "negative label": [_record(ims[0], -1), _record(ims[1], -1), _record(ims[2], -1)],
        "trailer differs": [_record(ims[0], 1), _record(ims[1], 1, False) + b"\x38\x01", _record(ims[2], 1)],
        "another field where the label goes": [_record(ims[0], 1), _record(ims[1], 1)[:-4] + b"\x30\x01\x38\x00",
                                               _record(ims[2], 1)],
    }
    for name, values in cases.items():
        assert raw_batch(values) is None, name
    encoded = pb.Datum(channels=1, height=4, width=4, data=b"x" * 16, label=1, encoded=True).SerializeToString()
    assert raw_batch([encoded] * 3) is None  # encoded images are decoded one by one
    floats = pb.Datum(channels=1, height=1, width=2, float_data=[1.0, 2.0], label=1).SerializeToString()
    assert raw_batch([floats] * 2) is None and raw_view(floats) is None
    assert raw_batch([]) is None
