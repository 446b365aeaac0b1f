"""Weights in and out of an engine Net: `copy_weights_into` (Caffe's CopyTrainedLayersFrom),
`net_to_proto` (Net::ToProto) and `save_net` / `save_weights` (a Net's snapshot).

The Net is duck-typed (name, layers, layer_names) so that this package never imports
engine.net, which imports it.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import numpy as np

from ..pb import caffe_pb2
from .blobs import array_to_blob, blob_shape, blob_to_array, shape_matches
from .files import FormatError, PathLike, format_by_name, weights_format
from .upgrade import upgrade_net
from .weights import (
    LayerWeights,
    read_net_binary,
    read_weights,
    write_net_binary,
    write_net_hdf5,
)

log = logging.getLogger(__name__)


def _fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def copy_weights_into(net: Any, source: PathLike | LayerWeights | caffe_pb2.NetParameter,
                      where: str | None = None) -> list[str]:
    """Copy parameters into `net` by layer name (Caffe's CopyTrainedLayersFrom).

    `source` is a weights file, a NetParameter, or a LayerWeights list. Source layers the net
    lacks are ignored (logged); for the others the blob count and every shape must match,
    except that a legacy 4-D blob matches any shape Caffe's ShapeEquals accepts. Returns the
    names of the layers copied. ``where`` names the source in errors (default: its path).
    """
    from ..backend import get_array_module

    where = where or (str(source) if isinstance(source, (str, os.PathLike)) else "weights")
    items = [(name, blobs) for name, _, blobs in _layers_of(source, where)]

    # The first layer of a name wins, as in Caffe's lookup.
    targets: dict[str, Any] = {}
    for layer_name, layer in zip(net.layer_names, net.layers):
        targets.setdefault(layer_name, layer)

    copied, ignored = [], []
    for name, blobs in items:
        layer = targets.get(name)
        if layer is None:
            ignored.append(name)
            continue
        target_blobs = layer.blobs
        if len(target_blobs) != len(blobs):
            raise FormatError(f"{where}: layer '{name}': {len(blobs)} parameter blobs in the "
                              f"file, the net's layer has {len(target_blobs)}")
        for j, (target, src) in enumerate(zip(target_blobs, blobs)):
            if isinstance(src, caffe_pb2.BlobProto):
                ok = shape_matches(target.shape, src)
                src_shape = blob_shape(src)
                array = blob_to_array(src, where=f"{where}: layer '{name}' blob {j}")
            else:
                array = np.asarray(src)
                src_shape = array.shape
                ok = tuple(src_shape) == tuple(target.shape)
            if not ok:
                raise FormatError(
                    f"{where}: layer '{name}' blob {j}: shape mismatch: file has "
                    f"{_fmt_shape(src_shape)}, the net expects {_fmt_shape(target.shape)} "
                    "(rename the layer to learn it from scratch)")
            xp = get_array_module(target.data)
            target.data[...] = xp.asarray(array.reshape(target.shape), dtype=target.data.dtype)
        copied.append(name)
    # Said only once the copy succeeded, so that a bad file's error stays the one line printed.
    for name in ignored:
        log.info("Ignoring source layer %s", name)
    return copied


def _layers_of(source: PathLike | LayerWeights | caffe_pb2.NetParameter, where: str
               ) -> list[tuple[str, str, list[Any]]]:
    """(name, type, blobs) of every layer of a weights file, NetParameter or LayerWeights: the
    blobs as BlobProtos (of a caffemodel, whose legacy shapes copy by Caffe's rule) or arrays."""
    if isinstance(source, (str, os.PathLike)):
        source = read_net_binary(source) if weights_format(source) == "binary" else \
            read_weights(source)
    if isinstance(source, caffe_pb2.NetParameter):
        if len(source.layers):
            source = caffe_pb2.NetParameter.FromString(source.SerializeToString())
            upgrade_net(source, where)
        return [(l.name, l.type, list(l.blobs)) for l in source.layer]
    return [(name, layer_type, list(arrays)) for name, layer_type, arrays in source]


def load_trained_weights(nets: Sequence[Any], path: PathLike) -> list[str]:
    """Caffe's -weights: copy ``path``'s layers into each of ``nets`` by name (the first is the
    one they are checked against: a solver's train net). A file that has none of its layers
    with weights is an error naming the first layer with weights of each (the weights of
    another net would otherwise leave every layer as its filler made it, silently); a file
    that misses some is one warning naming them. Returns the layers copied."""
    layers = _layers_of(path, str(path))
    net = nets[0]
    learnable = list(dict.fromkeys(name for name, layer in zip(net.layer_names, net.layers)
                                   if layer.blobs))
    in_file = {name for name, _, blobs in layers if blobs}
    missing = [name for name in learnable if name not in in_file]
    if learnable and len(missing) == len(learnable):  # before anything is copied or logged
        theirs = next(((n, t) for n, t, blobs in layers if blobs), None)
        mine = next(layer for layer in net.layers if layer.blobs)
        first = f"'{theirs[0]}' ({theirs[1] or 'type not stored'})" if theirs else "none"
        raise FormatError(f"{path}: no layer with weights in common with net '{net.name}': the "
                          f"file's first layer with weights is {first}, the net's is "
                          f"'{mine.name}' ({mine.param.type}); the weights of another net?")
    copied = copy_weights_into(net, layers, str(path))
    if missing:
        log.warning("%s: copied %d of the %d layers with weights of net '%s'; not in the file, "
                    "so left as their fillers made them: %s", path, len(learnable) - len(missing),
                    len(learnable), net.name, ", ".join(missing))
    for other in nets[1:]:
        copy_weights_into(other, layers, str(path))
    return copied


def net_to_proto(net: Any, write_diff: bool = False) -> caffe_pb2.NetParameter:
    """A NetParameter of the net's layers (their parameters as built) with their blobs, as
    Caffe's Net::ToProto writes a .caffemodel."""
    out = caffe_pb2.NetParameter(name=net.name or "")
    for layer in net.layers:
        lp = out.layer.add()
        lp.CopyFrom(layer.param)
        lp.ClearField("blobs")
        if not lp.HasField("phase"):
            lp.phase = caffe_pb2.Phase.Value(str(layer.phase))
        for blob in layer.blobs:
            lp.blobs.add().CopyFrom(array_to_blob(blob.data, blob.diff if write_diff else None))
    return out


def save_net(net: Any, path: PathLike, write_diff: bool = False, fmt: str | None = None) -> None:
    """Snapshot a Net's weights: Caffe's HDF5 layout for *.h5, else a binary .caffemodel;
    ``fmt`` ("hdf5" or "binary") decides instead of the name (pycaffe's save_hdf5)."""
    if (fmt or format_by_name(path)) == "hdf5":
        from ..backend import to_numpy

        written: set[str] = set()
        weights: LayerWeights = []
        diffs: list[list[np.ndarray]] = []
        for layer in net.layers:
            if layer.name in written:
                continue
            written.add(layer.name)
            weights.append((layer.name, layer.param.type, [to_numpy(b.data) for b in layer.blobs]))
            diffs.append([to_numpy(b.diff) for b in layer.blobs])
        write_net_hdf5(path, weights, diffs if write_diff else None)
    else:
        write_net_binary(path, net_to_proto(net, write_diff))


#: The name Net.save uses.
save_weights = save_net
