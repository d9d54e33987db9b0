"""A blob's buffer with a device copy (Caffe's SyncedMemory head): what counts as an access, when a pending
device copy comes back, in which order two copies of shared memory come back."""
from __future__ import annotations

import numpy as np

from cct.blob import Blob


class _Pending:
    """A device copy of ``values`` written into a buffer's front when called."""

    def __init__(self, buf, values, owner):
        self.buf, self.values, self.owner, self.calls = buf, np.asarray(values, np.float32), owner, 0

    def __call__(self):
        self.calls += 1
        self.buf.array[:self.values.size] = self.values


def test_an_untracked_buffer_counts_nothing():
    b = Blob((2, 3))
    b.data[...] = 1
    b.diff[...] = 2
    assert b.buffer("data").version == 0 and b.buffer("diff").version == 0


def test_each_access_of_a_tracked_buffer_counts_and_the_buffer_itself_does_not():
    b = Blob((2, 3))
    buf = b.buffer("data")
    buf.tracked = True
    before = buf.version
    b.buffer("data")
    other = Blob((3, 2))
    other.share_data(b)  # sharing memory is not an access of its values
    assert buf.version == before and other.buffer("data") is buf
    b.data  # noqa: B018
    other.data  # noqa: B018
    assert buf.version == before + 2
    assert b.buffer("diff").version == 0  # diff is its own buffer


def test_a_pending_device_copy_comes_back_once_at_the_first_access():
    b = Blob((2, 2))
    buf = b.buffer("data")
    pending = _Pending(buf, [1, 2, 3, 4], owner="dev")
    version = buf.device_wrote(pending)
    assert buf.tracked and version == buf.version and pending.calls == 0
    np.testing.assert_array_equal(b.data, [[1, 2], [3, 4]])
    assert pending.calls == 1 and buf.version == version + 1
    b.data  # noqa: B018
    assert pending.calls == 1


def test_a_second_device_copy_brings_the_first_back_unless_it_is_the_same_memory():
    b = Blob((4,))
    buf = b.buffer("data")
    first = _Pending(buf, [1, 1, 1, 1], owner="dev A")
    buf.device_wrote(first)
    again = _Pending(buf, [2, 2, 2, 2], owner="dev A")
    buf.device_wrote(again)  # the same device memory written again: nothing comes back yet
    assert first.calls == 0
    other = _Pending(buf, [3, 3, 0, 0][:2], owner="dev B")
    buf.device_wrote(other)  # other memory: A's values come back first, then B's front over them
    assert again.calls == 1 and first.calls == 0
    np.testing.assert_array_equal(b.data, [3, 3, 2, 2])
    assert other.calls == 1
