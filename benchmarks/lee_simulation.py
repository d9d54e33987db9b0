"""Lee et al.'s setting simulated (``cct.distributed.simulate``): fit the node and the network on the paper's two
anchors (VGG-A, N = 256, 128 nodes: Lee 62.97x, DP 19.92x), then print the P x {DP, DP+Overlap, Lee} speedup
table for VGG-A and the held-out figures of Figs. 8-9 beside the model's.

    python benchmarks/lee_simulation.py
"""
from __future__ import annotations

from cct.distributed import simulate as sim


def main() -> None:
    machine = sim.fit()
    print(sim.table(machine))
    layers = sim.vgg()
    print("\nanchors (fitted):  " + ", ".join(
        f"{v} {sim.speedup(layers, 256, 128, machine, v):.2f}x (paper {target}x)" for v, target in sim.ANCHORS.items()))
    print("held out (max over P, Lee k = 9, f = 2):")
    for (name, n), target in sim.HELD_OUT.items():
        ours = sim.max_speedup(name, n, machine)
        print(f"  {name:8} N = {n:3}: model {ours:6.2f}x  paper {target:6.2f}x  ratio {ours / target:5.2f}")
    print("k sweep at 128 nodes: " + ", ".join(
        f"k={k} {sim.speedup(layers, 256, 128, machine, 'Lee', k=k):.2f}x" for k in (3, 6, 9, 12)))
    print("f sweep at 128 nodes: " + ", ".join(
        f"f={f} {sim.speedup(layers, 256, 128, machine, 'Lee', f=f):.2f}x" for f in (0, 1, 2, 3)))


if __name__ == "__main__":
    main()
