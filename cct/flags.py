"""gflags-style command lines, as the Caffe binaries take them.

``-flag=value``, ``-flag value``, ``--flag``, bool flags as ``-gray``, ``-gray=true`` or ``-nogray``; flags
may come anywhere among the positional arguments and ``--`` ends them.  glog's own flags
(``-logtostderr`` …) are accepted and ignored: cct always logs to stderr.  Errors are one-line
:class:`FlagError`s worded as gflags words them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cct.errors import CctError

_KIND_NAMES = {str: "string", int: "int32", bool: "bool", float: "double"}
_TRUE = ("true", "t", "yes", "y", "1")
_FALSE = ("false", "f", "no", "n", "0")
HELP_FLAGS = ("help", "helpfull", "helpshort")


class FlagError(CctError):
    """A command-line mistake."""


@dataclass(frozen=True)
class Flag:
    name: str
    kind: type  # bool, int, float or str
    default: Any
    help: str


# glog's flags that Caffe users pass; accepted as they are.
GLOG_FLAGS = [Flag(n, k, d, "glog (cct always logs to stderr)") for n, k, d in (
    ("logtostderr", bool, False), ("alsologtostderr", bool, False), ("colorlogtostderr", bool, False),
    ("minloglevel", int, 0), ("stderrthreshold", int, 2), ("v", int, 0), ("log_dir", str, ""),
    ("logbuflevel", int, 0), ("logbufsecs", int, 30), ("max_log_size", int, 1800),
    ("stop_logging_if_full_disk", bool, False), ("vmodule", str, ""))]


class Flags(dict):
    """Parsed flag values with attribute access (``flags.solver``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _convert(flag: Flag, text: str) -> Any:
    kind_name = _KIND_NAMES[flag.kind]
    if flag.kind is bool:
        low = text.lower()
        if low not in _TRUE and low not in _FALSE:
            raise FlagError(f"illegal value '{text}' specified for bool flag '{flag.name}'")
        return low in _TRUE
    try:
        if flag.kind is int:
            value = int(text, 0) if text.lower().startswith(("0x", "-0x")) else int(text)
            if not -(1 << 31) <= value < (1 << 31):
                raise ValueError(text)
            return value
        if flag.kind is float:
            return float(text)
    except ValueError:
        raise FlagError(f"illegal value '{text}' specified for {kind_name} flag '{flag.name}'") from None
    return text


def parse_flags(argv: Sequence[str], flags: Sequence[Flag]) -> tuple[Flags, list[str]]:
    """Parse ``argv`` (without the program name): ``(values, positional arguments)``.

    ``values`` holds every flag of ``flags`` (defaults filled in) and ``help`` (True if -help was given)."""
    known = {f.name: f for f in list(flags) + GLOG_FLAGS}
    values = Flags({f.name: f.default for f in flags})
    values["help"] = False
    positional: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            positional.extend(argv[i:])
            break
        if not arg.startswith("-") or arg == "-":
            positional.append(arg)
            continue
        name, has_value, text = arg.lstrip("-").partition("=")
        if name in HELP_FLAGS:
            values["help"] = True
            continue
        flag = known.get(name)
        if flag is None and name.startswith("no") and not has_value:
            negated = known.get(name[2:])
            if negated is not None and negated.kind is bool:
                if negated.name in values:
                    values[negated.name] = False
                continue
        if flag is None:
            raise FlagError(f"unknown command line flag '{name}'")
        if flag.kind is bool and not has_value:
            value: Any = True
        else:
            if not has_value:
                if i >= len(argv):
                    raise FlagError(f"flag '{arg}' is missing its argument; flag description: {flag.help}")
                text = argv[i]
                i += 1
            value = _convert(flag, text)
        if name in values:
            values[name] = value
    return values, positional


def usage_text(header: str, flags: Sequence[Flag], title: str = "Flags") -> str:
    """``header`` followed by gflags' listing of ``flags``."""
    lines = [header, "", f"  {title}:"]
    for f in flags:
        default = f'"{f.default}"' if f.kind is str else str(f.default).lower()
        lines.append(f"    -{f.name} ({f.help}) type: {_KIND_NAMES[f.kind]} default: {default}")
    return "\n".join(lines)
