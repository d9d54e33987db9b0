"""``cct test``: score a model (Caffe's ``caffe test``): ``-iterations`` forward passes of the TEST net, the
outputs of every batch and their means."""
from __future__ import annotations

import numpy as np

from cct import log
from cct.cli.common import parse_gpus, stages, use_single_device
from cct.errors import CctError
from cct.flags import Flags

SUMMARY = "score a model"
FLAGS: list = []


def main(flags: Flags) -> int:
    from cct.device import to_host
    from cct.pycaffe import TEST, Net

    if not flags.model:
        raise CctError("Need a model definition to score.")
    if not flags.weights:
        raise CctError("Need model weights to score.")
    use_single_device(parse_gpus(flags.gpu))
    net = Net(flags.model, TEST, level=flags.level, stages=stages(flags.stage))
    net.copy_trained_layers_from(flags.weights)
    n = flags.iterations
    log.info("Running for %d iterations.", n)
    scores: list[np.ndarray] = []
    loss = np.float32(0)
    for i in range(n):
        loss += np.float32(net.forward_prefilled())
        values = [np.array(to_host(b.data), dtype=np.float32).ravel() for b in net.output_blobs]
        for name, v in zip(net.output_blob_names, values):
            for x in v:
                log.info("Batch %d, %s = %s", i, name, log.fmt(x))
        if i == 0:
            scores = values
        else:
            for acc, v in zip(scores, values):
                acc += v
    loss /= np.float32(n)
    log.info("Loss: %s", log.fmt(loss))
    for name, acc, weight in zip(net.output_blob_names, scores, net.output_loss_weights):
        for total in acc:
            mean = total / np.float32(n)
            note = ""
            if weight:
                w = np.float32(weight)
                note = f" (* {log.fmt(w)} = {log.fmt(w * mean)} loss)"
            log.info("%s = %s%s", name, log.fmt(mean), note)
    return 0
