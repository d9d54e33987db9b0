"""Devices: parsing ``cpu``/``cpu:T``/``gpu:N`` lists, memory helpers, thread limits, peak FLOPS and its cache."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from cct.device import Device, cupy_available, parse_devices, query
from cct.device import device as device_module
from cct.device.device import copy_into
from cct.errors import CctError
from cct.runtime.threads import cpu_cores


def test_parse_cpu_lists():
    assert parse_devices("cpu:1,cpu:1") == [Device("cpu", 0, 1), Device("cpu", 0, 1)]
    assert parse_devices(" cpu:3 ") == [Device("cpu", 0, 3)]
    assert parse_devices("cpu") == [Device("cpu", 0, cpu_cores())]
    assert [d.name for d in parse_devices("cpu:2,CPU:1")] == ["cpu:2", "cpu:1"]


@pytest.mark.parametrize("spec, words", [
    ("tpu:0", ["'tpu:0'", "unknown device"]),
    ("cpu:1,cpu:x", ["'cpu:x'", "unknown device"]),
    ("cpu:1,,cpu:1", ["''", "unknown device"]),
    ("cpu:0", ["'cpu:0'", "at least one thread"]),
    ("", ["no devices"]),
])
def test_bad_device_lists_are_one_line_naming_the_item(spec, words):
    with pytest.raises(CctError) as e:
        parse_devices(spec, "-devices")
    message = str(e.value)
    assert "\n" not in message and message.startswith("-devices")
    for w in words:
        assert w in message


@pytest.mark.skipif(cupy_available, reason="this machine has cupy and a GPU")
def test_gpu_without_cupy_is_one_line_naming_the_item():
    with pytest.raises(CctError, match=r"'gpu:0' needs cupy and a CUDA device") as e:
        parse_devices("cpu:1,gpu:0", "CCT_DEVICES")
    assert "\n" not in str(e.value) and str(e.value).startswith("CCT_DEVICES cpu:1,gpu:0")


def test_cpu_memory_helpers():
    d = Device("cpu", 0, 1)
    a = d.allocate((2, 3))
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and not a.any()
    assert d.xp is np and d.holds(a) and not d.is_gpu
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert d.to_device(x) is x
    d.copy_in(a, x)
    np.testing.assert_array_equal(d.to_host(a), x)
    b = np.zeros_like(x)
    copy_into(b, x)
    np.testing.assert_array_equal(b, x)


def test_context_limits_blas_threads():
    from threadpoolctl import threadpool_info

    def blas() -> list[int]:  # numpy's BLAS (the one its matmul calls)
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas" and "numpy" in p["filepath"]]

    before = blas()
    with Device("cpu", 0, 1).context():
        assert blas() and all(n == 1 for n in blas())
        import scipy.fft

        assert scipy.fft.get_workers() == 1
    assert blas() == before


def test_peak_gflops_is_measured_quickly_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "c"))
    d = Device("cpu", 0, 1)
    t = time.perf_counter()
    gflops, source = d.peak_gflops()
    assert time.perf_counter() - t < 2.0  # a few hundred ms on a loaded machine
    assert source == "measured" and gflops > 0.1
    assert d.peak_gflops() == (gflops, "cached")
    data = json.loads((tmp_path / "c" / "devices.json").read_text())
    (key,) = data["peak_gflops"]
    assert key.endswith("|cpu|threads=1") and query.cpu_model() in key
    # another thread count is another entry
    monkeypatch.setattr(device_module, "_probe_cpu", lambda threads: 123.0)
    assert Device("cpu", 0, 7).peak_gflops() == (123.0, "measured")
    assert d.peak_gflops() == (gflops, "cached")


def test_gpu_spec_table_matches_the_longest_name():
    keys = sorted(device_module.GPU_PEAK_TFLOPS, key=len, reverse=True)
    assert next(k for k in keys if k.lower() in "nvidia h100 pcie") == "H100 PCIe"
    assert next(k for k in keys if k.lower() in "nvidia h100 80gb hbm3") == "H100"
    assert next(k for k in keys if k.lower() in "nvidia a10g") == "A10G"


def test_describe_names_the_threads():
    assert Device("cpu", 0, 1).describe().endswith("1 BLAS thread")
    assert Device("cpu", 0, 4).describe().endswith("4 BLAS threads")


def test_a_blas_kernel_narrower_than_the_cpu_is_reported(monkeypatch):
    """OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU halves the GEMM speed: device_query says so in one line."""
    from cct import cli
    from cct.device import query
    from tests.solvers.helpers import captured_log, messages

    def machine(kernel, bits):
        monkeypatch.setattr(query, "blas_libraries",
                            lambda: [query.BlasLibrary("openblas", "0.3.30", kernel, 2, "libopenblas.so")])
        monkeypatch.setattr(query, "cpu_vector_bits", lambda: bits)
        return query.narrow_blas_kernel()

    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    line = machine("Haswell", 512)
    assert line.startswith("numpy's OpenBLAS runs Haswell kernels (256-bit vectors) (OPENBLAS_CORETYPE=Haswell) "
                           "on a CPU with 512-bit vectors")
    with captured_log() as out:
        assert cli.main(["device_query"]) == 0
    assert messages(out.getvalue(), "W") == [line]
    assert machine("SkylakeX", 512) == "" and machine("Haswell", 256) == "" and machine("", 512) == ""
