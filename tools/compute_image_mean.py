"""Caffe's ``compute_image_mean``: the mean image of an LMDB of Datums, as a .binaryproto.

Usage::

    python tools/compute_image_mean.py [-backend=lmdb] INPUT_DB [OUTPUT_FILE]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cct.data.tools import compute_image_mean_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(compute_image_mean_main(sys.argv[1:]))
