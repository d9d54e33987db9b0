"""The generated model files are their generators' output (edit the script, not the file), and ResNet-50 is
the released model's network: its layer names and layout, 53 convolutions, 25.6 M parameters."""
from __future__ import annotations

import importlib.util
import os

import pytest

import cct
from cct import native
from cct.config import settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# model -> (generator, its arguments writing to a path)
GENERATORS = {"resnet50": ("make_resnet50.py", lambda out: ["--out", out]),
              "mobilenet": ("make_mobilenet.py", lambda out: ["--out", out]),
              "inception_v3": ("make_inception_v3.py", lambda out: ["--out", out]),
              "googlenet": ("gen_googlenet.py", lambda out: [out])}


def _tool(script: str):
    spec = importlib.util.spec_from_file_location(script[:-3], os.path.join(REPO, "tools", script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", sorted(GENERATORS))
def test_model_file_is_its_generators_output(model, tmp_path):
    out = tmp_path / "deploy.prototxt"
    script, args = GENERATORS[model]
    assert _tool(script).main(args(str(out))) == 0
    with open(os.path.join(REPO, "models", model, "deploy.prototxt")) as f:
        assert out.read_text() == f.read()


def test_resnet50_is_the_released_network():
    settings.set("autotune", False)  # its shapes only (conftest restores the setting)
    net = cct.Net(os.path.join(REPO, "models", "resnet50", "deploy.prototxt"), cct.TEST)
    convs = [layer for layer in net.layers if layer.type == "Convolution"]
    assert len(convs) == 53
    assert sum(b.count for name, blobs in net.params.items() if not name.startswith("bn") for b in blobs) == 25_557_032
    for name, shape in (("pool1", (10, 64, 56, 56)), ("res2c", (10, 256, 56, 56)), ("res3d", (10, 512, 28, 28)),
                        ("res4f", (10, 1024, 14, 14)), ("res5c", (10, 2048, 7, 7)), ("prob", (10, 1000))):
        assert net.blobs[name].shape == shape, name
    assert net.bottom_names["res3a"] == ["res3a_branch1", "res3a_branch2c"]
    assert all(layer.use_global_stats for layer in net.layers if layer.type == "BatchNorm")


def test_mobilenet_is_the_papers_network():
    """MobileNet v1 (width 1.0, 224x224): Table 1's 27 convolutions, 13 of them depthwise (one input channel per
    group, run by the depthwise engine), 4.2 M parameters."""
    settings.set("autotune", False)  # its shapes only (conftest restores the setting)
    net = cct.Net(os.path.join(REPO, "models", "mobilenet", "deploy.prototxt"), cct.TEST)
    convs = [layer for layer in net.layers if layer.type == "Convolution"]
    depthwise = [layer for layer in convs if layer.layer_param.convolution_param.group > 1]
    assert len(convs) == 27 and len(depthwise) == 13
    assert all(layer.blobs[0].shape[1] == 1 for layer in depthwise)
    assert sum(b.count for name, blobs in net.params.items() if "/bn" not in name for b in blobs) == 4_231_976
    for name, shape in (("conv1", (10, 32, 112, 112)), ("conv2_2/dw", (10, 64, 56, 56)),
                        ("conv4_2/sep", (10, 512, 14, 14)), ("conv6/sep", (10, 1024, 7, 7)), ("prob", (10, 1000))):
        assert net.blobs[name].shape == shape, name
    if native.kernels() is not None:
        assert all(layer.engine.name == "depthwise" for layer in depthwise)
