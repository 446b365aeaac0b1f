"""``caffe.draw``: a picture of a NetParameter (layers as boxes, blobs as octagons) via pydot.

pydot is an optional extra (``pip install -e '.[draw]' in Poseidon's checkout``); rendering to an image also
needs Graphviz's ``dot`` program. ``get_pydot_graph`` builds the graph without either being
run; ``draw_net`` renders it (PNG bytes by default), ``draw_net_to_file`` writes it in the
format its suffix names (``.raw`` for the dot source).
"""
from __future__ import annotations

from typing import Any

try:
    import pydot
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError("caffe.draw needs pydot: pip install -e '.[draw]' in Poseidon's "
                      "checkout (or pip install pydot), and Graphviz's dot to render images "
                      "(apt-get install graphviz)") from None

from engine.pb import caffe_pb2

LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
_COLORS = {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
           "InnerProduct": "#CC33FF"}
_LEARNING = ("Convolution", "Deconvolution", "InnerProduct")


def get_pooling_types_dict() -> dict[int, str]:
    """PoolMethod number -> name (0 -> "MAX", ...)."""
    return {v.number: name for name, v in
            caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR.values_by_name.items()}


def get_edge_label(layer: Any) -> str:
    """What an edge out of ``layer`` says: the batch size of a Data layer, the outputs of a
    learning layer."""
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return '""'


def get_layer_lr_mult(layer: Any) -> tuple[float, float]:
    """(weight, bias) learning-rate multipliers of a Convolution/Deconvolution/InnerProduct."""
    if layer.type not in _LEARNING:
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    if len(layer.param) > 2:
        raise ValueError("Could not parse the learning rate multiplier")
    mults = [p.lr_mult for p in layer.param] + [1.0] * (2 - len(layer.param))
    return mults[0], mults[1]


def _spatial(layer: Any) -> tuple[int, int, int]:
    """(kernel size, stride, pad) as drawn: the first of each, Caffe's defaults when unset."""
    if layer.type == "Pooling":
        p = layer.pooling_param
        return p.kernel_size, p.stride, p.pad
    p = layer.convolution_param

    def first(values: Any, default: int) -> int:
        return values[0] if len(values) else default
    return first(p.kernel_size, 1), first(p.stride, 1), first(p.pad, 0)


def get_layer_label(layer: Any, rankdir: str, display_lrm: bool = False) -> str:
    """The text of a layer's box: name, type, spatial parameters, lr multipliers."""
    sep = " " if rankdir in ("TB", "BT") else r"\n"  # a vertical graph has room across
    kind = layer.type
    if kind == "Pooling":
        kind = f"{kind} {get_pooling_types_dict()[layer.pooling_param.pool]}"
    parts = [layer.name, f"({kind})"]
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        kernel, stride, pad = _spatial(layer)
        parts.append(sep.join([f"kernel size: {kernel}", f"stride: {stride}", f"pad: {pad}"]))
    if display_lrm and layer.type in _LEARNING:
        w, b = get_layer_lr_mult(layer)
        if w or b:
            parts.append(f"lr mult: {w:.1f}, {b:.1f}")
    return '"' + sep.join(parts) + '"'  # quoted: colons would not parse otherwise


def choose_color_by_layertype(layertype: str) -> str:
    return _COLORS.get(layertype, LAYER_STYLE_DEFAULT["fillcolor"])


def _included(layer: Any, phase: int | None) -> bool:
    if phase is None:
        return True
    if len(layer.include) and len(layer.exclude):
        raise ValueError(f"layer {layer.name} has both include and exclude specified.")
    if len(layer.include):
        return any(rule.phase == phase for rule in layer.include)
    return not any(rule.phase == phase for rule in layer.exclude)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', r'\"') + '"'


def get_pydot_graph(caffe_net: Any, rankdir: str, label_edges: bool = True,
                    phase: int | None = None, display_lrm: bool = False) -> Any:
    """A pydot.Dot of the net's layers (of ``phase`` only, when given) and blobs."""
    graph = pydot.Dot(_quoted(caffe_net.name or "Net"), graph_type="digraph", rankdir=rankdir)
    nodes: dict[str, Any] = {}
    edges: list[tuple[str, str, str]] = []
    for layer in caffe_net.layer:
        if not _included(layer, phase):
            continue
        node = _quoted(f"{layer.name}_{layer.type}")
        in_place = len(layer.bottom) == 1 and list(layer.bottom) == list(layer.top)
        style = NEURON_LAYER_STYLE if in_place else \
            {**LAYER_STYLE_DEFAULT, "fillcolor": choose_color_by_layertype(layer.type)}
        nodes[node] = pydot.Node(node, label=get_layer_label(layer, rankdir, display_lrm),
                                 **style)
        for blob in layer.bottom:
            name = _quoted(blob + "_blob")
            nodes[name] = pydot.Node(name, label=_quoted(blob), **BLOB_STYLE)
            edges.append((name, node, '""'))
        for blob in layer.top:
            name = _quoted(blob + "_blob")
            nodes[name] = pydot.Node(name, label=_quoted(blob))
            edges.append((node, name, get_edge_label(layer) if label_edges else '""'))
    for node in nodes.values():
        graph.add_node(node)
    for src, dst, label in edges:
        graph.add_edge(pydot.Edge(src, dst, label=label))
    return graph


def draw_net(caffe_net: Any, rankdir: str, ext: str = "png", phase: int | None = None,
             display_lrm: bool = False) -> bytes:
    """The net drawn by Graphviz in format ``ext`` (bytes)."""
    return get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm
                           ).create(format=ext)


def draw_net_to_file(caffe_net: Any, filename: str, rankdir: str = "LR",
                     phase: int | None = None, display_lrm: bool = False) -> None:
    """Write the drawing in the format the file's suffix names."""
    ext = filename[filename.rfind(".") + 1:]
    with open(filename, "wb") as f:
        f.write(draw_net(caffe_net, rankdir, ext, phase, display_lrm))
