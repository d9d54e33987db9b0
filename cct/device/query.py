"""What this machine is: CPU model and cores, the BLAS libraries loaded (with their kernel and threads), CUDA
device properties.  ``cct device_query`` prints them; benchmarks record them beside their figures; cached
speeds are keyed by them (:func:`machine_key`)."""
from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

from cct.device import backend
from cct.runtime.threads import cpu_cores


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown"


# the last-level cache where the kernel does not say (a common size for a few cores' share of a server CPU)
DEFAULT_LAST_LEVEL_CACHE = 32 << 20


def last_level_cache_bytes(caches: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the CPU's last-level cache (the highest-level data or unified cache Linux lists for CPU 0 in
    ``caches``), :data:`DEFAULT_LAST_LEVEL_CACHE` where it lists none."""
    import glob

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = (0, 0)
    for index in glob.glob(f"{caches}/index*"):
        try:
            with open(f"{index}/level") as f:
                level = int(f.read())
            with open(f"{index}/type") as f:
                kind = f.read().strip()
            with open(f"{index}/size") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        n = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        best = max(best, (level, n))
    return best[1] or DEFAULT_LAST_LEVEL_CACHE


@dataclass(frozen=True)
class BlasLibrary:
    """One BLAS library loaded in the process (threadpoolctl's view of it)."""

    api: str           # "openblas", "mkl", ...
    version: str
    kernel: str        # the core type its kernels were chosen for ("Haswell", "SkylakeX", "Zen"), "" unknown
    threads: int
    path: str

    def describe(self) -> str:
        kernel = f", {self.kernel} kernel" if self.kernel else ""
        return f"{self.api} {self.version}{kernel}, {self.threads} threads"


def blas_libraries() -> list[BlasLibrary]:
    """The BLAS libraries loaded now (numpy's and scipy's may be two copies of OpenBLAS)."""
    from threadpoolctl import threadpool_info

    return [BlasLibrary(str(p.get("internal_api", "")), str(p.get("version", "")),
                        str(p.get("architecture") or ""), int(p.get("num_threads") or 0), str(p.get("filepath", "")))
            for p in threadpool_info() if p.get("user_api") == "blas"]


# OpenBLAS kernels by the widest vector instructions they use, and the CPU flag that offers each width
_KERNEL_WIDTH = {"skylakex": 512, "cooperlake": 512, "sapphirerapids": 512, "haswell": 256, "zen": 256,
                 "sandybridge": 256, "nehalem": 128, "core2": 128, "prescott": 128}
_FLAG_WIDTH = (("avx512f", 512), ("avx2", 256), ("avx", 256), ("sse4_2", 128))


def cpu_vector_bits() -> int:
    """The widest float vectors the CPU offers (512 with AVX-512, 256 with AVX/AVX2, 128), 0 when unknown."""
    flags = set((_cpuinfo("flags") or "").split())
    return next((bits for flag, bits in _FLAG_WIDTH if flag in flags), 0)


def narrow_blas_kernel() -> str:
    """A one-line warning when numpy's OpenBLAS runs kernels narrower than the CPU's vectors (an AVX2 kernel
    forced by ``OPENBLAS_CORETYPE`` on an AVX-512 CPU runs GEMMs, and so convolutions, at about half the
    speed it could: 255 against 470 GFLOP/s on a 2-core Zen 5), else ""."""
    import os

    known = sorted((_KERNEL_WIDTH[lib.kernel.lower()], lib.kernel) for lib in blas_libraries()
                   if lib.kernel.lower() in _KERNEL_WIDTH)
    cpu = cpu_vector_bits()
    if not known or known[0][0] >= cpu:
        return ""
    width, kernel = known[0]
    forced = os.environ.get("OPENBLAS_CORETYPE")
    why = f" (OPENBLAS_CORETYPE={forced})" if forced else ""
    return (f"numpy's OpenBLAS runs {kernel} kernels ({width}-bit vectors){why} on a CPU with {cpu}-bit vectors: "
            f"GEMMs and convolutions run at a fraction of this CPU's speed")


def machine_key() -> str:
    """What a cached speed is valid for: host, CPU model, usable cores, the BLAS libraries with the kernels
    they run (OpenBLAS's ``OPENBLAS_CORETYPE`` picks another kernel on the same CPU: AVX2 Haswell kernels run
    at about half the speed of SkylakeX's AVX-512 ones, so a speed measured under one is no guide to the
    other) and the build of cct's own compiled kernels (:func:`cct.native.build_key`).  numpy and scipy each load
    a copy of OpenBLAS, listed in no fixed order: scipy's is loaded first and the list sorted, so the key is the
    same whenever it is asked for."""
    import scipy.linalg  # noqa: F401  (its BLAS: the same libraries in every process)

    from cct import native

    blas = sorted({f"{lib.api} {lib.version} {lib.kernel or 'unknown'} kernel" for lib in blas_libraries()})
    return (f"{platform.node()}|{cpu_model()}|{cpu_cores()} cores|{', '.join(blas) or 'unknown BLAS'}"
            f"|{native.build_key()}")


def cuda_properties(index: int) -> list[tuple[str, Any]]:
    """Caffe's ``device_query`` rows for CUDA device ``index`` (needs cupy)."""
    p = backend.cupy.cuda.runtime.getDeviceProperties(index)

    def yes_no(v: Any) -> str:
        return "Yes" if v else "No"

    def field(name: str) -> Any:  # CUDA 13 dropped some of the fields Caffe printed (memPitch, clockRate)
        return p.get(name, "not reported by this CUDA runtime")

    return [
        ("Device id", index), ("Major revision number", field("major")), ("Minor revision number", field("minor")),
        ("Name", backend.gpu_name(index)), ("Total global memory", field("totalGlobalMem")),
        ("Total shared memory per block", field("sharedMemPerBlock")),
        ("Total registers per block", field("regsPerBlock")), ("Warp size", field("warpSize")),
        ("Maximum memory pitch", field("memPitch")), ("Maximum threads per block", field("maxThreadsPerBlock")),
        ("Maximum dimension of block", ", ".join(str(d) for d in p["maxThreadsDim"])),
        ("Maximum dimension of grid", ", ".join(str(d) for d in p["maxGridSize"])),
        ("Clock rate", field("clockRate")), ("Total constant memory", field("totalConstMem")),
        ("Texture alignment", field("textureAlignment")),
        ("Concurrent copy and execution", yes_no(p.get("deviceOverlap", p.get("asyncEngineCount", 0)))),
        ("Number of multiprocessors", field("multiProcessorCount")),
        ("Kernel execution timeout", yes_no(p.get("kernelExecTimeoutEnabled", 0))),
    ]
