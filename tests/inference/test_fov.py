"""Net checks, field of view, valid patch sizes and the MPF rewrite (cct.inference.fov)."""
from __future__ import annotations

import pytest

from cct.errors import CctError
from cct.inference.fov import MPF_TYPE, analyze_net
from cct.io.prototxt import parse_net_param
from tests.inference.helpers import deploy_param


@pytest.mark.parametrize("name, fov, pooling", [("ctm_valid", 26, 4), ("ctm2d_valid", 26, 4), ("n337_w8", 85, 8),
                                                 ("n537_w8", 163, 8), ("n726_w8", 117, 4), ("n926_w8", 155, 4)])
def test_field_of_view_of_the_deploy_nets(name, fov, pooling):
    """ZNN's CTMCTMCTCT has v = 26; ZNNi's n337/n537/n726/n926 have 85, 163, 117, 155 (the digest's table)."""
    spec = analyze_net(deploy_param(name), name)
    assert spec.fov == (fov,) * spec.num_spatial
    assert spec.pooling == (pooling,) * spec.num_spatial
    assert spec.output_offset == (0,) * spec.num_spatial


def test_valid_sizes_are_v_minus_1_plus_multiples_of_the_pooling():
    spec = analyze_net(deploy_param("n337_w8"), "n337")
    mpf = (True, True, True)
    for j in (1, 2, 5):
        n = spec.run_input(mpf, (j,) * 3)
        assert n == (84 + 8 * j,) * 3  # n337: 92, 100, 108, ... (the digest's erratum)
        assert spec.output_size(mpf, n) == (j,) * 3
    with pytest.raises(CctError, match=r"pool1.*\+ 1 is not a multiple"):
        spec.output_size(mpf, (93, 92, 92))
    plain = (False, False, False)
    assert spec.run_input(plain, (3, 3, 3)) == (85 + 16,) * 3
    assert spec.output_size(plain, (101, 101, 101)) == (3, 3, 3)
    with pytest.raises(CctError, match="pool1.*not a multiple"):
        spec.output_size(plain, (100, 101, 101))
    assert spec.fragments(mpf) == 512 and spec.fragments((True, False, True)) == 64
    assert len(spec.shifts((True, False, True))) == 8
    assert spec.shifts((False, True, True))[1] == (0, 0, 1)
    assert spec.shifts((True, False, True))[-1] == (2, 2, 2)  # pool2's offsets scaled by pool1's kernel


def test_rewrite_turns_pooling_into_fragments():
    spec = analyze_net(deploy_param("ctm_valid"), "ctm")
    layers = spec.rewrite((True, False), 2, (30, 29, 31))
    assert [lp.type for lp in layers if "pool" in lp.name] == [MPF_TYPE, "Pooling"]
    assert tuple(layers[0].input_param.shape[0].dim) == (2, 1, 30, 29, 31)


NET = """
name: "t"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 20 dim: 20 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" convolution_param { num_output: 2 kernel_size: 3 %s } }
layer { name: "p1" type: "Pooling" bottom: "c1" top: "p1" pooling_param { pool: MAX kernel_size: 2 stride: 2 %s } }
%s
"""


def _net(conv: str = "", pool: str = "", extra: str = ""):
    return analyze_net(parse_net_param(NET % (conv, pool, extra)), "t.prototxt")


@pytest.mark.parametrize("conv, pool, extra, message", [
    ("pad: 1", "", "", "layer 'c1' (Convolution): padded convolution"),
    ("stride: 2", "", "", "layer 'c1' (Convolution): strided convolution"),
    ("", "", 'layer { name: "fc" type: "InnerProduct" bottom: "p1" top: "fc" inner_product_param { num_output: 2 } }',
     "layer 'fc' (InnerProduct): not supported by sliding-window inference"),
    ("", "pad: 1", "", "layer 'p1' (Pooling): padded pooling"),
    ("", "", 'layer { name: "p2" type: "Pooling" bottom: "p1" top: "p2" pooling_param { pool: MAX kernel_size: 3 '
     'stride: 2 } }', "layer 'p2' (Pooling): stride 2x2 != kernel 3x3"),
    ("", "", 'layer { name: "bn" type: "BatchNorm" bottom: "p1" top: "bn" batch_norm_param { use_global_stats: '
     'false } }', "layer 'bn' (BatchNorm): use_global_stats: false"),
    ("", "", 'layer { name: "cat" type: "Concat" bottom: "p1" bottom: "p1" top: "cat" concat_param { axis: 0 } }',
     "layer 'cat' (Concat): concatenates along axis 0"),
    ("", "", 'layer { name: "e" type: "Eltwise" bottom: "p1" bottom: "c1" top: "e" }',
     "layer 'e' (Eltwise): combines blobs that come through different pooling layers"),
    ("", "", 'layer { name: "sm" type: "Softmax" bottom: "p1" top: "sm" softmax_param { axis: 2 } }',
     "layer 'sm' (Softmax): softmax over axis 2"),
    ("", "", 'layer { name: "r" type: "ReLU" bottom: "c1" top: "r" }', "one output blob (this one has 2: p1, r)"),
])
def test_unsupported_nets_are_one_line_errors_naming_the_layer(conv, pool, extra, message):
    with pytest.raises(CctError) as e:
        _net(conv, pool, extra)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("t.prototxt")


def test_branches_crop_and_eltwise_geometry():
    """A skip branch cropped to the main branch: the window union and the crop's offset set the FOV."""
    extra = """
layer { name: "c2" type: "Convolution" bottom: "p1" top: "c2" convolution_param { num_output: 2 kernel_size: 5 } }
layer { name: "c3" type: "Convolution" bottom: "p1" top: "c3" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "crop" type: "Crop" bottom: "c3" bottom: "c2" top: "crop" crop_param { axis: 2 offset: 2 } }
layer { name: "sum" type: "Eltwise" bottom: "c2" bottom: "crop" top: "sum" }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "c2" top: "cat" }
"""
    spec = _net(extra=extra)
    # c1: extent 3; p1: 4, scale 2; c2: 4 + 4*2 = 12; c3 then crop by 2 at scale 2: offset 4, extent 4 <= 12
    assert spec.fov == (12, 12)
    assert spec.out_channels == 4
    assert spec.run_input((True,), (1, 2)) == (13, 15)  # F - 1 + P*J
    shapes = spec.shapes((True,), 1, (13, 15))
    assert shapes["cat"].spatial == (1, 2) and shapes["cat"].batch == 4 and shapes["cat"].channels == 4


def test_first_layer_must_be_the_input():
    with pytest.raises(CctError, match="one Input layer"):
        analyze_net(parse_net_param('layer { name: "c" type: "Convolution" bottom: "x" top: "c" }'), "n")
