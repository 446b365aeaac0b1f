"""A Solver's snapshots: where they go, writing them, and restoring from one.

Caffe's Solver::Snapshot / Restore, as functions of the values they need (the Solver calls them
and applies what ``restore`` returns; this module knows no Solver). The weights file is written
first, then the solverstate that names it, each atomically (caffe_io), so a run stopped at any
moment leaves either the previous snapshot or the new one, never half of one. The solverstate
also records the train data layers' stream positions, so a resumed run reads exactly the
records the uninterrupted one would have, and the gradient synchroniser's state (its plan), so
that it sums in the same order.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import backend, glog
from .pb import caffe_pb2
from .solvers import SolverError


def snapshot_base(param: Any, source: str, context: Any) -> str:
    """snapshot_prefix: its folder is looked up beside the solver file first, then in the
    working directory; a bare prefix (no folder) lands beside the solver file. Without a
    prefix: the solver file's name (later Caffe's default), or "" for a SolverParameter given
    in memory (Caffe 1.0: files named ``_iter_N.caffemodel``). ``source``: the solver's file
    (or "<SolverParameter>"); ``context``: its RunContext, which resolves relative folders."""
    if param.snapshot_prefix:
        prefix = Path(param.snapshot_prefix)
    elif source != "<SolverParameter>":
        prefix = Path(Path(source).stem)
    else:
        prefix = Path("")
    folder = prefix.parent if prefix.is_absolute() else context.resolve(str(prefix.parent))
    return os.path.join(folder, prefix.name)


def snapshot_paths(base: str, iteration: int, h5: bool) -> tuple[Path, Path]:
    """(weights, state) file names of a snapshot at ``iteration``."""
    stem = f"{base}_iter_{iteration}"
    return (Path(stem + (".caffemodel.h5" if h5 else ".caffemodel")),
            Path(stem + (".solverstate.h5" if h5 else ".solverstate")))


def write_snapshot(net: Any, state: Any, model: Path, state_path: Path, diff: bool,
                   last_good: Path | None) -> None:
    """Write ``net``'s weights to ``model``, then ``state`` (naming ``model``) to
    ``state_path``, each atomically. The caller has waited for every update in flight."""
    from .caffe_io import save_net, write_solverstate

    h5 = model.suffix == ".h5"
    glog.info(f"Snapshotting to {'HDF5' if h5 else 'binary proto'} file {model}")
    writing = model
    try:
        save_net(net, model, diff)
        glog.info(f"Snapshotting solver state to {'HDF5' if h5 else 'binary proto'} file "
                  f"{state_path}")
        writing = state_path
        state.learned_net = str(model)
        write_solverstate(state_path, state)
    except OSError as e:  # a full disk, a lost permission: say so, keep the previous snapshot
        raise SolverError(f"cannot write snapshot {writing}: {describe_os_error(e)}; last "
                          f"good snapshot: {last_good or 'none'}") from None


def describe_os_error(e: OSError) -> str:
    """'No space left on device (ENOSPC)'; h5py's errors carry their text but no errno."""
    text = e.strerror or str(e)
    code = errno.errorcode.get(e.errno or 0)
    if code is None:  # h5py: "Unable to create file (... errno = 28, error message = ...)"
        for num, name in errno.errorcode.items():
            if f"errno = {num}," in str(e):
                code = name
    return f"{text} ({code})" if code else text


def solver_state(iteration: int, current_step: int, history: Sequence[Any],
                 data_positions: Sequence[int], sync_state: bytes = b"",
                 learned_net: str = "") -> Any:
    """A SolverState message (history in Caffe's layout), with Poseidon's data positions and
    sync state."""
    from .caffe_io import array_to_blob

    state = caffe_pb2.SolverState()
    state.iter = iteration
    if learned_net:
        state.learned_net = learned_net
    state.current_step = current_step
    for h in history:
        state.history.add().CopyFrom(array_to_blob(h))
    state.data_position.extend(data_positions)
    if sync_state:
        state.sync_state = sync_state
    return state


@dataclass
class Restored:
    """What a .solverstate says of where training stood; the Solver applies it."""
    path: Path
    iter: int
    current_step: int
    #: records consumed per train data layer; empty for a Caffe solverstate
    data_positions: list[int]


def restore(path: str | Path, net: Any, history: Sequence[Any], solver_type: str) -> Restored:
    """Load a .solverstate (binary, or HDF5 by its .h5 suffix): the weights it names into
    ``net``, its history into ``history`` (checked against them first: nothing is changed when
    the state is of another net or solver)."""
    from .caffe_io import copy_weights_into, read_solverstate, resolve_learned_net, \
        solverstate_history

    path = Path(path)
    if not path.is_file():
        raise SolverError(f"solverstate {path} not found")
    state = read_solverstate(path)
    histories = solverstate_history(state)
    if len(histories) != len(history):
        raise SolverError(
            f"solverstate {path} has {len(histories)} history blobs, but a {solver_type} solver "
            f"on net '{net.name}' needs {len(history)} (a snapshot of another net "
            "or solver type?)")
    n_params = len(net.learnable_params)
    for k, (mine, theirs) in enumerate(zip(history, histories)):
        if mine.size != theirs.size:
            name = net.param_names[k % n_params]
            raise SolverError(f"solverstate {path}: history blob {k} has {theirs.size} values, "
                              f"parameter {name} has shape {tuple(mine.shape)} (a snapshot of "
                              "another net?)")
    positions = list(state.data_position)
    if positions and len(positions) != len(net.data_layers):
        raise SolverError(f"solverstate {path} records {len(positions)} data positions but net "
                          f"'{net.name}' has {len(net.data_layers)} data layers")
    if state.HasField("learned_net") and state.learned_net:
        copy_weights_into(net, resolve_learned_net(path, state))
    for mine, theirs in zip(history, histories):
        mine[...] = backend.get_array_module(mine).asarray(theirs.reshape(mine.shape))
    return Restored(path, state.iter, state.current_step, positions)
