"""The DAG model of synchronous SGD (Shi et al., arXiv:1805.03812), as Poseidon runs it.

An event simulation of one worker's iterations, with the resources the real communicator has
(engine/comm/syncer.py, schemes/):

- the training thread runs forward layer by layer; before a layer with parameters it waits for
  that layer's update of the previous iteration (the per-layer wait), then backward top-down;
  the moment a layer's backward ends its gradient is released (wait-free backpropagation);
- the node's link moves released layers in release order, one after the other (one sender
  thread, one socket per peer). A link is full duplex and each direction is shaped on its own,
  so a layer occupies it for ``alpha`` per message round plus ``beta`` times the larger of the
  bytes the node sends and receives for it;
  * PS: the real chunk layout (``ps.make_layout``) says which node's shard holds each chunk.
    A node sends its pushes to the remote shards and its own shard's sums to the P-1 remote
    workers, and receives the mirror image; the busiest node sets the pace (all wait for it).
    A sum can only leave once the last push of its chunk arrived and the shard added the P
    pushes, so one chunk's push and addition are not overlapped;
  * SFB: a node sends its factors u (K x N) and v (K x M) to P-1 peers and receives theirs;
  * ring: 2(P-1) steps of 1/P of the layer each way, pipelined in sub-chunks;
  * hd: 2·log2(P) steps of halves, quarters, ... of the layer, each waiting for the one
    before (a folded pair's whole vector before and after when P is not a power of two);
  each scheme's ``timing`` (engine/comm/schemes) prices a layer, as the planner does;
- one progress thread rebuilds SFB gradients (one GEMM of P·K·M·N multiply-adds), adds ring
  segments, writes the mean gradient and runs the solver update of the layer; then that
  layer's next forward may start.

One worker (P = 1) runs Caffe's plain loop: forward, backward, then every update. The
iteration time is the steady-state period (the last of several simulated iterations), so the
overlap of one iteration's communication with the next one's forward is counted.
The recurrence of DESIGN.md is the special case of one FIFO link and no reducer cost.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from engine.comm.levels import shared
from engine.comm.planner import COMM_MODES, LayerInfo, plan_layers
from engine.comm.schemes import NETWORK_SCHEMES, SCHEMES as SCHEME_CLASSES
from engine.comm.schemes.base import Device, LayerTiming
from engine.comm.schemes.ps import DEFAULT_CHUNK_BYTES, PSParam, make_layout

from engine.comm.link import Link
from .netinfo import NetInfo
from .trace import Trace

#: what --scheme takes: the planner's modes (auto, hybrid) and every scheme that runs between
#: machines (the model's nodes are machines; shm runs inside one)
SCHEMES = tuple(m for m in COMM_MODES if m not in SCHEME_CLASSES or m in NETWORK_SCHEMES)
ITERATIONS = 6  # simulated; the last period is the steady state

__all__ = ["Device", "LayerTiming", "Prediction", "predict", "sweep", "SCHEMES"]


@dataclass
class Prediction:
    scheme: str
    workers: int
    batch: int
    iteration_s: float
    compute_s: float
    exposed_comm_s: float
    images_per_s: float
    speedup: float = 1.0
    efficiency: float = 1.0
    bytes_per_node: float = 0.0  # sent + received by the busiest node per iteration
    layers: list[LayerTiming] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _chunk_bytes_by_layer(params: Sequence[LayerInfo], p: int, chunk_bytes: int
                          ) -> dict[int, list[tuple[int, int]]]:
    """layer -> [(bytes, shard)] of its PS chunks, from the communicator's own layout (one
    vector per layer, as an unfused PS unit)."""
    vectors = [PSParam(k, info.layer, info.params, f"<f{info.itemsize}")
               for k, info in enumerate(params)]
    out: dict[int, list[tuple[int, int]]] = {}
    itemsize = {v.index: np.dtype(v.dtype).itemsize for v in vectors}
    for c in make_layout(vectors, p, chunk_bytes):
        out.setdefault(c.layer, []).append((c.count * itemsize[c.param], c.shard))
    return out


def _layer_costs(info: LayerInfo, scheme: str, p: int, link: Link, device: Device,
                 chunks: list[tuple[int, int]], chunk_bytes: int) -> LayerTiming:
    """Link time and progress-thread time of one layer on the busiest node."""
    if scheme == "ps":  # the job's whole table decides which node is busiest
        return SCHEME_CLASSES["ps"].timing(info, p, link, device, chunk_bytes, info.itemsize,
                                           chunks=chunks)
    return SCHEME_CLASSES[scheme].timing(info, p, link, device, chunk_bytes, info.itemsize)


def _times(info: NetInfo, trace: Trace) -> tuple[list[float], list[float]]:
    """Per-layer forward and backward seconds in net order (layers the trace lacks, such as
    the Split layers the engine inserts, cost nothing)."""
    traced = trace.by_name()
    fwd = [traced[l.name].forward_ms / 1e3 if l.name in traced else 0.0 for l in info.layers]
    bwd = [traced[l.name].backward_ms / 1e3 if l.name in traced else 0.0 for l in info.layers]
    return fwd, bwd


def missing_layers(info: NetInfo, trace: Trace) -> list[str]:
    """Layers with parameters or compute that the trace does not time (a wrong trace)."""
    traced = trace.by_name()
    return [l.name for l in info.layers if l.name not in traced and l.type != "Split"]


def predict(info: NetInfo, trace: Trace, workers: int, scheme: str, link: Link,
            device: Device | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            slots: int = 1, local_link: Link | None = None, levels: bool = True) -> Prediction:
    """The steady-state iteration of ``workers`` workers synchronising by ``scheme``;
    ``slots`` of them per machine, reducing inside each machine first (``levels``) or each a
    node of its own sharing its machine's link with its mates."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    device = device or Device()
    fwd, bwd = _times(info, trace)
    compute = sum(fwd) + sum(bwd)
    batch = info.batch
    if workers == 1:
        update = sum(device.update_s(i.params * i.itemsize) for i in info.params)
        it = compute + update
        return Prediction(scheme, 1, batch, it, compute, 0.0, batch / it if it else 0.0)
    if slots > 1 and workers > slots and levels:  # each scheme's two-level cost
        plans = plan_layers(info.params, workers, comm=scheme, link=link, device=device,
                            chunk_bytes=chunk_bytes, slots=slots, local_link=local_link)
        costs = {pl.info.layer: pl.timings[pl.scheme] for pl in plans}
    else:
        plans = plan_layers(info.params, workers, comm=scheme, link=link, device=device,
                            chunk_bytes=chunk_bytes)
        chunks = _chunk_bytes_by_layer([pl.info for pl in plans if pl.scheme == "ps"],
                                       workers, chunk_bytes)
        costs = {pl.info.layer: _layer_costs(
            pl.info, pl.scheme, workers,
            shared(link, SCHEME_CLASSES[pl.scheme].machine_share(workers, slots)),
            device, chunks.get(pl.info.layer, []), chunk_bytes) for pl in plans}
    ready = {layer: 0.0 for layer in costs}  # when each layer's update is applied
    starts = []
    t = 0.0
    for _ in range(ITERATIONS):
        for i, f in enumerate(fwd):
            if i in ready:
                t = max(t, ready[i])
            if i == 0:
                starts.append(t)
            t += f
        up_free = down_free = reducer_free = t
        for i in range(len(bwd) - 1, -1, -1):
            t += bwd[i]
            if i in costs:  # released: on the link in release order, then the reducer
                c = costs[i]
                up_start = max(up_free, t)
                up_free = up_start + c.up_s
                down_free = max(max(down_free, up_start + c.lag_s) + c.down_s, up_free + c.tail_s)
                reducer_free = max(reducer_free, down_free) + c.reduce_s
                ready[i] = reducer_free
        if device.update_on_device:  # the updates' kernels take the device's time too
            t += sum(c.update_s for c in costs.values())
    period = starts[-1] - starts[-2]
    bytes_per_node = sum(c.bytes_sent + c.bytes_received for c in costs.values())
    return Prediction(scheme, workers, batch, period, compute, max(period - compute, 0.0),
                      workers * batch / period, bytes_per_node=bytes_per_node,
                      layers=list(costs.values()))


def sweep(info: NetInfo, trace: Trace, workers: Sequence[int], schemes: Sequence[str],
          link: Link, device: Device | None = None,
          chunk_bytes: int = DEFAULT_CHUNK_BYTES, slots: int = 1,
          local_link: Link | None = None) -> list[Prediction]:
    """Every (scheme, P), with speedup and efficiency against one worker (same batch each);
    with ``slots`` workers per machine, P counts workers (a multiple of ``slots``)."""
    one = predict(info, trace, 1, schemes[0], link, device, chunk_bytes)
    out = []
    for scheme in schemes:
        for p in workers:
            pr = predict(info, trace, p, scheme, link, device, chunk_bytes,
                         slots=slots if p >= slots else 1, local_link=local_link)
            pr.speedup = pr.images_per_s / one.images_per_s if one.images_per_s else 0.0
            pr.efficiency = pr.speedup / p
            out.append(pr)
    return out
