"""The global random stream (Caffe's ``caffe_rng``): fillers, Dropout masks, data shuffling and crops.

Seeded by a solver's ``random_seed`` or :func:`set_random_seed`; otherwise from the OS entropy pool.
Bit-exact reproduction of Caffe's boost streams is not attempted (see CAFFE_FACTS §4).
"""
from __future__ import annotations

import numpy as np

_rng = np.random.default_rng()


def set_random_seed(seed: int) -> None:
    """Reseed the global stream (pycaffe's ``caffe.set_random_seed``)."""
    global _rng
    _rng = np.random.default_rng(int(seed))


def get_rng() -> np.random.Generator:
    """The global generator.  Components that need their own stream draw a seed from it."""
    return _rng


def stream_state(gen: np.random.Generator | None = None) -> dict:
    """The state of ``gen`` (default: the global stream) as JSON-able values."""
    return (gen or _rng).bit_generator.state


def restore_stream(state: dict, gen: np.random.Generator | None = None) -> None:
    """Put ``gen`` (default: the global stream) back to a :func:`stream_state`."""
    (gen or _rng).bit_generator.state = state
