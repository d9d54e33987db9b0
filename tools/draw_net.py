#!/usr/bin/env python
"""Draw a net's graph (the arguments of Caffe's python/draw_net.py; the same as ``cct draw``).

    python tools/draw_net.py NET.prototxt OUT.png [--rankdir LR|RL|TB|BT] [--phase TRAIN|TEST|ALL] [--display_lrm]

The format follows OUT's extension: png, svg, pdf ... need Graphviz (and pydot, the ``draw`` extra, if it is
installed); ``.dot``, ``.gv`` and ``.raw`` are the DOT text and need neither.
"""
from __future__ import annotations

import argparse
import sys

import cct
from cct.draw import draw_net_to_file
from cct.errors import CctError
from cct.io.prototxt import read_net_param

PHASES = {"TRAIN": cct.TRAIN, "TEST": cct.TEST, "ALL": None}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input_net_proto_file", help="the net prototxt")
    p.add_argument("output_image_file", help="the drawing; its extension gives the format")
    p.add_argument("--rankdir", default="LR", help="layout direction: LR, RL, TB or BT")
    p.add_argument("--phase", default="ALL", choices=sorted(PHASES), help="draw the layers of this phase")
    p.add_argument("--display_lrm", action="store_true", help="show learning-rate multipliers")
    args = p.parse_args(argv)
    print(f"Drawing net to {args.output_image_file}")
    try:
        net = read_net_param(args.input_net_proto_file)
        draw_net_to_file(net, args.output_image_file, args.rankdir, PHASES[args.phase], args.display_lrm)
    except CctError as e:
        print(f"draw_net: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
