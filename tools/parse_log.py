#!/usr/bin/env python
"""Parse a Caffe (or cct) training log into CSV tables: ``<log>.train`` and ``<log>.test``.

Usage (as Caffe's ``tools/extra/parse_log.py``)::

    parse_log.py logfile_path output_dir [--verbose] [--delimiter ,]

Each row is one iteration: ``NumIters``, ``Seconds`` (since the ``Solving`` line), ``LearningRate``
(the last ``lr = `` seen; the first row takes the second row's), then one column per net output
(``Train net output #k: name = v`` / ``Test net output #k: name = v``).  The same rows and columns
as Caffe's script, which it follows line for line in behaviour; in addition it reads glog's newer
``I<yyyymmdd>`` prefix (Caffe's script only knows ``I<mmdd>`` and would skip every such line) and
a log with no ``Solving`` line (times then count from its first line).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable

RE_ITERATION = re.compile(r"Iteration (\d+)")
RE_TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")

Row = "OrderedDict[str, float]"


def log_year(path: str) -> int:
    """The year a log was written (glog's ``I<mmdd>`` prefix has none): its ctime's year, as Caffe."""
    return datetime.datetime.fromtimestamp(os.path.getctime(path)).year


def line_datetime(line: str, year: int) -> datetime.datetime:
    """The time in a glog prefix: ``I0210 13:39:22.381027 …`` or ``I20260210 13:39:22.381027 …``.

    Raises ValueError for a line without one."""
    fields = line.strip().split()
    if len(fields) < 2:
        raise ValueError("no glog prefix")
    date = fields[0][1:]
    if len(date) == 8 and date.isdigit():
        year, month, day = int(date[:4]), int(date[4:6]), int(date[6:])
    elif len(date) == 4 and date.isdigit():
        month, day = int(date[:2]), int(date[2:])
    else:
        raise ValueError("no glog date")
    clock, _, micro = fields[1].rpartition(".")
    hour, minute, second = (int(x) for x in clock.split(":"))
    return datetime.datetime(year, month, day, hour, minute, second, int(micro))


def _start_time(lines: Iterable[str], year: int, first: list[str]) -> datetime.datetime | None:
    """Consume lines up to and including the first ``Solving`` line and return its time.  Lines read
    on the way are kept in ``first`` in case there is no such line."""
    for line in lines:
        first.append(line)
        if "Solving" in line:
            first.clear()
            return line_datetime(line, year)
    return None


def _net_output(regex: re.Pattern, row: OrderedDict | None, rows: list, line: str, iteration: float,
                seconds: float, learning_rate: float) -> OrderedDict | None:
    """Add a matching output to the current row; a row is complete once it has as many columns as
    the first row (the first row itself is pushed when the iteration changes)."""
    match = regex.search(line)
    if match:
        if not row or row["NumIters"] != iteration:
            if row:
                rows.append(row)
            row = OrderedDict([("NumIters", iteration), ("Seconds", seconds), ("LearningRate", learning_rate)])
        row[match.group(2)] = float(match.group(3))
    if row and rows and len(row) == len(rows[0]):
        rows.append(row)
        row = None
    return row


def parse_log(path: str) -> tuple[list[OrderedDict], list[OrderedDict]]:
    """(train rows, test rows) of a training log."""
    year = log_year(path)
    iteration = -1.0
    learning_rate = float("nan")
    train_rows: list[OrderedDict] = []
    test_rows: list[OrderedDict] = []
    train_row = test_row = None
    with open(path, errors="replace") as f:
        skipped: list[str] = []
        start = _start_time(f, year, skipped)
        remaining: Iterable[str] = f
        if start is None:  # no Solving line: count from the first timestamped line, parse everything
            remaining = skipped
            for line in skipped:
                try:
                    start = line_datetime(line, year)
                    break
                except ValueError:
                    continue
            if start is None:
                return [], []
        for line in remaining:
            match = RE_ITERATION.search(line)
            if match:
                iteration = float(match.group(1))
            if iteration == -1:
                continue
            try:
                when = line_datetime(line, year)
            except ValueError:
                continue  # a line without a glog prefix (e.g. a net printout)
            seconds = (when - start).total_seconds()
            lr_match = RE_LEARNING_RATE.search(line)
            if lr_match:
                learning_rate = float(lr_match.group(1))
            train_row = _net_output(RE_TRAIN_OUTPUT, train_row, train_rows, line, iteration, seconds,
                                    learning_rate)
            test_row = _net_output(RE_TEST_OUTPUT, test_row, test_rows, line, iteration, seconds,
                                   learning_rate)
    for rows in (train_rows, test_rows):
        if len(rows) > 1:  # the lr is logged after the first outputs: borrow the second row's
            rows[0]["LearningRate"] = rows[1]["LearningRate"]
    return train_rows, test_rows


def write_csv(filename: str, rows: list[OrderedDict], delimiter: str = ",", verbose: bool = False) -> None:
    if not rows:
        if verbose:
            print(f"Not writing {filename}; no lines to write")
        return
    with open(filename, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()), dialect=csv.excel, delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    if verbose:
        print(f"Wrote {filename}")


def save_csv_files(logfile_path: str, output_dir: str, train_rows: list[OrderedDict],
                   test_rows: list[OrderedDict], delimiter: str = ",", verbose: bool = False) -> None:
    base = os.path.join(output_dir, os.path.basename(logfile_path))
    write_csv(base + ".train", train_rows, delimiter, verbose)
    write_csv(base + ".test", test_rows, delimiter, verbose)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Parse a Caffe training log into CSV files "
                                                 "(<log>.train, <log>.test).")
    parser.add_argument("logfile_path", help="Path to log file")
    parser.add_argument("output_dir", help="Directory in which to place output CSV files")
    parser.add_argument("--verbose", action="store_true", help="Print some extra info (e.g., output filenames)")
    parser.add_argument("--delimiter", default=",", help="Column delimiter in output files (default: '%(default)s')")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.logfile_path):
        print(f"parse_log.py: no such log file: {args.logfile_path}", file=sys.stderr)
        return 1
    if not os.path.isdir(args.output_dir):
        print(f"parse_log.py: output directory does not exist: {args.output_dir}", file=sys.stderr)
        return 1
    train_rows, test_rows = parse_log(args.logfile_path)
    save_csv_files(args.logfile_path, args.output_dir, train_rows, test_rows, args.delimiter, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
