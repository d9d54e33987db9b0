"""Configurations: which degrees are tried, in what order, and how parts tile a layer's output."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cct.plan import config as cfg
from cct.plan.config import Config, enumerate_configs, part_boxes


def test_degrees_are_powers_of_two_and_the_worker_count():
    assert cfg.degrees(16) == [16, 8, 4, 2, 1]
    assert cfg.degrees(6) == [6, 4, 2, 1]
    assert cfg.degrees(1) == [1]


def test_seventy_configurations_of_a_large_layer_at_16_workers_image_parallelism_first():
    configs = enumerate_configs(16, (512, 64, 56, 56))
    assert len(configs) == 70 == len(set(configs))
    assert configs[0] == Config(16, 1, 1, 1)
    assert all(c.workers <= 16 for c in configs)
    assert Config(1, 1, 2, 2) in configs and Config(2, 2, 2, 2) in configs and Config(1, 1, 1, 1) in configs
    # n descending, then c, h, w descending: the order ties are broken in
    assert configs == sorted(configs, key=lambda c: tuple(-d for d in c.degrees))


def test_dimensions_a_layer_cannot_split_and_small_dimensions_limit_the_degrees():
    fc = enumerate_configs(16, (512, 4096, 1, 1), "nc")
    assert len(fc) == 15 and all(c.h == c.w == 1 for c in fc)
    small = enumerate_configs(16, (10, 3, 1, 1))
    assert max(c.n for c in small) == 8 and max(c.c for c in small) == 2
    assert enumerate_configs(1, (512, 64, 56, 56)) == [Config()]
    assert enumerate_configs(16, (512, 3, 227, 227), "n") == [Config(d) for d in (16, 8, 4, 2, 1)]


@pytest.mark.parametrize("config,extent", [
    (Config(4, 1, 1, 1), (10, 3, 7, 7)), (Config(2, 3, 1, 1), (5, 7, 1, 1)), (Config(1, 1, 2, 2), (2, 5, 13, 13)),
    (Config(2, 2, 2, 2), (3, 3, 3, 3)), (Config(1, 6, 1, 1), (1, 1000, 1, 1))])
def test_parts_tile_the_output_in_worker_order(config, extent):
    lo, hi = part_boxes(config, extent)
    assert lo.shape == hi.shape == (config.workers, 4)
    volume = np.prod(hi - lo, axis=1)
    assert volume.sum() == np.prod(extent)
    for a, b in itertools.combinations(range(config.workers), 2):  # disjoint
        assert np.any(np.minimum(hi[a], hi[b]) <= np.maximum(lo[a], lo[b]))
    # worker j = ((i_n·c + i_c)·h + i_h)·w + i_w, part i along an axis of size S split d ways is [iS/d, (i+1)S/d)
    for j, idx in enumerate(itertools.product(*(range(d) for d in config.degrees))):
        for axis, (i, d, size) in enumerate(zip(idx, config.degrees, extent)):
            assert (lo[j, axis], hi[j, axis]) == (i * size // d, (i + 1) * size // d)
    assert tuple(np.max(hi - lo, axis=0)) == cfg.largest_part(config, extent)


def test_all_part_boxes_pads_idle_devices_with_empty_boxes():
    extent = (8, 6, 5, 5)
    configs = enumerate_configs(8, extent)
    lo, hi, valid = cfg.all_part_boxes(configs, extent, 8)
    for k, c in enumerate(configs):
        a, b = part_boxes(c, extent)
        assert np.array_equal(lo[k, :c.workers], a) and np.array_equal(hi[k, :c.workers], b)
        assert valid[k].sum() == c.workers and not np.any(hi[k, c.workers:] - lo[k, c.workers:])


def test_baselines_pick_the_widest_image_or_channel_split():
    configs = enumerate_configs(16, (512, 4096, 1, 1), "nc")
    assert cfg.image_parallel(configs) == Config(16) and cfg.model_parallel(configs) == Config(1, 16)
    assert cfg.image_parallel(enumerate_configs(16, (10, 1000, 1, 1), "nc")) == Config(8)
    assert str(Config(1, 1, 2, 2)) == "{n=1, c=1, h=2, w=2}" and Config(2, 2, 2, 1).replicas == 4
