#!/usr/bin/env python
"""Plot training logs (Caffe's ``tools/extra/plot_training_log.py.example``) to a PNG.

Usage::

    plot_training_log.py chart_type[0-7] /where/to/save.png /path/to/first.log ...

Chart types (Caffe's numbering)::

    0: Test accuracy  vs. Iters        4: Train learning rate  vs. Iters
    1: Test accuracy  vs. Seconds      5: Train learning rate  vs. Seconds
    2: Test loss  vs. Iters            6: Train loss  vs. Iters
    3: Test loss  vs. Seconds          7: Train loss  vs. Seconds

One line per log, labelled with the log's file name (which must end in ``.log``).  The logs are read
with :mod:`parse_log` (no shell script); "accuracy" is the test output named ``accuracy`` (else the
first whose name contains ``acc``), "loss" the output named ``loss`` (else the first containing
``loss``).  Needs matplotlib (``pip install matplotlib``); without it, says so and exits with 1.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parse_log import parse_log  # noqa: E402

LOG_SUFFIX = ".log"
SEPARATOR = "  vs. "
X_FIELDS = {"Iters": "NumIters", "Seconds": "Seconds"}
Y_FIELDS = ["Test accuracy", "Test loss", "Train learning rate", "Train loss"]
CHART_TYPES = [f"{y}{SEPARATOR}{x}" for y in Y_FIELDS for x in X_FIELDS]
MARKERS = "os^vD<>px*h"


def help_text() -> str:
    lines = [
        "This script mainly serves as the basis of your customizations.",
        "Usage:",
        f"    ./plot_training_log.py chart_type[0-{len(CHART_TYPES) - 1}] /where/to/save.png /path/to/first.log ...",
        "Notes:",
        "    1. Supporting multiple logs.",
        f"    2. Log file name must end with the lower-cased \"{LOG_SUFFIX}\".",
        "Supported chart types:",
    ]
    lines += [f"    {i}: {c}" for i, c in enumerate(CHART_TYPES)]
    return "\n".join(lines)


def _column(rows: list, kind: str) -> str | None:
    """The output column holding ``kind`` ("accuracy" or "loss")."""
    if not rows:
        return None
    names = [k for k in rows[0] if k not in ("NumIters", "Seconds", "LearningRate")]
    if kind in names:
        return kind
    key = "acc" if kind == "accuracy" else kind
    return next((n for n in names if key in n.lower()), None)


def series(chart_type: int, path_to_log: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of ``chart_type`` in one log."""
    y_field, x_field = CHART_TYPES[chart_type].split(SEPARATOR)
    train, test = parse_log(path_to_log)
    rows = test if y_field.startswith("Test") else train
    if y_field.endswith("learning rate"):
        column: str | None = "LearningRate"
    else:
        column = _column(rows, "accuracy" if y_field.endswith("accuracy") else "loss")
    if column is None:
        return [], []
    x_key = X_FIELDS[x_field]
    points = [(r[x_key], r[column]) for r in rows if column in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot_chart(chart_type: int, path_to_png: str, path_to_logs: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y_field, x_field = CHART_TYPES[chart_type].split(SEPARATOR)
    fig, ax = plt.subplots()
    for i, path in enumerate(path_to_logs):
        x, y = series(chart_type, path)
        label = os.path.basename(path)[: -len(LOG_SUFFIX)]
        ax.plot(x, y, label=label, marker=MARKERS[i % len(MARKERS)], linewidth=0.75)
    loc = "upper right" if ("loss" in y_field or "learning rate" in y_field) else "lower right"
    ax.legend(loc=loc, ncol=1)
    ax.set_title(CHART_TYPES[chart_type])
    ax.set_xlabel(x_field)
    ax.set_ylabel(y_field)
    fig.savefig(path_to_png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3:
        print(help_text())
        return 1
    try:
        chart_type = int(argv[0])
    except ValueError:
        chart_type = -1
    if not 0 <= chart_type < len(CHART_TYPES):
        print(f"{argv[0]} is not a valid chart type.")
        print(help_text())
        return 1
    path_to_png, path_to_logs = argv[1], argv[2:]
    if not path_to_png.endswith(".png"):
        print(f"Path must end with png: {path_to_png}")
        return 1
    for path in path_to_logs:
        if not os.path.exists(path):
            print(f"Path does not exist: {path}")
            return 1
        if not path.endswith(LOG_SUFFIX):
            print(f"Log file must end in {LOG_SUFFIX}: {path}")
            return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_training_log.py needs matplotlib, which is not installed: pip install matplotlib "
              "(or pip install 'cct[plot]')", file=sys.stderr)
        return 1
    plot_chart(chart_type, path_to_png, path_to_logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
