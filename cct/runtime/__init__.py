"""The runtime leaf: the cores this process may use and the BLAS/FFT thread budgets of concurrent threads
(:mod:`cct.runtime.threads`), CcT's batch partitions (:mod:`cct.runtime.partition`), and freed memory kept
for reuse by the allocator, in one arena for all threads (:mod:`cct.runtime.memory`).  Layers, engines,
devices and executors build on it; it depends on nothing of cct's but the settings (:mod:`cct.config`)."""
# threads first: importing it sets OpenBLAS's worker spin, which must precede numpy's loading of OpenBLAS
from cct.runtime.threads import blas_threads, cpu_cores, thread_budget

# isort: split
from cct.runtime.memory import one_malloc_arena
from cct.runtime.partition import batch_ranges, partitions_for, run_batch, run_partitions

one_malloc_arena()  # before any of cct's threads allocate (cct.runtime.memory)

__all__ = ["batch_ranges", "blas_threads", "cpu_cores", "partitions_for", "run_batch", "run_partitions",
           "thread_budget"]
