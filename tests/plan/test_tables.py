"""DeePa's Tables 2 and 3 from their own costs: a three-node chain with the producer pinned to {n=16} and the
table's rows as the middle layer's configurations; the search picks the paper's minimum."""
from __future__ import annotations

import numpy as np
import pytest

from cct.plan.config import Config
from cct.plan.search import CostEdge, CostGraph, search

# (configuration, GPU workers, transfer, compute, update, total as printed), ms per step
TABLE2 = [  # AlexNet's first fully-connected layer on 16 K80s, minibatch 512
    (Config(16, 1), 16, 0.0, 1.28, 1075.0, 1076.0),
    (Config(1, 16), 16, 134.4, 1.28, 0.0, 135.7),
    (Config(1, 4), 4, 33.6, 5.1, 0.0, 38.7),
    (Config(1, 2), 2, 16.8, 10.2, 0.0, 27.0),
    (Config(1, 1), 1, 8.4, 20.4, 0.0, 28.8),
]
TABLE3 = [  # VGG-16's last three convolutional layers as one node
    (Config(16), 16, 0.0, 15.9, 134.4, 150.3),
    (Config(8), 8, 39.2, 31.8, 67.2, 138.2),
    (Config(4), 4, 39.2, 63.7, 33.6, 136.5),
    (Config(1, 1, 2, 2), 4, 39.2, 54.7, 33.6, 127.5),
    (Config(2), 2, 39.2, 127.4, 16.8, 183.4),
]


def chain(table) -> CostGraph:
    """producer {n=16} → layer (one configuration per row: compute + update, transfer on its in-edge) → consumer."""
    return CostGraph({"producer": np.zeros(1), "layer": np.array([r[3] + r[4] for r in table]),
                      "consumer": np.zeros(1)},
                     [CostEdge("producer", "layer", np.array([[r[2] for r in table]])),
                      CostEdge("layer", "consumer", np.zeros((len(table), 1)))])


@pytest.mark.parametrize("table,config,total", [(TABLE2, Config(1, 2), 27.0), (TABLE3, Config(1, 1, 2, 2), 127.5)],
                         ids=["table2_fc6", "table3_vgg_conv5"])
def test_the_search_picks_the_papers_configuration(table, config, total):
    g = chain(table)
    r = search(g)
    chosen = table[r.assignment["layer"]]
    print("\n" + "\n".join(f"{str(c):<22} {w:>2} workers  {x:6.1f} + {cm:6.2f} + {u:7.1f} = {x + cm + u:7.2f}"
                           f"{'   <- chosen' if row is chosen else ''}" for row in table
                           for c, w, x, cm, u, _ in [row]))
    assert chosen[0] == config and r.cost == pytest.approx(total, rel=1e-9)
    assert r.residue == ["producer", "consumer"] and r.node_eliminations == 1


@pytest.mark.parametrize("table", [TABLE2, TABLE3], ids=["table2", "table3"])
def test_rows_add_up_and_have_the_structure_the_tables_imply(table):
    g = chain(table)
    per_replica = next(u / c.replicas for c, _, _, _, u, _ in table if c.replicas > 1)
    for i, (config, workers, _, compute, update, total) in enumerate(table):
        assert config.workers == workers
        assert g.cost({"producer": 0, "layer": i, "consumer": 0}) == pytest.approx(total, abs=0.3)  # printed rounded
        # update: a constant per replica, nothing for a single one; compute ∝ 1/workers (within the rounding)
        assert update == pytest.approx(config.replicas * per_replica if config.replicas > 1 else 0.0, rel=0.01)
        assert compute * workers == pytest.approx(table[0][3] * table[0][1], rel=0.16)
    if table is TABLE2:  # a channel split copies the whole input to every worker
        assert all(t == pytest.approx(w * 8.4) for c, w, t, *_ in table if c.n == 1)
