"""Caffe's dataset tools: ``convert_imageset`` and ``compute_image_mean``.

Both take Caffe's command lines in gflags syntax (``-flag=value``, ``-flag value``, ``--flag``, bool
flags as ``-gray``, ``-gray=true`` or ``-nogray``; flags may come anywhere; ``--`` ends them).  Each
``*_main(argv)`` takes the arguments after the program name and returns the exit status; errors are
one line on stderr, never a traceback.

convert_imageset [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME
    Each list line is ``<path> <label>`` (split at the last space); the image ``ROOTFOLDER + path`` is
    read in colour (or grey with ``-gray``), resized to ``-resize_width`` × ``-resize_height`` when both
    are > 0, and stored as a Datum under key ``"%08d_<path>" % line_index`` (images that cannot be read
    are logged and skipped).  ``-encoded`` stores the file bytes (re-encoded as ``-encode_type`` or the
    file's extension when the image was resized or its colour-ness changed).  ``-backend lmdb`` (the default)
    or ``leveldb`` (needs plyvel: the ``leveldb`` extra).

compute_image_mean [FLAGS] INPUT_DB [OUTPUT_FILE]
    The float32 mean of all Datums (accumulated in float32, as Caffe does), written as a BlobProto
    with legacy ``num=1, channels, height, width``; logs ``mean_value channel [c]: v``.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from cct import log
from cct.data.datum import DatumError, array_to_datum, decode_datum_native, parse_datum
from cct.data.db import backend_name, iterate_records, open_writer
from cct.data.image import encode_image, read_image
from cct.data.image_data_layer import atoi
from cct.errors import CctError
from cct.flags import Flag, FlagError, parse_flags, usage_text
from cct.proto import caffe_pb2 as pb
from cct.rng import get_rng


def _usage(tool: str, text: str, flags: list[Flag]) -> str:
    return usage_text(f"{tool}: {text}", flags)


def _run(body, argv: Sequence[str]) -> int:
    try:
        return body(list(argv))
    except FlagError as e:
        print(str(e), file=sys.stderr)
        return 1
    except CctError as e:
        log.error("%s", e)
        return 1


# ---- convert_imageset -----------------------------------------------------------------------------
_CONVERT_FLAGS = [
    Flag("gray", bool, False, "When this option is on, treat images as grayscale ones"),
    Flag("shuffle", bool, False, "Randomly shuffle the order of images and their labels"),
    Flag("backend", str, "lmdb", "The backend {lmdb, leveldb} for storing the result"),
    Flag("resize_width", int, 0, "Width images are resized to"),
    Flag("resize_height", int, 0, "Height images are resized to"),
    Flag("check_size", bool, False, "When this option is on, check that all the datum have the same size"),
    Flag("encoded", bool, False, "When this option is on, the encoded image will be save in datum"),
    Flag("encode_type", str, "", "Optional: What type should we encode the image as ('png','jpg',...)."),
]
_CONVERT_USAGE = ("Convert a set of images to the leveldb/lmdb\nformat used as input for Caffe.\nUsage:\n"
                  "    convert_imageset [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME\n")


def _match_ext(filename: str, encoding: str) -> bool:
    """Caffe's ``matchExt``: the file's extension is the encoding (jpeg counts as jpg)."""
    pos = filename.rfind(".")
    ext = (filename[pos + 1:] if pos >= 0 else filename).lower()
    return ext == encoding or (encoding == "jpg" and ext == "jpeg")


def read_image_to_datum(filename: str, label: int, height: int, width: int, is_color: bool,
                        encoding: str) -> pb.Datum | None:
    """Caffe's ``ReadImageToDatum``; None (logged) when the image cannot be read."""
    img = read_image(filename, height, width, is_color)
    if img is None:
        log.error("Could not open or find file %s", filename)
        return None
    if encoding:
        if (img.shape[2] == 3) == is_color and not height and not width and _match_ext(filename, encoding):
            with open(filename, "rb") as f:
                data = f.read()
        else:
            try:
                data = encode_image(img, encoding)
            except ValueError as e:
                raise CctError(f"{filename}: {e}") from None
        return pb.Datum(data=data, label=int(label), encoded=True)
    return array_to_datum(img, label)


def _convert_imageset(argv: list[str]) -> int:
    values, args = parse_flags(argv, _CONVERT_FLAGS)
    if values.help or len(args) != 3:
        print(_usage("convert_imageset", _CONVERT_USAGE, _CONVERT_FLAGS), file=sys.stderr)
        return 1
    root, list_file, db_name = args
    is_color = not values["gray"]
    encoded = values["encoded"]
    encode_type = values["encode_type"]
    backend = backend_name(values["backend"])
    try:
        with open(list_file, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError as e:
        raise CctError(f"convert_imageset: cannot open the list file {list_file} ({e.strerror})") from None
    lines: list[tuple[str, int]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        pos = line.rfind(" ")
        lines.append((line[:pos] if pos >= 0 else line, atoi(line[pos + 1:])))
    if values["shuffle"]:
        log.info("Shuffling data")
        order = get_rng().permutation(len(lines))
        lines = [lines[i] for i in order]
    log.info("A total of %d images.", len(lines))
    if encode_type and not encoded:
        log.info("encode_type specified, assuming encoded=true.")
        encoded = True
    height, width = max(0, values["resize_height"]), max(0, values["resize_width"])
    db = open_writer(db_name, backend)
    count = 0
    data_size: int | None = None
    for line_id, (path, label) in enumerate(lines):
        enc = encode_type
        if encoded and not enc:
            pos = path.rfind(".")
            if pos < 0:
                log.warning("Failed to guess the encoding of '%s'", path)
            enc = path[pos + 1:].lower()
        datum = read_image_to_datum(root + path, label, height, width, is_color, enc)
        if datum is None:
            continue
        if values["check_size"]:
            size = len(datum.data)
            if data_size is None:
                data_size = datum.channels * datum.height * datum.width
            elif size != data_size:
                raise CctError(f"convert_imageset: {root + path}: Incorrect data field size {size} "
                               f"(expected {data_size})")
        key = f"{line_id:08d}_".encode() + path.encode("utf-8", "surrogateescape")
        db.put(key, datum.SerializeToString())
        count += 1
        if count % 1000 == 0:
            db.commit()
            log.info("Processed %d files.", count)
    if count % 1000 != 0:
        db.commit()
        log.info("Processed %d files.", count)
    db.close()
    return 0


def convert_imageset_main(argv: list[str]) -> int:
    """``convert_imageset [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME``; argv excludes the program name."""
    return _run(_convert_imageset, argv)


# ---- compute_image_mean ---------------------------------------------------------------------------
_MEAN_FLAGS = [Flag("backend", str, "lmdb", "The backend {leveldb, lmdb} containing the images")]
_MEAN_USAGE = ("Compute the mean_image of a set of images given by a leveldb/lmdb\nUsage:\n"
               "    compute_image_mean [FLAGS] INPUT_DB [OUTPUT_FILE]\n")


def _datum_values(datum: pb.Datum) -> np.ndarray:
    if datum.data:
        return np.frombuffer(datum.data, dtype=np.uint8)
    return np.asarray(datum.float_data, dtype=np.float32)


def _compute_image_mean(argv: list[str]) -> int:
    values, args = parse_flags(argv, _MEAN_FLAGS)
    if values.help or len(args) not in (1, 2):
        print(_usage("compute_image_mean", _MEAN_USAGE, _MEAN_FLAGS), file=sys.stderr)
        return 1
    db_path = args[0]
    records = iterate_records(db_path, values["backend"], "compute_image_mean: database")
    total: np.ndarray | None = None
    shape = (0, 0, 0)
    count = 0
    for key, value in records:
        try:
            datum = parse_datum(value)
            decoded = decode_datum_native(datum)
        except DatumError as e:
            raise CctError(f"compute_image_mean: {db_path}: record {key.decode('utf-8', 'replace')}: {e}") \
                from None
        if total is None:
            if decoded:
                log.info("Decoding Datum")
            shape = (datum.channels, datum.height, datum.width)
            total = np.zeros(max(len(datum.data), len(datum.float_data)), dtype=np.float32)
            log.info("Starting iteration")
        x = _datum_values(datum)
        if x.size != int(np.prod(shape)) or x.size != total.size:
            raise CctError(f"compute_image_mean: {db_path}: record {key.decode('utf-8', 'replace')}: "
                           f"Incorrect data field size {x.size} (expected {total.size})")
        np.add(total, x, out=total, dtype=np.float32)
        count += 1
        if count % 10000 == 0:
            log.info("Processed %d files.", count)
    if total is None:
        raise CctError(f"compute_image_mean: {db_path}: the database is empty")
    if count % 10000 != 0:
        log.info("Processed %d files.", count)
    mean = (total / np.float32(count)).astype(np.float32)
    if len(args) == 2:
        from cct.io.weights import write_proto_binary

        log.info("Write to %s", args[1])
        blob = pb.BlobProto(num=1, channels=shape[0], height=shape[1], width=shape[2])
        blob.data.extend(mean.tolist())
        write_proto_binary(args[1], blob)
    channels, dim = shape[0], shape[1] * shape[2]
    log.info("Number of channels: %d", channels)
    for c in range(channels):
        # Caffe sums each channel sequentially in float32.
        s = np.cumsum(mean[c * dim:(c + 1) * dim], dtype=np.float32)[-1]
        log.info("mean_value channel [%d]: %s", c, log.fmt(np.float32(s) / np.float32(dim)))
    return 0


def compute_image_mean_main(argv: list[str]) -> int:
    """``compute_image_mean [FLAGS] INPUT_DB [OUTPUT_FILE]``; argv excludes the program name."""
    return _run(_compute_image_mean, argv)
