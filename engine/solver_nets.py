"""The Solver's nets: the train net and the test nets a SolverParameter names (files, inline
NetParameters, NetState precedence as Caffe's solver.cpp), and the checks of the solver's own
fields and of its snapshot folder before any training. A part of ``Solver`` (engine/solver.py),
kept apart because building nets is a job of its own."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from . import glog
from .context import RunContext
from .pb import caffe_pb2
from .solvers import SolverError, check_lr_policy


class SolverNets:
    """The Solver's net building (``param``, ``source``, ``context``, ``is_root`` and
    ``net_class`` are the Solver's)."""

    param: Any
    source: str
    context: RunContext
    is_root: bool
    net_class: type | None
    snapshot_prefix: Callable[[], Path]  # (engine/solver_snapshots.py)

    # -- construction ---------------------------------------------------------------------
    def _check_param(self) -> None:
        p = self.param
        where = f"solver {self.source}"
        if p.max_iter < 0:
            raise SolverError(f"{where}: max_iter must be >= 0, got {p.max_iter}")
        if p.average_loss < 1:
            raise SolverError(f"{where}: average_loss must be >= 1, got {p.average_loss}")
        if p.iter_size < 1:
            raise SolverError(f"{where}: iter_size must be >= 1, got {p.iter_size}")
        if p.regularization_type not in ("L1", "L2"):
            raise SolverError(f"{where}: unknown regularization_type \"{p.regularization_type}\" "
                              "(known: L1, L2)")
        if any(n < 0 for n in p.test_iter) or p.test_interval < 0 or p.display < 0 or p.snapshot < 0:
            raise SolverError(f"{where}: test_iter, test_interval, display and snapshot must be >= 0")
        check_lr_policy(p)

    def _check_snapshot_prefix(self) -> None:
        """Caffe's CheckSnapshotWritePermissions: fail now, not after hours of training. A
        missing folder is made (Caffe fails, and a fresh checkout's `snapshot_prefix:
        "snapshots/lenet"` would cost a user a round trip); the log names it, so a typo in
        the prefix shows at once."""
        p = self.param
        if not self.is_root or not (p.snapshot or p.snapshot_after_train):
            return
        folder = Path(os.path.dirname(self.snapshot_prefix()) or ".")
        where = f"solver {self.source}: cannot write snapshots to prefix '{p.snapshot_prefix}'"
        if not folder.exists():
            try:
                folder.mkdir(parents=True)
            except OSError as e:
                raise SolverError(f"{where}: cannot make folder {folder}: "
                                  f"{e.strerror or e}") from None
            glog.info(f"Made the snapshot folder {folder} (snapshot_prefix "
                      f"'{p.snapshot_prefix}')")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise SolverError(f"{where}: {folder} is not a writable folder")

    def _resolve(self, path: str) -> Path:
        return self.context.resolve(path)

    def _read_net(self, name: str) -> tuple[Any, list[Path], str]:
        """A net file the solver names: its NetParameter, the folders its paths resolve in,
        and its path."""
        from .caffe_io import read_net_prototxt

        path = self._resolve(name)
        if not path.is_file():
            raise SolverError(f"solver {self.source}: net file '{name}' not found (looked in "
                              + ", ".join(str(d) for d in self.context.base_dirs) + ")")
        return read_net_prototxt(path), [path.parent, *self.context.base_dirs], str(path)

    def _make_net(self, param: Any, base_dirs: list[Path], phase: str, extra_state: Any,
                  origin: str) -> Any:
        from .net import Net as EngineNet
        Net = self.net_class or EngineNet

        # NetState precedence, as Caffe: the phase, then the net's own state, then the solver's
        state = caffe_pb2.NetState()
        state.phase = caffe_pb2.TRAIN if phase == "TRAIN" else caffe_pb2.TEST
        state.MergeFrom(param.state)
        if extra_state is not None:
            state.MergeFrom(extra_state)
        state.phase = caffe_pb2.TRAIN if phase == "TRAIN" else caffe_pb2.TEST
        param.state.CopyFrom(state)
        ctx = RunContext(self.context.rank, self.context.world_size, base_dirs)
        return Net(param, phase=phase, level=state.level, context=ctx, origin=origin)

    def _build_train_net(self) -> Any:
        p = self.param
        fields = [f for f in ("net", "net_param", "train_net", "train_net_param") if p.HasField(f)]
        if not fields:
            raise SolverError(f"solver {self.source}: no net: give one of net, net_param, "
                              "train_net, train_net_param")
        if len(fields) > 1:
            raise SolverError(f"solver {self.source}: more than one train net "
                              f"({', '.join(fields)}); give exactly one")
        kind = fields[0]
        if kind.endswith("_param"):
            glog.info(f"Creating training net specified in {kind}.")
            net_param = caffe_pb2.NetParameter()
            net_param.CopyFrom(getattr(p, kind))
            base_dirs, origin = list(self.context.base_dirs), self.source
        else:
            glog.info(f"Creating training net from {'net' if kind == 'net' else 'train_net'} "
                      f"file: {getattr(p, kind)}")
            net_param, base_dirs, origin = self._read_net(getattr(p, kind))
        return self._make_net(net_param, base_dirs, "TRAIN", p.train_state, origin)

    def _build_test_nets(self) -> list[Any]:
        p = self.param
        generic = [f for f in ("net", "net_param") if p.HasField(f)]
        n_specific = len(p.test_net_param) + len(p.test_net)
        where = f"solver {self.source}"
        if (generic and len(p.test_iter) < n_specific) or (not generic and len(p.test_iter) != n_specific):
            raise SolverError(f"{where}: test_iter must be given once for each test net "
                              f"({n_specific} test nets, {len(p.test_iter)} test_iter)")
        n_nets = len(p.test_iter)
        if len(p.test_state) and len(p.test_state) != n_nets:
            raise SolverError(f"{where}: test_state must be unspecified or given once per test net "
                              f"({n_nets} test nets, {len(p.test_state)} test_state)")
        if n_nets and p.test_interval <= 0:
            raise SolverError(f"{where}: test_iter is given, so test_interval must be > 0")
        specs: list[tuple[str, Any, list[Path], str]] = []
        for tp in p.test_net_param:
            net_param = caffe_pb2.NetParameter()
            net_param.CopyFrom(tp)
            specs.append(("test_net_param", net_param, list(self.context.base_dirs), self.source))
        for name in p.test_net:
            specs.append((f"test_net file: {name}", *self._read_net(name)))
        while len(specs) < n_nets:
            if p.HasField("net_param"):
                net_param = caffe_pb2.NetParameter()
                net_param.CopyFrom(p.net_param)
                specs.append(("net_param", net_param, list(self.context.base_dirs), self.source))
            else:
                specs.append((f"net file: {p.net}", *self._read_net(p.net)))
        nets = []
        for i, (source, net_param, base_dirs, origin) in enumerate(specs):
            if not self.is_root:
                break  # only the root tests; other ranks skip building (and opening) test data
            glog.info(f"Creating test net (#{i}) specified by {source}")
            nets.append(self._make_net(net_param, base_dirs, "TEST",
                                       p.test_state[i] if len(p.test_state) else None, origin))
        return nets
