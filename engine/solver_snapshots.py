"""The Solver's state on disk and in memory: snapshots (weights, then the solverstate naming
them, each atomic), elastic training's commits (a snapshot's content in memory), and restoring
either. A part of ``Solver`` (engine/solver.py); the formats are engine/snapshots.py's."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from . import snapshots
from .context import RunContext
from .pb import caffe_pb2


class SolverSnapshots:
    """Snapshots and commits of the Solver's net, history, iteration and data positions."""

    param: Any
    source: str
    context: RunContext
    is_root: bool
    net: Any
    history: list[Any]
    iter: int
    current_step: int
    type: str
    last_snapshot: Path | None
    #: (engine/solver.py) every update in flight applied; the sync's state for a snapshot
    wait_all: Callable[[], None]
    sync_state: Callable[[], bytes]

    # -- snapshots (engine/snapshots.py) --------------------------------------------------
    def snapshot_prefix(self) -> Path:
        """The resolved snapshot_prefix."""
        return Path(snapshots.snapshot_base(self.param, self.source, self.context))

    def snapshot_paths(self) -> tuple[Path, Path]:
        """(weights, state) file names of a snapshot at the current iteration."""
        h5 = self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5
        return snapshots.snapshot_paths(str(self.snapshot_prefix()), self.iter, h5)

    def snapshot(self) -> tuple[Path, Path] | None:
        """Write weights then solver state, each atomically (root only; others return None,
        knowing the name rank 0 writes: errors name it as the last good snapshot, a shared
        file system assumed, as for the solver and the data)."""
        model, state_path = self.snapshot_paths()
        if not self.is_root:
            self.last_snapshot = state_path
            return None
        self.wait_all()  # the weights as every update so far left them
        snapshots.write_snapshot(self.net, self.solver_state(), model, state_path,
                                 self.param.snapshot_diff, self.last_snapshot)
        self.last_snapshot = state_path
        return model, state_path

    def solver_state(self, learned_net: str = "") -> Any:
        """The SolverState message of the current iteration (history in Caffe's layout)."""
        return snapshots.solver_state(self.iter, self.current_step, self.history,
                                      [layer.position() for layer in self.net.data_layers],
                                      self.sync_state(), learned_net)

    def commit(self, into: snapshots.Commit | None = None) -> snapshots.Commit:
        """The state a snapshot at this iteration would write, copied in memory (elastic
        training's commit), into the arrays of ``into`` (a commit no longer needed) where they
        fit; waits for every update in flight first."""
        self.wait_all()
        return snapshots.take_commit(self.net, self.history, self.iter, self.current_step,
                                     [layer.position() for layer in self.net.data_layers],
                                     self.sync_state(), into)

    def state_arrays(self) -> list[Any]:
        """The live arrays a commit holds copies of, in its order (weights, then history)."""
        return snapshots.state_arrays(self.net, self.history)[0]

    def restore_commit(self, commit: snapshots.Commit) -> None:
        """Go on from ``commit`` exactly as from the snapshot it would have written."""
        snapshots.apply_commit(commit, self.net, self.history, f"solver {self.source}")
        self.iter = commit.iter
        self.current_step = commit.current_step
        for layer, pos in zip(self.net.data_layers, commit.data_positions):
            layer.seek(int(pos))

    def write_commit(self, commit: snapshots.Commit) -> Path:
        """Write ``commit`` to disk as the Caffe snapshot of its iteration, whatever this
        process's rank (the commit of a job that must stop); returns the solverstate's path."""
        self.restore_commit(commit)
        model, state_path = self.snapshot_paths()
        state = snapshots.solver_state(commit.iter, commit.current_step, self.history,
                                       commit.data_positions, commit.sync_state)
        snapshots.write_snapshot(self.net, state, model, state_path, self.param.snapshot_diff,
                                 self.last_snapshot)
        self.last_snapshot = state_path
        return state_path

    def restore(self, path: str | Path) -> None:
        """Load a .solverstate (binary, or HDF5 by its .h5 suffix) and the weights it names."""
        r = snapshots.restore(path, self.net, self.history, self.type)
        self.iter = r.iter
        self.current_step = r.current_step
        layers = self.net.data_layers
        # a Caffe solverstate records none: where Caffe's uninterrupted run would be
        positions = r.data_positions or [self.iter * layer.step * self.param.iter_size
                                         for layer in layers]
        for layer, pos in zip(layers, positions):
            layer.seek(int(pos))
        self.last_snapshot = r.path
