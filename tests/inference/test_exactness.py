"""The tiled MPF output equals the naive per-window evaluation (the plain net with cct.Net on each field-of-view
window) within the project's comparison rule at rtol 1e-5, every output voxel is written exactly once — on a
2-pooling net over a whole 100^3 volume, a 3-pooling net at 140^3 (2,000 sampled voxels), a 2-D net, with
plain pooling, batches, mirror padding, each engine and several tiles."""
from __future__ import annotations

import numpy as np
import pytest

from cct.compare.tolerance import assert_close
from cct.config import settings
from cct.engines.cost_model import DEFAULT_RATES
from cct.inference import infer, load_spec
from cct.inference.volume_io import MemoryWriter
from tests.inference.helpers import dense_reference, deploy_param, save_weights, window_reference


def _run(param, weights, volume, budget, **kw):
    spec = load_spec(param)
    pad = kw.get("pad", "valid")
    spatial = volume.shape[1:] if volume.ndim == spec.num_spatial + 1 else volume.shape
    out = spatial if pad == "mirror" else tuple(v - f + 1 for v, f in zip(spatial, spec.fov))
    sink = MemoryWriter((spec.out_channels,) + tuple(out))
    result = infer(param, weights, volume, sink, memory_budget=budget, quiet=True, rates=DEFAULT_RATES,
                   report=lambda line: None, **kw)
    assert sink.counts.min() == 1 and sink.counts.max() == 1, "every output voxel written exactly once"
    return sink.array, result, spec


@pytest.fixture(scope="module")
def ctm(tmp_path_factory):
    param = deploy_param("ctm_valid", width=4)
    weights = save_weights(param, str(tmp_path_factory.mktemp("w") / "ctm.caffemodel"), seed=1)
    return param, weights


def test_two_pooling_net_every_voxel_of_100_cubed(ctm):
    param, weights = ctm
    rng = np.random.default_rng(0)
    volume = rng.random((100, 100, 100), dtype=np.float32)
    ours, result, spec = _run(param, weights, volume, "24MiB")
    assert ours.shape == (2, 75, 75, 75)
    assert result.plan.tiles > 1, "the budget forces several overlapping tiles"
    dense = dense_reference(param, weights, volume[None], spec.fov, spec.pooling)
    assert_close(ours, dense, "tiled MPF vs the plain net at every offset", rtol=1e-5, reference="cct.Net")
    positions = rng.integers(0, 75, (300, 3))
    positions[:8] = [[0, 0, 0], [74, 74, 74], [0, 74, 0], [74, 0, 74], [37, 37, 37], [3, 1, 2], [73, 72, 71],
                     [result.plan.tile[0] - 1, result.plan.tile[0], 0]]
    naive = window_reference(param, weights, volume[None], positions, spec.fov)
    picked = np.stack([ours[(slice(None),) + tuple(p)] for p in positions])
    assert_close(picked, naive, "tiled MPF vs per-window evaluation", rtol=1e-5, reference="per-window")


def test_three_pooling_net_2000_sampled_voxels_of_140_cubed(tmp_path):
    """One engine (lowering, as the reference) within 1e-5; the planner's own mix of FFT and lowering within
    1e-4 (float32 FFT rounding compounds over seven layers: the digest's tolerance for mixed engines)."""
    settings.set("partitions", 2)  # the plan's memory per partition: the same plan (all MPF) on any machine
    settings.set("lowering_max_mb", 32)
    param = deploy_param("n337_w8", width=2)
    weights = save_weights(param, str(tmp_path / "n337.caffemodel"), seed=2)
    rng = np.random.default_rng(1)
    volume = rng.random((140, 140, 140), dtype=np.float32)
    positions = rng.integers(0, 56, (2000, 3))
    spec = load_spec(param)
    naive = window_reference(param, weights, volume[None], positions, spec.fov, batch=50)
    for engine, rtol in (("lowering", 1e-5), ("auto", 1e-4)):
        ours, result, spec = _run(param, weights, volume, "96MiB", engine=engine)
        assert spec.fov == (85, 85, 85) and ours.shape == (3, 56, 56, 56)
        assert all(result.plan.mpf)
        picked = np.stack([ours[(slice(None),) + tuple(p)] for p in positions])
        assert_close(picked, naive, f"3-pooling MPF ({engine}) vs per-window evaluation", rtol=rtol,
                     reference="per-window")


def test_2d_net_every_pixel(tmp_path):
    param = deploy_param("ctm2d_valid", width=4)
    weights = save_weights(param, str(tmp_path / "ctm2d.caffemodel"), seed=3)
    rng = np.random.default_rng(2)
    image = rng.random((90, 77), dtype=np.float32)
    ours, result, spec = _run(param, weights, image, "4MiB")
    assert ours.shape == (2, 65, 52)
    dense = dense_reference(param, weights, image[None], spec.fov, spec.pooling)
    assert_close(ours, dense, "2-D tiled MPF vs the plain net", rtol=1e-5, reference="cct.Net")
    positions = rng.integers(0, [65, 52], (100, 2))
    naive = window_reference(param, weights, image[None], positions, spec.fov)
    assert_close(np.stack([ours[:, a, b] for a, b in positions]), naive, "2-D per-window", rtol=1e-5,
                 reference="per-window")


@pytest.mark.parametrize("engine", ["lowering", "fft"])
@pytest.mark.parametrize("batches", [(1,), (4,)])
def test_engines_and_batches(ctm, engine, batches):
    param, weights = ctm
    rng = np.random.default_rng(3)
    volume = rng.random((1, 47, 45, 50), dtype=np.float32)
    ours, result, spec = _run(param, weights, volume, "16MiB", engine=engine, batches=batches)
    assert result.plan.batch in batches
    assert all(p.startswith(engine) for p in result.plan.primitives.values())
    dense = dense_reference(param, weights, volume, spec.fov, spec.pooling)
    assert_close(ours, dense, f"{engine}, batch {batches}", rtol=1e-5, reference="cct.Net")


def test_plain_pooling_plans_and_shifts(ctm):
    """A plan with plain pooling (one run per offset of those layers) gives the same dense output."""
    from cct.inference.planner import candidates
    from cct.inference.runner import InferenceNet, Weights
    from cct.inference.tiling import Tiling, run_tiles
    from cct.inference.volume_io import Volume

    param, weights = ctm
    spec = load_spec(param)
    w = Weights.load(weights)
    rng = np.random.default_rng(4)
    volume = rng.random((1, 44, 41, 39), dtype=np.float32)
    out_shape = tuple(v - 25 for v in volume.shape[1:])
    dense = dense_reference(param, weights, volume, spec.fov, spec.pooling)
    for mpf in [(False, False), (True, False), (False, True)]:
        plans, _ = candidates(spec, out_shape, 64 << 20, batches=(1, 3), mpf_choices=[mpf], rates=DEFAULT_RATES)
        plan = plans[0]
        assert plan.shifts == 8 ** (2 - sum(mpf))
        sink = MemoryWriter((2,) + out_shape)
        vol = Volume(volume, True)
        run_tiles(spec, lambda k, p=plan: InferenceNet(spec, w, p.mpf, k, p.run_input, p.primitives), mpf,
                  plan.batch, Tiling(out_shape, plan.tile, plan.run_input), vol.read, sink.write)
        assert sink.counts.min() == 1 and sink.counts.max() == 1
        assert_close(sink.array, dense, f"pooling as MPF {mpf}", rtol=1e-5, reference="cct.Net")


def test_mirror_padding_gives_the_input_size(ctm):
    param, weights = ctm
    rng = np.random.default_rng(5)
    volume = rng.random((30, 33, 28), dtype=np.float32)
    ours, _, spec = _run(param, weights, volume, "16MiB", pad="mirror")
    assert ours.shape == (2, 30, 33, 28)
    padded = np.pad(volume, [((f - 1) // 2, f - 1 - (f - 1) // 2) for f in spec.fov], mode="reflect")
    dense = dense_reference(param, weights, padded[None], spec.fov, spec.pooling)
    assert_close(ours, dense, "mirror padding", rtol=1e-5, reference="cct.Net on np.pad(reflect)")


def test_a_wrong_recombination_fails_the_comparison(ctm):
    """The comparison can fail: swapping two fragments' positions in the dense tile is caught."""
    from cct.inference import mpf as mpf_module

    param, weights = ctm
    volume = np.random.default_rng(6).random((40, 40, 40), dtype=np.float32)
    spec = load_spec(param)
    dense = dense_reference(param, weights, volume[None], spec.fov, spec.pooling)
    original = mpf_module.scatter_fragments

    def swapped(frags, *args):
        original(frags[::-1].copy(), *args)
    try:
        mpf_module.scatter_fragments = swapped
        import cct.inference.tiling as tiling

        tiling.scatter_fragments = swapped
        ours, _, _ = _run(param, weights, volume, "16MiB")
    finally:
        mpf_module.scatter_fragments = original
        tiling.scatter_fragments = original
    with pytest.raises(AssertionError):
        assert_close(ours, dense, "swapped fragments", rtol=1e-5)


BRANCHY = """
name: "branchy"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 16 dim: 16 dim: 16 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "PReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "c2a" type: "Convolution" bottom: "pool1" top: "c2a"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "msra" } } }
layer { name: "c2b" type: "Convolution" bottom: "pool1" top: "c2b"
        convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "crop" type: "Crop" bottom: "c2b" bottom: "c2a" top: "crop" crop_param { axis: 2 offset: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "c2a" bottom: "crop" top: "sum" eltwise_param { operation: MAX } }
layer { name: "tanh" type: "TanH" bottom: "sum" top: "sum" }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "c2a" top: "cat" }
layer { name: "pool2" type: "Pooling" bottom: "cat" top: "pool2" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "out" type: "Convolution" bottom: "pool2" top: "out"
        convolution_param { num_output: 2 kernel_size: 2 weight_filler { type: "msra" } } }
layer { name: "prob" type: "Softmax" bottom: "out" top: "prob" }
"""


def test_branches_batchnorm_scale_eltwise_concat_crop_average_pooling(tmp_path):
    """In-place BatchNorm/Scale/PReLU, a cropped skip branch merged by Eltwise MAX, a Concat and average
    pooling fragments: the runner's blob lifetimes and released buffers give the plain net's numbers."""
    import cct
    from cct.io.prototxt import parse_net_param

    param = parse_net_param(BRANCHY)
    cct.set_random_seed(7)
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(7)
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.shape).astype(np.float32) * (0.3 if b.data.ndim > 1 else 0.2)
    bn = net.params["bn1"]
    bn[0].data[...] = rng.standard_normal(4) * 2
    bn[1].data[...] = rng.random(4) * 3 + 0.5
    bn[2].data[...] = 2.0
    weights = str(tmp_path / "branchy.caffemodel")
    net.save(weights)
    spec = load_spec(param)
    assert spec.fov == (14, 14, 14) and spec.pooling == (4, 4, 4)  # 3, +1, +2*2, +1*2, +1*4
    volume = rng.random((2, 37, 35, 34), dtype=np.float32)
    ours, result, _ = _run(param, weights, volume, "8MiB")
    dense = dense_reference(param, weights, volume, spec.fov, spec.pooling)
    assert_close(ours, dense, "branchy net", rtol=1e-5, reference="cct.Net")
    positions = rng.integers(0, [24, 22, 21], (40, 3))
    naive = window_reference(param, weights, volume, positions, spec.fov)
    assert_close(np.stack([ours[(slice(None),) + tuple(p)] for p in positions]), naive, "branchy per-window",
                 rtol=1e-5, reference="per-window")


def test_hdf5_weights(ctm, tmp_path):
    """Weights from a .caffemodel.h5 give the same output as from the binary caffemodel."""
    import cct

    param, weights = ctm
    net = cct.Net(param, cct.TEST, weights=weights)
    h5 = str(tmp_path / "w.caffemodel.h5")
    net.to_hdf5(h5)
    volume = np.random.default_rng(8).random((30, 31, 29), dtype=np.float32)
    a, _, _ = _run(param, weights, volume, "16MiB")
    b, _, _ = _run(param, h5, volume, "16MiB")
    np.testing.assert_array_equal(a, b)
