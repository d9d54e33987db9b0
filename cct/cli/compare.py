"""``cct compare``: run a net on the inputs of a reference file written by real Caffe and compare every blob,
gradient and parameter under the project's one rule; a table in net order, exit 0 when all agree, 1 naming
the first array that does not (see :mod:`cct.compare.reference` for the file and the order)."""
from __future__ import annotations

import json
import sys

from cct import log
from cct.cli.common import stages
from cct.errors import CctError
from cct.flags import Flag, Flags

SUMMARY = "compare a net's blobs with a reference file written by Caffe"
FLAGS = [
    Flag("reference", str, "", "compare: the reference file (.npz or .h5 with input/, data/, diff/, param/, "
                               "param_diff/ arrays), e.g. written by tools/caffe_dump.py under pycaffe."),
    Flag("tolerance", float, 1e-4, "compare: relative tolerance, against the larger of an element and its "
                                   "blob's scale (atol 1e-5)."),
    Flag("format", str, "text", "compare: output format, text or json."),
]


def _phase(value: str) -> int | None:
    from cct.pycaffe import TEST, TRAIN

    if not value:
        return None
    if value in ("TRAIN", "TEST"):
        return TRAIN if value == "TRAIN" else TEST
    raise CctError(f"-phase {value}: phase must be \"TRAIN\" or \"TEST\"")


def main(flags: Flags) -> int:
    from cct.compare.reference import compare_with_reference, format_text, to_json

    if not flags.model:
        raise CctError("Need a model definition to compare (-model).")
    if not flags.reference:
        raise CctError("Need a reference file to compare with (-reference).")
    fmt = flags.format or "text"
    if fmt not in ("text", "json"):
        raise CctError(f"-format {fmt}: must be text or json")
    if not flags.tolerance > 0:
        raise CctError(f"-tolerance {flags.tolerance}: must be positive")
    weights = [w for w in flags.weights.split(",") if w] if flags.weights else []
    if not weights:
        log.warning("No -weights given: the net keeps the values its fillers drew")
    report = compare_with_reference(flags.model, weights, flags.reference, _phase(flags.phase),
                                    rtol=flags.tolerance, level=flags.level, stages=stages(flags.stage))
    if fmt == "json":
        print(json.dumps(to_json(report), indent=1))
    else:
        print(format_text(report))
    sys.stdout.flush()
    first = report.first_failure
    if first is not None:
        log.error("%s", first.detail())
        return 1
    return 0
