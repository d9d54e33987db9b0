"""FLOP counts (cct.bench.flops) against hand formulas: a small net layer by layer, what the backward counts
depending on which gradients the net computes, and CaffeNet/GoogLeNet per image against their published
multiply-add counts."""
from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

import cct
from cct.bench.flops import count_net
from cct.config import settings
from cct.proto import caffe_pb2 as pb

MODELS = Path(__file__).resolve().parents[2] / "models"
NET = """
name: "small"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 4 dim: 3 dim: 16 dim: 16 }} }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param {{ num_output: 8 kernel_size: 3 group: 1 }} }}
layer {{ name: "gconv" type: "Convolution" bottom: "conv" top: "gconv"
        convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2 bias_term: false }} }}
layer {{ name: "relu" type: "ReLU" bottom: "gconv" top: "gconv" }}
layer {{ name: "pool" type: "Pooling" bottom: "gconv" top: "pool"
        pooling_param {{ pool: {pool} kernel_size: 3 stride: 2 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param {{ num_output: 5 }} }}
layer {{ name: "deconv" type: "Deconvolution" bottom: "conv" top: "up"
        convolution_param {{ num_output: 2 kernel_size: 4 stride: 2 }} }}
{loss}
"""
LOSS = """layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }"""


def _net(phase: int, pool: str = "MAX", loss: str = "", force_backward: bool = False):
    param = text_format.Parse(NET.format(pool=pool, loss=loss), pb.NetParameter())
    param.force_backward = force_backward
    return cct.Net(param, phase)


def _layers(net) -> dict:
    return {lf.name: lf for lf in count_net(net).layers}


def test_forward_by_hand() -> None:
    layers = _layers(_net(cct.TEST))
    # conv: 8 x 14 x 14 outputs per image, 3·3·3 products each, + a bias add; batch 4
    assert layers["conv"].forward == 4 * 8 * 14 * 14 * (2 * 27 + 1)
    # gconv: groups of 4 input channels → 2 outputs; 4 x 7 x 7 outputs, 4·3·3 products, no bias
    assert layers["gconv"].forward == 4 * 4 * 7 * 7 * 2 * 36
    assert layers["relu"].forward == 4 * 4 * 7 * 7
    assert layers["pool"].forward == 4 * 4 * 3 * 3 * 9  # ceil((7-3)/2)+1 = 3 outputs a side, 9 per window
    assert layers["ip"].forward == 4 * 5 * (2 * 36 + 1)
    # deconv: each of 8 x 14 x 14 inputs spreads 2·4·4 products; 2 x 30 x 30 bias adds
    assert layers["deconv"].forward == 4 * (8 * 14 * 14 * 2 * 32 + 2 * 30 * 30)
    assert layers["data"].forward == 0


def test_backward_counts_only_computed_gradients() -> None:
    # no loss: Caffe's time loop computes weight gradients (the params learn) but no data gradients
    layers = _layers(_net(cct.TRAIN))
    assert layers["conv"].backward == 4 * 8 * 14 * 14 * (2 * 27 + 1)  # weights + bias, no data gradient
    assert layers["relu"].backward == 0 and layers["pool"].backward == 0
    # with a loss, gradients flow down to conv's output (conv's bottom is the input: no data gradient)
    layers = _layers(_net(cct.TRAIN, loss=LOSS))
    assert layers["gconv"].backward == 2 * layers["gconv"].forward  # weights + data, no bias
    assert layers["conv"].backward == 4 * 8 * 14 * 14 * (2 * 27 + 1)
    assert layers["pool"].backward == 4 * 4 * 3 * 3  # MAX: one per output
    assert layers["ip"].backward == 4 * 5 * (2 * 36 + 1) + 4 * 5 * 2 * 36
    # force_backward: the input gets its gradient too
    layers = _layers(_net(cct.TRAIN, loss=LOSS, force_backward=True))
    assert layers["conv"].backward == 4 * 8 * 14 * 14 * (2 * 27 + 1 + 2 * 27)


def test_average_pooling_backward_spreads_over_the_window() -> None:
    layers = _layers(_net(cct.TRAIN, pool="AVE", loss=LOSS))
    assert layers["pool"].backward == layers["pool"].forward


def test_per_image_and_phases() -> None:
    flops = count_net(_net(cct.TRAIN, loss=LOSS))
    assert flops.batch == 4
    assert flops.per_image(train=False) == flops.forward / 4
    assert flops.per_image(train=True) == (flops.forward + flops.backward) / 4
    assert flops.uncounted == []
    products = [lf for lf in flops.layers if lf.type in ("Convolution", "Deconvolution", "InnerProduct")]
    assert products and flops.products() == sum(lf.forward + lf.backward for lf in products)
    assert flops.products() < flops.forward + flops.backward  # pooling, ReLU and the loss are not products


@pytest.fixture
def lowering_engine():
    settings.set("conv_engine", "lowering", "test")  # no engine measurements: only shapes matter here
    settings.set("lowering", 1, "test")


# multiply-adds per image (conv: C_out·H_out·W_out·(C_in/g)·k², fc: inputs·outputs)
CAFFENET_MACS = (96 * 55 * 55 * 3 * 121 + 256 * 27 * 27 * 48 * 25 + 384 * 13 * 13 * 256 * 9 + 384 * 13 * 13 * 192 * 9
                 + 256 * 13 * 13 * 192 * 9 + 9216 * 4096 + 4096 * 4096 + 4096 * 1000)


def test_caffenet_forward_is_its_multiply_adds(lowering_engine) -> None:
    net = cct.Net(str(MODELS / "caffenet" / "deploy.prototxt"), cct.TEST)
    flops = count_net(net)
    gemm = sum(lf.forward for lf in flops.layers if lf.type in ("Convolution", "InnerProduct"))
    biases = 96 * 55 * 55 + 256 * 27 * 27 + 384 * 13 * 13 * 2 + 256 * 13 * 13 + 4096 * 2 + 1000
    assert gemm / flops.batch == 2 * CAFFENET_MACS + biases  # 1.449 GFLOP
    assert flops.per_image(False) == pytest.approx(2 * CAFFENET_MACS, rel=0.005)
    assert flops.uncounted == []


def test_googlenet_is_about_1_6_g_multiply_adds(lowering_engine) -> None:
    net = cct.Net(str(MODELS / "googlenet" / "deploy.prototxt"), cct.TEST)
    flops = count_net(net)
    assert 1.55e9 < flops.per_image(False) / 2 < 1.65e9  # the paper's "1.5 billion multiply-adds", plus LRN etc.
    assert flops.uncounted == []
