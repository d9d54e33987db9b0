"""gflags-style parsing shared by `cct` and the dataset tools."""
from __future__ import annotations

import pytest

from cct.flags import Flag, FlagError, parse_flags, usage_text

FLAGS = [Flag("gray", bool, False, "grey"), Flag("n", int, 0, "count"), Flag("s", str, "x", "text"),
         Flag("r", float, 1.5, "ratio")]


def test_forms_and_positionals() -> None:
    values, pos = parse_flags(["a", "-gray", "--n=3", "b", "-s", "y", "-r", "0.25"], FLAGS)
    assert pos == ["a", "b"]
    assert (values.gray, values.n, values.s, values.r, values.help) == (True, 3, "y", 0.25, False)


def test_negation_double_dash_and_glog_flags() -> None:
    values, pos = parse_flags(["-gray=false", "-nogray", "-logtostderr", "-v", "2", "--", "-n"], FLAGS)
    assert pos == ["-n"] and values.gray is False and values.n == 0
    assert "logtostderr" not in values  # accepted, not reported


def test_help() -> None:
    assert parse_flags(["-help"], FLAGS)[0].help


@pytest.mark.parametrize("argv,message", [
    (["-n"], "flag '-n' is missing its argument"),
    (["-gray=maybe"], "illegal value 'maybe' specified for bool flag 'gray'"),
    (["-n=x"], "illegal value 'x' specified for int32 flag 'n'"),
    (["-r=x"], "illegal value 'x' specified for double flag 'r'"),
    (["-bogus"], "unknown command line flag 'bogus'"),
])
def test_errors_are_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        parse_flags(argv, FLAGS)


def test_usage_lists_flags() -> None:
    text = usage_text("tool: does things", FLAGS)
    assert '-s (text) type: string default: "x"' in text and "-gray (grey) type: bool default: false" in text
