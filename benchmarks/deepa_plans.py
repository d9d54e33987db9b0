"""DeePa's per-layer parallelism plans (cct.plan) for AlexNet, VGG-16 and Inception-v3 against image parallelism and
OWT, priced with the same cost model in the same run.

Run:   python benchmarks/deepa_plans.py [--workers 1,2,4,8,16] [--batch 512] [--gflops 2500] [--bandwidth 4.5]
                                        [--cost analytic|measured] [--repeat 5]
Prints, per model and worker count P: the plan's Eq. 1 step cost and those of image parallelism and OWT as ratios to
it; MB moved per step by each (ratios to the plan); the search time (elimination + enumeration + undo, median of
--repeat searches of the same cost graph, cost tables excluded); the node count before and after elimination.  Then,
per model at the largest P, the layers the plan does not run image-parallel on all P workers.

The defaults model DeePa's 16-GPU K80 machine at minibatch 512: 2.5 TFLOP/s per worker (57% of a GK210's 4.37
TFLOP/s peak) and 4.5 GB/s between workers (what Table 2's update column implies: 16 replicas of fc6's 151 MB,
both ways, in 1075 ms).  Absolute milliseconds depend on those two figures; the ratios are the point.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_minloglevel", "1")

from cct.plan import CostModel, layer_graph, plan_net, search  # noqa: E402

MODELS = ("alexnet", "vgg16", "inception_v3")
ROOT = Path(__file__).resolve().parents[1] / "models"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8,16")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--gflops", type=float, default=2500.0)
    ap.add_argument("--bandwidth", type=float, default=4.5)
    ap.add_argument("--cost", default="analytic", choices=["analytic", "measured"])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    workers = [int(p) for p in args.workers.split(",")]
    model = CostModel(args.gflops, args.bandwidth, args.cost)
    print(f"workers of {args.gflops:g} GFLOP/s and {args.bandwidth:g} GB/s, batch {args.batch}, {args.cost} costs; "
          f"search times: median of {args.repeat}")
    print(f"{'model':<13}{'P':>3}  {'plan ms':>9} {'image/plan':>10} {'OWT/plan':>9}  {'plan MB':>9} "
          f"{'image MB':>10} {'(x)':>7} {'OWT MB':>9} {'(x)':>6}  {'search ms':>9}  nodes")
    last = {}
    for name in MODELS:
        graph = layer_graph(ROOT / name / "deploy.prototxt", batch=args.batch)
        for p in workers:
            plan = plan_net(graph, p, model)
            cost_graph = plan.costs.cost_graph()
            ms = statistics.median(search(cost_graph).seconds * 1e3 for _ in range(args.repeat))
            image, owt = plan.baselines
            mb = plan.plan.moved_bytes / 1e6

            def ratio(x: float, y: float) -> str:
                return f"{x / y:.2f}" if y > 0 else ("1.00" if x == 0 else "inf")

            print(f"{name:<13}{p:>3}  {plan.plan.cost_ms:9.1f} {ratio(image.cost_ms, plan.plan.cost_ms):>10} "
                  f"{ratio(owt.cost_ms, plan.plan.cost_ms):>9}  {mb:9.1f} {image.moved_bytes / 1e6:10.1f} "
                  f"{ratio(image.moved_bytes / 1e6, mb):>7} {owt.moved_bytes / 1e6:9.1f} "
                  f"{ratio(owt.moved_bytes / 1e6, mb):>6}  {ms:9.1f}  {len(graph.nodes)} -> {len(plan.result.residue)}")
            last[name] = plan
    for name, plan in last.items():
        p = plan.workers
        other = [f"{n} {plan.config(n)}" for n in plan.graph.nodes if plan.config(n).degrees != (p, 1, 1, 1)]
        print(f"\n{name} at P = {p}, layers not image-parallel on all {p} workers ({len(other)} of "
              f"{len(plan.graph.nodes)}):")
        print("  " + "\n  ".join(other) if other else "  none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
