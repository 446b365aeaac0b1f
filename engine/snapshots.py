"""A Solver's snapshots: where they go, writing them, and restoring from one.

Caffe's Solver::Snapshot / Restore. The weights file is written first, then the solverstate
that names it, each atomically (caffe_io), so a run stopped at any moment leaves either the
previous snapshot or the new one, never half of one. The solverstate also records the train
data layers' stream positions, so a resumed run reads exactly the records the uninterrupted one
would have.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import backend, glog
from .pb import caffe_pb2
from .solvers import SolverError

if TYPE_CHECKING:
    from .solver import Solver


def snapshot_base(solver: "Solver") -> str:
    """snapshot_prefix: its folder is looked up beside the solver file first, then in the
    working directory; a bare prefix (no folder) lands beside the solver file. Without a
    prefix: the solver file's name (later Caffe's default), or "" for a SolverParameter given
    in memory (Caffe 1.0: files named ``_iter_N.caffemodel``)."""
    p = solver.param
    if p.snapshot_prefix:
        prefix = Path(p.snapshot_prefix)
    elif solver.source != "<SolverParameter>":
        prefix = Path(Path(solver.source).stem)
    else:
        prefix = Path("")
    folder = prefix.parent if prefix.is_absolute() else solver.context.resolve(str(prefix.parent))
    return os.path.join(folder, prefix.name)


def snapshot_paths(solver: "Solver") -> tuple[Path, Path]:
    """(weights, state) file names of a snapshot at the solver's current iteration."""
    h5 = solver.param.snapshot_format == caffe_pb2.SolverParameter.HDF5
    base = f"{snapshot_base(solver)}_iter_{solver.iter}"
    return (Path(base + (".caffemodel.h5" if h5 else ".caffemodel")),
            Path(base + (".solverstate.h5" if h5 else ".solverstate")))


def write_snapshot(solver: "Solver") -> tuple[Path, Path] | None:
    """Write weights then solver state, each atomically (root only; others return None)."""
    from .caffe_io import save_net, write_solverstate

    model, state_path = snapshot_paths(solver)
    # every rank knows what rank 0 writes at this iteration (errors name it as the last good
    # snapshot; a shared file system is assumed, as for the solver and the data)
    if not solver.is_root:
        solver.last_snapshot = state_path
        return None
    solver.wait_all()
    h5 = model.suffix == ".h5"
    glog.info(f"Snapshotting to {'HDF5' if h5 else 'binary proto'} file {model}")
    writing = model
    try:
        save_net(solver.net, model, solver.param.snapshot_diff)
        glog.info(f"Snapshotting solver state to {'HDF5' if h5 else 'binary proto'} file "
                  f"{state_path}")
        writing = state_path
        write_solverstate(state_path, solver_state(solver, str(model)))
    except OSError as e:  # a full disk, a lost permission: say so, keep the previous snapshot
        raise SolverError(f"cannot write snapshot {writing}: {describe_os_error(e)}; last "
                          f"good snapshot: {solver.last_snapshot or 'none'}") from None
    solver.last_snapshot = state_path
    return model, state_path


def describe_os_error(e: OSError) -> str:
    """'No space left on device (ENOSPC)'; h5py's errors carry their text but no errno."""
    text = e.strerror or str(e)
    code = errno.errorcode.get(e.errno or 0)
    if code is None:  # h5py: "Unable to create file (... errno = 28, error message = ...)"
        for num, name in errno.errorcode.items():
            if f"errno = {num}," in str(e):
                code = name
    return f"{text} ({code})" if code else text


def solver_state(solver: "Solver", learned_net: str = "") -> Any:
    """The SolverState message of the current iteration (history in Caffe's layout)."""
    from .caffe_io import array_to_blob

    state = caffe_pb2.SolverState()
    state.iter = solver.iter
    if learned_net:
        state.learned_net = learned_net
    state.current_step = solver.current_step
    for h in solver.history:
        state.history.add().CopyFrom(array_to_blob(h))
    state.data_position.extend(layer.position() for layer in solver.net.data_layers)
    sync = solver.sync_state()
    if sync:
        state.sync_state = sync
    return state


def restore(solver: "Solver", path: str | Path) -> None:
    """Load a .solverstate (binary, or HDF5 by its .h5 suffix) and the weights it names."""
    from .caffe_io import copy_weights_into, read_solverstate, resolve_learned_net, \
        solverstate_history

    path = Path(path)
    if not path.is_file():
        raise SolverError(f"solverstate {path} not found")
    state = read_solverstate(path)
    histories = solverstate_history(state)
    net = solver.net
    if len(histories) != len(solver.history):
        raise SolverError(
            f"solverstate {path} has {len(histories)} history blobs, but a {solver.type} solver "
            f"on net '{net.name}' needs {len(solver.history)} (a snapshot of another net "
            "or solver type?)")
    n_params = len(net.learnable_params)
    for k, (mine, theirs) in enumerate(zip(solver.history, histories)):
        if mine.size != theirs.size:
            name = net.param_names[k % n_params]
            raise SolverError(f"solverstate {path}: history blob {k} has {theirs.size} values, "
                              f"parameter {name} has shape {tuple(mine.shape)} (a snapshot of "
                              "another net?)")
    if state.HasField("learned_net") and state.learned_net:
        copy_weights_into(net, resolve_learned_net(path, state))
    for mine, theirs in zip(solver.history, histories):
        mine[...] = backend.get_array_module(mine).asarray(theirs.reshape(mine.shape))
    solver.iter = state.iter
    solver.current_step = state.current_step
    _seek_data(solver, list(state.data_position))
    solver.last_snapshot = path


def _seek_data(solver: "Solver", positions: list[int]) -> None:
    layers = solver.net.data_layers
    if positions and len(positions) != len(layers):
        raise SolverError(f"solverstate records {len(positions)} data positions but net "
                          f"'{solver.net.name}' has {len(layers)} data layers")
    if not positions:  # a Caffe solverstate: where Caffe's uninterrupted run would be
        positions = [solver.iter * layer.step * solver.param.iter_size for layer in layers]
    for layer, pos in zip(layers, positions):
        layer.seek(int(pos))
