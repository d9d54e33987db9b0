"""Node and edge elimination (DeePa §4) against brute force on seeded random DAGs, series-parallel reduction,
ties, and one-line errors for bad graphs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cct.errors import CctError
from cct.plan.search import CostEdge, CostGraph, brute_force, find_cycle, search


def random_dag(rng: np.random.Generator, max_nodes: int = 8, max_configs: int = 5) -> CostGraph:
    """A random DAG: up to ``max_nodes`` nodes listed in shuffled order, 1..``max_configs`` configurations each,
    an edge between each ordered pair with a per-graph probability (some doubled: parallel edges); costs either
    continuous or small integers (ties)."""
    n = int(rng.integers(1, max_nodes + 1))
    order = [f"v{i}" for i in range(n)]  # topological order
    sizes = rng.integers(1, max_configs + 1, n)
    integral = rng.random() < 0.3

    def values(shape):
        return rng.integers(0, 4, shape).astype(float) if integral else rng.uniform(0, 10, shape)

    p = rng.uniform(0.15, 0.7)
    edges = []
    for i, j in itertools.combinations(range(n), 2):
        for _ in range(2 if rng.random() < 0.15 else 1):
            if rng.random() < p:
                edges.append(CostEdge(order[i], order[j], values((sizes[i], sizes[j]))))
    listed = [order[k] for k in rng.permutation(n)]
    costs = {v: values(sizes[order.index(v)]) for v in listed}
    return CostGraph(costs, [edges[k] for k in rng.permutation(len(edges))])


def series_parallel(rng: np.random.Generator, steps: int, max_configs: int = 5) -> tuple[CostGraph, str, str]:
    """A two-terminal series-parallel DAG grown from one edge s → t by series (subdivide an edge) and parallel
    (add a path beside an edge) steps."""
    pairs = [("s", "t")]
    nodes = ["s", "t"]
    for k in range(steps):
        u, v = pairs[int(rng.integers(len(pairs)))]
        w = f"w{k}"
        nodes.append(w)
        if rng.random() < 0.5:
            pairs.remove((u, v))
        pairs += [(u, w), (w, v)]
    sizes = {v: int(rng.integers(1, max_configs + 1)) for v in nodes}
    costs = {v: rng.uniform(0, 10, sizes[v]) for v in nodes}
    edges = [CostEdge(u, v, rng.uniform(0, 10, (sizes[u], sizes[v]))) for u, v in pairs]
    return CostGraph(costs, edges), "s", "t"


def exhaustive(graph: CostGraph) -> float:
    """Eq. 1 minimised by itertools (independent of brute_force's vectorised enumeration)."""
    names = list(graph.costs)
    best = float("inf")
    for picks in itertools.product(*(range(len(graph.costs[v])) for v in names)):
        best = min(best, graph.cost(dict(zip(names, picks))))
    return best


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def test_optimal_on_1000_random_dags():
    rng = np.random.default_rng(20180214)
    residues = []
    for _ in range(1000):
        g = random_dag(rng)
        r = search(g)
        _, best = brute_force(g)
        assert close(r.cost, best), (r.cost, best)
        assert close(g.cost(r.assignment), r.cost)  # Eq. 1 of the returned assignment is the reported cost
        assert set(r.assignment) == set(g.costs)
        assert all(0 <= r.assignment[v] < len(g.costs[v]) for v in g.costs)
        residues.append(len(r.residue))
    # the sample exercises both rules and the enumeration of irreducible residues
    assert min(residues) <= 2 and max(residues) >= 5


def test_brute_force_matches_exhaustive_enumeration():
    rng = np.random.default_rng(7)
    checked = 0
    while checked < 150:
        g = random_dag(rng, max_nodes=6, max_configs=4)
        if np.prod([len(c) for c in g.costs.values()]) > 400:
            continue
        assignment, best = brute_force(g)
        assert close(best, exhaustive(g))
        assert close(g.cost(assignment), best)
        checked += 1


@pytest.mark.parametrize("seed", range(20))
def test_series_parallel_graphs_reduce_to_their_two_terminals(seed):
    rng = np.random.default_rng(seed)
    g, s, t = series_parallel(rng, steps=int(rng.integers(1, 9)), max_configs=4)
    r = search(g)
    assert r.residue == [s, t]
    assert r.node_eliminations == len(g.costs) - 2
    assert close(r.cost, brute_force(g)[1])


def test_chain_eliminates_every_inner_node_and_merges_parallel_edges():
    rng = np.random.default_rng(3)
    names = [f"l{i}" for i in range(10)]
    costs = {v: rng.uniform(0, 5, 4) for v in names}
    edges = [CostEdge(a, b, rng.uniform(0, 5, (4, 4))) for a, b in zip(names, names[1:])]
    edges.append(CostEdge("l3", "l4", rng.uniform(0, 5, (4, 4))))  # a parallel edge
    r = search(CostGraph(costs, edges))
    assert r.residue == ["l0", "l9"] and r.node_eliminations == 8 and r.edge_eliminations == 1
    assert r.enumerated == 16
    assert close(r.cost, brute_force(CostGraph(costs, edges))[1])


def test_greedy_choice_is_not_taken_when_transfers_outweigh_it():
    # b alone prefers configuration 0, but moving between a's only configuration and b's 0 costs more
    g = CostGraph({"a": np.array([0.0]), "b": np.array([1.0, 2.0]), "c": np.array([0.0])},
                  [CostEdge("a", "b", np.array([[5.0, 0.0]])), CostEdge("b", "c", np.zeros((2, 1)))])
    r = search(g)
    assert r.assignment == {"a": 0, "b": 1, "c": 0} and r.cost == 2.0


def test_ties_keep_the_first_configuration_of_every_node():
    g = CostGraph({v: np.zeros(3) for v in "abcd"},
                  [CostEdge("a", "b", np.zeros((3, 3))), CostEdge("b", "c", np.zeros((3, 3))),
                   CostEdge("a", "c", np.zeros((3, 3))), CostEdge("c", "d", np.zeros((3, 3)))])
    assert search(g).assignment == {v: 0 for v in "abcd"}


def test_several_sources_and_sinks_get_virtual_terminals():
    rng = np.random.default_rng(5)
    costs = {v: rng.uniform(0, 5, 3) for v in ("x", "y", "m", "p", "q")}
    edges = [CostEdge(u, v, rng.uniform(0, 5, (3, 3))) for u, v in (("x", "m"), ("y", "m"), ("m", "p"), ("m", "q"))]
    g = CostGraph(costs, edges)
    r = search(g)
    assert "(virtual source)" in r.residue and "(virtual sink)" in r.residue
    assert set(r.assignment) == set(costs)
    assert close(r.cost, brute_force(g)[1])


def test_single_node_and_isolated_nodes():
    assert search(CostGraph({"only": np.array([3.0, 1.0, 2.0])})).assignment == {"only": 1}
    g = CostGraph({"a": np.array([2.0, 1.0]), "b": np.array([0.5, 0.25])})
    r = search(g)
    assert r.assignment == {"a": 1, "b": 1} and r.cost == 1.25


def test_a_residue_too_large_to_enumerate_names_its_nodes():
    rng = np.random.default_rng(11)
    names = [f"k{i}" for i in range(5)]
    costs = {v: rng.uniform(0, 1, 5) for v in names}
    edges = [CostEdge(a, b, rng.uniform(0, 1, (5, 5))) for a, b in itertools.combinations(names, 2)]  # K5
    with pytest.raises(CctError, match=r"does not reduce: 5 nodes remain .* k0, k1, k2, k3, k4"):
        search(CostGraph(costs, edges), limit=1000)
    assert close(search(CostGraph(costs, edges)).cost, brute_force(CostGraph(costs, edges))[1])


def test_bad_graphs_are_one_line_errors():
    one = np.zeros(1)
    with pytest.raises(CctError, match="not a DAG: cycle a -> b -> c -> a"):
        search(CostGraph({"a": one, "b": one, "c": one},
                         [CostEdge("a", "b", np.zeros((1, 1))), CostEdge("b", "c", np.zeros((1, 1))),
                          CostEdge("c", "a", np.zeros((1, 1)))]))
    with pytest.raises(CctError, match="unknown node 'z'"):
        search(CostGraph({"a": one}, [CostEdge("a", "z", np.zeros((1, 1)))]))
    with pytest.raises(CctError, match="node 'e' has no configurations"):
        search(CostGraph({"e": np.zeros(0)}))
    with pytest.raises(CctError, match=r"xfer table is \(2, 1\), needs \(1, 1\)"):
        search(CostGraph({"a": one, "b": one}, [CostEdge("a", "b", np.zeros((2, 1)))]))


def test_find_cycle():
    assert find_cycle(["a", "b"], [("a", "b")]) == []
    assert find_cycle(["a"], [("a", "a")]) == ["a", "a"]
    assert find_cycle(["a", "b", "c"], [("a", "b"), ("b", "c"), ("c", "b")]) == ["b", "c", "b"]
