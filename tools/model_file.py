"""The command line of the model generators (make_inception_v3, make_resnet50): ``[--batch N] [--out PATH]``,
the generated file headed by a comment that names its generator."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_model(argv: list[str] | None, description: str, build: Callable[[int], Any], default_out: Path,
                header: str, batch: int = 10) -> int:
    """Parse ``argv``, write ``header`` and ``build(batch)``'s NetParameter to ``--out``; returns 0."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + str(build(args.batch)))
    print(f"wrote {out}")
    return 0
