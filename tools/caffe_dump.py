#!/usr/bin/env python
"""Write a reference file of a net's blobs under real Caffe's pycaffe, for ``cct compare``.

Runs with Caffe's own Python interface (Python 2.7 or 3; numpy, and h5py for an HDF5 output) and does not
import cct::

    python tools/caffe_dump.py -model net.prototxt -weights w.caffemodel -output ref.npz \\
        [-phase TRAIN|TEST] [-input data=batch.npy ...] [-seed 0] [-gpu N]

then, with cct::

    cct compare -model net.prototxt -weights w.caffemodel -reference ref.npz

The file (``.npz``, or HDF5 for ``.h5``/``.hdf5``) holds ``input/<blob>`` (what was fed), ``data/<blob>``
(every blob after ``net.forward()``), ``param/<layer>/<i>`` (every learnable blob after the forward) and,
in TRAIN, ``diff/<blob>`` and ``param_diff/<layer>/<i>`` after ``net.backward()``.

Inputs come from ``-input BLOB=FILE.npy`` (the blob is reshaped to the array's shape) or are drawn from
``numpy.random.RandomState(seed)`` in the blob's declared shape: class labels (the second bottom of
SoftmaxWithLoss, Accuracy, MultinomialLogisticLoss, InfogainLoss, HingeLoss) as integers below the number
of classes, ContrastiveLoss's similarity as 0/1, SigmoidCrossEntropyLoss's targets uniform in [0, 1),
anything else standard normal; inputs are drawn in the net's input order.
"""
from __future__ import absolute_import, division, print_function  # noqa: UP010 - also runs under Python 2.7

import argparse
import sys

import numpy as np

CLASS_LABEL_LAYERS = ("SoftmaxWithLoss", "Accuracy", "MultinomialLogisticLoss", "InfogainLoss", "HingeLoss")


def _source_blobs(net):
    """Each blob name -> the blob it copies through Split layers (Caffe's automatic splits)."""
    source = {}
    for name, layer in zip(net._layer_names, net.layers):
        if layer.type == "Split":
            bottom = net.bottom_names[name][0]
            for top in net.top_names[name]:
                source[top] = source.get(bottom, bottom)
    return source


def input_roles(net):
    """Input blob -> ('label', classes) | ('binary', None) | ('unit', None) for inputs read as targets."""
    source = _source_blobs(net)
    inputs = set(net.inputs)
    roles = {}
    for name, layer in zip(net._layer_names, net.layers):
        bottoms = list(net.bottom_names[name])
        roots = [source.get(b, b) for b in bottoms] + [None, None, None]
        if layer.type in CLASS_LABEL_LAYERS and roots[1] in inputs:
            scores = net.blobs[bottoms[0]].data
            classes = scores.shape[1] if scores.ndim > 1 else 1
            roles[roots[1]] = ("label", classes)
        elif layer.type == "ContrastiveLoss" and roots[2] in inputs:
            roles[roots[2]] = ("binary", None)
        elif layer.type == "SigmoidCrossEntropyLoss" and roots[1] in inputs:
            roles[roots[1]] = ("unit", None)
    return roles


def random_inputs(net, seed):
    """Seeded inputs of the declared shapes (see the module doc)."""
    rng = np.random.RandomState(seed)
    roles = input_roles(net)
    out = {}
    for name in net.inputs:
        shape = net.blobs[name].data.shape
        role, classes = roles.get(name, (None, None))
        if role == "label":
            value = rng.randint(0, classes, size=shape)
        elif role == "binary":
            value = rng.randint(0, 2, size=shape)
        elif role == "unit":
            value = rng.uniform(0.0, 1.0, size=shape)
        else:
            value = rng.standard_normal(shape)
        out[name] = np.asarray(value, dtype=np.float32)
    return out


def run(net, inputs, train):
    """Feed ``inputs`` (reshaping blobs whose shape differs), forward, and in TRAIN backward.  Returns the
    reference arrays as an ordered list of (name, array)."""
    reshaped = False
    for name, value in inputs.items():
        blob = net.blobs[name]
        if tuple(blob.data.shape) != tuple(value.shape):
            blob.reshape(*value.shape)
            reshaped = True
    if reshaped:
        net.reshape()
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    net.forward()
    arrays = [("input/" + name, np.array(value, dtype=np.float32)) for name, value in inputs.items()]
    arrays += [("data/" + name, blob.data.copy()) for name, blob in net.blobs.items()]
    params = [("param/%s/%d" % (layer, i), b.data.copy())
              for layer, blobs in net.params.items() for i, b in enumerate(blobs)]
    if train:
        for blobs in net.params.values():
            for b in blobs:
                b.diff[...] = 0
        net.backward()
        arrays += [("diff/" + name, blob.diff.copy()) for name, blob in net.blobs.items()]
        params += [("param_diff/%s/%d" % (layer, i), b.diff.copy())
                   for layer, blobs in net.params.items() for i, b in enumerate(blobs)]
    return arrays + params


def write(path, arrays):
    """An .npz, or HDF5 (nested groups) for .h5/.hdf5."""
    if path.lower().endswith((".h5", ".hdf5")):
        import h5py

        with h5py.File(path, "w") as f:
            for name, value in arrays:
                f.create_dataset(name, data=value)
    else:
        with open(path, "wb") as f:
            np.savez(f, **dict(arrays))


def dump(caffe, model, weights, phase, output, input_files=None, seed=0):
    """Build ``model`` in ``phase`` ('TRAIN' or 'TEST') with ``weights`` under ``caffe`` (pycaffe, or any
    module with its Net API), run it and write the reference file; returns the list of (name, array)."""
    train = phase == "TRAIN"
    net = caffe.Net(model, caffe.TRAIN if train else caffe.TEST)
    for w in weights:
        net.copy_from(w)
    inputs = random_inputs(net, seed)
    for name, path in (input_files or {}).items():
        if name not in inputs:
            raise SystemExit("caffe_dump: -input %s: the net has no input blob %s (inputs: %s)"
                             % (name, name, ", ".join(net.inputs)))
        inputs[name] = np.asarray(np.load(path), dtype=np.float32)
    arrays = run(net, inputs, train)
    write(output, arrays)
    return arrays


def parse_args(argv):
    p = argparse.ArgumentParser(description="Write a reference file of a net's blobs under pycaffe.")
    p.add_argument("-model", "--model", required=True, help="the net prototxt")
    p.add_argument("-weights", "--weights", default="", help="weights, comma-separated (.caffemodel)")
    p.add_argument("-output", "--output", required=True, help="the reference file (.npz or .h5)")
    p.add_argument("-phase", "--phase", default="TRAIN", choices=("TRAIN", "TEST"))
    p.add_argument("-input", "--input", action="append", default=[], metavar="BLOB=FILE.npy",
                   help="an input array (repeat for several inputs); others are seeded random")
    p.add_argument("-seed", "--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("-gpu", "--gpu", type=int, default=-1, help="run on this GPU (default: CPU)")
    args = p.parse_args(argv)
    files = {}
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep:
            p.error("-input %s: expected BLOB=FILE.npy" % item)
        files[name] = path
    args.input_files = files
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import caffe

    if args.gpu >= 0:
        caffe.set_device(args.gpu)
        caffe.set_mode_gpu()
    else:
        caffe.set_mode_cpu()
    weights = [w for w in args.weights.split(",") if w]
    arrays = dump(caffe, args.model, weights, args.phase, args.output, args.input_files, args.seed)
    print("caffe_dump: wrote %d arrays (%s) to %s" % (len(arrays), args.phase, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
