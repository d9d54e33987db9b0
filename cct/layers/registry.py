"""The layer registry: Caffe type string -> creator (Caffe's ``LayerRegistry``).

A creator is a layer class or a function ``(LayerParameter) -> Layer``; creator functions are where an
engine is chosen (from the layer's parameters, shapes, a plan, the environment), never the net builder.
Registering a type twice is an error; an unknown type names the known ones.
"""
from __future__ import annotations

import importlib
from typing import Callable, TypeVar, Union

from cct.errors import ParamError
from cct.proto import caffe_pb2 as pb

Creator = Callable[[pb.LayerParameter], "object"]
_registry: dict[str, Creator] = {}

T = TypeVar("T", bound=Union[type, Callable])


def register(type_name: str) -> Callable[[T], T]:
    """Decorator: register a layer class (or creator function) under Caffe type ``type_name``."""

    def deco(creator: T) -> T:
        if type_name in _registry:
            raise RuntimeError(f"layer type {type_name} registered twice")
        _registry[type_name] = creator
        return creator

    return deco


def layer_type_list() -> list[str]:
    """Registered type strings, sorted (pycaffe's ``caffe.layer_type_list()``)."""
    _load_all()
    return sorted(_registry)


def create_layer(param: pb.LayerParameter):
    """Instantiate the layer for ``param.type``."""
    _load_all()
    creator = _registry.get(param.type)
    if creator is None:
        raise ParamError("type", f"Unknown layer type: {param.type or '(empty)'} "
                                 f"(known types: {', '.join(sorted(_registry))})")
    return creator(param)


_loaded = False

# The modules whose ``@register`` decorators define the layer types, imported on the first lookup (by name:
# the registry depends on none of them; they depend on it).
LAYER_MODULES = tuple(f"cct.layers.{m}" for m in (
    "accuracy", "conv", "eltwise", "embed", "inner_product", "input", "loss", "lrn", "neuron", "normalization",
    "pooling", "python_layer", "reduction", "scale", "shape", "softmax", "spp")) + tuple(f"cct.data.{m}" for m in (
        "data_layer", "hdf5_layers", "image_data_layer", "memory_data", "window_data")) + (
    "cct.inference.mpf",)  # MaxPoolingFragments: a cct-only type in nets cct infer rewrites


def _load_all() -> None:
    """Import every layer module once so their ``@register`` decorators run."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in LAYER_MODULES:
            importlib.import_module(module)
