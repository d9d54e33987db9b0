"""pycaffe's net specification: write a net as Python calls, get a ``NetParameter``.

    from cct import layers as L, params as P
    n = NetSpec()
    n.data, n.label = L.Data(source="train_lmdb", backend=P.Data.LMDB, batch_size=64, ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.conv1, in_place=True)
    n.loss = L.SoftmaxWithLoss(n.conv1, n.label)
    n.to_proto()      # NetParameter, layers in dependency order

``layers.<Type>(*bottoms, **kwargs)`` gives one :class:`Top` (or a tuple of ``ntop`` Tops, or the
:class:`Function` itself when ``ntop=0``).  Layer types start with a capital letter; lower-case names are
looked up in the ``cct.layers`` package, which this object stands in for once ``cct`` exports it as
pycaffe's ``caffe.layers``.  Keyword arguments, as pycaffe routes them:

* ``ntop`` (default 1) and ``in_place`` (tops named as the bottoms) are consumed;
* a name ending in ``param`` (``param=[dict(lr_mult=1)]``, ``transform_param=...``, ``loss_param=...``)
  is assigned to that ``LayerParameter`` field;
* any other name goes into ``<x>_param`` where ``<x>`` comes from the ``<Type>Parameter`` message of the
  layer type (Convolution → ``convolution_param``, ReLU → ``relu_param``); when the type has no such message
  (Deconvolution, SoftmaxWithLoss …) or it has no such field, onto ``LayerParameter`` itself
  (``loss_weight``, ``include``, ``propagate_down``, ``name`` …).

Values: a list fills a repeated field (a list of dicts adds messages), a dict fills a sub-message, a scalar
given for a repeated field becomes a one-element list.  Names: a layer is named after its first top; tops
that no NetSpec attribute names are called ``<Type><n>`` (a counter per type, from 1, in the order the
layers are reached by the depth-first walk from the requested tops).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any, Union

from cct.errors import CctError
from cct.proto import caffe_pb2


class NetSpecError(CctError, AttributeError):
    """A keyword argument that fits no field of the layer (pycaffe lets protobuf's AttributeError out)."""


def param_name_dict() -> dict[str, str]:
    """Layer type → prefix of its ``<prefix>_param`` field, from the ``LayerParameter`` schema
    (``ReLUParameter relu_param`` → ``{'ReLU': 'relu'}``)."""
    names = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            type_name = field.message_type.name
            if type_name.endswith("Parameter"):
                names[type_name[:-len("Parameter")]] = field.name[:-len("_param")]
    return names


_param_names = param_name_dict()


def assign_proto(proto: Any, name: str, val: Any) -> None:
    """Set field ``name`` of message ``proto`` from a Python value (lists → repeated, dicts → messages).

    Raises AttributeError when ``proto`` has no field ``name`` (used for kwarg routing)."""
    field = getattr(proto, name)
    is_repeated = hasattr(field, "extend")
    if isinstance(val, tuple):
        val = list(val)
    if is_repeated and not isinstance(val, list):
        val = [val]
    if isinstance(val, list):
        if val and isinstance(val[0], dict):
            for item in val:
                sub = field.add()
                for k, v in item.items():
                    assign_proto(sub, k, v)
        else:
            field.extend(val)
    elif isinstance(val, dict):
        for k, v in val.items():
            assign_proto(field, k, v)
    else:
        setattr(proto, name, val)


_Names = dict  # Top | Function → name


class Top:
    """One output blob of a layer (output ``n`` of Function ``fn``)."""

    def __init__(self, fn: Function, n: int):
        self.fn = fn
        self.n = n

    def to_proto(self) -> caffe_pb2.NetParameter:
        """A NetParameter with every layer needed to compute this top (auto names only)."""
        return to_proto(self)

    def _update(self, params: dict[str, Any]) -> None:
        self.fn._update(params)

    def _to_proto(self, layers: OrderedDict, names: _Names, autonames: Counter) -> None:
        self.fn._to_proto(layers, names, autonames)

    def __repr__(self) -> str:
        return f"<Top {self.n} of {self.fn.type_name}>"


class Function:
    """One layer: its type, its input Tops and its keyword parameters."""

    def __init__(self, type_name: str, inputs: tuple, params: dict[str, Any]):
        self.type_name = type_name
        for index, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                raise TypeError(f"{type_name} input {index} is not a Top (type is {type(inp)})")
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _update(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def _get_top_name(self, top: Top, names: _Names, autonames: Counter) -> str:
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = f"{top.fn.type_name}{autonames[top.fn.type_name]}"
        return names[top]

    def _get_name(self, names: _Names, autonames: Counter) -> str:
        if self not in names:
            if self.ntop > 0:
                names[self] = self._get_top_name(self.tops[0], names, autonames)
            else:
                autonames[self.type_name] += 1
                names[self] = f"{self.type_name}{autonames[self.type_name]}"
        return names[self]

    def _to_proto(self, layers: OrderedDict, names: _Names, autonames: Counter) -> None:
        if self in layers:
            return
        bottom_names = []
        for inp in self.inputs:
            inp._to_proto(layers, names, autonames)
            bottom_names.append(layers[inp.fn].top[inp.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._get_top_name(top, names, autonames) for top in self.tops)
        layer.name = self._get_name(names, autonames)
        for key, value in self.params.items():
            self._assign(layer, key, value)
        layers[self] = layer

    def _assign(self, layer: caffe_pb2.LayerParameter, key: str, value: Any) -> None:
        """Route one keyword argument (see the module doc)."""
        if not key.endswith("param"):
            prefix = _param_names.get(self.type_name)
            if prefix is not None:
                sub = getattr(layer, prefix + "_param")
                if key in sub.DESCRIPTOR.fields_by_name:
                    assign_proto(sub, key, value)
                    return
        try:
            assign_proto(layer, key, value)
        except AttributeError as e:
            where = f"{_param_names[self.type_name]}_param or " if self.type_name in _param_names else ""
            raise NetSpecError(f"layer type {self.type_name}: keyword '{key}' is not a field of {where}"
                               f"LayerParameter ({e})") from None


TopLike = Union[Top, Function, tuple]


class NetSpec:
    """Named tops: assign ``n.name = top`` (or ``n['name'] = top``); :meth:`to_proto` builds every
    layer they need, naming each assigned top (and the layer whose first top it is) by its attribute."""

    def __init__(self) -> None:
        object.__setattr__(self, "tops", OrderedDict())

    def __setattr__(self, name: str, value: TopLike) -> None:
        self.tops[name] = value

    def __getattr__(self, name: str) -> TopLike:
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setitem__(self, name: str, value: TopLike) -> None:
        self.tops[name] = value

    def __getitem__(self, name: str) -> TopLike:
        return self.tops[name]

    def __delitem__(self, name: str) -> None:
        del self.tops[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tops

    def __iter__(self) -> Iterator[str]:
        return iter(self.tops)

    def keys(self) -> list[str]:
        return list(self.tops)

    def vals(self) -> list[TopLike]:
        return list(self.tops.values())

    def update(self, name: str, params: dict[str, Any]) -> None:
        """Add/replace keyword parameters of the layer producing top ``name``."""
        self.tops[name]._update(params)

    def to_proto(self) -> caffe_pb2.NetParameter:
        """NetParameter with the layers needed for every assigned top, in depth-first order."""
        names: _Names = {}
        for name, top in self.tops.items():
            # a tuple of tops (``n.x = L.Foo(ntop=2)``) names its first top; the others get auto names
            names[top[0] if isinstance(top, tuple) else top] = name
        autonames: Counter = Counter()
        layers: OrderedDict = OrderedDict()
        for top in self.tops.values():
            for item in (top if isinstance(top, tuple) else (top,)):
                item._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


def to_proto(*tops: Top) -> caffe_pb2.NetParameter:
    """NetParameter with every layer needed to compute ``tops``; all names automatic."""
    layers: OrderedDict = OrderedDict()
    autonames: Counter = Counter()
    for top in tops:
        top.fn._to_proto(layers, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


class Layers:
    """``layers.<Type>(*bottoms, **kwargs)`` → a Top, a tuple of ``ntop`` Tops, or (ntop=0) the Function."""

    def __getattr__(self, type_name: str):
        if not type_name[:1].isupper():
            raise AttributeError(f"layer types start with a capital letter: layers.{type_name}")

        def layer_fn(*args: Top, **kwargs: Any) -> TopLike:
            fn = Function(type_name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops

        layer_fn.__name__ = type_name
        return layer_fn


class _EnumValues:
    """``params.<Type>.<NAME>`` → the value of enum ``NAME`` in ``caffe_pb2.<Type>Parameter``."""

    def __init__(self, type_name: str):
        self._message = getattr(caffe_pb2, type_name + "Parameter")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._message, name)


class Parameters:
    """``params.Pooling.MAX`` == ``caffe_pb2.PoolingParameter.MAX``."""

    def __getattr__(self, type_name: str) -> _EnumValues:
        if type_name.startswith("__"):
            raise AttributeError(type_name)
        return _EnumValues(type_name)


layers = Layers()
params = Parameters()
