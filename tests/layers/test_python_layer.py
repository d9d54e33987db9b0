"""The Python layer: a user class loaded from python_param, with pycaffe's contract."""
from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

import cct.layers.python_layer  # noqa: F401  (registers the layer even if other layer modules are unfinished)
from cct.errors import ParamError
from cct.gradient_check import check_gradient, layer_param, setup_layer
from cct.layers.registry import create_layer
from cct.proto import caffe_pb2 as pb

MODULE = "cct_test_pylayers"

SOURCE = textwrap.dedent('''
    import numpy as np
    from cct.layers.base import Layer

    class Scale(Layer):
        """top = bottom * w * factor, with a learnable per-channel w; factor from param_str."""

        def setup(self, bottom, top):
            self.seen = (self.param_str, self.phase)
            self.factor = float(self.param_str or 1)
            if not self.blobs:
                self.blobs.add_blob(bottom[0].shape[1])
                self.blobs[0].data[...] = np.arange(1, bottom[0].shape[1] + 1)

        def reshape(self, bottom, top):
            top[0].reshape(*bottom[0].shape)

        def forward(self, bottom, top):
            top[0].data[...] = bottom[0].data * self.blobs[0].data * self.factor

        def backward(self, top, propagate_down, bottom):
            self.blobs[0].diff[...] += (top[0].diff * bottom[0].data).sum(axis=0) * self.factor
            if propagate_down[0]:
                bottom[0].diff[...] = top[0].diff * self.blobs[0].data * self.factor

    class HalfSquaredDistance(Layer):
        """A user loss: sum((a - b)^2) / 2, declared a loss by loss_weight in the prototxt."""

        def setup(self, bottom, top):
            if len(bottom) != 2:
                raise Exception("Need two inputs")

        def reshape(self, bottom, top):
            top[0].reshape(1)

        def forward(self, bottom, top):
            self.d = bottom[0].data - bottom[1].data
            top[0].data[...] = (self.d ** 2).sum() / 2

        def backward(self, top, propagate_down, bottom):
            for i, sign in ((0, 1), (1, -1)):
                if propagate_down[i]:
                    bottom[i].diff[...] = sign * self.d * top[0].diff[0]

    NotALayer = dict
''')


@pytest.fixture
def pymodule(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)


def python(layer: str, param_str: str | None = None, module: str = MODULE, extra: str = "") -> str:
    ps = f' param_str: "{param_str}"' if param_str is not None else ""
    return f'type: "Python" python_param {{ module: "{module}" layer: "{layer}"{ps} }} {extra}'


def test_forward_backward_and_attributes(pymodule):
    x = np.random.default_rng(0).standard_normal((2, 3))
    run = setup_layer(python("Scale", "2.5"), [x], num_tops=1, phase=pb.TEST, dtype=np.float64)
    lay = run.layer
    assert lay.seen == ("2.5", pb.TEST)
    assert lay.type == "Python"
    assert len(lay.blobs) == 1 and lay.blobs[0].shape == (3,)
    (y,) = run.forward()
    np.testing.assert_allclose(y, x * np.array([1, 2, 3]) * 2.5)
    run.top[0].diff[...] = 1.0
    lay.backward_layer(run.top, [True], run.bottom)
    np.testing.assert_allclose(run.bottom[0].diff, np.broadcast_to([2.5, 5.0, 7.5], (2, 3)))
    np.testing.assert_allclose(lay.blobs[0].diff, x.sum(axis=0) * 2.5)


def test_gradient(pymodule):
    x = np.random.default_rng(1).standard_normal((3, 4))
    check_gradient(python("Scale", "0.5"), [x], num_tops=1)


def test_param_str_defaults_to_empty(pymodule):
    lay = create_layer(layer_param(python("Scale")))
    assert lay.param_str == "" and lay.phase == pb.TRAIN


def test_python_loss_layer_with_loss_weight(pymodule):
    a, b = np.ones((2, 3)), np.zeros((2, 3))
    run = setup_layer(python("HalfSquaredDistance", extra="loss_weight: 2"), [a, b], num_tops=1,
                      dtype=np.float64)
    assert run.top[0].diff[0] == 2.0  # the loss weight, as Caffe fills it
    run.forward()
    loss = run.layer.forward_layer(run.bottom, run.top)
    assert loss == pytest.approx(2 * 3.0)
    run.layer.backward_layer(run.top, [True, True], run.bottom)
    np.testing.assert_allclose(run.bottom[0].diff, 2 * (a - b))
    np.testing.assert_allclose(run.bottom[1].diff, -2 * (a - b))


def test_module_in_current_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != ""])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cct_test_cwd_layer.py").write_text(SOURCE)
    try:
        lay = create_layer(layer_param(python("Scale", module="cct_test_cwd_layer")))
        assert type(lay).__name__ == "Scale"
    finally:
        sys.modules.pop("cct_test_cwd_layer", None)


def test_errors(pymodule, tmp_path, monkeypatch):
    with pytest.raises(ParamError, match="python_param.module.*no_such_module_xyz"):
        create_layer(layer_param(python("Scale", module="no_such_module_xyz")))
    with pytest.raises(ParamError, match="python_param.layer.*Missing"):
        create_layer(layer_param(python("Missing")))
    with pytest.raises(ParamError, match="python_param.layer.*NotALayer.*not a Layer"):
        create_layer(layer_param(python("NotALayer")))
    with pytest.raises(ParamError, match="python_param.module"):
        create_layer(layer_param('type: "Python" python_param { layer: "Scale" }'))
    # a missing dependency of the user's module is the user's ImportError, not a parameter error
    (tmp_path / "cct_test_broken_layer.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        create_layer(layer_param(python("Scale", module="cct_test_broken_layer")))


def test_share_in_parallel_accepted(pymodule):
    text = f'type: "Python" python_param {{ module: "{MODULE}" layer: "Scale" share_in_parallel: true }}'
    run = setup_layer(text, [np.ones((1, 2))], num_tops=1)
    np.testing.assert_allclose(run.forward()[0], [[1.0, 2.0]])
