"""Max-pooling fragments: each fragment is Caffe's pooling at its offset, exactly; the recombined fragments are
the sliding max-filter; recombination of several pooling levels matches brute force."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cct.blob import Blob
from cct.errors import CctError
from cct.inference.fov import MPF_TYPE, PoolSite
from cct.inference.mpf import fragment_pool, fragment_temp_bytes, scatter_fragments
from cct.layers.registry import create_layer, layer_type_list
from cct.proto import caffe_pb2 as pb


def _caffe_pool(x: np.ndarray, kernel, method=pb.PoolingParameter.MAX) -> np.ndarray:
    p = pb.LayerParameter(name="pool", type="Pooling", phase=pb.TEST)
    p.pooling_param.pool = method
    p.pooling_param.kernel_nd.extend(kernel)
    p.pooling_param.stride_nd.extend(kernel)
    layer = create_layer(p)
    bottom, top = Blob(x.shape), Blob()
    bottom.data[...] = x
    layer.setup_layer([bottom], [top])
    layer.forward_layer([bottom], [top])
    return top.data.copy()


@pytest.mark.parametrize("shape, kernel", [((2, 3, 9, 7, 11), (2, 2, 3)), ((1, 2, 5, 7), (3, 4)),
                                           ((3, 1, 11), (4,)), ((1, 4, 7, 5, 9), (2, 1, 2))])
def test_each_fragment_is_pooling_at_its_offset(shape, kernel):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x[..., ::3] = 0.0  # ties
    S, C, *n = shape
    out = fragment_pool(x, kernel)
    P = int(np.prod(kernel))
    assert out.shape == (S * P, C) + tuple(v // k for v, k in zip(n, kernel))
    for s in range(S):
        for o, off in enumerate(itertools.product(*(range(k) for k in kernel))):
            window = tuple(slice(a, a + k * (v // k)) for a, k, v in zip(off, kernel, n))
            crop = x[(slice(s, s + 1), slice(None)) + window]
            np.testing.assert_array_equal(out[s * P + o][None], _caffe_pool(crop, kernel))


def test_average_fragments():
    x = np.random.default_rng(1).standard_normal((2, 2, 7, 5)).astype(np.float32)
    out = fragment_pool(x, (2, 3), pb.PoolingParameter.AVE)
    for o, (a, b) in enumerate(itertools.product(range(2), range(3))):
        ref = _caffe_pool(x[:, :, a:a + 6, b:b + 3], (2, 3), pb.PoolingParameter.AVE)
        np.testing.assert_allclose(out[o::6], ref, rtol=1e-6, atol=1e-7)


def test_recombined_fragments_are_the_max_filter():
    x = np.random.default_rng(2).standard_normal((1, 3, 11, 9, 7)).astype(np.float32)
    kernel = (2, 2, 2)
    frags = fragment_pool(x, kernel)
    site = PoolSite("p", kernel, (1, 1, 1), pb.PoolingParameter.MAX)
    dense = np.empty((3, 10, 8, 6), np.float32)
    scatter_fragments(frags, [site], [True], [None], dense)
    ref = np.lib.stride_tricks.sliding_window_view(x[0], (2, 2, 2), axis=(1, 2, 3)).max(axis=(-3, -2, -1))
    np.testing.assert_array_equal(dense, ref)


def test_two_levels_and_a_plain_layer_recombine_as_brute_force():
    """Fragments of two MPF levels (kernels 2 then 3) land at x = o1 + 2*o2 + 6*j; with the second level plain
    at offset o2 they land at x = o1 + 2*o2 + 6*j for that o2 only."""
    rng = np.random.default_rng(3)
    J = (2, 3)
    sites = [PoolSite("a", (2, 2), (1, 1), 0), PoolSite("b", (3, 3), (2, 2), 0)]
    frags = rng.standard_normal((4 * 9, 1) + J).astype(np.float32)
    dense = np.full((1, 12, 18), np.nan, np.float32)
    scatter_fragments(frags, sites, [True, True], [None, None], dense)
    for (o1y, o1x), (o2y, o2x) in itertools.product(itertools.product(range(2), range(2)),
                                                    itertools.product(range(3), range(3))):
        f = (o1y * 2 + o1x) * 9 + o2y * 3 + o2x
        for jy, jx in itertools.product(range(J[0]), range(J[1])):
            assert dense[0, o1y + 2 * o2y + 6 * jy, o1x + 2 * o2x + 6 * jx] == frags[f, 0, jy, jx]
    part = np.full((1, 12, 18), np.nan, np.float32)
    scatter_fragments(frags[:4], sites, [True, False], [None, (1, 2)], part)
    written = ~np.isnan(part)
    assert written.sum() == 4 * 6
    assert part[0, 0 + 2, 1 + 4] == frags[1, 0, 0, 0]  # o1 = (0, 1), o2 = (1, 2), j = 0


def test_layer_is_registered_and_checks_sizes():
    assert MPF_TYPE in layer_type_list()
    p = pb.LayerParameter(name="frag", type=MPF_TYPE, phase=pb.TEST)
    p.pooling_param.pool = pb.PoolingParameter.MAX
    p.pooling_param.kernel_size = 2
    p.pooling_param.stride = 2
    layer = create_layer(p)
    bottom, top = Blob((1, 2, 9, 9, 9)), Blob()
    layer.setup_layer([bottom], [top])
    assert top.shape == (8, 2, 4, 4, 4)
    with pytest.raises(CctError, match=r"'frag'.*10x9x9 \+ 1 is not a multiple of the kernel 2x2x2"):
        bottom.reshape((1, 2, 10, 9, 9))
        layer.reshape([bottom], [top])
    p.pooling_param.stride = 1
    with pytest.raises(CctError, match="stride == kernel"):
        create_layer(p).setup_layer([Blob((1, 1, 9, 9))], [Blob()])


def test_scratch_estimate_is_the_intermediate_filters():
    import tracemalloc

    x = np.random.default_rng(4).standard_normal((1, 4, 41, 41, 41)).astype(np.float32)
    out = np.empty((8, 4, 20, 20, 20), np.float32)
    fragment_pool(x, (2, 2, 2), out=out)
    tracemalloc.start()
    fragment_pool(x, (2, 2, 2), out=out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    est = fragment_temp_bytes(x.shape, (2, 2, 2))
    assert 0.8 * est <= peak <= 1.2 * est + 64 * 1024
