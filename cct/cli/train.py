"""``cct train``: train or finetune a model (Caffe's ``caffe train``)."""
from __future__ import annotations

from typing import Any

from cct import log
from cct.cli.common import parse_gpus, planned_factory, stages
from cct.errors import CctError
from cct.exec.diff_memory import share_as_the_command_line_does
from cct.flags import Flag, Flags

SUMMARY = "train or finetune a model"
FLAGS: list = [
    Flag("sigterm_effect", str, "", "Optional (cct); action to take when a SIGTERM signal is received: "
         "snapshot (snapshot and stop), stop or none (default: terminate, as Caffe)."),
    Flag("stop_on_nan", bool, False, "Optional (cct); on the first non-finite loss or gradient, snapshot the last "
         "finite state and exit with an error (default: report it once and go on, as Caffe)."),
    Flag("overlap", str, "lee", "Under mpiexec: how gradient reductions overlap backprop: none (one blocking "
         "Allreduce), layer (one per layer as it is ready) or lee (two chunks, Lee et al.)."),
    Flag("chunk_split", str, "auto", "Under mpiexec with -overlap lee: where chunk 1 ends: a layer name (chunk 1 = "
         "the layers after it), k (the top k Convolution/Pooling/InnerProduct layers) or auto (measured)."),
    Flag("replicate_fc", int, 0, "Under mpiexec with -overlap lee: replicate the gradient of the first f "
         "InnerProduct layers (Allgather of activations and errors instead of Allreduce of weight gradients)."),
    Flag("mpi_timeout", float, 600.0, "Under mpiexec: seconds any wait for the other ranks may last before the "
         "job is aborted (longer than rank 0's test passes)."),
]


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
    from cct.distributed.mpi import launcher_size

    mpi_size, mpi_variable = launcher_size()
    factory = planned_factory(flags)
    handler = SignalHandler(flags.sigint_effect, flags.sighup_effect, flags.sigterm_effect)
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
    if mpi_size > 1:
        if factory is not None:
            raise CctError(f"-plan {flags.plan} under mpiexec ({mpi_variable}={mpi_size}): a plan splits layers across "
                           "one process's devices; run it without mpiexec")
        if len(gpus) > 1:
            raise CctError(f"-gpu {flags.gpu} under mpiexec ({mpi_variable}={mpi_size}): give each rank one "
                           "device; the ranks are the data parallelism")
        from cct.distributed import mpi_train

        with handler:
            mpi_train.train(param, source=flags.solver, size=mpi_size, variable=mpi_variable,
                            snapshot=flags.snapshot, overlap=flags.overlap, chunk_split=flags.chunk_split,
                            replicate_fc=flags.replicate_fc, timeout=flags.mpi_timeout, action=handler.get_action,
                            stop_on_nan=flags.stop_on_nan)
        log.info("Optimization Done.")
        return 0
    with handler:
        if len(gpus) > 1:  # Caffe's NCCL::Run: one solver replica per GPU, gradients averaged every iteration
            from cct.device import Device
            from cct.distributed.replicas import DataParallel

            trainer: Any = DataParallel(param, [Device("gpu", g) for g in gpus], source=flags.solver)
            root = trainer.root
        else:
            trainer = root = create_solver(param, source=flags.solver, executor_factory=factory)
            sharing = share_as_the_command_line_does(root.net)
            if sharing is not None:
                log.info("Training net: %s", sharing.describe())
        root.set_action_function(handler.get_action)
        for solver in getattr(trainer, "solvers", [root]):
            solver.stop_on_nan = flags.stop_on_nan
        if flags.snapshot:
            log.info("Resuming from %s", flags.snapshot)
            trainer.restore(flags.snapshot)
        log.info("Starting Optimization")
        trainer.solve()
    log.info("Optimization Done.")
    return 0
