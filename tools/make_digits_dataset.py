"""Build the embedded default dataset: the UCI optical digits as LMDBs of Datum.

The 1,797 8×8 grey digits (values 0..16) that scikit-learn bundles are written as PNG files (scaled to
0..255), split 1,437 train / 360 test with a fixed shuffle, and converted with cct's own
``convert_imageset`` into ``models/digits/digits_train_lmdb`` and ``digits_test_lmdb``.  The LMDBs are
committed; this script (which needs scikit-learn, only for its bundled copy of the data) regenerates them:

    python tools/make_digits_dataset.py [OUTPUT_DIR]
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from cct.data.tools import convert_imageset_main

NUM_TEST = 360
SEED = 1701


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "models" / "digits"
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("make_digits_dataset needs scikit-learn for its bundled copy of the digits", file=sys.stderr)
        return 1
    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(SEED).permutation(len(images))
    splits = {"test": order[:NUM_TEST], "train": order[NUM_TEST:]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, idx in splits.items():
            lines = []
            for i in idx:
                rel = f"{name}/{i:04d}.png"
                (root / name).mkdir(exist_ok=True)
                Image.fromarray(images[i], mode="L").save(root / rel)
                lines.append(f"{rel} {int(digits.target[i])}")
            (root / f"{name}.txt").write_text("\n".join(lines) + "\n")
            db = out / f"digits_{name}_lmdb"
            if db.exists():
                shutil.rmtree(db)
            rc = convert_imageset_main(["-gray", f"{root}/", str(root / f"{name}.txt"), str(db)])
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
