"""``cct <command> [flags]``: Caffe's ``caffe`` tool (``tools/caffe.cpp``) with its verbs, flags and log lines.

Commands: ``train`` (-solver, -snapshot | -weights a,b, -gpu, -level, -stage, -sigint_effect,
-sighup_effect), ``test`` (-model -weights -iterations -level -stage -gpu), ``time`` (-model -phase
-iterations -level -stage -gpu), ``device_query`` (-gpu, or -devices: each device's peak GFLOP/s), plus
``convert_imageset`` and ``compute_image_mean`` (Caffe's separate tools, same arguments).  cct's own knobs
(``-conv_engine``, ``-lowering``, ``-partitions``, ``-devices``, ``-split``) apply to every command.  Flags
use gflags syntax: ``-flag=v``, ``-flag v``, ``--flag=v``; bool flags also ``-flag`` / ``-noflag``.

Every user error (a missing or bad file, a bad flag, an unknown command) is one glog ``F`` line and a
non-zero exit status; an unexpected exception is one line too, with a hint to set ``CCT_TRACEBACK=1``.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cct import log
from cct.engines.select import apply_engine_flags, describe_layer_engine
from cct.errors import CctError
from cct.flags import Flag, Flags, parse_flags, usage_text
from cct.parallel.devices import apply_device_flags

USAGE = ("command line brew\n"
         "usage: caffe <command> <args>\n\n"
         "commands:\n"
         "  train           train or finetune a model\n"
         "  test            score a model\n"
         "  device_query    show GPU diagnostic information\n"
         "  time            benchmark model execution time\n"
         "  convert_imageset    convert a set of images to the leveldb/lmdb format (own flags)\n"
         "  compute_image_mean  compute the mean image of a leveldb/lmdb (own flags)")


FLAGS = [
    Flag("gpu", str, "", "Optional; run in GPU mode on given device IDs separated by ','.Use '-gpu all' to "
         "run on all available GPUs. The effective training batch size is multiplied by the number of devices."),
    Flag("solver", str, "", "The solver definition protocol buffer text file."),
    Flag("model", str, "", "The model definition protocol buffer text file."),
    Flag("phase", str, "", "Optional; network phase (TRAIN or TEST). Only used for 'time'."),
    Flag("level", int, 0, "Optional; network level."),
    Flag("stage", str, "", "Optional; network stages (not to be confused with phase), separated by ','."),
    Flag("snapshot", str, "", "Optional; the snapshot solver state to resume training."),
    Flag("weights", str, "", "Optional; the pretrained weights to initialize finetuning, separated by ','. "
         "Cannot be set simultaneously with snapshot."),
    Flag("iterations", int, 50, "The number of iterations to run."),
    Flag("sigint_effect", str, "stop", "Optional; action to take when a SIGINT signal is received: "
         "snapshot, stop or none."),
    Flag("sighup_effect", str, "snapshot", "Optional; action to take when a SIGHUP signal is received: "
         "snapshot, stop or none."),
    # cct's engine knobs (the same settings as CCT_LOWERING / CCT_PARTITIONS for the Python API)
    Flag("conv_engine", str, "", "Optional; convolution engine: lowering, fft or auto (default: CCT_CONV_ENGINE "
                                 "or auto: measured per layer where fft applies)."),
    Flag("lowering", str, "", "Optional; convolution lowering: 1, 2, 3 or auto (default: CCT_LOWERING or auto)."),
    Flag("partitions", str, "", "Optional; batch partitions per layer: N or auto (default: CCT_PARTITIONS or "
         "auto)."),
    Flag("devices", str, "", "Optional; split each batch across these devices, e.g. cpu:1,cpu:1 or cpu,gpu:0 "
         "(cpu = all cores, cpu:T = T threads, gpu:N = CUDA device N; default: CCT_DEVICES or none)."),
    Flag("split", str, "", "Optional; with -devices, each device's share of a batch: auto (by peak FLOPS) or "
         "fractions f1,f2,... summing to 1 (default: CCT_SPLIT or auto)."),
]


def usage(prog: str = "cct") -> str:
    return usage_text(f"{prog}: {USAGE}", FLAGS, "Flags from tools/caffe.cpp")


# ------------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------------

def parse_gpus(value: str) -> list[int]:
    """``-gpu``: '' → none; 'all' → every CUDA device; else comma-separated ids."""
    from cct.device import cupy, cupy_available

    if not value:
        return []
    if not cupy_available:
        raise CctError(f"-gpu {value}: GPU mode needs cupy and a CUDA device (pip install 'cct[gpu]'); "
                       "none is available")
    if value == "all":
        return list(range(cupy.cuda.runtime.getDeviceCount()))
    try:
        return [int(s) for s in value.split(",")]
    except ValueError:
        raise CctError(f"-gpu {value}: not a comma-separated list of device ids (or 'all')") from None


def _device_name(device_id: int) -> str:
    from cct.device import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _use_single_device(gpus: list[int]) -> None:
    """``test``/``time``: the first id only; logs as Caffe does."""
    from cct import mode

    while len(gpus) > 1:
        log.info("Not using GPU #%d for single-GPU function", gpus.pop())
    if gpus:
        log.info("Use GPU with device ID %d", gpus[0])
        log.info("GPU device name: %s", _device_name(gpus[0]))
        mode.set_device(gpus[0])
        mode.set_mode_gpu()
    else:
        log.info("Use CPU.")
        mode.set_mode_cpu()


def _stages(value: str) -> list[str]:
    return value.split(",")  # as boost::split: '' gives one empty stage


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------

def train(flags: Flags) -> int:
    """Train or finetune: Caffe's ``caffe train``."""
    from cct import mode
    from cct.device import cupy_available
    from cct.proto import caffe_pb2 as pb
    from cct.solvers import SignalHandler, create_solver, read_solver_file

    if not flags.solver:
        raise CctError("Need a solver definition to train.")
    if flags.snapshot and flags.weights:
        raise CctError("Give a snapshot to resume training or weights to finetune but not both.")
    if flags.gpu and flags.devices:
        raise CctError(f"-gpu {flags.gpu} and -devices {flags.devices}: -gpu trains a batch per GPU (Caffe's data "
                       "parallelism), -devices splits each batch across devices; give one of them")
    handler = SignalHandler(flags.sigint_effect, flags.sighup_effect)
    param = read_solver_file(flags.solver)
    param.train_state.level = flags.level
    param.train_state.stage.extend(_stages(flags.stage))
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
            log.info("GPU %d: %s", g, _device_name(g))
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
            from cct.parallel.data_parallel import DataParallel

            trainer: Any = DataParallel(param, [Device("gpu", g) for g in gpus], source=flags.solver)
            root = trainer.root
        else:
            trainer = root = create_solver(param, source=flags.solver)
        root.set_action_function(handler.get_action)
        if flags.snapshot:
            log.info("Resuming from %s", flags.snapshot)
            trainer.restore(flags.snapshot)
        log.info("Starting Optimization")
        trainer.solve()
    log.info("Optimization Done.")
    return 0


def test(flags: Flags) -> int:
    """Score a model: ``-iterations`` forward passes of the TEST net, per-batch and mean outputs."""
    from cct.device import to_host
    from cct.pycaffe import TEST, Net

    if not flags.model:
        raise CctError("Need a model definition to score.")
    if not flags.weights:
        raise CctError("Need model weights to score.")
    stages = _stages(flags.stage)
    _use_single_device(parse_gpus(flags.gpu))
    net = Net(flags.model, TEST, level=flags.level, stages=stages)
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


def _phase(value: str) -> int:
    from cct.pycaffe import TEST, TRAIN

    if value in ("", "TRAIN"):
        return TRAIN
    if value == "TEST":
        return TEST
    raise CctError(f"-phase {value}: phase must be \"TRAIN\" or \"TEST\"")


def _synchronize() -> Callable[[], None]:
    from cct import mode
    from cct.device import cupy, cupy_available

    if cupy_available and mode.mode() == mode.GPU:
        return lambda: cupy.cuda.Device().synchronize()
    return lambda: None


def time_(flags: Flags) -> int:
    """Benchmark: per-layer forward and backward times averaged over ``-iterations`` (Caffe's timers:
    whole microseconds per layer, whole milliseconds per iteration and in total)."""
    from cct.pycaffe import Net

    if not flags.model:
        raise CctError("Need a model definition to time.")
    phase = _phase(flags.phase)
    stages = _stages(flags.stage)
    _use_single_device(parse_gpus(flags.gpu))
    net = Net(flags.model, phase, level=flags.level, stages=stages)
    sync = _synchronize()
    log.info("Performing Forward")
    log.info("Initial loss: %s", log.fmt(np.float32(net.forward_prefilled())))
    log.info("Performing Backward")
    net.backward_all()
    for name, layer in zip(net._layer_names, net.layers):
        engine = describe_layer_engine(layer)
        if engine:
            log.info("%10s\tengine: %s", name, engine)
    layers = net.layers
    n = flags.iterations
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", n)
    us = lambda t0: int((time.perf_counter() - t0) * 1e6)  # noqa: E731
    forward_us = [0] * len(layers)
    backward_us = [0] * len(layers)
    forward_total = backward_total = 0
    total_start = time.perf_counter()
    for j in range(n):
        iter_start = time.perf_counter()
        for i in range(len(layers)):
            t0 = time.perf_counter()
            net.executor.forward_layer(net, i)
            sync()
            forward_us[i] += us(t0)
        forward_total += us(iter_start)
        backward_start = time.perf_counter()
        for i in range(len(layers) - 1, -1, -1):
            t0 = time.perf_counter()
            net.executor.backward_layer(net, i)
            sync()
            backward_us[i] += us(t0)
        backward_total += us(backward_start)
        log.info("Iteration: %d forward-backward time: %d ms.", j + 1, int((time.perf_counter() - iter_start) * 1e3))
    log.info("Average time per layer: ")
    for i, name in enumerate(net._layer_names):
        log.info("%10s\tforward: %s ms.", name, log.fmt(forward_us[i] / 1000 / n))
        log.info("%10s\tbackward: %s ms.", name, log.fmt(backward_us[i] / 1000 / n))
    total_ms = int((time.perf_counter() - total_start) * 1e3)
    log.info("Average Forward pass: %s ms.", log.fmt(forward_total / 1000 / n))
    log.info("Average Backward pass: %s ms.", log.fmt(backward_total / 1000 / n))
    log.info("Average Forward-Backward: %s ms.", log.fmt(np.float32(total_ms) / np.float32(n)))
    log.info("Total Time: %d ms.", total_ms)
    log.info("*** Benchmark ends ***")
    return 0


def device_query(flags: Flags) -> int:
    """CUDA device properties for each ``-gpu`` id (needs cupy); without ``-gpu``, this machine's CPU
    and BLAS."""
    if flags.devices:
        _log_devices(flags.devices)
        return 0
    log.info("Querying GPUs %s", flags.gpu)
    if flags.gpu:
        from cct.device import cupy

        for g in parse_gpus(flags.gpu):
            _log_cuda_device(cupy, g)
        return 0
    _log_cpu()
    return 0


def _log_devices(spec: str) -> None:
    """``device_query -devices LIST``: each device with its peak GFLOP/s and where that figure comes from,
    then the auto split."""
    from cct.device import parse_devices

    devices = parse_devices(spec, "-devices")
    log.info("Querying devices %s", spec)
    peaks = []
    for i, d in enumerate(devices):
        gflops, source = d.peak_gflops()
        peaks.append(gflops)
        how = {"measured": "measured now: sgemm probe", "cached": "sgemm probe, cached"}.get(source, source)
        log.info("Device %d: %s (%s): peak %s GFLOP/s (%s)", i, d, d.describe(), f"{gflops:.1f}", how)
    total = sum(peaks)
    log.info("Split by peak FLOPS: %s", ", ".join(f"{d} {100 * p / total:.1f}%" for d, p in zip(devices, peaks)))


def _log_cuda_device(cupy: Any, device_id: int) -> None:
    p = cupy.cuda.runtime.getDeviceProperties(device_id)
    yes_no = lambda v: "Yes" if v else "No"  # noqa: E731
    rows = [
        ("Device id", device_id), ("Major revision number", p["major"]), ("Minor revision number", p["minor"]),
        ("Name", _device_name(device_id)), ("Total global memory", p["totalGlobalMem"]),
        ("Total shared memory per block", p["sharedMemPerBlock"]),
        ("Total registers per block", p["regsPerBlock"]), ("Warp size", p["warpSize"]),
        ("Maximum memory pitch", p["memPitch"]), ("Maximum threads per block", p["maxThreadsPerBlock"]),
        ("Maximum dimension of block", ", ".join(str(d) for d in p["maxThreadsDim"])),
        ("Maximum dimension of grid", ", ".join(str(d) for d in p["maxGridSize"])),
        ("Clock rate", p["clockRate"]), ("Total constant memory", p["totalConstMem"]),
        ("Texture alignment", p["textureAlignment"]),
        ("Concurrent copy and execution", yes_no(p.get("deviceOverlap", p.get("asyncEngineCount", 0)))),
        ("Number of multiprocessors", p["multiProcessorCount"]),
        ("Kernel execution timeout", yes_no(p.get("kernelExecTimeoutEnabled", 0))),
    ]
    for label, value in rows:
        log.info("%s", f"{label + ':':<31}{value}")


def _log_cpu() -> None:
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    log.info("CPU:                           %s", model)
    log.info("CPU cores:                     %s (usable by this process: %s)", os.cpu_count(), usable)
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        log.info("BLAS:                          (threadpoolctl not installed; cannot tell)")
        return
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"] or threadpool_info()
    if not pools:
        log.info("BLAS:                          none found")
    for p in pools:
        log.info("BLAS:                          %s %s, %s threads (%s)", p.get("internal_api"),
                 p.get("version"), p.get("num_threads"), p.get("filepath"))


def _data_tool(name: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        try:
            from cct.data import tools
        except ImportError as e:
            raise CctError(f"{name} is not available in this installation (cct.data.tools: {e})") from None
        return int(getattr(tools, f"{name}_main")(argv) or 0)

    return run


COMMANDS: dict[str, Callable[[Flags], int]] = {
    "device_query": device_query, "test": test, "time": time_, "train": train,
}
TOOLS = {"convert_imageset": _data_tool("convert_imageset"),
         "compute_image_mean": _data_tool("compute_image_mean")}


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------

def _fatal(message: str) -> None:
    log.logger.critical("%s", " ".join(message.split("\n")).strip(), stacklevel=2)


def run(argv: Sequence[str]) -> int:
    """Dispatch without the error boundary (exceptions propagate)."""
    argv = list(argv)
    if argv and argv[0] in TOOLS:
        return TOOLS[argv[0]](argv[1:])
    flags, positional = parse_flags(argv, FLAGS)
    if flags.help:
        print(usage(), file=sys.stderr)
        return 0
    if len(positional) != 1:
        print(usage(), file=sys.stderr)
        return 1
    name = positional[0]
    if name in TOOLS:
        raise CctError(f"{name} takes its own arguments: put it first (cct {name} ...)")
    command = COMMANDS.get(name)
    if command is None:
        raise CctError(f"Unknown action: {name} (available caffe actions: "
                       f"{', '.join(sorted(COMMANDS) + sorted(TOOLS))})")
    apply_engine_flags(flags.lowering or None, flags.partitions or None, flags.conv_engine or None)
    apply_device_flags(flags.devices or None, flags.split or None)
    return command(flags)


def main(argv: Sequence[str] | None = None) -> int:
    """``cct`` console script: run a command; every failure becomes one line and a non-zero status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except CctError as e:
        _fatal(str(e))
        return 1
    except KeyboardInterrupt:
        _fatal("Interrupted.")
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that turns any failure into one line
        if os.environ.get("CCT_TRACEBACK", "") not in ("", "0"):
            import traceback

            traceback.print_exc()
            return 1
        _fatal(f"{type(e).__name__}: {e} (an internal error; set CCT_TRACEBACK=1 to see the traceback)")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
