"""tools/caffe_dump.py (written for real pycaffe) driven through a pycaffe-shaped shim over cct: what it
writes has the reference layout (the same names as Caffe's own reference files), round-trips through
``cct compare`` in npz and HDF5, and the tool stays Python-2-readable and free of cct."""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import cct
from cct.compare.reference import compare_with_reference, read_reference
from tests.reference import assert_close, reference_dir

TOOL = Path(__file__).resolve().parents[2] / "tools" / "caffe_dump.py"


def _load():
    spec = importlib.util.spec_from_file_location("cct_tools_caffe_dump", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


caffe_dump = _load()


class _Blob:
    """pycaffe's Blob: data, diff, reshape(*dims) — nothing else."""

    def __init__(self, blob):
        self._b = blob

    data = property(lambda self: self._b.data)
    diff = property(lambda self: self._b.diff)

    def reshape(self, *dims: int) -> None:
        assert all(isinstance(d, int) for d in dims)  # pycaffe takes positional ints only
        self._b.reshape(*dims)


class _Layer:
    def __init__(self, layer):
        self.type = layer.type


class _Net:
    """The pycaffe Net surface caffe_dump may use (a missing attribute here is one real pycaffe lacks)."""

    def __init__(self, model: str, phase: int):
        assert not isinstance(phase, str)
        self._net = cct.Net(model, phase)

    def copy_from(self, weights: str) -> None:
        self._net.copy_from(weights)

    blobs = property(lambda self: {k: _Blob(b) for k, b in self._net.blobs.items()})
    params = property(lambda self: {k: [_Blob(b) for b in v] for k, v in self._net.params.items()})
    inputs = property(lambda self: list(self._net.inputs))
    layers = property(lambda self: [_Layer(layer) for layer in self._net.layers])
    _layer_names = property(lambda self: list(self._net._layer_names))
    bottom_names = property(lambda self: self._net.bottom_names)
    top_names = property(lambda self: self._net.top_names)

    def reshape(self) -> None:
        self._net.reshape()

    def forward(self, **kwargs):
        assert not kwargs
        return self._net.forward()

    def backward(self, **kwargs):
        assert not kwargs
        return self._net.backward()


pycaffe_shim = types.SimpleNamespace(Net=_Net, TRAIN=cct.TRAIN, TEST=cct.TEST)


@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_dump_of_recorded_inputs_has_caffe_layout_and_agrees(tmp_path, phase: str) -> None:
    folder = reference_dir("nets", "lenet")
    caffe_ref = np.load(folder / ("train.npz" if phase == "TRAIN" else "test.npz"))
    inputs = {}
    for key in caffe_ref.files:
        if key.startswith("input/"):
            inputs[key[6:]] = str(tmp_path / f"{key[6:]}.npy")
            np.save(inputs[key[6:]], caffe_ref[key])
    out = tmp_path / "ref.npz"
    caffe_dump.dump(pycaffe_shim, str(folder / "net.prototxt"), [str(folder / "weights.caffemodel")], phase,
                    str(out), inputs)
    ours = read_reference(str(out))
    assert sorted(ours) == sorted(caffe_ref.files)  # exactly the names real Caffe's files have
    for key in caffe_ref.files:  # and the values Caffe computed, under the one rule
        assert_close(ours[key], caffe_ref[key], key)
    report = compare_with_reference(str(folder / "net.prototxt"), [str(folder / "weights.caffemodel")], str(out))
    assert report.ok and report.phase == (cct.TRAIN if phase == "TRAIN" else cct.TEST)


@pytest.mark.parametrize("name", ["losses", "conv3d", "batchnorm_block"])
def test_seeded_random_inputs_round_trip_through_hdf5(tmp_path, name: str) -> None:
    pytest.importorskip("h5py")
    folder = reference_dir("nets", name)
    model, weights = str(folder / "net.prototxt"), str(folder / "weights.caffemodel")
    out = tmp_path / "ref.h5"
    arrays = dict(caffe_dump.dump(pycaffe_shim, model, [weights], "TRAIN", str(out), seed=3))
    again = dict(caffe_dump.dump(pycaffe_shim, model, [weights], "TRAIN", str(tmp_path / "again.npz"), seed=3))
    for k in arrays:  # the seed decides the inputs
        np.testing.assert_array_equal(arrays[k], again[k])
    report = compare_with_reference(model, [weights], str(out))
    assert report.ok, report.first_failure.detail()
    assert all(np.isfinite(v).all() for v in arrays.values())


def test_label_inputs_are_class_indices() -> None:
    folder = reference_dir("nets", "losses")
    net = _Net(str(folder / "net.prototxt"), cct.TRAIN)
    roles = caffe_dump.input_roles(net)
    inputs = caffe_dump.random_inputs(net, 0)
    labels = [b for b, (role, _) in roles.items() if role == "label"]
    assert labels, roles
    for b in labels:
        classes = roles[b][1]
        v = inputs[b]
        assert v.dtype == np.float32 and (v == np.round(v)).all() and v.min() >= 0 and v.max() < classes


def test_tool_is_python2_syntax_and_does_not_import_cct() -> None:
    source = TOOL.read_text()
    tree = ast.parse(source, feature_version=(3, 4))  # no f-strings, annotations of variables, walrus ...
    for node in ast.walk(tree):
        assert not isinstance(node, (ast.JoinedStr, ast.AnnAssign, ast.AsyncFunctionDef)), node
        if isinstance(node, ast.FunctionDef):
            assert node.returns is None and all(a.annotation is None for a in node.args.args), node.name
            assert not node.args.kwonlyargs, node.name
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n == "cct" or n.startswith("cct.") for n in names)
    assert "from __future__ import absolute_import, division, print_function" in source


def test_command_line_with_a_caffe_module(tmp_path, monkeypatch) -> None:
    folder = reference_dir("nets", "lenet")
    fake = types.ModuleType("caffe")
    fake.Net, fake.TRAIN, fake.TEST = _Net, cct.TRAIN, cct.TEST
    fake.set_mode_cpu = lambda: None
    monkeypatch.setitem(sys.modules, "caffe", fake)
    out = tmp_path / "cli.npz"
    rc = caffe_dump.main(["-model", str(folder / "net.prototxt"), "-weights", str(folder / "weights.caffemodel"),
                          "-output", str(out), "-phase", "TEST", "-seed", "1"])
    assert rc == 0 and not any(k.startswith("diff/") for k in read_reference(str(out)))
