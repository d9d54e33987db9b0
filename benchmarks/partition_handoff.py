"""What handing work to the batch partitions costs: cct's partition threads against a ``ThreadPoolExecutor``.

Run:   python benchmarks/partition_handoff.py [--calls 2000] [--rounds 7]
:func:`cct.runtime.partition.run_concurrently` runs ``fn(k)`` for ``k < p``, the first in the calling thread and
the others on persistent threads, and returns when all are done; a layer pays that hand-off on every call it
splits into partitions (CaffeNet's training iteration makes about 80 such calls, one image of Inception-v3 about
25 on a 16-core machine, of up to 13 partitions).  Both sides run empty calls, so the figure is the hand-off
alone: the baseline submits ``p - 1`` tasks to a ``concurrent.futures.ThreadPoolExecutor`` of ``cores - 1``
threads and waits on their futures (what ``run_concurrently`` did before it had threads of its own).  Rounds
alternate the two; medians of microseconds per call, and the ratio cct/executor, for ``p`` from 2 to
``2 x cores``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

from cct.runtime import partition  # noqa: E402
from cct.runtime.threads import cpu_cores  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls timed together in one round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    cores = cpu_cores()
    pool = ThreadPoolExecutor(max_workers=max(1, cores - 1))

    def empty(_k: int) -> None:
        pass

    def executor_call(p: int) -> None:
        futures = [pool.submit(empty, k) for k in range(1, p)]
        empty(0)
        for f in futures:
            f.result()

    def cct_call(p: int) -> None:
        partition.run_concurrently(p, empty)

    counts = sorted({2, cores, 2 * cores} | ({4} if cores >= 4 else set()))
    print(f"{cores} cores; microseconds per call of p empty partitions, medians of {args.rounds} rounds "
          f"of {args.calls} calls")
    print(f"{'p':>4} {'cct':>9} {'executor':>9} {'cct/executor':>13}")
    for p in counts:
        times: dict[str, list[float]] = {"cct": [], "executor": []}
        for _ in range(args.rounds):
            for name, call in (("cct", cct_call), ("executor", executor_call)):
                start = time.perf_counter()
                for _ in range(args.calls):
                    call(p)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        ours, theirs = statistics.median(times["cct"]), statistics.median(times["executor"])
        print(f"{p:>4} {ours:>9.1f} {theirs:>9.1f} {ours / theirs:>13.2f}")
    pool.shutdown()


if __name__ == "__main__":
    main()
