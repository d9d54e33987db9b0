"""Protobuf wire-format primitives for the few places that read or write bytes directly.

Used where going through message objects would copy large arrays: writing packed float blobs
(:func:`cct.blob.blob_to_proto`), reading raw Datum pixels without a copy, and diagnosing why a binary
file does not parse.
"""
from __future__ import annotations

import numpy as np

WIRE_VARINT, WIRE_64BIT, WIRE_LEN, WIRE_32BIT = 0, 1, 2, 5


class Truncated(ValueError):
    """The bytes end inside a varint."""


class Malformed(ValueError):
    """A varint longer than 10 bytes."""


def read_varint(buf, pos: int, end: int | None = None) -> tuple[int, int]:
    """``(value, position after it)`` of the varint at ``buf[pos]``."""
    end = len(buf) if end is None else end
    value = shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise Malformed(f"varint longer than 10 bytes at byte {pos}")
    raise Truncated("the bytes end inside a varint")


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def packed_floats(field_number: int, values: np.ndarray) -> bytes:
    """Encoding of a packed ``repeated float`` field holding ``values`` (empty → no bytes)."""
    raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
    if not raw:
        return b""
    return encode_varint((field_number << 3) | WIRE_LEN) + encode_varint(len(raw)) + raw
