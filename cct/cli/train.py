"""``cct train``: train or finetune a model (Caffe's ``caffe train``)."""
from __future__ import annotations

from typing import Any

from cct import log
from cct.cli.common import parse_gpus, planned_factory, stages
from cct.errors import CctError
from cct.flags import Flags

SUMMARY = "train or finetune a model"
FLAGS: list = []


def main(flags: Flags) -> int:
    from cct import mode
    from cct.device import cupy_available
    from cct.device.backend import gpu_name
    from cct.proto import caffe_pb2 as pb
    from cct.solvers import SignalHandler, create_solver, read_solver_file

    if not flags.solver:
        raise CctError("Need a solver definition to train.")
    if flags.snapshot and flags.weights:
        raise CctError("Give a snapshot to resume training or weights to finetune but not both.")
    if flags.gpu and flags.devices:
        raise CctError(f"-gpu {flags.gpu} and -devices {flags.devices}: -gpu trains a batch per GPU (Caffe's data "
                       "parallelism), -devices splits each batch across devices; give one of them")
    factory = planned_factory(flags)
    handler = SignalHandler(flags.sigint_effect, flags.sighup_effect)
    param = read_solver_file(flags.solver)
    param.train_state.level = flags.level
    param.train_state.stage.extend(stages(flags.stage))
    gpu = flags.gpu
    if not gpu and param.solver_mode == pb.SolverParameter.GPU:
        if cupy_available:
            gpu = str(param.device_id)
        else:
            log.warning("%s asks for solver_mode GPU but no CUDA device is usable (cupy missing); training "
                        "on the CPU", flags.solver)
    gpus = parse_gpus(gpu)
    if not gpus:
        log.info("Use CPU.")
        mode.set_mode_cpu()
    else:
        log.info("Using GPUs %s", ", ".join(str(g) for g in gpus))
        for g in gpus:
            log.info("GPU %d: %s", g, gpu_name(g))
        param.device_id = gpus[0]
        mode.set_device(gpus[0])
        mode.set_mode_gpu()
        mode.set_solver_count(len(gpus))
    if flags.snapshot:
        param.ClearField("weights")
    elif flags.weights:
        param.ClearField("weights")
        param.weights.append(flags.weights)
    with handler:
        if len(gpus) > 1:  # Caffe's NCCL::Run: one solver replica per GPU, gradients averaged every iteration
            from cct.device import Device
            from cct.distributed.replicas import DataParallel

            trainer: Any = DataParallel(param, [Device("gpu", g) for g in gpus], source=flags.solver)
            root = trainer.root
        else:
            trainer = root = create_solver(param, source=flags.solver, executor_factory=factory)
        root.set_action_function(handler.get_action)
        if flags.snapshot:
            log.info("Resuming from %s", flags.snapshot)
            trainer.restore(flags.snapshot)
        log.info("Starting Optimization")
        trainer.solve()
    log.info("Optimization Done.")
    return 0
