"""Write the max-filter twin of a pooled net (dense training, ZNN's sparse convolution and max-filtering).

Usage::

    python tools/max_filter_net.py IN.prototxt OUT.prototxt [--spatial 3] [--input-size 37]

Each MAX pooling with kernel == stride becomes a max-filter (stride 1, ``dilation_nd`` = the sparsity so
far) and every later convolution's dilation is multiplied by that sparsity (:mod:`cct.io.rewrite`).
``--input-size`` sets the spatial size of every ``Input`` layer (e.g. 37 for a 12^3 dense output of
CTMCTMCTCT).  Errors are one line naming the file and layer.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cct.errors import CctError  # noqa: E402
from cct.io.prototxt import read_net_param, write_text  # noqa: E402
from cct.io.rewrite import to_max_filter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("net")
    ap.add_argument("out")
    ap.add_argument("--spatial", type=int, default=3, help="spatial axes of the blobs (default 3)")
    ap.add_argument("--input-size", type=int, default=None, help="spatial size of every Input layer")
    args = ap.parse_args(argv)
    try:
        twin = to_max_filter(read_net_param(args.net), args.spatial, args.net)
        if args.input_size is not None:
            for lp in twin.layer:
                if lp.type == "Input":
                    for shape in lp.input_param.shape:
                        dims = list(shape.dim)
                        shape.dim[:] = dims[:-args.spatial] + [args.input_size] * args.spatial
        write_text(args.out, twin)
    except CctError as e:
        print(f"max_filter_net: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
