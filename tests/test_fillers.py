"""Fillers: distributions and Caffe's fan-in/fan-out rules."""
from __future__ import annotations

import math

import numpy as np
import pytest
from google.protobuf import text_format

from cct.blob import Blob
from cct.errors import ParamError
from cct.fillers import fill
from cct.proto import caffe_pb2 as pb
from cct.rng import set_random_seed


def filled(shape, text: str) -> np.ndarray:
    set_random_seed(3)
    b = Blob(shape)
    fill(b, text_format.Parse(text, pb.FillerParameter()))
    return b.data.copy()


def test_constant_and_uniform() -> None:
    assert np.all(filled((3, 4), 'type: "constant" value: 2.5') == 2.5)
    u = filled((200, 50), 'type: "uniform" min: -2 max: 3')
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.05


def test_gaussian_and_sparse() -> None:
    g = filled((400, 100), 'type: "gaussian" mean: 1 std: 2')
    assert abs(g.mean() - 1) < 0.05 and abs(g.std() - 2) < 0.05
    s = filled((100, 400), 'type: "gaussian" std: 1 sparse: 25')  # non-zero probability 25/100
    assert abs((s != 0).mean() - 0.25) < 0.02
    with pytest.raises(ParamError, match="std"):
        filled((2, 2), 'type: "gaussian" std: 0')


def test_positive_unitball_rows_sum_to_one() -> None:
    x = filled((6, 2, 3, 3), 'type: "positive_unitball"')
    assert np.all(x >= 0)
    np.testing.assert_allclose(x.reshape(6, -1).sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("norm,n", [("FAN_IN", 3 * 5 * 5), ("FAN_OUT", 64 * 5 * 5), ("AVERAGE", (75 + 1600) / 2)])
def test_xavier_and_msra_scales(norm: str, n: float) -> None:
    shape = (64, 3, 5, 5)  # conv weight: fan_in = 3*5*5, fan_out = 64*5*5
    x = filled(shape, f'type: "xavier" variance_norm: {norm}')
    limit = math.sqrt(3.0 / n)
    assert x.min() >= -limit and x.max() <= limit and x.max() > 0.9 * limit
    m = filled(shape, f'type: "msra" variance_norm: {norm}')
    assert abs(m.std() - math.sqrt(2.0 / n)) < 0.05 * math.sqrt(2.0 / n)


def test_bilinear_kernel() -> None:
    w = filled((2, 1, 4, 4), 'type: "bilinear"')
    # K=4: f=2, c=0.75 → 1-D weights 0.25, 0.75, 0.75, 0.25
    one = np.array([0.25, 0.75, 0.75, 0.25], dtype=np.float32)
    np.testing.assert_allclose(w[1, 0], np.outer(one, one), rtol=1e-6)
    w3 = filled((1, 1, 3, 3), 'type: "bilinear"')  # K=3: f=2, c=(K-1)/(2f)=0.5 (Caffe HEAD)
    one3 = np.array([0.5, 1.0, 0.5], dtype=np.float32)
    np.testing.assert_allclose(w3[0, 0], np.outer(one3, one3), rtol=1e-6)


def test_unknown_filler() -> None:
    with pytest.raises(ParamError, match="unknown filler type 'nope'"):
        filled((2,), 'type: "nope"')
