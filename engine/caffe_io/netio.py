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


def copy_weights_into(net: Any, source: PathLike | LayerWeights | caffe_pb2.NetParameter
                      ) -> list[str]:
    """Copy parameters into `net` by layer name (Caffe's CopyTrainedLayersFrom).

    `source` is a weights file, a NetParameter, or a LayerWeights list. Source layers the net
    lacks are ignored (logged); for the others the blob count and every shape must match,
    except that a legacy 4-D blob matches any shape Caffe's ShapeEquals accepts. Returns the
    names of the layers copied.
    """
    from ..backend import get_array_module

    where = str(source) if isinstance(source, (str, os.PathLike)) else "weights"
    if isinstance(source, (str, os.PathLike)):
        if weights_format(source) == "binary":
            source = read_net_binary(source)
        else:
            source = read_weights(source)
    if isinstance(source, caffe_pb2.NetParameter):
        if len(source.layers):
            source = caffe_pb2.NetParameter.FromString(source.SerializeToString())
            upgrade_net(source, where)
        items = [(l.name, list(l.blobs)) for l in source.layer]
    else:
        items = [(name, list(arrays)) for name, _, arrays in source]

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
