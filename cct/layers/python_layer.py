"""The ``Python`` layer type: a layer implemented by a user class, with pycaffe's contract.

A net names the class with ``python_param { module: "m" layer: "C" param_str: "..." }``.  The creator
imports ``m`` (from ``sys.path``; the current directory is added, as running Caffe from the directory of
one's layer modules allows), takes its attribute ``C`` — a subclass of :class:`cct.layers.base.Layer`
(exported as ``cct.Layer`` / ``caffe.Layer``) — instantiates it with the LayerParameter, and sets
``param_str`` and ``phase`` before the framework calls ``setup``.  The user class implements
``setup / reshape / forward / backward`` on lists of Blobs (``.data``, ``.diff``, ``.reshape(*dims)``),
may create learnable blobs with ``self.blobs.add_blob(*shape)``, and takes any number of bottoms and
tops.  A Python layer is a loss when its prototxt gives ``loss_weight`` (as in Caffe).
``python_param.share_in_parallel`` is accepted and ignored.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

from cct.errors import ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb


def _ensure_cwd_on_path() -> None:
    """Let modules in the current directory be found.  ``''`` (the current directory, resolved at each
    import) goes at the end, so it never shadows an installed module."""
    if "" not in sys.path:
        sys.path.append("")


def _import(module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only a missing module *named by the prototxt* is a parameter error; a missing dependency
        # imported by the user's module propagates as it is.
        missing = e.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ParamError("python_param.module",
                             f"cannot import module '{module_name}': not found on sys.path") from e
        raise


@register("Python")
def create_python_layer(param: pb.LayerParameter) -> Layer:
    """Creator for ``type: "Python"`` (Caffe's ``GetPythonLayer``)."""
    pp = param.python_param
    if not pp.module:
        raise ParamError("python_param.module", "a Python layer needs python_param.module")
    if not pp.layer:
        raise ParamError("python_param.layer", "a Python layer needs python_param.layer")
    _ensure_cwd_on_path()
    module = _import(pp.module)
    cls = getattr(module, pp.layer, None)
    if cls is None:
        where = getattr(module, "__file__", None) or pp.module
        raise ParamError("python_param.layer", f"module '{pp.module}' ({where}) has no class '{pp.layer}'")
    if not (isinstance(cls, type) and issubclass(cls, Layer)):
        raise ParamError("python_param.layer",
                         f"'{pp.module}.{pp.layer}' is not a Layer subclass (derive it from caffe.Layer)")
    layer = cls(param)
    layer.param_str = pp.param_str  # type: ignore[attr-defined]  (pycaffe attribute)
    layer.phase = param.phase
    return layer
