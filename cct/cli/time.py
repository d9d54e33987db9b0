"""``cct time``: benchmark model execution time (Caffe's ``caffe time``): per-layer forward and backward times
averaged over ``-iterations`` (whole microseconds per layer, whole milliseconds per iteration and in total),
the engine every convolution runs, and which max pooling's backward line includes the in-place ReLU's below it
and which BatchNorm's forward and backward lines the in-place Scale's (and the in-place ReLU's) above it (one step
in training: the other lines read 0).  The net's engines are chosen as a long training run chooses them: every
close call of the models measured (:func:`cct.engines.autotune.expecting_iterations`; cached for the next runs)."""
from __future__ import annotations

import math

import numpy as np

from cct import log
from cct.cli.common import parse_gpus, phase, planned_factory, stages, use_single_device
from cct.errors import CctError
from cct.exec.diff_memory import share_as_the_command_line_does
from cct.flags import Flags

SUMMARY = "benchmark model execution time"
FLAGS: list = []


def main(flags: Flags) -> int:
    from cct.bench.timing import device_synchronizer, time_layers
    from cct.engines.autotune import expecting_iterations
    from cct.engines.choice import describe_layer_engine
    from cct.pycaffe import Net

    if not flags.model:
        raise CctError("Need a model definition to time.")
    net_phase = phase(flags.phase)
    factory = planned_factory(flags)
    use_single_device(parse_gpus(flags.gpu))
    # timed as a long training run runs it: every close call the models leave is measured now (once: cached), not
    # only those the fast autotune's usual budget pays for
    with expecting_iterations(math.inf):
        net = Net(flags.model, net_phase, level=flags.level, stages=stages(flags.stage),
                  executor=factory() if factory else None)
    sharing = share_as_the_command_line_does(net, every_layer=True)
    if sharing is not None:
        log.info("%s", sharing.describe())
    log.info("Performing Forward")
    log.info("Initial loss: %s", log.fmt(np.float32(net.forward_prefilled())))
    log.info("Performing Backward")
    net.backward_all()
    for name, layer in zip(net._layer_names, net.layers):
        engine = describe_layer_engine(layer)
        if engine:
            log.info("%10s\tengine: %s", name, engine)
    n = flags.iterations
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", n)
    # the timed passes call every layer's backward, as Caffe's do, where Net::Backward above skips the layers no
    # loss needs (a deploy net's parameter gradients): one untimed pass of them first, so that the one-time
    # setup of those layers (a GEMM layout measured for this machine) is not averaged into the first pass
    t = time_layers(net, n, device_synchronizer(),
                    lambda j, ms: log.info("Iteration: %d forward-backward time: %d ms.", j, int(ms)), warmup=1)
    log.info("Average time per layer: ")
    for i, name in enumerate(t.layer_names):
        log.info("%10s\tforward: %s ms.", name, log.fmt(t.forward_us[i] / 1000 / n))
        log.info("%10s\tbackward: %s ms.", name, log.fmt(t.backward_us[i] / 1000 / n))
    for name in t.layer_names:  # after the per-layer lines, which keep Caffe's format
        for other in t.fused_forward.get(name, ()):
            log.info("%10s\tforward includes %s's forward (one step in training)", name, other)
        for other in t.fused_backward.get(name, ()):
            log.info("%10s\tbackward includes %s's backward (one step in training)", name, other)
    log.info("Average Forward pass: %s ms.", log.fmt(t.forward_total_us / 1000 / n))
    log.info("Average Backward pass: %s ms.", log.fmt(t.backward_total_us / 1000 / n))
    log.info("Average Forward-Backward: %s ms.", log.fmt(np.float32(t.total_ms) / np.float32(n)))
    log.info("Total Time: %d ms.", t.total_ms)
    log.info("*** Benchmark ends ***")
    return 0
