"""Caffe's ``convert_imageset``: image files and a list of ``path label`` lines → an LMDB of Datums.

Usage::

    python tools/convert_imageset.py [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME

(flags: -gray -shuffle -backend=lmdb -resize_width -resize_height -check_size -encoded -encode_type)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cct.data.tools import convert_imageset_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(convert_imageset_main(sys.argv[1:]))
