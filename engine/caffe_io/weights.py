"""Weights files: binary .caffemodel, Caffe's HDF5 .caffemodel.h5 and .npz, read and written.

Whatever the format, weights are exchanged as `LayerWeights` lists,
``[(layer_name, layer_type, [array, ...]), ...]``; `read_weights` and `write_weights` pick the
format from the file.
"""
from __future__ import annotations

import zipfile
import zlib
from typing import Any, Sequence

import numpy as np

from ..pb import caffe_pb2
from .blobs import array_to_blob, blob_to_array
from .files import (
    FormatError,
    PathLike,
    atomic_path,
    atomic_write_bytes,
    format_by_name,
    import_h5py,
    open_h5,
    parse_binary,
    read_bytes,
    weights_format,
)
from .kinds import check_kind
from .upgrade import V1, V1_TYPE_NAMES, upgrade_net

LayerWeights = list[tuple[str, str, list[np.ndarray]]]


# ---------------------------------------------------------------------------------------------
# Binary nets (.caffemodel)
# ---------------------------------------------------------------------------------------------

def read_net_binary(path: PathLike, upgrade: bool = True) -> caffe_pb2.NetParameter:
    """A binary NetParameter (.caffemodel), upgraded like a prototxt unless `upgrade=False`."""
    net = caffe_pb2.NetParameter()
    data = read_bytes(path)
    try:
        parse_binary(data, net, path, "caffemodel")
        if len(net.layer) == 0 and len(net.layers) == 0:
            raise FormatError(f"{path}: not a valid caffemodel (truncated or corrupt): "
                              f"no layers in {len(data)} bytes")
    except FormatError:
        check_kind(path, "caffemodel")  # a solverstate or a prototxt given as weights
        raise
    net_to_weights(net, path)  # every blob's value count must match its shape
    if upgrade:
        upgrade_net(net, str(path))
    return net


def write_net_binary(path: PathLike, net: caffe_pb2.NetParameter) -> None:
    atomic_write_bytes(path, net.SerializeToString())


def _layer_type(layer: caffe_pb2.LayerParameter | caffe_pb2.V1LayerParameter) -> str:
    if isinstance(layer, caffe_pb2.V1LayerParameter):
        return V1_TYPE_NAMES[V1.LayerType.Name(layer.type)]
    return layer.type


def net_to_weights(net: caffe_pb2.NetParameter, path: PathLike = "<net>") -> LayerWeights:
    """The layers of a NetParameter as (name, type, [arrays]) (V1 `layers` included)."""
    return [(layer.name, _layer_type(layer),
             [blob_to_array(b, where=f"{path}: layer '{layer.name}' blob {j}")
              for j, b in enumerate(layer.blobs)])
            for layer in [*net.layer, *net.layers]]


def weights_to_net(weights: LayerWeights, name: str = "") -> caffe_pb2.NetParameter:
    net = caffe_pb2.NetParameter(name=name)
    for layer_name, layer_type, arrays in weights:
        layer = net.layer.add(name=layer_name, type=layer_type)
        for a in arrays:
            layer.blobs.add().CopyFrom(array_to_blob(a))
    return net


# ---------------------------------------------------------------------------------------------
# HDF5 (.caffemodel.h5) in Caffe's layout
# ---------------------------------------------------------------------------------------------

def _h5_layer_arrays(group: Any, where: str) -> list[np.ndarray]:
    """Datasets "0", "1", ... of one layer group, in index order."""
    h5py = import_h5py()
    names = [n for n, item in group.items() if isinstance(item, h5py.Dataset)]
    if sorted(names, key=lambda n: int(n) if n.isdigit() else -1) != \
            [str(i) for i in range(len(names))]:
        raise FormatError(f"{where}: expected datasets 0..{len(names) - 1}, found {names}")
    return [np.asarray(group[str(i)][()]) for i in range(len(names))]


def _h5_layers(group: Any, prefix: str, path: PathLike) -> LayerWeights:
    """Layer groups under `group`, in the net's order, with the type Poseidon records (Caffe
    records none: ""). A '/' in a layer name (GoogLeNet's "inception_3a/1x1") nests groups in
    HDF5, so a group holding only groups is a path step, not a layer.

    HDF5 lists a group's members by name; the net's order is the order the writer (Caffe's or
    ours, one layer after the other into a new file) created them, which is the order of
    their object headers in the file."""
    h5py = import_h5py()
    out: LayerWeights = []
    members = [(name, item) for name, item in group.items() if isinstance(item, h5py.Group)]
    members.sort(key=lambda member: h5py.h5o.get_info(member[1].id).addr)
    for name, item in members:
        full = f"{prefix}{name}"
        children = list(item.values())
        if any(isinstance(c, h5py.Dataset) for c in children) or not children:
            layer_type = item.attrs.get("type", "")
            out.append((full, layer_type.decode() if isinstance(layer_type, bytes) else
                        str(layer_type), _h5_layer_arrays(item, f"{path}: layer '{full}'")))
        out.extend(_h5_layers(item, f"{full}/", path))
    return out


def read_net_hdf5(path: PathLike) -> LayerWeights:
    """Layers of a Caffe HDF5 snapshot (group data/<layer>/<i>), in net order; their types
    where Poseidon wrote the file (an attribute), else ""."""
    with open_h5(path, "caffemodel.h5") as f:
        if "data" not in f:
            check_kind(path, "caffemodel")
            raise FormatError(f"{path}: not a Caffe HDF5 model (no 'data' group)")
        return _h5_layers(f["data"], "", path)


def write_net_hdf5(path: PathLike, weights: LayerWeights,
                   diffs: Sequence[Sequence[np.ndarray]] | None = None) -> None:
    """Caffe's HDF5 model layout: data/<layer>/<i> (and diff/<layer>/<i> when given).

    A layer name seen twice keeps its first arrays, as Caffe writes only owned parameters.
    """
    h5py = import_h5py()
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        groups = [("data", [arrays for _, _, arrays in weights])]
        if diffs is not None:
            groups.append(("diff", list(diffs)))
        for group_name, per_layer in groups:
            top = f.create_group(group_name)
            for (layer_name, layer_type, _), arrays in zip(weights, per_layer):
                if layer_name in top:
                    continue
                g = top.create_group(layer_name)
                if layer_type:  # for --info and readers; Caffe reads only the datasets
                    g.attrs["type"] = layer_type
                for i, a in enumerate(arrays):
                    g.create_dataset(str(i), data=np.asarray(a))


# ---------------------------------------------------------------------------------------------
# NumPy archives (.npz, arrays named <layer>/<i>)
# ---------------------------------------------------------------------------------------------

def read_npz(path: PathLike) -> LayerWeights:
    """Layers of an .npz of arrays named `<layer>/<i>` (layer names may contain '/')."""
    layers: dict[str, dict[int, np.ndarray]] = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in z.files:
                name, _, index = key.rpartition("/")
                if not name or not index.isdigit():
                    raise FormatError(f"{path}: array '{key}' is not named <layer>/<index>")
                layers.setdefault(name, {})[int(index)] = z[key]
    except FileNotFoundError:
        raise FormatError(f"{path}: cannot read: No such file or directory") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{path}: not a valid .npz (truncated or corrupt): {e}") from None
    out: LayerWeights = []
    for name, by_index in layers.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise FormatError(f"{path}: layer '{name}' has blobs {sorted(by_index)}, "
                              f"expected 0..{len(by_index) - 1}")
        out.append((name, "", [by_index[i] for i in range(len(by_index))]))
    return out


def write_npz(path: PathLike, weights: LayerWeights) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name, _, blobs in weights:
        for i, a in enumerate(blobs):
            arrays.setdefault(f"{name}/{i}", np.asarray(a))
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)


# ---------------------------------------------------------------------------------------------
# Any weights file
# ---------------------------------------------------------------------------------------------

def read_weights(path: PathLike) -> LayerWeights:
    """[(layer_name, layer_type, [arrays])] from a .caffemodel, .caffemodel.h5 or .npz."""
    fmt = weights_format(path)
    if fmt == "hdf5":
        return read_net_hdf5(path)
    if fmt == "npz":
        return read_npz(path)
    return net_to_weights(read_net_binary(path), path)


def write_weights(path: PathLike, weights: LayerWeights, name: str = "") -> None:
    """Write weights in the format the suffix names (.h5 / .npz / anything else: binary)."""
    fmt = format_by_name(path)
    if fmt == "hdf5":
        write_net_hdf5(path, weights)
    elif fmt == "npz":
        write_npz(path, weights)
    else:
        write_net_binary(path, weights_to_net(weights, name))
