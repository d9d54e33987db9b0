"""``cct draw NET OUT``: draw a net as a graph (Caffe's ``python/draw_net.py``): the image format follows OUT's
extension — png, svg, pdf ... through Graphviz, or ``.dot``/``.gv``/``.raw`` for the DOT text (no Graphviz
needed).  See :mod:`cct.draw`."""
from __future__ import annotations

from cct import log
from cct.errors import CctError
from cct.flags import Flag, Flags

SUMMARY = "draw a net as a graph (png, svg, pdf or dot)"
ARGUMENTS = "NET.prototxt OUT.png|OUT.svg|OUT.dot"
FLAGS = [
    Flag("rankdir", str, "LR", "draw: direction of the layout: LR, RL, TB or BT."),
    Flag("display_lrm", bool, False, "draw: show the learning-rate multipliers of learning layers."),
]


def _draw_phase(value: str) -> int | None:
    from cct.pycaffe import TEST, TRAIN

    phases = {"": None, "ALL": None, "TRAIN": TRAIN, "TEST": TEST}
    if value not in phases:
        raise CctError(f"-phase {value}: must be TRAIN, TEST or ALL")
    return phases[value]


def main(flags: Flags) -> int:
    from cct.draw import draw_net_to_file
    from cct.io.prototxt import read_net_param

    if len(flags.args) != 2:
        raise CctError(f"draw needs a net and an output file: cct draw {ARGUMENTS} (got {len(flags.args)} "
                       "arguments)")
    net_file, out = flags.args
    if "." not in out.rsplit("/", 1)[-1]:
        raise CctError(f"draw: {out} has no extension to give the format (png, svg, pdf, dot ...)")
    if flags.rankdir not in ("LR", "RL", "TB", "BT"):
        raise CctError(f"-rankdir {flags.rankdir}: must be LR, RL, TB or BT")
    param = read_net_param(net_file)
    log.info("Drawing net to %s", out)
    try:
        draw_net_to_file(param, out, flags.rankdir, _draw_phase(flags.phase), flags.display_lrm)
    except OSError as e:
        raise CctError(f"draw: cannot write {out} ({e.strerror})") from None
    return 0
