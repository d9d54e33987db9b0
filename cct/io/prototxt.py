"""Text protobuf files (.prototxt): nets and solvers.

Parsing is protobuf's own text format (``google.protobuf.text_format``), as Caffe's
``ReadProtoFromTextFile``; every net read is then upgraded (:mod:`cct.io.upgrade`).  Errors are one
line: ``Could not open file <path>`` or ``<path>:<line>:<col>: <what protobuf says>``.
"""
from __future__ import annotations

import codecs
import os
import re
from typing import TypeVar

from google.protobuf import text_format
from google.protobuf.message import Message

from cct.errors import CctError
from cct.io.upgrade import upgrade_net_as_needed, upgrade_solver_as_needed
from cct.io.weights import (
    HDF5_SIGNATURE,
    atomic_write,
    is_hdf5,
    looks_like_text,
    parse_proto_binary,
    read_bytes,
)
from cct.proto import caffe_pb2

M = TypeVar("M", bound=Message)

_LOCATION_PREFIX = re.compile(r"^\d+(?::\d+)? : ")


def parse_text(text: str | bytes, message: M, source: str = "<string>") -> M:
    """Merge protobuf text ``text`` into ``message`` (cleared first) without upgrading.

    A syntax error, unknown field or repeated singular field raises
    ``CctError("<source>:<line>:<col>: <protobuf's message>")``."""
    if isinstance(text, bytes):
        if text.startswith(HDF5_SIGNATURE):
            raise CctError(f"{source}: is an HDF5 file, not a text {message.DESCRIPTOR.name}")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CctError(f"{source}: is not a text file (byte {e.start} is not UTF-8); a binary "
                           "file such as a .caffemodel cannot be read as a prototxt") from None
    message.Clear()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        line, col = e.GetLine(), e.GetColumn()
        what = _LOCATION_PREFIX.sub("", str(e)).replace("\n", " ")
        where = f"{source}:{line}:{col}" if line is not None and col is not None else (
            f"{source}:{line}" if line is not None else source)
        raise CctError(f"{where}: {what}") from None
    return message


def read_text(path: str | os.PathLike[str], message: M) -> M:
    """Caffe's ``ReadProtoFromTextFile`` (no upgrade)."""
    return parse_text(read_bytes(path), message, os.fspath(path))


def read_net_param(path: str | os.PathLike[str]) -> caffe_pb2.NetParameter:
    """A net prototxt, upgraded (Caffe's ``ReadNetParamsFromTextFileOrDie``)."""
    net = read_text(path, caffe_pb2.NetParameter())
    upgrade_net_as_needed(net, os.fspath(path))
    return net


def parse_net_param(text: str | bytes, source: str = "<string>") -> caffe_pb2.NetParameter:
    """A net from prototxt text in memory (NetSpec, pycaffe ``Net`` from a temp file), upgraded."""
    net = parse_text(text, caffe_pb2.NetParameter(), source)
    upgrade_net_as_needed(net, source)
    return net


def read_solver_param(path: str | os.PathLike[str]) -> caffe_pb2.SolverParameter:
    """A solver prototxt with the ``solver_type`` upgrade applied.

    (Caffe HEAD's snapshot_prefix defaulting is done by the solver, not here.)"""
    solver = read_text(path, caffe_pb2.SolverParameter())
    upgrade_solver_as_needed(solver, os.fspath(path))
    return solver


def parse_solver_param(text: str | bytes, source: str = "<string>") -> caffe_pb2.SolverParameter:
    """A solver from prototxt text in memory, upgraded."""
    solver = parse_text(text, caffe_pb2.SolverParameter(), source)
    upgrade_solver_as_needed(solver, source)
    return solver


def write_text(path: str | os.PathLike[str], message: Message) -> None:
    """Caffe's ``WriteProtoToTextFile`` (protobuf text format, two-space indent), atomically."""
    text = text_format.MessageToString(message)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def read_net_param_any(path: str | os.PathLike[str]) -> caffe_pb2.NetParameter:
    """A ``NetParameter`` from a binary caffemodel (Caffe's ``ReadNetParamsFromBinaryFileOrDie``)
    or, if the file is text, from a prototxt; upgraded either way.  An HDF5 file is an error."""
    source = os.fspath(path)
    if is_hdf5(path):
        raise CctError(f"{source}: is an HDF5 weights file (.caffemodel.h5), not a NetParameter; "
                       "read it with cct.io.hdf5.read_hdf5_weights")
    data = read_bytes(path)
    net = caffe_pb2.NetParameter()
    if data and looks_like_text(data):
        try:
            parse_text(data, net, source)
        except CctError as text_error:
            try:
                parse_proto_binary(data, net, source)
            except CctError:
                raise text_error from None
    else:
        parse_proto_binary(data, net, source)
    upgrade_net_as_needed(net, source)
    return net


# ------------------------------------------------------------------------------------------------
# Locating a layer in a prototxt (for error messages)
# ------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\f\v]+) | (?P<nl>\n) | (?P<comment>\#[^\n]*)
  | (?P<str>"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<open>[{<]) | (?P<close>[}>])
  | (?P<other>.)
""", re.VERBOSE)

_LAYER_BLOCKS = ("layer", "layers")


def _unquote(token: str) -> str:
    body = token[1:-1] if len(token) >= 2 and token[-1] == token[0] else token[1:]
    try:
        return codecs.escape_decode(body.encode("utf-8"))[0].decode("utf-8", "replace")
    except ValueError:
        return body


def find_layer_line(path: str | os.PathLike[str], layer_name: str) -> int | None:
    """The 1-based line of ``name: "<layer_name>"`` of the top-level ``layer``/``layers`` block
    (or the V0 ``layers { layer { name } }`` block) naming that layer, or None if the file cannot
    be read or has no such layer.  Comments and strings are skipped properly."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return find_layer_line_in_text(text, layer_name)


def find_layer_line_in_text(text: str, layer_name: str) -> int | None:
    """:func:`find_layer_line` on text in memory."""
    line = 1
    stack: list[str] = []        # field names of the enclosing message blocks
    last_ident: str | None = None
    pending_name: int | None = None  # line of a `name` field whose value is being read
    value = ""
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        tok = m.group()
        if kind == "nl":
            line += 1
            continue
        if kind in ("ws", "comment"):
            continue
        if pending_name is not None:
            if kind == "str":
                value += _unquote(tok)
                continue
            if kind == "other" and tok == ":" and not value:
                continue
            if value == layer_name:
                return pending_name
            pending_name, value = None, ""
        if kind == "open":
            stack.append(last_ident or "")
            last_ident = None
        elif kind == "close":
            if stack:
                stack.pop()
            last_ident = None
        elif kind == "ident":
            in_layer = (len(stack) == 1 and stack[0] in _LAYER_BLOCKS) or stack == ["layers", "layer"]
            if tok == "name" and in_layer:
                pending_name, value = line, ""
            last_ident = tok
        # ':' and other punctuation leave last_ident alone (`layer: {` is valid too)
    if pending_name is not None and value == layer_name:
        return pending_name
    return None


__all__ = ["parse_text", "read_text", "read_net_param", "parse_net_param", "read_solver_param",
           "parse_solver_param", "write_text", "read_net_param_any", "find_layer_line",
           "find_layer_line_in_text"]
