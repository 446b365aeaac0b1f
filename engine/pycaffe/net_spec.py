"""``caffe.net_spec``: write nets in Python and get a NetParameter (pycaffe's NetSpec).

``L.Convolution(bottom, kernel_size=3, num_output=8)`` makes a layer call (a ``Function``)
and returns its output (a ``Top``, or a tuple of them with ``ntop=``). Keyword arguments
become fields of the layer's own ``<type>_param`` message when it has such a field, else of
the LayerParameter; a dict fills a message, a list a repeated field, and a single value
given to a repeated field is a one-element list. Assigning Tops to a ``NetSpec``'s attributes
names them; ``to_proto`` emits every layer needed, in dependency order, naming the others
after their type (``Convolution1``, ...). ``P.Pooling.MAX`` reads the enum from caffe_pb2.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from engine.pb import caffe_pb2


def _layer_param_fields() -> dict[str, str]:
    """Layer type -> the LayerParameter field of its parameters, read off the schema: the
    field ``convolution_param`` holds a ``ConvolutionParameter``, so "Convolution" ->
    "convolution_param"."""
    fields = {}
    for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if f.name.endswith("_param") and f.message_type is not None:
            fields[f.message_type.name[:-len("Parameter")]] = f.name
    return fields


#: types whose parameters live in another type's message
_PARAM_FIELD = {**_layer_param_fields(), "Deconvolution": "convolution_param",
                "Im2col": "convolution_param", "LSTM": "recurrent_param", "RNN": "recurrent_param"}


def assign_proto(proto: Any, name: str, value: Any) -> None:
    """Set field ``name`` of message ``proto`` from a Python value (dicts are messages, lists
    repeated fields; a lone value of a repeated field is a list of one)."""
    field = getattr(proto, name)
    repeated = hasattr(field, "extend")
    if repeated and not isinstance(value, (list, tuple)):
        value = [value]
    if repeated:
        for item in value:
            if isinstance(item, dict):
                _fill(field.add(), item)
            else:
                field.append(item)
    elif isinstance(value, dict):
        _fill(field, value)
    else:
        setattr(proto, name, value)


def _fill(message: Any, values: dict[str, Any]) -> None:
    for k, v in values.items():
        assign_proto(message, k, v)


class Top:
    """One output of a layer call: ``fn`` made it, as its ``n``-th top."""

    def __init__(self, fn: "Function", n: int):
        self.fn = fn
        self.n = n

    def to_proto(self) -> Any:
        """A NetParameter of every layer this top needs."""
        return to_proto(self)

    def _to_proto(self, layers: "OrderedDict[Function, Any]", names: dict[Any, str],
                  autonames: Counter) -> None:
        self.fn._to_proto(layers, names, autonames)


class Function:
    """A layer call: its type, its input Tops and its parameters."""

    def __init__(self, type_name: str, inputs: tuple[Any, ...], params: dict[str, Any]):
        for i, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                raise TypeError(f"{type_name} input {i} is not a Top (type is {type(inp)})")
        self.type_name = type_name
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _autoname(self, key: Any, names: dict[Any, str], autonames: Counter) -> str:
        if key not in names:
            autonames[self.type_name] += 1
            names[key] = f"{self.type_name}{autonames[self.type_name]}"
        return names[key]

    def _layer_name(self, names: dict[Any, str], autonames: Counter) -> str:
        # a layer is named after its first top (assigned name or not)
        if self.ntop > 0:
            return self._autoname(self.tops[0], names, autonames)
        return self._autoname(self, names, autonames)

    def _to_proto(self, layers: "OrderedDict[Function, Any]", names: dict[Any, str],
                  autonames: Counter) -> None:
        if self in layers:
            return
        for inp in self.inputs:
            inp._to_proto(layers, names, autonames)
        layer = caffe_pb2.LayerParameter(type=self.type_name)
        layer.bottom.extend(layers[inp.fn].top[inp.n] for inp in self.inputs)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._autoname(t, names, autonames) for t in self.tops)
        layer.name = self._layer_name(names, autonames)
        own = _PARAM_FIELD.get(self.type_name)
        for key, value in self.params.items():
            if not key.endswith("param") and own is not None and \
                    key in getattr(layer, own).DESCRIPTOR.fields_by_name:
                assign_proto(getattr(layer, own), key, value)
            elif key in layer.DESCRIPTOR.fields_by_name:
                assign_proto(layer, key, value)
            else:
                raise AttributeError(f"layer '{layer.name}' ({self.type_name}): no parameter "
                                     f"{key!r} in {own or 'its parameters'} or LayerParameter")
        layers[self] = layer


def to_proto(*tops: Top) -> Any:
    """A NetParameter of every layer the tops need; blobs named automatically."""
    layers: "OrderedDict[Function, Any]" = OrderedDict()
    names: dict[Any, str] = {}
    autonames: Counter = Counter()
    for top in tops:
        top._to_proto(layers, names, autonames)
    return caffe_pb2.NetParameter(layer=list(layers.values()))


class NetSpec:
    """Tops assigned as attributes (``n.conv1 = L.Convolution(...)``) are named by the
    attribute; ``to_proto`` emits the layers they need in assignment order."""

    def __init__(self) -> None:
        object.__setattr__(self, "tops", OrderedDict())

    def __setattr__(self, name: str, value: Any) -> None:
        self.tops[name] = value

    def __getattr__(self, name: str) -> Any:
        if name == "tops":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    __setitem__ = __setattr__

    def __getitem__(self, name: str) -> Any:
        return self.tops[name]

    def to_proto(self) -> Any:
        names: dict[Any, str] = {v: k for k, v in self.tops.items()}
        layers: "OrderedDict[Function, Any]" = OrderedDict()
        autonames: Counter = Counter()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        return caffe_pb2.NetParameter(layer=list(layers.values()))


class Layers:
    """``L.<Type>(*bottoms, **params)``: a Top, a tuple of Tops (ntop > 1) or, with ntop=0,
    the Function itself."""

    def __getattr__(self, type_name: str) -> Any:
        if type_name.startswith("__"):
            raise AttributeError(type_name)

        def layer(*inputs: Top, **params: Any) -> Any:
            fn = Function(type_name, inputs, params)
            if fn.ntop == 0:
                return fn
            return fn.tops[0] if fn.ntop == 1 else fn.tops
        return layer


class _EnumsOf:
    def __init__(self, message: str):
        self._message = message

    def __getattr__(self, name: str) -> Any:
        return getattr(getattr(caffe_pb2, self._message + "Parameter"), name)


class Parameters:
    """``P.Pooling.MAX``: enum values of ``caffe_pb2.PoolingParameter``."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _EnumsOf(name)


layers = Layers()
params = Parameters()
