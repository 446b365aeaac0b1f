"""Caffe's `time` benchmark: average forward, backward and per-layer times of a net."""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from engine import backend
from engine.net import Net
from .trace import FORMAT, VERSION, LayerTime  # a timing report is a layer-time trace


@dataclass
class TimingReport:
    net: str
    iterations: int
    forward_ms: float
    backward_ms: float
    layers: list[LayerTime] = field(default_factory=list)
    batch: int | None = None
    device: str = ""

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "net": self.net, "batch": self.batch,
                "device": self.device,
                "source": f"poseidon time --json, {datetime.date.today()}, "
                          f"{self.iterations} iterations",
                "iterations": self.iterations,
                "forward_ms": self.forward_ms, "backward_ms": self.backward_ms,
                "forward_backward_ms": self.total_ms,
                "layers": [l.as_dict() for l in self.layers]}


def sync_device() -> None:
    """Wait for queued GPU work so wall-clock times mean something."""
    xp = backend.xp_default()
    if xp is not np:
        xp.cuda.Device().synchronize()


def time_passes(net: Net, iterations: int) -> float:
    """Milliseconds per forward+backward pass, each timed whole after two warm-up passes, the
    device synchronised once at the end (`caffe time`'s total, without a timer per layer that
    would stop a GPU's queue after every layer)."""
    if iterations < 1:
        raise ValueError(f"iterations must be positive, got {iterations}")
    for _ in range(2):  # kernels compile, plans build, the memory pool fills
        net.forward_prefilled()
        net.backward()
    sync_device()
    start = time.perf_counter()
    for _ in range(iterations):
        net.forward_prefilled()
        net.backward()
    sync_device()
    return (time.perf_counter() - start) * 1000.0 / iterations


def time_net(net: Net, iterations: int = 50,
             each: Callable[[int, float], None] | None = None) -> TimingReport:
    """Time ``iterations`` forward+backward passes layer by layer, after one warm-up pass,
    as `caffe time` does (per-layer times are per iteration, averaged); ``each(i, ms)`` hears
    every pass as it ends (`caffe time`'s "Iteration: i forward-backward time" line)."""
    if iterations < 1:
        raise ValueError(f"iterations must be positive, got {iterations}")
    net.forward_prefilled()
    net.backward()
    n = len(net.layers)
    fwd = [0.0] * n
    bwd = [0.0] * n
    clock = time.perf_counter
    for it in range(iterations):
        began = clock()
        for i in range(n):
            start = clock()
            net.forward_layer(i)
            sync_device()
            fwd[i] += clock() - start
        net.seed_loss_diffs()
        for i in range(n - 1, -1, -1):
            start = clock()
            net.backward_layer(i)
            sync_device()
            bwd[i] += clock() - start
        if each is not None:
            each(it + 1, (clock() - began) * 1000.0)
    scale = 1000.0 / iterations
    layers = [LayerTime(name, layer.type, f * scale, b * scale)
              for name, layer, f, b in zip(net.layer_names, net.layers, fwd, bwd)]
    first = net.top_vecs[0] if net.top_vecs and net.top_vecs[0] else None
    batch = int(first[0].shape[0]) if first and first[0].shape else None
    return TimingReport(net.name, iterations, sum(fwd) * scale, sum(bwd) * scale, layers,
                        batch, backend.device_name())
