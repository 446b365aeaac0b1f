"""Solver snapshots: binary .solverstate and Caffe's HDF5 .solverstate.h5, their history blobs,
and finding the weights file (learned_net) a state names.
"""
from __future__ import annotations

from pathlib import Path

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


def read_solverstate(path: PathLike) -> caffe_pb2.SolverState:
    """A .solverstate (binary) or .solverstate.h5 (Caffe's HDF5 keys) as a SolverState."""
    if weights_format(path) == "hdf5":
        state = caffe_pb2.SolverState()
        with open_h5(path, "solverstate.h5") as f:
            if "iter" not in f:
                check_kind(path, "solverstate")  # a caffemodel.h5 given as a snapshot
            state.iter = int(np.asarray(f["iter"][()]).ravel()[0])
            state.current_step = int(np.asarray(f["current_step"][()]).ravel()[0])
            if "learned_net" in f:
                raw = f["learned_net"][()]
                state.learned_net = raw.decode() if isinstance(raw, bytes) else str(raw)
            history = f["history"] if "history" in f else {}
            for i in range(len(history)):
                state.history.add().CopyFrom(array_to_blob(np.asarray(history[str(i)][()])))
            if "data_position" in f:
                state.data_position.extend(int(v) for v in np.asarray(f["data_position"][()]))
            if "sync_state" in f:
                state.sync_state = bytes(np.asarray(f["sync_state"][()]).tobytes())
        return state
    state = caffe_pb2.SolverState()
    try:
        parse_binary(read_bytes(path), state, path, "solverstate")
    except FormatError:
        check_kind(path, "solverstate")
        raise
    if not state.learned_net and not len(state.history):
        check_kind(path, "solverstate")  # a caffemodel parses as an empty state
    for j, blob in enumerate(state.history):
        blob_to_array(blob, where=f"{path}: history blob {j}")  # validates counts
    return state


def solverstate_history(state: caffe_pb2.SolverState) -> list[np.ndarray]:
    return [blob_to_array(b, where=f"history blob {j}") for j, b in enumerate(state.history)]


def write_solverstate(path: PathLike, state: caffe_pb2.SolverState) -> None:
    """Binary, or Caffe's HDF5 keys (iter, learned_net, current_step, history/<i>) for *.h5
    (and Poseidon's data_position and sync_state, which Caffe ignores)."""
    if format_by_name(path) != "hdf5":
        atomic_write_bytes(path, state.SerializeToString())
        return
    h5py = import_h5py()
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("iter", data=np.array([state.iter], dtype=np.int32))
        f.create_dataset("learned_net", data=np.bytes_(state.learned_net.encode()))
        f.create_dataset("current_step", data=np.array([state.current_step], dtype=np.int32))
        g = f.create_group("history")
        for i, arr in enumerate(solverstate_history(state)):
            g.create_dataset(str(i), data=arr)
        if len(state.data_position):
            f.create_dataset("data_position", data=np.array(state.data_position, dtype=np.int64))
        if state.sync_state:
            f.create_dataset("sync_state", data=np.frombuffer(state.sync_state, np.uint8))


def resolve_learned_net(state_path: PathLike, state: caffe_pb2.SolverState) -> Path:
    """The weights file a solverstate names: as given if it exists, else beside the state file
    (Caffe writes a bare file name relative to its working directory)."""
    named = Path(state.learned_net)
    if named.exists():
        return named
    beside = Path(state_path).parent / named.name
    if beside.exists():
        return beside
    raise FormatError(f"{state_path}: learned_net '{state.learned_net}' not found (looked at "
                      f"{named} and {beside})")
