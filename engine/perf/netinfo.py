"""What the performance model needs to know of a net, without training it.

The training net is built by the real engine (``engine.net.Net``) inside ``blob.shapes_only``:
no blob holds memory (each array is one value under its shape) and no filler runs, so
VGG-19-22K's 229M parameters and GoogLeNet's activations at batch 256 cost no RAM, and every shape (Split layers, in-place layers,
InnerProduct's input width) is exactly what training would see. The layers that synchronise,
and which of them can hand out sufficient factors, come from the communicator's own adapter
(``engine.comm.bind.describe_net``), so the simulator prices the plan the planner really makes.

Data layers need data to know their shapes; they are replaced by Input layers of the same
tops: the batch from the layer (or the caller), the image shape from ``input_shape``, else from
the layer's database when it exists, else from ``crop_size`` with as many channels as
``mean_value`` entries (3 when none), else the shape of the public set the source names
(MNIST, CIFAR, digits), said in a warning line.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from engine.comm.cost import LayerInfo
from engine.pb import caffe_pb2

_log = logging.getLogger(__name__)

DATA_TYPES = {"Data": "data_param", "ImageData": "image_data_param",
              "HDF5Data": "hdf5_data_param", "WindowData": "window_data_param",
              "MemoryData": "memory_data_param"}


class NetInfoError(ValueError):
    """A net whose shapes cannot be known; the message names the file and the layer."""


@dataclass(frozen=True)
class LayerFacts:
    """One layer of the training net, in forward order."""
    index: int
    name: str
    type: str
    #: bytes of its output blobs (a memory-bound layer's cost grows with them)
    top_bytes: int
    #: bytes of its input blobs
    bottom_bytes: int
    #: multiply-accumulates of one forward pass (convolutions and inner products; 0 otherwise)
    macs: int


@dataclass
class NetInfo:
    name: str
    batch: int
    layers: list[LayerFacts]
    #: the layers with learnable parameters, as the planner sees them
    params: list[LayerInfo]

    @property
    def total_params(self) -> int:
        return sum(i.params for i in self.params)

    def by_name(self) -> dict[str, LayerFacts]:
        return {l.name: l for l in self.layers}


def read_train_net(path: str | Path) -> caffe_pb2.NetParameter:
    """A net prototxt, or the training net a solver prototxt names."""
    from engine.caffe_io import FormatError, read_net_prototxt, read_solver_prototxt

    p = Path(path)
    if not p.is_file():
        raise NetInfoError(f"net file {p} not found")
    try:
        return read_net_prototxt(p)
    except FormatError as net_error:
        try:
            solver = read_solver_prototxt(p)
        except FormatError:
            raise NetInfoError(str(net_error)) from None
    if solver.HasField("train_net_param") or solver.HasField("net_param"):
        return solver.train_net_param if solver.HasField("train_net_param") else solver.net_param
    name = solver.train_net or solver.net
    if not name:
        raise NetInfoError(f"{p}: the solver names no net")
    for base in (p.parent, Path.cwd()):
        if (base / name).is_file():
            return read_net_prototxt(base / name)
    raise NetInfoError(f"{p}: its net {name} is found neither beside it nor here")


def _image_shape(layer: Any, where: Path | None, input_shape: Sequence[int] | None) -> list[int]:
    if input_shape:
        return list(input_shape)
    tp = layer.transform_param
    field = DATA_TYPES[layer.type]
    sub = getattr(layer, field)
    source = getattr(sub, "source", "")
    # a relative path: against the folder of the file naming it, then the working directory
    bases = [b for b in (where, Path.cwd()) if b is not None]
    db = next((b / source for b in bases if source and (b / source).exists()), None)
    if db is not None and layer.type == "Data":
        from engine.data.datum import datum_to_array, parse_datum
        from engine.data.lmdb_source import open_db
        src = open_db(db, caffe_pb2.DataParameter.DB.Name(sub.backend))
        try:
            _, value = src.get(0)
        finally:
            src.close()
        c, h, w = datum_to_array(parse_datum(value)).shape
        crop = tp.crop_size
        return [c, crop, crop] if crop else [c, h, w]
    if tp.crop_size:
        return [len(tp.mean_value) or 3, tp.crop_size, tp.crop_size]
    known = next((shape for name, shape in KNOWN_SHAPES if name in source.lower()), None)
    if known:
        # a shape is all a synthetic pass needs, and the set's name is a safer guess than a
        # refusal; the line says so, and how to overrule it
        _log.warning("layer '%s' (%s): its database %s is not here to read the image shape "
                     "from; taking %s, the shape of the set its source names (--input-shape "
                     "C,H,W to say otherwise)", layer.name, layer.type, source, known)
        return [int(d) for d in known.split(",")]
    raise NetInfoError(f"layer '{layer.name}' ({layer.type}): its image shape is unknown (no "
                       f"crop_size, and its database {source or '(none)'} is not here to read "
                       f"one from): give the input shape, e.g. --input-shape 3,224,224 "
                       f"(channels, height, width)")


#: the image shape of a public set a source's name names (--input-shape's hint)
KNOWN_SHAPES = (("mnist", "1,28,28"), ("cifar", "3,32,32"), ("digits", "1,8,8"))


def with_inputs(net: caffe_pb2.NetParameter, batch: int | None = None,
                input_shape: Sequence[int] | None = None,
                where: Path | None = None) -> tuple[caffe_pb2.NetParameter, int]:
    """The TRAIN-phase net with each data layer replaced by an Input layer; (net, batch)."""
    from engine.net_param import filter_net

    state = caffe_pb2.NetState(phase=caffe_pb2.TRAIN)
    out = filter_net(net, state)
    found = None
    for i, layer in enumerate(out.layer):
        if layer.type not in DATA_TYPES:
            continue
        sub = getattr(layer, DATA_TYPES[layer.type])
        b = batch or getattr(sub, "batch_size", 0)
        if not b:
            raise NetInfoError(f"layer '{layer.name}' ({layer.type}): no batch_size")
        shapes = [[b, *_image_shape(layer, where, input_shape)], [b]][:len(layer.top)]
        repl = caffe_pb2.LayerParameter(name=layer.name, type="Input", top=layer.top)
        for s in shapes:
            repl.input_param.shape.add().dim.extend(s)
        out.layer[i].CopyFrom(repl)
        found = found or b
    if found is None:
        for layer in out.layer:
            if layer.type == "Input" and layer.input_param.shape:
                found = layer.input_param.shape[0].dim[0]
                if batch:  # the caller's batch replaces the net's
                    for s in layer.input_param.shape:
                        s.dim[0] = batch
                    found = batch
                break
    if found is None:
        raise NetInfoError(f"net '{net.name}' has no data or Input layer: its batch is unknown")
    return out, int(found)


def net_info(model: str | Path | caffe_pb2.NetParameter, batch: int | None = None,
             input_shape: Sequence[int] | None = None) -> NetInfo:
    """The facts of ``model``'s training net (a net or solver prototxt, or a NetParameter)."""
    from engine.blob import shapes_only
    from engine.comm.bind import describe_net
    from engine.layers import LayerError
    from engine.net import Net, NetError

    where = None
    if isinstance(model, caffe_pb2.NetParameter):
        param = model
    else:
        param = read_train_net(model)
        where = Path(model).parent
    param, b = with_inputs(param, batch, input_shape, where)
    try:
        with shapes_only():
            net = Net(param, phase="TRAIN")
    except (NetError, LayerError) as e:
        raise NetInfoError(str(e)) from None
    _, infos = describe_net(net)
    return facts_of(net, infos, b)


def facts_of(net: Any, infos: list[LayerInfo], batch: int | None = None) -> NetInfo:
    """The facts of a built engine Net (``infos``: its describe_net LayerInfos)."""
    layers = []
    for i, (name, layer) in enumerate(zip(net.layer_names, net.layers)):
        tops, bottoms = net.top_vecs[i], net.bottom_vecs[i]
        layers.append(LayerFacts(i, name, layer.type,
                                 sum(t.count * t.data.itemsize for t in tops),
                                 sum(x.count * x.data.itemsize for x in bottoms),
                                 _macs(layer, bottoms, tops)))
    if batch is None:
        first = next(iter(net.blobs.values()), None)
        batch = int(first.shape[0]) if first is not None and first.shape else 1
    return NetInfo(net.name, batch, layers, infos)


def _macs(layer: Any, bottom: Sequence[Any], top: Sequence[Any]) -> int:
    """Multiply-accumulates of one forward pass of a convolution or inner product."""
    if not layer.blobs or layer.type not in ("Convolution", "Deconvolution", "InnerProduct"):
        return 0
    w = layer.blobs[0]
    if layer.type == "Convolution":  # each output: in/group x kernel products
        return int(top[0].count * (w.count // w.shape[0]))
    if layer.type == "Deconvolution":  # each input: out/group x kernel products
        return int(bottom[0].count * (w.count // w.shape[0]))
    fan_in = w.shape[0] if layer.param.inner_product_param.transpose else w.shape[1]
    return int(bottom[0].count // fan_in * w.count)  # K rows x (M x N)
