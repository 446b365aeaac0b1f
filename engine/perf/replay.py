"""Replayed compute: train with a GPU worker's device work replaced by waits.

`poseidon train --replay T.json --time-scale S` reproduces a GPU cluster's ratio of compute to
communication on a machine without those GPUs. What a GPU worker runs on its device waits
instead, x S: each layer's forward and backward their traced times, and the solver update and
SFB's rebuild of a fully connected layer's gradient the time the default GPU worker of the cost
model takes (``DEVICE``: the ``Device`` that `poseidon simulate` assumes, its update 300 GB/s
and its GEMMs 5 TFLOP/s). The layers and the update hold one device lock, as kernels queue on
one stream; the rebuild waits on the communicator's thread, where the model prices it.
Everything on the host is real: the blobs keep their real shapes, the gradients are real arrays
of real sizes, and the communicator (wait-free release after each backward, the per-layer wait
before each forward) sends them over the real sockets, signs and checks them, and the shards
sum them. The emulated cluster scales its links' bandwidth down by the same S, so the machine's
CPU is not what limits the run. Nothing computes, so the parameters never change.

The training net is built with its data layers replaced by Input layers of the same shapes
(engine/perf/netinfo.py), so no database is read, and without test nets: a replayed run
measures speed, not accuracy.
"""
from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from engine.comm.cost import Device
from engine.factors import SufficientFactors
from engine.pb import caffe_pb2
from engine.solver import Solver

from .netinfo import read_train_net, with_inputs
from .trace import Trace, load_trace


class ReplayError(ValueError):
    """A trace that does not fit the net; the message names the layer."""


#: a kernel asked for this soon after the last one's end was queued behind it (a stream runs
#: its kernels back to back): it starts at that end, so a sleep's late wake-up (~0.1 ms, more
#: on a busy machine) is not added to every layer, and no thread spins to avoid it
QUEUED_S = 0.002


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (late by the wake-up)."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


#: the GPU worker whose update and rebuild a replayed run waits for (simulate's default)
DEVICE = Device()


class ReplayDevice:
    """One emulated GPU: its work waits ``time_scale`` x its time, and what runs on its one
    stream (the layers, the updates) waits in turn."""

    def __init__(self, time_scale: float, device: Device = DEVICE) -> None:
        self.time_scale = time_scale
        self.device = device
        self._stream = threading.Lock()
        self._end = float("-inf")  # when the stream's last kernel ended

    def compute(self, seconds: float) -> None:
        """A kernel of ``seconds`` (already scaled), in its turn on the stream."""
        with self._stream:
            now = time.perf_counter()
            start = self._end if now - self._end < QUEUED_S else now
            self._end = start + max(seconds, 0.0)
            sleep_until(self._end)

    def update(self, nbytes: int) -> None:
        """The solver update of ``nbytes`` of parameters."""
        self.compute(self.device.update_s(nbytes) * self.time_scale)

    def gemm(self, flops: float) -> None:
        """A product of ``flops`` (SFB's rebuild, on the communicator's thread)."""
        time.sleep(flops / self.device.gemm_flops_per_s * self.time_scale)


class ReplayLayer:
    """Stands in for one layer: its shapes, parameters and sufficient factors are the real
    layer's; its forward and backward only wait."""

    def __init__(self, layer: Any, forward_s: float, backward_s: float,
                 device: ReplayDevice) -> None:
        self._layer = layer
        self.forward_s = forward_s
        self.backward_s = backward_s
        self._device = device

    def reshape(self, bottom: Sequence[Any], top: Sequence[Any]) -> None:
        self._layer.reshape(bottom, top)

    def forward(self, bottom: Sequence[Any], top: Sequence[Any]) -> None:
        self._device.compute(self.forward_s)

    def backward(self, top: Sequence[Any], propagate_down: Sequence[bool],
                 bottom: Sequence[Any]) -> None:
        self._device.compute(self.backward_s)

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

    def rebuild_gradient(self, u: Any, v: Any) -> None:
        spec = self._layer.factor_spec()
        self._device.gemm(2.0 * u.shape[0] * spec.m * spec.n)


class ReplaySolver(Solver):
    """A Solver whose updates wait as its emulated ``device`` would (``make_solver`` sets it)."""

    device: ReplayDevice

    def _update_param(self, i: int, workers: int) -> None:
        blob = self.net.learnable_params[i]
        self.device.update(blob.count * blob.diff.dtype.itemsize)


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


def install(net: Any, trace: Trace, device: ReplayDevice) -> None:
    """Replace every layer of ``net`` by its replay on ``device``, times from ``trace``."""
    traced = trace.by_name()
    missing = [name for name, layer in zip(net.layer_names, net.layers)
               if name not in traced and layer.type != "Split"]
    if missing:
        raise ReplayError(f"trace {trace.net or '?'} has no times for layer(s) "
                          f"{', '.join(missing[:5])} of net '{net.name}'")
    for i, name in enumerate(net.layer_names):
        t = traced.get(name)
        fwd = t.forward_ms * device.time_scale / 1e3 if t else 0.0
        bwd = t.backward_ms * device.time_scale / 1e3 if t else 0.0
        kind = ReplayFactorLayer if isinstance(net.layers[i], SufficientFactors) else ReplayLayer
        net.layers[i] = kind(net.layers[i], fwd, bwd, device)


def make_solver(solver: str | Path, trace_path: str | Path, time_scale: float,
                device: Device = DEVICE, **solver_args: Any) -> Any:
    """A Solver whose training net replays ``trace_path``'s layer times x ``time_scale``, its
    updates and SFB's rebuilds as ``device``'s x ``time_scale``."""
    from engine import glog
    from engine.context import RunContext

    if not time_scale > 0:
        raise ReplayError(f"--time-scale must be positive, got {time_scale:g}")
    trace = load_trace(trace_path)
    context = solver_args.pop("context", None) or RunContext()
    context = RunContext(context.rank, context.world_size, [Path(solver).parent])
    s = ReplaySolver(replay_solver_param(solver), context=context, **solver_args)
    s.device = ReplayDevice(time_scale, device)
    install(s.net, trace, s.device)
    glog.info(f"Replaying layer times from {trace_path} x {time_scale:g} ({trace.source}), "
              f"the updates and SFB's rebuilds as a GPU's ({device.update_bytes_per_s / 1e9:g} GB/s, "
              f"GEMM {device.gemm_flops_per_s / 1e12:g} TFLOP/s); no data is read and no test "
              "net is run")
    return s
