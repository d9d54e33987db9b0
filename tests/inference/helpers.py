"""Shared helpers of the inference tests: small versions of the deploy nets with seeded weights, and two
references computed with :class:`cct.Net` (never the inference runner): the net on each field-of-view
window, and the dense output of the plain net run at every pooling offset."""
from __future__ import annotations

import itertools
import os

import numpy as np

import cct
from cct.config import settings
from cct.io.prototxt import read_net_param
from cct.proto import caffe_pb2 as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "models", "znn", "deploy")


def deploy_param(name: str, width: int | None = None) -> pb.NetParameter:
    """``models/znn/deploy/<name>.prototxt`` with every hidden convolution's width set to ``width``."""
    param = read_net_param(os.path.join(DEPLOY, f"{name}.prototxt"))
    if width is not None:
        convs = [lp for lp in param.layer if lp.type == "Convolution"]
        for lp in convs[:-1]:
            lp.convolution_param.num_output = width
    return param


def save_weights(param: pb.NetParameter, path: str, seed: int = 0) -> str:
    """Seeded weights (the prototxt's msra fillers: activations stay of order one through the layers) and random
    biases for ``param``, written as a binary caffemodel."""
    cct.set_random_seed(seed)
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(seed)
    for blobs in net.params.values():
        if len(blobs) > 1:
            blobs[1].data[...] = rng.standard_normal(blobs[1].shape).astype(np.float32) * 0.1
    net.save(path)
    return path


def fov_net(param: pb.NetParameter, weights: str, batch: int, fov) -> cct.Net:
    """The plain deploy net on ``batch`` windows of ``fov`` (lowering engine: no autotune in tests)."""
    settings.set("conv_engine", "lowering")
    p = pb.NetParameter()
    p.CopyFrom(param)
    shape = p.layer[0].input_param.shape[0]
    del shape.dim[:]
    shape.dim.extend((batch, shape_channels(param)) + tuple(fov))
    return cct.Net(p, cct.TEST, weights=weights)


def shape_channels(param: pb.NetParameter) -> int:
    return int(param.layer[0].input_param.shape[0].dim[1])


def window_reference(param, weights, volume: np.ndarray, positions, fov, batch: int = 32) -> np.ndarray:
    """``(len(positions), C_out)``: the net on each window ``volume[:, p : p + fov]`` (volume ``(C, *spatial)``)."""
    net = fov_net(param, weights, batch, fov)
    data = net.blobs[net.inputs[0]]
    out = net.blobs[net.outputs[0]]
    rows = []
    for b0 in range(0, len(positions), batch):
        chunk = positions[b0:b0 + batch]
        for k, p in enumerate(chunk):
            data.data[k] = volume[(slice(None),) + tuple(slice(int(a), int(a) + f) for a, f in zip(p, fov))]
        net.forward()
        flat = out.data.reshape(out.shape[0], out.shape[1], -1)
        assert flat.shape[2] == 1, "a field-of-view window gives one output voxel"
        rows.append(flat[:len(chunk), :, 0].copy())
    return np.concatenate(rows)


def dense_reference(param, weights, volume: np.ndarray, fov, pooling) -> np.ndarray:
    """``(C_out, *(V - F + 1))``: the plain net run on the volume shifted by every pooling offset ``σ`` gives
    the outputs ``σ + P·j`` (each of them is the net on its own window)."""
    settings.set("conv_engine", "lowering")
    spatial = volume.shape[1:]
    out_shape = tuple(v - f + 1 for v, f in zip(spatial, fov))
    dense = None
    for sigma in itertools.product(*(range(p) for p in pooling)):
        count = tuple((o - s + p - 1) // p for o, s, p in zip(out_shape, sigma, pooling))
        if min(count) <= 0:
            continue
        size = tuple(f + p * (c - 1) for f, p, c in zip(fov, pooling, count))
        p = pb.NetParameter()
        p.CopyFrom(param)
        shape = p.layer[0].input_param.shape[0]
        del shape.dim[:]
        shape.dim.extend((1, volume.shape[0]) + size)
        net = cct.Net(p, cct.TEST, weights=weights)
        net.blobs[net.inputs[0]].data[0] = volume[(slice(None),) + tuple(slice(s, s + n) for s, n in zip(sigma, size))]
        net.forward()
        y = net.blobs[net.outputs[0]].data[0]
        if dense is None:
            dense = np.full((y.shape[0],) + out_shape, np.nan, dtype=np.float32)
        dense[(slice(None),) + tuple(slice(s, None, p) for s, p in zip(sigma, pooling))] = y
    return dense
