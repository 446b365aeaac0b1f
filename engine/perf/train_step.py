"""A training step timed as a worker of a dense scheme runs it, with the wire left out.

`poseidon bench time` sets this beside PyTorch's training step (loss.backward and an SGD
step). A distributed worker's step does more than forward and backward: at release each
layer's gradients leave the GPU on the staging stream (engine/comm/staging.py), come back
the same way as the round's sum, and the layer is updated before its next forward.
``StagedRelease`` is a GradientSync doing exactly that with a world of one: the copies out
and back, the solver's update, and the waits, as a dense scheme makes them, without a peer.
"""
from __future__ import annotations

import time

from engine.comm.staging import Staged, Staging
from engine.comm.units import LayerSlot, ParamSlot, Unit, gather, scatter_sum
from engine.solver import Solver

from .timing import sync_device


class StagedRelease:
    """A world of one: release stages a layer's gradients to the host, and the layer's wait
    (before its next forward) copies them back and updates it."""

    def __init__(self, solver: Solver) -> None:
        self._solver = solver
        net = solver.net
        self._units: dict[int, Unit] = {}
        for i, layer in enumerate(net.param_layer_index):
            name = net.layer_names[layer]
            unit = self._units.get(layer)
            if unit is None:
                unit = self._units[layer] = Unit([LayerSlot(layer, name, [])], "ps")
            unit.layers[0].params.append(ParamSlot(i, f"{name}/{len(unit.layers[0].params)}",
                                                   net.learnable_params[i]))
        self._staging = Staging()
        self._pending: dict[int, Staged | None] = {}

    def release(self, layer_index: int) -> None:
        unit = self._units.get(layer_index)
        if unit is not None:
            self._pending[layer_index] = self._staging.begin(unit)

    def wait(self, layer_index: int) -> None:
        if layer_index not in self._pending:
            return
        staged = self._pending.pop(layer_index)
        unit = self._units[layer_index]
        vec = staged.wait() if staged is not None else gather(unit)
        if staged is None or not self._staging.scatter(unit, vec, vec):
            scatter_sum(unit, vec)
        self._solver.update_layer(layer_index)

    def wait_all(self) -> None:
        for layer in sorted(self._pending):
            self.wait(layer)

    def request(self, action: str) -> None:
        raise ValueError(f"a timed training step takes no {action!r} request")

    def take_request(self) -> str | None:
        return None

    def close(self) -> None:
        self._pending.clear()

    def state(self) -> bytes:
        return b""


def time_training_steps(solver: Solver, iterations: int) -> float:
    """Milliseconds per training step of ``solver`` with its gradients staged as a dense
    scheme's (``StagedRelease``), after two warm-up steps; the device synchronised once at
    the end, every update applied."""
    if iterations < 1:
        raise ValueError(f"iterations must be positive, got {iterations}")
    solver.attach_sync(StagedRelease(solver))
    solver.step(2)
    solver.wait_all()
    sync_device()
    start = time.perf_counter()
    solver.step(iterations)
    solver.wait_all()
    sync_device()
    return (time.perf_counter() - start) * 1000.0 / iterations
