"""pycaffe's ``caffe.draw``: a net as a graph — layers as coloured boxes, blobs as octagons — in Graphviz.

The graph is Caffe's: one node per layer labelled with its name and type (plus kernel, stride and pad for
convolution, deconvolution and pooling, and optionally the learning-rate multipliers), one node per blob,
an edge from each bottom blob to its layer and from the layer to each top blob (labelled with the batch
size of Data layers and the outputs of Convolution/Deconvolution/InnerProduct); in-place layers are green.
``phase`` keeps only the layers whose include/exclude rules admit that phase.

Rendering: :func:`net_to_dot` writes DOT text with no dependency at all (``draw_net_to_file`` with a
``.dot``, ``.gv`` or ``.raw`` file does the same).  Images (png, svg, pdf ...) come from Graphviz: through
pydot (the ``draw`` extra, ``pip install 'cct[draw]'``) when it is installed, as Caffe's draw does, else from
the ``dot`` program itself; without either, one line says what to install.  :func:`get_pydot_graph` needs
pydot, as in Caffe.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from cct.errors import CctError
from cct.proto import caffe_pb2

# Internal layer and blob styles (Caffe's colours).
LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
TEXT_FORMATS = ("dot", "gv", "raw")  # extensions written as DOT text, without Graphviz


def get_pooling_types_dict() -> dict[int, str]:
    """Pooling method number → name (``{0: 'MAX', 1: 'AVE', 2: 'STOCHASTIC'}``)."""
    return {v.number: name for name, v in caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR.values_by_name.items()}


def get_edge_label(layer: caffe_pb2.LayerParameter) -> str:
    """The label of a layer's edges to its tops: the batch of a Data layer, the outputs of a convolution,
    deconvolution or inner product, else the empty label ``""``."""
    if layer.type == "Data":
        return "Batch " + str(layer.data_param.batch_size)
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return '""'


def get_layer_lr_mult(layer: caffe_pb2.LayerParameter) -> tuple[float, float]:
    """The (weights, bias) learning-rate multipliers of a Convolution, Deconvolution or InnerProduct layer
    (1.0 where no ``param`` gives one); ValueError for other types or more than two ``param`` entries."""
    if layer.type not in ("Convolution", "Deconvolution", "InnerProduct"):
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    params = list(layer.param)
    if len(params) > 2:
        raise ValueError("Could not parse the learning rate multiplier")
    mults = [p.lr_mult for p in params] + [1.0] * (2 - len(params))
    return mults[0], mults[1]


def get_layer_label(layer: caffe_pb2.LayerParameter, rankdir: str, display_lrm: bool = False) -> str:
    """The layer node's label, in double quotes: name, (type), spatial parameters, lr multipliers — on
    separate lines for horizontal layouts (LR/RL), separated by spaces for vertical ones (TB/BT)."""
    separator = " " if rankdir in ("TB", "BT") else r"\n"
    parts = [layer.name]
    if layer.type == "Pooling":
        parts.append(f"({layer.type} {get_pooling_types_dict()[layer.pooling_param.pool]})")
    else:
        parts.append(f"({layer.type})")
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        if layer.type == "Pooling":
            p = layer.pooling_param
            kernel, stride, pad = p.kernel_size, p.stride, p.pad
        else:
            c = layer.convolution_param
            kernel = c.kernel_size[0] if len(c.kernel_size) else 1
            stride = c.stride[0] if len(c.stride) else 1
            pad = c.pad[0] if len(c.pad) else 0
        parts.append(separator.join([f"kernel size: {kernel}", f"stride: {stride}", f"pad: {pad}"]))
    if display_lrm and layer.type in ("Convolution", "Deconvolution", "InnerProduct"):
        lrm0, lrm1 = get_layer_lr_mult(layer)
        if lrm0 or lrm1:
            parts.append(f"lr mult: {lrm0:.1f}, {lrm1:.1f}")
    return '"%s"' % separator.join(parts)


def choose_color_by_layertype(layertype: str) -> str:
    """Red convolutions, orange pooling, purple inner products, blue otherwise."""
    return {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
            "InnerProduct": "#CC33FF"}.get(layertype, "#6495ED")


@dataclass
class Graph:
    """A drawing's content: named nodes with Graphviz attributes and labelled edges between node names."""

    name: str
    rankdir: str
    nodes: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)  # key → (node name, attributes)
    edges: list[tuple[str, str, str]] = field(default_factory=list)  # (source key, destination key, label)


def _included(layer: caffe_pb2.LayerParameter, phase: int | None) -> bool:
    """Caffe draw's phase rule: include rules admit a phase they name; exclude rules drop one they name."""
    if phase is None:
        return True
    if len(layer.include) and len(layer.exclude):
        raise ValueError("layer " + layer.name + " has both include and exclude specified.")
    included = not len(layer.include) or any(rule.phase == phase for rule in layer.include)
    return included and not any(rule.phase == phase for rule in layer.exclude)


def net_graph(caffe_net: caffe_pb2.NetParameter, rankdir: str, label_edges: bool = True, phase: int | None = None,
              display_lrm: bool = False) -> Graph:
    """The nodes and edges of ``caffe_net`` (see the module doc).  A blob node keeps the style of its last
    mention: octagons for blobs something reads, Graphviz's default for blobs only written."""
    graph = Graph(caffe_net.name or "Net", rankdir)
    for layer in caffe_net.layer:
        if not _included(layer, phase):
            continue
        key = f"{layer.name}_{layer.type}"
        in_place = len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]
        style = dict(NEURON_LAYER_STYLE) if in_place else dict(LAYER_STYLE_DEFAULT,
                                                                fillcolor=choose_color_by_layertype(layer.type))
        graph.nodes[key] = (get_layer_label(layer, rankdir, display_lrm), style)
        for bottom in layer.bottom:
            graph.nodes[bottom + "_blob"] = (bottom, dict(BLOB_STYLE))
            graph.edges.append((bottom + "_blob", key, '""'))
        for top in layer.top:
            graph.nodes[top + "_blob"] = (top, {})
            graph.edges.append((key, top + "_blob", get_edge_label(layer) if label_edges else '""'))
    return graph


def _quote(text: str) -> str:
    """A DOT identifier: kept when already a quoted string (labels carry their own quotes and ``\\n``)."""
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _attributes(attrs: dict[str, str]) -> str:
    return ", ".join(f"{k}={_quote(str(v))}" for k, v in attrs.items())


def to_dot(graph: Graph) -> str:
    """DOT text of a :class:`Graph`."""
    lines = [f"digraph {_quote(graph.name)} {{", f"rankdir={graph.rankdir};"]
    for name, attrs in graph.nodes.values():
        lines.append(f"{_quote(name)} [{_attributes(attrs)}];" if attrs else f"{_quote(name)};")
    for src, dst, label in graph.edges:
        lines.append(f"{_quote(graph.nodes[src][0])} -> {_quote(graph.nodes[dst][0])} [label={_quote(label)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def net_to_dot(caffe_net: caffe_pb2.NetParameter, rankdir: str = "LR", label_edges: bool = True,
               phase: int | None = None, display_lrm: bool = False) -> str:
    """DOT text of the net's drawing (needs neither pydot nor Graphviz)."""
    return to_dot(net_graph(caffe_net, rankdir, label_edges, phase, display_lrm))


def _pydot() -> Any:
    try:
        import pydot
    except ImportError:
        raise CctError("drawing through pydot needs it: pip install 'cct[draw]' (and Graphviz for images); "
                       "cct.draw.net_to_dot gives the DOT text without it") from None
    return pydot


def get_pydot_graph(caffe_net: caffe_pb2.NetParameter, rankdir: str, label_edges: bool = True,
                    phase: int | None = None, display_lrm: bool = False) -> Any:
    """The drawing as a ``pydot.Dot`` (needs pydot)."""
    pydot = _pydot()
    graph = net_graph(caffe_net, rankdir, label_edges, phase, display_lrm)
    dot = pydot.Dot(graph.name, graph_type="digraph", rankdir=rankdir)
    nodes = {key: pydot.Node(name, **attrs) for key, (name, attrs) in graph.nodes.items()}
    for node in nodes.values():
        dot.add_node(node)
    for src, dst, label in graph.edges:
        dot.add_edge(pydot.Edge(nodes[src], nodes[dst], label=label))
    return dot


def _has_pydot() -> bool:
    try:
        import pydot  # noqa: F401
    except ImportError:
        return False
    return True


def render_dot(text: str, ext: str) -> bytes:
    """Graphviz's ``dot -T<ext>`` of DOT ``text``; a one-line error when Graphviz is not installed."""
    program = shutil.which("dot")
    if program is None:
        raise CctError(f"drawing a .{ext} needs Graphviz's dot program (e.g. apt-get install graphviz, or "
                       "pip install 'cct[draw]' for pydot with Graphviz); a .dot file needs neither")
    done = subprocess.run([program, f"-T{ext}"], input=text.encode("utf-8"), capture_output=True, check=False)
    if done.returncode != 0:
        message = " ".join(done.stderr.decode("utf-8", "replace").split())
        raise CctError(f"dot -T{ext} failed: {message}")
    return done.stdout


def draw_net(caffe_net: caffe_pb2.NetParameter, rankdir: str, ext: str = "png", phase: int | None = None,
             display_lrm: bool = False) -> bytes:
    """The drawing encoded as ``ext`` (png, svg, pdf, ... or dot/gv/raw for DOT text)."""
    if ext in TEXT_FORMATS:
        return net_to_dot(caffe_net, rankdir, phase=phase, display_lrm=display_lrm).encode("utf-8")
    if _has_pydot():
        try:
            return get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm).create(format=ext)
        except Exception as e:  # noqa: BLE001 - pydot reports a missing or failing Graphviz in several ways
            if shutil.which("dot") is None:
                raise CctError(f"drawing a .{ext} needs Graphviz's dot program (pydot is installed, Graphviz "
                               f"is not: {' '.join(str(e).split())[:200]})") from None
            raise
    return render_dot(net_to_dot(caffe_net, rankdir, phase=phase, display_lrm=display_lrm), ext)


def draw_net_to_file(caffe_net: caffe_pb2.NetParameter, filename: str, rankdir: str = "LR",
                     phase: int | None = None, display_lrm: bool = False) -> None:
    """Write the drawing to ``filename`` in the format of its extension (``.dot``/``.gv``/``.raw``: DOT text)."""
    ext = filename[filename.rfind(".") + 1:]
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, "wb") as f:
        f.write(data)
