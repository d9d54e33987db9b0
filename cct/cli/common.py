"""What every ``cct`` command shares: Caffe's flags (``tools/caffe.cpp``), cct's engine and device knobs, and
the device-selection helpers of Caffe's verbs."""
from __future__ import annotations

from cct import log
from cct.errors import CctError
from cct.flags import Flag

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
    Flag("conv_engine", str, "", "Optional; convolution engine: lowering, fft, winograd (3x3 stride-1 layers, "
                                 "lowering elsewhere), depthwise (one input channel per group, lowering elsewhere) "
                                 "or auto (default: CCT_CONV_ENGINE or auto: measured per layer where fft or "
                                 "winograd may gain, depthwise where its model beats the lowering's)."),
    Flag("lowering", str, "", "Optional; convolution lowering: 1, 2, 3 or auto (default: CCT_LOWERING or auto)."),
    Flag("autotune", str, "", "Optional; measuring engine candidates: fast (close calls, a few seconds per net), "
                              "full (every layer) or off (cost models only) (default: CCT_AUTOTUNE or fast)."),
    Flag("partitions", str, "", "Optional; batch partitions per layer: N or auto (default: CCT_PARTITIONS or "
         "auto)."),
    Flag("devices", str, "", "Optional; split each batch across these devices, e.g. cpu:1,cpu:1 or cpu,gpu:0 "
         "(cpu = all cores, cpu:T = T threads, gpu:N = CUDA device N; default: CCT_DEVICES or none)."),
    Flag("executor", str, "", "Optional; how passes run: layer (layer by layer) or taskgraph (ZNN's task graph "
         "with a worker pool; default: CCT_EXECUTOR or layer)."),
    Flag("workers", str, "", "Optional; with -executor taskgraph, worker threads: N or auto (the cores; default: "
         "CCT_WORKERS or auto)."),
    Flag("split", str, "", "Optional; with -devices, each device's share of a batch: auto (by peak FLOPS) or "
         "fractions f1,f2,... summing to 1 (default: CCT_SPLIT or auto)."),
    Flag("share_diffs", str, "", "Optional; train/time: 1 lets blobs whose gradients are never alive at once share "
         "their memory, 0 keeps one gradient per blob as Caffe (default: CCT_SHARE_DIFFS or 1)."),
    Flag("plan", str, "", "Optional; train/time: run each layer as this plan file (cct plan -format json "
         "-output) splits it across -devices (sample and channel splits)."),
]


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


def use_single_device(gpus: list[int]) -> None:
    """``test``/``time``: the first id only; logs as Caffe does."""
    from cct import mode
    from cct.device.backend import gpu_name

    while len(gpus) > 1:
        log.info("Not using GPU #%d for single-GPU function", gpus.pop())
    if gpus:
        log.info("Use GPU with device ID %d", gpus[0])
        log.info("GPU device name: %s", gpu_name(gpus[0]))
        mode.set_device(gpus[0])
        mode.set_mode_gpu()
    else:
        log.info("Use CPU.")
        mode.set_mode_cpu()


def stages(value: str) -> list[str]:
    return value.split(",")  # as boost::split: '' gives one empty stage


def phase(value: str) -> int:
    from cct.pycaffe import TEST, TRAIN

    if value in ("", "TRAIN"):
        return TRAIN
    if value == "TEST":
        return TEST
    raise CctError(f"-phase {value}: phase must be \"TRAIN\" or \"TEST\"")


def planned_factory(flags):
    """``-plan plan.json`` with ``-devices``: the executor factory of a planned run (None without ``-plan``);
    a plan with ``-gpu`` or ``-split``, or without devices, is a one-line error."""
    if not flags.plan:
        return None
    from cct.exec.device_split import device_setting
    from cct.exec.planned import planned_executor_factory

    if flags.gpu:
        raise CctError(f"-gpu {flags.gpu} and -plan {flags.plan}: a plan runs on -devices; give one of them")
    setting = device_setting()
    if setting is None:
        raise CctError(f"-plan {flags.plan} needs -devices (the devices the plan's workers run on, e.g. "
                       "cpu:1,cpu:1)")
    if setting.fractions is not None:
        raise CctError(f"{setting.split_source} {flags.split or 'fractions'} and -plan {flags.plan}: the plan "
                       "decides every layer's split; drop the split")
    return planned_executor_factory(flags.plan, setting.devices, setting.source)
