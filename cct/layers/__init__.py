"""Layers: one module per family, one class per Caffe type, all registered by type string.

Importing this package imports every layer module so that :mod:`cct.layers.registry` knows them all.
"""
from cct import data as _data  # noqa: F401,E402  (data layers register themselves)
from cct.inference import mpf as _mpf  # noqa: F401,E402  (MaxPoolingFragments, used by cct infer, registers itself)
from cct.layers import (  # noqa: F401  (imported for registration)
    accuracy,
    conv,
    eltwise,
    embed,
    inner_product,
    input,
    loss,
    lrn,
    neuron,
    normalization,
    pooling,
    python_layer,
    reduction,
    scale,
    shape,
    softmax,
    spp,
)
from cct.layers.base import Layer, LossLayer
from cct.layers.registry import create_layer, layer_type_list, register

__all__ = ["Layer", "LossLayer", "create_layer", "layer_type_list", "register"]


def __getattr__(name: str):
    """pycaffe's ``caffe.layers.<Type>(...)`` (net_spec): ``cct.layers`` is this package, and a capitalised
    name that is not one of its attributes is a layer type for NetSpec."""
    if name[:1].isupper():
        from cct.net_spec import layers as _net_spec_layers

        return getattr(_net_spec_layers, name)
    raise AttributeError(f"module 'cct.layers' has no attribute '{name}'")
