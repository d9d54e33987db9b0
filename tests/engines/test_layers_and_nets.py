"""Each forced lowering through the layers: float64 gradient checks, and Caffe's reference nets (1e-4), also
with 2 batch partitions and with the FFT engine."""
from __future__ import annotations

import numpy as np
import pytest

import cct
from cct.gradient_check import check_gradient, setup_layer
from tests import test_reference_nets as refnets
from tests.helpers import use_flags
from tests.reference import assert_close

GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'
LAYER_CASES = [
    ('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 pad: 1 %s }', (2, 4, 5, 4)),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_h: 3 kernel_w: 2 pad_h: 2 dilation: 2 '
     'group: 2 %s }', (2, 4, 6, 5)),
    ('type: "Convolution" convolution_param { num_output: 2 kernel_size: [2, 3, 2] pad: [1, 0, 1] %s }',
     (1, 2, 3, 4, 3)),
    ('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 stride: 2 %s }', (2, 2, 7, 7)),
    ('type: "Deconvolution" convolution_param { num_output: 3 kernel_size: 3 pad: 1 group: 1 %s }', (2, 2, 3, 4)),
    ('type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 2 group: 2 %s }', (1, 4, 3, 3)),
]


@pytest.mark.parametrize("lowering", ["1", "2", "3"])
@pytest.mark.parametrize("text,shape", LAYER_CASES, ids=[f"layer{i}" for i in range(len(LAYER_CASES))])
def test_gradient_check_with_forced_lowering(lowering, text, shape):
    use_flags(lowering, None)
    x = np.random.default_rng(5).standard_normal(shape)
    check_gradient(text % GAUSS, [x])


@pytest.mark.parametrize("lowering", ["1", "2", "3"])
def test_layer_outputs_equal_across_lowerings_float32(lowering):
    x = np.random.default_rng(6).standard_normal((3, 6, 9, 8)).astype(np.float32)
    text = f'type: "Convolution" convolution_param {{ num_output: 5 kernel_size: 3 pad: 1 group: 1 {GAUSS} }}'
    use_flags("1", None)
    base = setup_layer(text, [x])
    use_flags(lowering, None)
    other = setup_layer(text, [x])
    assert other.layer.engine.strategy == int(lowering)
    for a, b in zip(base.layer.blobs, other.layer.blobs):
        b.data[...] = a.data
    np.testing.assert_allclose(other.forward()[0], base.forward()[0], rtol=1e-4, atol=1e-5)


NET_MODES = [("1", "1"), ("2", "1"), ("3", "1"), ("auto", "2"), ("3", "2")]


def _compare(name: str, phase: int):
    """Every recorded blob, diff and parameter agrees with Caffe under the project's rule (another lowering
    sums the k² products in another order: cct.compare.tolerance says why that stays inside it)."""
    net, ref, _ = refnets._run(name, phase)
    for key in ref.files:
        kind, _, rest = key.partition("/")
        if kind == "data":
            ours = net.blobs[rest].data
        elif kind == "diff":
            ours = net.blobs[rest].diff
        elif kind in ("param", "param_diff"):
            layer, _, i = rest.rpartition("/")
            blob = net.params[layer][int(i)]
            ours = blob.data if kind == "param" else blob.diff
        else:
            continue
        assert_close(ours, ref[key], f"{name} {key}")
    return net


@pytest.mark.parametrize("lowering,partitions", NET_MODES, ids=[f"L{a}-P{b}" for a, b in NET_MODES])
@pytest.mark.parametrize("name", refnets.NETS)
def test_reference_nets_with_each_lowering(name, lowering, partitions):
    use_flags(lowering, partitions)
    _compare(name, cct.TRAIN)
    _compare(name, cct.TEST)


@pytest.mark.parametrize("name", refnets.NETS)
def test_reference_nets_with_fft_engine(name):
    """CCT_CONV_ENGINE=fft: every convolution (strided ones as their stride-1 convolution) by FFT."""
    use_flags(None, None, "fft")
    for phase in (cct.TRAIN, cct.TEST):
        net = _compare(name, phase)
        engines = [layer.engine.name for layer in net.layers if layer.type in ("Convolution", "Deconvolution")]
        assert all(e == "fft" for e in engines), engines
