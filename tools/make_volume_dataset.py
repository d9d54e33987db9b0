"""Build a small synthetic 3-D segmentation dataset (HDF5) for the ZNN-style nets in ``models/znn``.

Each volume is a Voronoi tessellation of random seeds — "cells" of random brightness separated by dark
"membranes" (the faces between cells, dilated to about two voxels) — blurred and with Gaussian noise, a toy
version of the electron-microscopy boundary detection ZNN was built for.  Training samples are random
``patch³`` crops (flips and axis permutations included): ``data`` ``(N, 1, patch, patch, patch)`` float32
in [0, 1] and ``label`` ``(N, 1, g, g, g)`` float32 with ``g = patch / stride``: 1 where the voxel at the
centre of each ``stride³`` block is membrane, else 0 — the voxel-wise target of a net that pools twice
(``stride`` 4) and keeps the spatial size elsewhere (padded convolutions), scored by SoftmaxWithLoss over
its 2 output channels.  About 45% of the targets are membrane.

Writes ``train.h5``, ``test.h5`` and the source lists ``train.txt`` / ``test.txt`` (paths as given, relative
to the working directory like Caffe's HDF5Data) into the output directory:

    python tools/make_volume_dataset.py [--out models/znn/data] [--train 256] [--test 64] [--patch 32]

``--inference-volume N`` also writes ``volume.h5``: one ``N³`` volume of the same kind for sliding-window
inference (``cct infer``), dataset ``raw`` (float32 in [0, 1], ``(Z, Y, X)``) and ``membrane`` (uint8, the true
membrane mask), generated slab by slab so that a volume larger than memory can be made; ``--only-inference``
skips the training files:

    python tools/make_volume_dataset.py --inference-volume 256 --only-inference
    cct infer -model models/znn/deploy/ctm_valid.prototxt -input models/znn/data/volume.h5:raw \
              -output models/znn/data/prediction.h5 -memory_budget 1GiB

``--dense FOV`` writes ``train_dense3d.h5`` / ``test_dense3d.h5`` (and lists) for the max-filter nets of
``models/znn/`` instead: a label for every output voxel of a net with that field of view (``--dims 2``: 2-D
slices, ``*_dense2d``):

    python tools/make_volume_dataset.py --dense 26 --patch 37 --train 64 --test 16
    python tools/make_volume_dataset.py --dense 26 --patch 37 --dims 2 --train 256 --test 64

The files are generated, not committed (``models/znn/.gitignore``); run this once before
``cct train -solver models/znn/<net>/solver.prototxt`` (from the repository root).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SEED = 1701


def make_volume(size: int, cell: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(image, membrane mask) of a ``size³`` volume with cells of about ``cell`` voxels across."""
    from scipy import ndimage
    from scipy.spatial import cKDTree

    n_seeds = max(2, int((size / cell) ** 3))
    seeds = rng.uniform(0, size, (n_seeds, 3))
    grid = np.stack(np.meshgrid(*(np.arange(size),) * 3, indexing="ij"), axis=-1).reshape(-1, 3) + 0.5
    owner = cKDTree(seeds).query(grid)[1].reshape((size,) * 3)
    faces = np.zeros(owner.shape, dtype=bool)
    for axis in range(3):
        step = np.diff(owner, axis=axis) != 0
        lo = [slice(None)] * 3
        lo[axis] = slice(0, -1)
        faces[tuple(lo)] |= step
    membrane = ndimage.binary_dilation(faces, iterations=1)
    brightness = rng.uniform(0.55, 0.95, n_seeds)
    image = np.where(membrane, 0.15, brightness[owner])
    image = ndimage.gaussian_filter(image, 0.8) + rng.normal(0.0, 0.08, image.shape)
    return np.clip(image, 0.0, 1.0).astype(np.float32), membrane


def write_inference_volume(path: Path, size: int, cell: float, rng: np.random.Generator, slab: int = 64) -> None:
    """One ``size³`` volume into ``path`` (datasets ``raw`` and ``membrane``), ``slab`` z-slices at a time: the
    Voronoi seeds cover the whole volume; each slab is computed with a margin of ``MARGIN`` slices on both sides
    (the blur and the membrane dilation reach that far), so slabs join without seams."""
    import h5py
    from scipy import ndimage
    from scipy.spatial import cKDTree

    n_seeds = max(2, int((size / cell) ** 3))
    seeds = rng.uniform(0, size, (n_seeds, 3))
    tree = cKDTree(seeds)
    brightness = rng.uniform(0.55, 0.95, n_seeds)
    margin = MARGIN
    with h5py.File(path, "w") as f:
        raw = f.create_dataset("raw", (size,) * 3, dtype="float32", chunks=(min(size, 64),) * 3)
        mem = f.create_dataset("membrane", (size,) * 3, dtype="uint8", chunks=(min(size, 64),) * 3)
        for z0 in range(0, size, slab):
            z1 = min(size, z0 + slab)
            lo, hi = max(0, z0 - margin), min(size, z1 + margin)
            grid = np.stack(np.meshgrid(np.arange(lo, hi), np.arange(size), np.arange(size), indexing="ij"),
                            axis=-1).reshape(-1, 3) + 0.5
            owner = tree.query(grid)[1].reshape(hi - lo, size, size)
            faces = np.zeros(owner.shape, dtype=bool)
            for axis in range(3):
                step = np.diff(owner, axis=axis) != 0
                sl = [slice(None)] * 3
                sl[axis] = slice(0, -1)
                faces[tuple(sl)] |= step
            membrane = ndimage.binary_dilation(faces, iterations=1)
            image = np.where(membrane, 0.15, brightness[owner])
            image = ndimage.gaussian_filter(image, 0.8) + rng.normal(0.0, 0.08, image.shape)
            keep = slice(z0 - lo, z0 - lo + (z1 - z0))
            raw[z0:z1] = np.clip(image[keep], 0.0, 1.0).astype(np.float32)
            mem[z0:z1] = membrane[keep].astype(np.uint8)


MARGIN = 4


def sample_patches(volumes: list[tuple[np.ndarray, np.ndarray]], count: int, patch: int, stride: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random crops with random flips/axis orders: data (N,1,p,p,p), label (N,1,g,g,g)."""
    g = patch // stride
    data = np.empty((count, 1) + (patch,) * 3, dtype=np.float32)
    label = np.empty((count, 1) + (g,) * 3, dtype=np.float32)
    centre = np.arange(g) * stride + stride // 2
    for i in range(count):
        image, membrane = volumes[int(rng.integers(len(volumes)))]
        o = rng.integers(0, image.shape[0] - patch + 1, 3)
        crop = tuple(slice(int(a), int(a) + patch) for a in o)
        x, m = image[crop], membrane[crop]
        order = tuple(rng.permutation(3))
        x, m = x.transpose(order), m.transpose(order)
        for axis in range(3):
            if rng.integers(2):
                x, m = np.flip(x, axis), np.flip(m, axis)
        data[i, 0] = x
        label[i, 0] = m[np.ix_(centre, centre, centre)]
    return data, label


def sample_dense_patches(volumes: list[tuple[np.ndarray, np.ndarray]], count: int, patch: int, fov: int, dims: int,
                         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random crops for dense training (max-filter nets, ZNN): data ``(N, 1) + (patch,) * dims`` and a
    label for every output voxel, ``(N, 1) + (patch - fov + 1,) * dims``: output voxel ``z`` sees ``input[z : z +
    fov]`` and is scored against the membrane at the window's centre voxel ``z + fov // 2``.  ``dims`` 2: one
    random slice of each crop (the 2-D twin)."""
    out = patch - fov + 1
    data = np.empty((count, 1) + (patch,) * dims, dtype=np.float32)
    label = np.empty((count, 1) + (out,) * dims, dtype=np.float32)
    inner = tuple(slice(fov // 2, fov // 2 + out) for _ in range(dims))
    for i in range(count):
        image, membrane = volumes[int(rng.integers(len(volumes)))]
        o = rng.integers(0, image.shape[0] - patch + 1, 3)
        crop = tuple(slice(int(a), int(a) + patch) for a in o)
        x, m = image[crop], membrane[crop]
        order = tuple(rng.permutation(3))
        x, m = x.transpose(order), m.transpose(order)
        for axis in range(3):
            if rng.integers(2):
                x, m = np.flip(x, axis), np.flip(m, axis)
        if dims == 2:
            z = int(rng.integers(patch))
            x, m = x[z], m[z]
        data[i, 0] = x
        label[i, 0] = m[inner]
    return data, label


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/znn/data", help="output directory (default models/znn/data)")
    ap.add_argument("--train", type=int, default=256, help="training patches")
    ap.add_argument("--test", type=int, default=64, help="test patches")
    ap.add_argument("--patch", type=int, default=32, help="patch edge in voxels (a multiple of --stride)")
    ap.add_argument("--stride", type=int, default=4, help="the net's output stride (label grid spacing)")
    ap.add_argument("--volume", type=int, default=64, help="edge of each generated volume")
    ap.add_argument("--cell", type=float, default=14.0, help="typical cell diameter in voxels")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--inference-volume", type=int, default=0, metavar="N",
                    help="also write volume.h5, one N^3 volume for cct infer (0: none)")
    ap.add_argument("--only-inference", action="store_true", help="only volume.h5 (no training files)")
    ap.add_argument("--dense", type=int, default=0, metavar="FOV",
                    help="dense labels for a max-filter net of this field of view (ZNN's dense training): "
                         "writes <name>_dense<dims>d.h5 with a label per output voxel")
    ap.add_argument("--dims", type=int, default=3, choices=(2, 3), help="with --dense: 3-D crops or 2-D slices")
    args = ap.parse_args(argv)
    if args.dense:
        if not 0 < args.dense <= args.patch <= args.volume:
            ap.error(f"--dense {args.dense} needs a field of view <= --patch ({args.patch}) <= --volume")
    elif args.patch % args.stride or args.patch > args.volume:
        ap.error(f"--patch ({args.patch}) must be a multiple of --stride ({args.stride}) and <= --volume")
    try:
        import h5py
    except ImportError:
        print("make_volume_dataset needs h5py: pip install 'cct[hdf5]'", file=sys.stderr)
        return 1
    if args.only_inference and args.inference_volume <= 0:
        ap.error("--only-inference needs --inference-volume N")
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.inference_volume > 0:
        path = out / "volume.h5"
        write_inference_volume(path, args.inference_volume, args.cell, np.random.default_rng(args.seed + 1))
        print(f"{path}: raw and membrane {(args.inference_volume,) * 3}")
    if args.only_inference:
        return 0
    # separate volumes for training and testing: test patches are never crops of training volumes
    for name, count, n_volumes in (("train", args.train, 4), ("test", args.test, 1)):
        volumes = [make_volume(args.volume, args.cell, rng) for _ in range(n_volumes)]
        if args.dense:
            data, label = sample_dense_patches(volumes, count, args.patch, args.dense, args.dims, rng)
            name = f"{name}_dense{args.dims}d"
        else:
            data, label = sample_patches(volumes, count, args.patch, args.stride, rng)
        path = out / f"{name}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=data)
            f.create_dataset("label", data=label)
        (out / f"{name}.txt").write_text(f"{path.as_posix()}\n")
        print(f"{path}: data {data.shape}, label {label.shape}, membrane fraction {label.mean():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
