"""The runtime leaf: cores this process may use, BLAS thread budgets, and CcT's batch partitions
(:mod:`cct.runtime.partition`).  Everything else builds on it; it imports nothing of cct's but errors."""
from cct.runtime.partition import (
    batch_ranges,
    cpu_cores,
    partitions_for,
    partitions_setting,
    run_batch,
    run_partitions,
    set_partitions,
)

__all__ = ["batch_ranges", "cpu_cores", "partitions_for", "partitions_setting", "run_batch", "run_partitions",
           "set_partitions"]
