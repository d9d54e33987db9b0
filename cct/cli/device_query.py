"""``cct device_query``: CUDA device properties for each ``-gpu`` id (needs cupy), as Caffe prints them;
``-devices LIST``: each device's peak GFLOP/s and the split by peak FLOPS; neither: this machine's CPU and
BLAS."""
from __future__ import annotations

from cct import log
from cct.cli.common import parse_gpus
from cct.flags import Flags

SUMMARY = "show GPU diagnostic information"
FLAGS: list = []


def main(flags: Flags) -> int:
    if flags.devices:
        _log_devices(flags.devices)
        return 0
    log.info("Querying GPUs %s", flags.gpu)
    if flags.gpu:
        from cct.device.query import cuda_properties

        for g in parse_gpus(flags.gpu):
            for label, value in cuda_properties(g):
                log.info("%s", f"{label + ':':<31}{value}")
        return 0
    _log_cpu()
    return 0


def _log_devices(spec: str) -> None:
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


def _log_cpu() -> None:
    import os

    from cct.device.query import blas_libraries, cpu_model, narrow_blas_kernel
    from cct.runtime.threads import cpu_cores

    log.info("CPU:                           %s", cpu_model())
    log.info("CPU cores:                     %s (usable by this process: %s)", os.cpu_count(), cpu_cores())
    libs = blas_libraries()
    if not libs:
        log.info("BLAS:                          none found")
    for lib in libs:
        log.info("BLAS:                          %s (%s)", lib.describe(), lib.path)
    from cct import native
    from cct.runtime.threads import blas_worker_spin

    log.info("Kernels:                       %s", native.describe())
    log.info("OpenBLAS workers:              %s", blas_worker_spin())
    narrow = narrow_blas_kernel()
    if narrow:
        log.warning("%s", narrow)
