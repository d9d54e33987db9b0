"""Datum records: serialized ``caffe.Datum`` ↔ ``(C, H, W)`` arrays.

A raw Datum holds uint8 ``data`` in C×H×W order (OpenCV's BGR for colour), or ``float_data`` when
``data`` is empty; an encoded one (``encoded: true``) holds JPEG/PNG file bytes, decoded as Caffe's
DataTransformer does: ``force_color`` → 3-channel BGR, ``force_gray`` → 1 channel, else the file's
own channels.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cct.data.image import COLOR, GRAY, UNCHANGED, decode_image
from cct.io.wire import read_varint
from cct.proto import caffe_pb2 as pb


class DatumError(Exception):
    """A record that is not a usable Datum; callers add the source and key."""


def parse_datum(value: bytes) -> pb.Datum:
    datum = pb.Datum()
    try:
        datum.ParseFromString(value)
    except Exception as e:  # protobuf's DecodeError and friends
        raise DatumError(f"not a Datum ({e})") from None
    return datum


def raw_view(value) -> tuple[np.ndarray, int] | None:
    """Fast path for the common record, a raw uint8 Datum: ``(pixels (C, H, W) view into value, label)``
    straight from the wire format, without copying the pixels; None for anything else (encoded,
    float_data, unusual or malformed records), which then takes the protobuf path."""
    mv = memoryview(value)
    end = len(mv)
    pos = 0
    c = h = w = label = 0
    data = None
    # the usual layout (fields in number order, small dimensions): channels, height and width as one-byte
    # varints, then the pixels; read without the general loop, which then parses only what follows
    if end > 8 and mv[0] == 0x08 and mv[2] == 0x10 and mv[4] == 0x18 and mv[6] == 0x22 \
            and (mv[1] | mv[3] | mv[5]) < 0x80:
        c, h, w = mv[1], mv[3], mv[5]
        try:
            n, pos = read_varint(mv, 7, end)
        except ValueError:
            return None
        if pos + n > end:
            return None
        data = (pos, n)
        pos += n
    try:
        while pos < end:
            tag = mv[pos]  # one-byte varints (the usual tags and small values) inline
            if tag < 0x80:
                pos += 1
            else:
                tag, pos = read_varint(mv, pos, end)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                v = mv[pos] if pos < end else 0x80
                if v < 0x80:
                    pos += 1
                else:
                    v, pos = read_varint(mv, pos, end)
                if field == 1:
                    c = v
                elif field == 2:
                    h = v
                elif field == 3:
                    w = v
                elif field == 5:
                    label = v - (1 << 64) if v >= 1 << 63 else v
                elif field == 7 and v:
                    return None  # encoded
            elif wire == 2:
                n, pos = read_varint(mv, pos, end)
                if pos + n > end or field == 6:
                    return None
                if field == 4:
                    data = (pos, n)
                pos += n
            elif wire == 5 and field != 6:
                pos += 4
            elif wire == 1:
                pos += 8
            else:
                return None
    except ValueError:
        return None
    if data is None or pos != end or c <= 0 or h <= 0 or w <= 0 or data[1] != c * h * w:
        return None
    return np.frombuffer(mv, dtype=np.uint8, count=data[1], offset=data[0]).reshape(c, h, w), label


def raw_batch(values: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
    """Fast path for a batch of small raw records written alike (same dimensions, same header bytes, labels
    of the same varint length — what ``convert_imageset`` writes for MNIST- or CIFAR-sized data):
    ``(pixels (B, C, H, W) uint8, labels (B,) int64)`` by a few whole-batch numpy operations on the joined
    records instead of one parse per record; None when any record departs from the first one's layout (the
    records are then read one by one, with :func:`raw_view` or protobuf)."""
    first = raw_view(values[0]) if len(values) else None
    if first is None:
        return None
    head = memoryview(values[0])
    size = len(head)
    # the layout raw_view reads without its general loop: channels, height, width, then the pixels
    if not (head[0] == 0x08 and head[2] == 0x10 and head[4] == 0x18 and head[6] == 0x22):
        return None
    count, start = read_varint(head, 7, size)
    # what follows the pixels: the label (tag 0x28, a varint), then Caffe's explicit "encoded: false" (0x38 0x00)
    end = size - 2 if size - start - count >= 2 and head[size - 2] == 0x38 and head[size - 1] == 0 else size
    tail = end - start - count
    if tail > 6 or (tail and head[start + count] != 0x28) or set(map(len, values)) != {size}:
        return None  # a label wider than 5 varint bytes (or negative), other fields, or records of other sizes
    rows = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), size)
    if not ((rows[:, :start] == rows[:1, :start]).all() and (rows[:, end:] == rows[:1, end:]).all()):
        return None
    labels = np.zeros(len(values), dtype=np.int64)
    if tail:
        digits = rows[:, start + count + 1:end]  # the label's varint: continuation bits on all but the last byte
        if not ((rows[:, start + count] == 0x28).all() and (digits[:, :-1] >= 0x80).all()
                and (digits[:, -1] < 0x80).all()):
            return None
        for j in range(digits.shape[1]):
            labels |= (digits[:, j].astype(np.int64) & 0x7F) << (7 * j)
    return rows[:, start:start + count].reshape((len(values),) + first[0].shape), labels


def decode_flag(force_color: bool = False, force_gray: bool = False) -> int:
    if force_color:
        return COLOR
    if force_gray:
        return GRAY
    return UNCHANGED


def datum_to_array(datum: pb.Datum, flag: int = UNCHANGED) -> np.ndarray:
    """The Datum's pixels as ``(C, H, W)``: a uint8 view for raw bytes, float32 for ``float_data``,
    a decoded (transposed HWC) uint8 image for an encoded Datum."""
    raw = datum.data  # one access: protobuf returns a fresh copy of the bytes on every access
    if datum.encoded:
        img = decode_image(raw, flag)
        if img is None:
            raise DatumError("encoded Datum could not be decoded as an image")
        if img.dtype != np.uint8:
            raise DatumError(f"encoded image has {img.dtype} samples; only 8-bit images are supported")
        return img.transpose(2, 0, 1)
    c, h, w = datum.channels, datum.height, datum.width
    if c <= 0 or h <= 0 or w <= 0:
        raise DatumError(f"Datum has shape {c}x{h}x{w} (channels, height and width must be positive)")
    n = c * h * w
    if raw:
        if len(raw) != n:
            raise DatumError(f"Datum data has {len(raw)} bytes for shape {c}x{h}x{w} ({n})")
        return np.frombuffer(raw, dtype=np.uint8).reshape(c, h, w)
    if len(datum.float_data):
        if len(datum.float_data) != n:
            raise DatumError(f"Datum float_data has {len(datum.float_data)} values for shape "
                             f"{c}x{h}x{w} ({n})")
        return np.asarray(datum.float_data, dtype=np.float32).reshape(c, h, w)
    raise DatumError("Datum has neither data nor float_data (an empty image)")


def array_to_datum(img: np.ndarray, label: int = 0) -> pb.Datum:
    """Caffe's ``CVMatToDatum``: an ``(H, W, C)`` uint8 image into a raw Datum (C×H×W bytes)."""
    if img.ndim == 2:
        img = img[:, :, None]
    h, w, c = img.shape
    datum = pb.Datum(channels=c, height=h, width=w, label=int(label), encoded=False)
    datum.data = np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.uint8).tobytes()
    return datum


def decode_datum_native(datum: pb.Datum) -> bool:
    """Caffe's ``DecodeDatumNative``: replace an encoded Datum by its raw pixels; False if raw."""
    if not datum.encoded:
        return False
    chw = datum_to_array(datum, UNCHANGED)
    label = datum.label
    datum.CopyFrom(array_to_datum(chw.transpose(1, 2, 0), label))
    return True
