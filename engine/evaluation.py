"""A net's test pass as Caffe's solver and `caffe test` run it: forward a number of batches,
sum every output element in float32, and report the means, with a loss output's weighted
value in Caffe's log form."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import backend, glog

f32 = np.float32


@dataclass
class TestResult:
    """Mean outputs of a test pass: (blob name, mean value, loss weight) per output element."""

    scores: list[tuple[str, float, float]] = field(default_factory=list)
    loss: float = 0.0


def loss_weights(net: Any) -> dict[str, float]:
    """Blob name -> loss weight for the net's loss outputs (Caffe's blob_loss_weights)."""
    by_id = {id(net.top_vecs[li][j]): w for li, j, w in net.loss_tops}
    return {name: by_id[id(blob)] for name, blob in net.blobs.items() if id(blob) in by_id}


def run_test_passes(net: Any, iterations: int,
                    on_batch: Callable[[int, str, float], None] | None = None,
                    interrupted: Callable[[], bool] | None = None) -> TestResult | None:
    """Forward ``net`` ``iterations`` times, summing every output element in float32 as
    Caffe does; returns the means, or None when ``interrupted()`` said stop."""
    weights = loss_weights(net)
    sums: list[Any] = []
    names: list[str] = []
    loss = f32(0)
    for i in range(iterations):
        if interrupted is not None and interrupted():
            return None
        loss += f32(net.forward_prefilled())
        k = 0
        for name in net.output_blob_names:
            for value in backend.to_numpy(net.blobs[name].data).astype(np.float32).ravel():
                if i == 0:
                    sums.append(value)
                    names.append(name)
                else:
                    sums[k] += value
                k += 1
                if on_batch is not None:
                    on_batch(i, name, float(value))
    n = f32(max(iterations, 1))
    return TestResult([(name, float(s / n), weights.get(name, 0.0)) for name, s in zip(names, sums)],
                      float(loss / n))


def score_line(name: str, value: float, weight: float) -> str:
    """``name = v`` plus Caffe's `` (* w = x loss)`` for a loss output."""
    tail = f" (* {glog.fmt(weight)} = {glog.fmt(f32(weight) * f32(value))} loss)" if weight else ""
    return f"{name} = {glog.fmt(value)}{tail}"
