"""Parallel execution facilities: batch partitions across threads (:mod:`cct.parallel.partition`)."""
from cct.parallel.partition import (
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
