"""Replayed compute: train with each layer's forward and backward replaced by a wait.

`poseidon train --replay T.json --time-scale S` reproduces a GPU cluster's ratio of compute to
communication on a machine without those GPUs: every layer waits its traced time x S instead of
computing, while everything else is real. The blobs keep their real shapes, the parameters and
their gradients are real arrays of real sizes, the solver update runs, and the communicator
(wait-free release after each backward, the per-layer wait before each forward) sends real
gradients of real sizes over the real sockets. The emulated cluster scales its links' bandwidth
down by the same S, so the machine's CPU is not what limits the run.

The training net is built with its data layers replaced by Input layers of the same shapes
(engine/perf/netinfo.py), so no database is read, and without test nets: a replayed run
measures speed, not accuracy.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Sequence

from engine.factors import SufficientFactors
from engine.pb import caffe_pb2

from .netinfo import read_train_net, with_inputs
from .trace import Trace, load_trace


class ReplayError(ValueError):
    """A trace that does not fit the net; the message names the layer."""


def wait(seconds: float) -> None:
    """Sleep ``seconds``; the last half millisecond spins, since a sleep wakes late by about
    that much and replayed layers are short (a spin that short costs no measurable CPU)."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    if seconds > 0.0005:
        time.sleep(seconds - 0.0005)
    while time.perf_counter() < end:
        pass


class ReplayLayer:
    """Stands in for one layer: its shapes, parameters and sufficient factors are the real
    layer's; its forward and backward only wait."""

    def __init__(self, layer: Any, forward_s: float, backward_s: float) -> None:
        self._layer = layer
        self.forward_s = forward_s
        self.backward_s = backward_s

    def reshape(self, bottom: Sequence[Any], top: Sequence[Any]) -> None:
        self._layer.reshape(bottom, top)

    def forward(self, bottom: Sequence[Any], top: Sequence[Any]) -> None:
        wait(self.forward_s)

    def backward(self, top: Sequence[Any], propagate_down: Sequence[bool],
                 bottom: Sequence[Any]) -> None:
        wait(self.backward_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


class ReplayFactorLayer(ReplayLayer, SufficientFactors):
    """Stands in for a layer with sufficient factors: SFB sends the real factors of each pass
    (the top diff and bottom data, whatever their values), so the bytes are the real ones."""

    def backward(self, top: Sequence[Any], propagate_down: Sequence[bool],
                 bottom: Sequence[Any]) -> None:
        super().backward(top, propagate_down, bottom)
        self.remember_factors(top, bottom)

    def factor_spec(self) -> Any:
        return self._layer.factor_spec()

    def sufficient_factors(self) -> tuple[Any, Any]:
        return self._layer.sufficient_factors()

    def remember_factors(self, top: Any, bottom: Any) -> None:
        self._layer.remember_factors(top, bottom)


@functools.lru_cache(maxsize=4)
def replay_solver_param(solver: str | Path) -> caffe_pb2.SolverParameter:
    """The solver with its training net inline, data layers as Inputs, and no testing. Kept
    for the process (an elastic worker builds its solver again for every generation, and this
    builds a net to find the inputs' shapes); the Solver copies it, nothing changes it."""
    from engine.caffe_io import read_solver_prototxt

    path = Path(solver)
    param = read_solver_prototxt(path)
    net, _ = with_inputs(read_train_net(path), where=path.parent)
    for f in ("net", "net_param", "train_net", "train_net_param", "test_net", "test_net_param",
              "test_iter", "test_state"):
        param.ClearField(f)
    param.net_param.CopyFrom(net)
    param.test_interval = 0
    if param.snapshot_prefix and not Path(param.snapshot_prefix).is_absolute():
        param.snapshot_prefix = str(path.parent / param.snapshot_prefix)
    return param


def install(net: Any, trace: Trace, time_scale: float) -> None:
    """Replace every layer of ``net`` by its replay, times from ``trace`` x ``time_scale``."""
    traced = trace.by_name()
    missing = [name for name, layer in zip(net.layer_names, net.layers)
               if name not in traced and layer.type != "Split"]
    if missing:
        raise ReplayError(f"trace {trace.net or '?'} has no times for layer(s) "
                          f"{', '.join(missing[:5])} of net '{net.name}'")
    for i, name in enumerate(net.layer_names):
        t = traced.get(name)
        fwd = t.forward_ms * time_scale / 1e3 if t else 0.0
        bwd = t.backward_ms * time_scale / 1e3 if t else 0.0
        kind = ReplayFactorLayer if isinstance(net.layers[i], SufficientFactors) else ReplayLayer
        net.layers[i] = kind(net.layers[i], fwd, bwd)


def make_solver(solver: str | Path, trace_path: str | Path, time_scale: float,
                **solver_args: Any) -> Any:
    """A Solver whose training net replays ``trace_path``'s layer times x ``time_scale``."""
    from engine import glog
    from engine.context import RunContext
    from engine.solver import Solver

    if not time_scale > 0:
        raise ReplayError(f"--time-scale must be positive, got {time_scale:g}")
    trace = load_trace(trace_path)
    context = solver_args.pop("context", None) or RunContext()
    context = RunContext(context.rank, context.world_size, [Path(solver).parent])
    s = Solver(replay_solver_param(solver), context=context, **solver_args)
    install(s.net, trace, time_scale)
    glog.info(f"Replaying layer times from {trace_path} x {time_scale:g} ({trace.source}); "
              "no data is read and no test net is run")
    return s
