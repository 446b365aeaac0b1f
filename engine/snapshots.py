"""A Solver's snapshots: where they go, writing them, and restoring from one.

Caffe's Solver::Snapshot / Restore, as functions of the values they need (the Solver calls them
and applies what ``restore`` returns; this module knows no Solver). The weights file is written
first, then the solverstate that names it, each atomically (caffe_io), so a run stopped at any
moment leaves either the previous snapshot or the new one, never half of one. The solverstate
also records the train data layers' stream positions, so a resumed run reads exactly the
records the uninterrupted one would have, and the gradient synchroniser's state (its plan), so
that it sums in the same order.

A ``Commit`` is the same content held in memory (elastic training commits every few
iterations and rolls back to the newest commit when a worker is lost): copies of every blob of
the train net and of the solver's history, the iteration, the learning-rate step, the data
positions and the plan. Restoring a commit is restoring the snapshot it would have written, so
a run that goes on from a commit equals one resumed from that snapshot.
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


@dataclass
class Commit:
    """A snapshot's content in memory: ``arrays`` holds copies of every blob of the train net
    in layer order (``weight_arrays`` of them), then the solver's history blobs."""
    iter: int
    current_step: int
    data_positions: list[int]
    #: the gradient synchroniser's state (the plan) when it was taken; b"" without one
    sync_state: bytes
    arrays: list[Any]
    weight_arrays: int

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


def state_arrays(net: Any, history: Sequence[Any]) -> tuple[list[Any], int]:
    """The live arrays a commit copies, in its order (every blob of ``net`` in layer order, then
    ``history``), and how many of them are weights. A blob two layers share comes twice."""
    weights = [b.data for layer in net.layers for b in layer.blobs]
    return weights + list(history), len(weights)


def take_commit(net: Any, history: Sequence[Any], iteration: int, current_step: int,
                data_positions: Sequence[int], sync_state: bytes = b"",
                into: Commit | None = None) -> Commit:
    """Copy the state into a Commit (the caller has waited for every update in flight). The
    copies stay where the arrays live (a GPU's memory for a GPU run). ``into``: a commit no
    longer needed whose arrays fit, overwritten instead of allocating (fresh memory costs its
    page faults: on this 2-core machine a copy of AlexNet's 488 MB took twice as long into new
    memory as into memory it had written before)."""
    live, weights = state_arrays(net, history)
    if into is not None and len(into.arrays) == len(live) and all(
            type(d) is type(a) and d.shape == a.shape and d.dtype == a.dtype
            for d, a in zip(into.arrays, live)):
        for d, a in zip(into.arrays, live):
            d[...] = a
        copies = into.arrays
    else:
        copies = [backend.get_array_module(a).array(a, copy=True) for a in live]
    return Commit(int(iteration), int(current_step), [int(p) for p in data_positions],
                  sync_state, copies, weights)


def check_commit(commit: Commit, net: Any, history: Sequence[Any], where: str) -> None:
    """``commit`` fits ``net`` and ``history`` array for array (shape and dtype) and data layer
    for data layer; SolverError naming ``where`` and the first array that does not."""
    live, weights = state_arrays(net, history)
    if len(live) != len(commit.arrays) or weights != commit.weight_arrays:
        raise SolverError(f"{where}: a commit of {commit.weight_arrays} weight and "
                          f"{len(commit.arrays) - commit.weight_arrays} history arrays, but net "
                          f"'{net.name}' and its solver have {weights} and {len(live) - weights}")
    for k, (mine, theirs) in enumerate(zip(live, commit.arrays)):
        if tuple(mine.shape) != tuple(theirs.shape) or mine.dtype != theirs.dtype:
            raise SolverError(f"{where}: commit array {k} is {theirs.dtype}{tuple(theirs.shape)}, "
                              f"net '{net.name}' has {mine.dtype}{tuple(mine.shape)} there")
    if len(commit.data_positions) != len(net.data_layers):
        raise SolverError(f"{where}: a commit of {len(commit.data_positions)} data positions, "
                          f"net '{net.name}' has {len(net.data_layers)} data layers")


def apply_commit(commit: Commit, net: Any, history: Sequence[Any], where: str) -> None:
    """Copy ``commit``'s arrays into ``net``'s blobs and ``history`` (checked first: nothing is
    changed when it does not fit)."""
    check_commit(commit, net, history, where)
    live, _ = state_arrays(net, history)
    for mine, theirs in zip(live, commit.arrays):
        mine[...] = backend.get_array_module(mine).asarray(theirs)


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
