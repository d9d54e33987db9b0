"""Sub-batch views (``Blob.view_rows``): rows of a parent blob in the parent's memory, following it."""
from __future__ import annotations

import numpy as np
import pytest

from cct.blob import Blob, RowView
from cct.errors import CctError


def test_a_view_is_rows_of_the_parent_memory():
    p = Blob((4, 3))
    p.data[...] = np.arange(12).reshape(4, 3)
    v = Blob.view_rows(p, 1, 3)
    assert isinstance(v, RowView) and v.shape == (2, 3)
    np.testing.assert_array_equal(v.data, [[3, 4, 5], [6, 7, 8]])
    v.data[...] = -1
    v.diff[...] = 5
    np.testing.assert_array_equal(p.data[1:3], -1)
    np.testing.assert_array_equal(p.diff, [[0] * 3, [5] * 3, [5] * 3, [0] * 3])


def test_a_view_follows_the_parent_when_it_reshapes_or_reallocates():
    p = Blob((4, 2))
    v = Blob.view_rows(p, 2, 4)
    v.data  # noqa: B018
    p.reshape(4, 5)  # grows: a new buffer
    v.reshape(2, 5)
    v.data[...] = 1
    assert p.data[2:].sum() == 10 and p.data[:2].sum() == 0
    q = Blob((4, 5))
    p.share_data(q)
    v.data[...] = 2
    assert q.data[2:].sum() == 20


def test_a_view_whose_shape_does_not_fit_the_parent_is_an_error():
    p = Blob((4, 3))
    v = Blob.view_rows(p, 0, 2)
    v.reshape(2, 4)
    with pytest.raises(CctError, match="rows"):
        v.data  # noqa: B018
    with pytest.raises(CctError, match="not inside"):
        Blob.view_rows(p, 3, 5)


def test_sharing_between_views_only_checks_they_coincide():
    bottom, top = Blob((4, 3)), Blob((4, 3))
    top.share_data(bottom)  # what Split's reshape does on the whole batch
    vb, vt = Blob.view_rows(bottom, 1, 3), Blob.view_rows(top, 1, 3)
    vt.share_data(vb)  # what it does on the sub-batch: already the same memory
    assert vt.shares_data_with(vb)
    with pytest.raises(CctError, match="cannot share diff"):
        vt.share_diff(vb)
