"""The DAG model of synchronous SGD (Shi et al., arXiv:1805.03812), as Poseidon runs it.

An event simulation of one worker's iterations, with the resources the real communicator has
(engine/comm/syncer.py, schemes/):

- the training thread runs forward layer by layer; before a layer with parameters it waits for
  that layer's update of the previous iteration (the per-layer wait), then backward top-down;
  the moment a layer's backward ends its gradient is released (wait-free backpropagation);
- the busiest node's link: each side (sending, receiving) is a FIFO that moves released layers
  in release order, one at a time. A layer holds a side for a span of at least the bytes the
  link carries for it times beta, so no side is ever busier than its bandwidth (LinkUse records
  every span; tests/test_perf_physics.py checks it over random nets, schemes and links). Each
  scheme's ``timing`` (engine/comm/schemes) gives the spans, as the planner sees them:
  * PS: the real chunk layout (``ps.make_layout``) says which node's shard holds each chunk;
    the node whose link carries the most of the whole table is priced for every layer. It
    sends its pushes to the remote shards and its shard's sums to the P-1 remote workers, and
    receives the mirror image. A sum leaves once the slowest push of its chunk is in, and
    many flows through one side share it unfairly (``Link.slowdown``);
  * SFB: a node sends its factors u (K x N) and v (K x M) to P-1 peers and receives theirs;
  * ring: 2(P-1) steps of 1/P of the layer each way, pipelined in sub-chunks: both sides are
    held from the first step to the last, the latency paid once per step;
  * hd: 2·log2(P) steps of halves, quarters, ... of the layer, each waiting for the one
    before (a folded pair's whole vector before and after when P is not a power of two);
  * two levels: the network round starts after the machine's reduce-scatter, and a
    machine's k owners talk to the same other machines (their flows share a path fairly);
- one progress thread rebuilds SFB gradients (one GEMM of P·K·M·N multiply-adds), adds ring
  segments, writes the summed gradient and runs the solver update of the layer (the mean in
  it); then that layer's next forward may start.

One worker (P = 1) runs Caffe's plain loop: forward, backward, then every update. The
iteration time is the steady-state period (the last of several simulated iterations), so the
overlap of one iteration's communication with the next one's forward is counted.
With a trace's measured communication (``MEASURED``: each layer holds the network for its
measured ``comm_ms``) this is DESIGN.md's recurrence of one FIFO, with no link model at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Sequence

import numpy as np

from engine.comm.cost import Device, LayerInfo, LayerTiming, level_timing, shared
from engine.comm.link import Link
from engine.comm.planner import COMM_MODES, DEFAULT_LOCAL_LINK, plan_layers
from engine.comm.schemes import NETWORK_SCHEMES
from engine.comm.schemes import SCHEMES as SCHEME_CLASSES
from engine.comm.chunks import DEFAULT_CHUNK_BYTES, PSParam, make_layout

from .netinfo import NetInfo
from .trace import Trace

#: what --scheme takes: the planner's modes (auto, hybrid) and every scheme that runs between
#: machines (the model's nodes are machines; shm runs inside one)
SCHEMES = tuple(m for m in COMM_MODES if m not in SCHEME_CLASSES or m in NETWORK_SCHEMES)
ITERATIONS = 6  # simulated; the last period is the steady state
#: the bytes of a gradient value on the wire: fp32, as the planner prices dense schemes
WIRE_ITEMSIZE = 4
#: the "scheme" of a prediction from a trace's measured communication times
MEASURED = "measured"

__all__ = ["Device", "LayerTiming", "LinkUse", "MEASURED", "Prediction", "predict", "sweep",
           "SCHEMES"]


@dataclass(frozen=True)
class LinkUse:
    """A span one layer held one side of the busiest node's link (``up``: sending, ``down``:
    receiving), and the bytes the node's whole link carried for it in that span."""
    side: str
    layer: str
    iteration: int
    start_s: float
    end_s: float
    bytes: float


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
    #: every span of every simulated iteration, in the order the link sides were taken
    link_use: list[LinkUse] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The scalar fields (not the per-layer timings and link spans: a deep copy of those
        took seconds for GoogLeNet's 16 worker counts)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("layers", "link_use")}


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


def _busiest_node(chunks: dict[int, list[tuple[int, int]]], p: int) -> int:
    """The node whose link carries the most of the PS table (each side): its shard takes
    P-1 pushes and sends P-1 sums of each of its chunks, its worker one of each other chunk."""
    load = [0.0] * p
    for layer in chunks.values():
        for nbytes, shard in layer:
            for node in range(p):
                load[node] += (p - 1) * nbytes if node == shard else nbytes
    return max(range(p), key=lambda n: load[n])


def _layer_costs(info: LayerInfo, scheme: str, p: int, link: Link, device: Device,
                 chunks: list[tuple[int, int]], chunk_bytes: int, node: int) -> LayerTiming:
    """Link time and progress-thread time of one layer on the busiest node."""
    if scheme == "ps":  # one node's link for every layer: the job's whole table's busiest
        return SCHEME_CLASSES["ps"].timing(info, p, link, device, chunk_bytes, info.itemsize,
                                           chunks=chunks, node=node)
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


def measured_costs(info: NetInfo, trace: Trace) -> dict[int, LayerTiming]:
    """Each layer with parameters holds the network for its measured ``comm_ms`` (a trace of a
    distributed run) and its update is then there: DESIGN.md's recurrence with measured
    communication times, no link model, nothing else priced."""
    traced = trace.by_name()
    missing = [i.name for i in info.params
               if i.name not in traced or traced[i.name].comm_ms is None]
    if missing:
        raise ValueError(f"the trace measured no comm_ms for layer(s) {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} (every layer with parameters "
                         "needs one, 0 for a layer fused into another's message)")
    out = {}
    for i in info.params:
        c = traced[i.name].comm_ms / 1e3  # type: ignore[operator]
        out[i.layer] = LayerTiming(i.name, MEASURED, 0.0, 0.0, c, c, 0.0, 0.0, 0.0)
    return out


def predict(info: NetInfo, trace: Trace, workers: int, scheme: str, link: Link,
            device: Device | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            slots: int = 1, local_link: Link | None = None, levels: bool = True) -> Prediction:
    """The steady-state iteration of ``workers`` workers synchronising by ``scheme``;
    ``slots`` of them per machine, reducing inside each machine first (``levels``) or each a
    node of its own sharing its machine's link with its mates. ``scheme`` MEASURED: the
    trace's measured communication instead of the link model (``measured_costs``)."""
    if scheme == MEASURED and workers > 1:
        if workers != trace.workers:
            raise ValueError(f"the trace's communication was measured with {trace.workers} "
                             f"workers, not {workers}")
        fwd, bwd = _times(info, trace)
        period, use = _run(fwd, bwd, measured_costs(info, trace), device or Device())
        compute = sum(fwd) + sum(bwd)
        return Prediction(scheme, workers, info.batch, period, compute,
                          max(period - compute, 0.0), _rate(workers * info.batch, period),
                          link_use=use)
    if scheme not in SCHEMES and scheme != MEASURED:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    device = device or Device()
    fwd, bwd = _times(info, trace)
    compute = sum(fwd) + sum(bwd)
    batch = info.batch
    if workers == 1:  # nothing to communicate: the updates are what is not compute
        update = sum(device.update_s(i.params * i.itemsize) for i in info.params)
        it = compute + update
        return Prediction(scheme, 1, batch, it, compute, update, batch / it if it else 0.0)
    # the plan is the planner's, who sees the link as its probe does (fair shares); the
    # layers are priced on the link as it is
    planned = replace(link, unfair=0.0)
    if slots > 1 and workers > slots and levels:  # each scheme's two-level cost
        local_link = local_link or DEFAULT_LOCAL_LINK
        plans = plan_layers(info.params, workers, comm=scheme, link=planned, device=device,
                            chunk_bytes=chunk_bytes, slots=slots, local_link=local_link)
        costs = {}
        for pl in plans:
            cls = SCHEME_CLASSES[pl.scheme]
            costs[pl.info.layer] = level_timing(
                cls, pl.info, workers, slots, link, local_link, device, chunk_bytes,
                WIRE_ITEMSIZE if cls.dense else pl.info.itemsize)
    else:
        plans = plan_layers(info.params, workers, comm=scheme, link=planned, device=device,
                            chunk_bytes=chunk_bytes)
        chunks = _chunk_bytes_by_layer([pl.info for pl in plans if pl.scheme == "ps"],
                                       workers, chunk_bytes)
        node = _busiest_node(chunks, workers)
        if slots > 1:  # flat workers of a machine: their P-1 peers are on M-1 other machines
            link = replace(link, peers_per_host=(workers - 1) / max(workers // slots - 1, 1))
        costs = {}
        for pl in plans:  # flat workers of one machine share its link (machine_share ways)
            ways = SCHEME_CLASSES[pl.scheme].machine_share(workers, slots)
            costs[pl.info.layer] = replace(_layer_costs(
                pl.info, pl.scheme, workers, shared(link, ways), device,
                chunks.get(pl.info.layer, []), chunk_bytes, node), ways=ways)
    period, use = _run(fwd, bwd, costs, device)
    bytes_per_node = sum(c.bytes_sent + c.bytes_received for c in costs.values())
    return Prediction(scheme, workers, batch, period, compute, max(period - compute, 0.0),
                      _rate(workers * batch, period), bytes_per_node=bytes_per_node,
                      layers=list(costs.values()), link_use=use)


def _rate(images: int, period: float) -> float:
    return images / period if period > 0 else 0.0  # a net of no time at all


def _run(fwd: Sequence[float], bwd: Sequence[float], costs: dict[int, LayerTiming],
         device: Device) -> tuple[float, list[LinkUse]]:
    """The steady-state period of ITERATIONS iterations, and the link spans they took."""
    ready = {layer: 0.0 for layer in costs}  # when each layer's update is applied
    starts: list[float] = []
    use: list[LinkUse] = []
    t = 0.0
    for it in range(ITERATIONS):
        for i, f in enumerate(fwd):
            if i in ready:
                t = max(t, ready[i])
            if i == 0:
                starts.append(t)
            t += f
        # the forward waited for every update, so the link and the reducer are free by now
        up_free = down_free = reducer_free = t
        for i in range(len(bwd) - 1, -1, -1):
            t += bwd[i]
            if i in costs:  # released: each side of the link a FIFO in release order
                c = costs[i]
                up_start = max(up_free, t + c.start_s)
                up_free = up_start + c.up_s
                down_start = max(down_free, up_start + c.lag_s, up_free + c.tail_s - c.down_s)
                down_free = down_start + c.down_s
                use.append(LinkUse("up", c.name, it, up_start, up_free, c.bytes_sent * c.ways))
                use.append(LinkUse("down", c.name, it, down_start, down_free,
                                   c.bytes_received * c.ways))
                reducer_free = max(reducer_free, down_free) + c.reduce_s
                ready[i] = reducer_free
        if device.update_on_device:  # the updates' kernels take the device's time too
            t += sum(c.update_s for c in costs.values())
    return starts[-1] - starts[-2], use


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
