"""Caffe's file formats: prototxt nets and solvers, .caffemodel, .caffemodel.h5, .binaryproto,
.solverstate(.h5), and the V0/V1 -> current net upgrade Caffe applies when it reads a net.

Every reader turns a malformed or corrupt file into one `FormatError` line naming the file (and
line, column and field for text), never a protobuf or HDF5 traceback. Every writer is atomic.

Weights are exchanged as `LayerWeights` lists, ``[(layer_name, layer_type, [array, ...]), ...]``,
whatever the file format; `copy_weights_into` applies them to a Net by layer name as Caffe's
Net::CopyTrainedLayersFrom does.

One module per job; import from the package, which re-exports the public API:

- files: FormatError, guarded reads, atomic writes, format detection by name or magic bytes
- text: prototxt nets and solvers
- upgrade: Caffe's net (V0, V1, data transform, input, BatchNorm) and solver upgrades
- blobs: BlobProto <-> numpy, .binaryproto files, shape matching
- weights: .caffemodel, .caffemodel.h5 and .npz weights files
- solverstate: .solverstate and .solverstate.h5
- netio: weights into and out of an engine Net
"""
from __future__ import annotations

from .blobs import (
    array_to_blob,
    blob_shape,
    blob_to_array,
    read_blobproto,
    shape_matches,
    write_blobproto,
)
from .files import (
    HDF5_MAGIC,
    ZIP_MAGIC,
    FormatError,
    PathLike,
    atomic_path,
    atomic_write_bytes,
    format_by_name,
    weights_format,
)
from .netio import copy_weights_into, load_trained_weights, net_to_proto, save_net, save_weights
from .solverstate import (
    read_solverstate,
    resolve_learned_net,
    solverstate_history,
    write_solverstate,
)
from .text import (
    parse_net_text,
    parse_solver_text,
    read_net_prototxt,
    read_solver_prototxt,
    write_prototxt,
)
from .upgrade import (
    V0_TYPE_NAMES,
    V1,
    V1_TYPE_NAMES,
    net_needs_upgrade,
    upgrade_net,
    upgrade_solver,
)
from .weights import (
    LayerWeights,
    net_to_weights,
    read_net_binary,
    read_net_hdf5,
    read_npz,
    read_weights,
    weights_to_net,
    write_net_binary,
    write_net_hdf5,
    write_npz,
    write_weights,
)

__all__ = [
    "HDF5_MAGIC", "V0_TYPE_NAMES", "V1", "V1_TYPE_NAMES", "ZIP_MAGIC", "FormatError",
    "LayerWeights", "PathLike", "array_to_blob", "atomic_path", "atomic_write_bytes",
    "blob_shape", "blob_to_array", "copy_weights_into", "format_by_name",
    "load_trained_weights", "net_needs_upgrade",
    "net_to_proto", "net_to_weights", "parse_net_text", "parse_solver_text", "read_blobproto",
    "read_net_binary", "read_net_hdf5", "read_net_prototxt", "read_npz",
    "read_solver_prototxt", "read_solverstate", "read_weights", "resolve_learned_net",
    "save_net", "save_weights", "shape_matches", "solverstate_history", "upgrade_net",
    "upgrade_solver", "weights_format", "weights_to_net", "write_blobproto",
    "write_net_binary", "write_net_hdf5", "write_npz", "write_prototxt", "write_solverstate",
    "write_weights",
]
