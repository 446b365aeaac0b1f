"""What synchronising a layer costs: the facts the planner and the DAG model price
(``LayerInfo``), the machine's speeds outside the link (``Device``), one layer's cost on the
busiest node (``LayerTiming``), the byte counts of SACP (Poseidon's cost formulas) and a
scheme's cost in two levels (``level_timing``). Below the planner, the levels and the schemes,
which all price layers with it; each scheme's own ``timing`` (engine/comm/schemes) fills a
``LayerTiming``.

SACP's byte counts, floats sent + received per node per iteration, for an FC layer with an
M x N weight, batch K, P1 workers and P2 server shards:

    PS, worker only               2MN
    PS, node = worker + server    2MN(P1+P2-2)/P2
    SFB                           2K(P1-1)(M+N)
    ring allreduce                4MN(P1-1)/P1
    halving-doubling (hd)         4MN(P1-1)/P1 when P1 is a power of two (ring's bytes in
                                  2 log2 P1 steps instead of 2(P1-1))
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


def cost_ps_worker(params: int) -> float:
    return 2.0 * params


def cost_ps_node(params: int, p1: int, p2: int) -> float:
    return 2.0 * params * (p1 + p2 - 2) / p2


def cost_sfb(m: int, n: int, k: int, p1: int) -> float:
    return 2.0 * k * (p1 - 1) * (m + n)


def cost_ring(params: int, p1: int) -> float:
    return 4.0 * params * (p1 - 1) / p1


@dataclass
class LayerInfo:
    """What the planner knows of a layer with learnable parameters."""
    layer: int
    name: str
    shapes: list[tuple[int, ...]]
    #: (K, M, N) when the layer can hand out sufficient factors u (K x N) and v (K x M)
    factors: tuple[int, int, int] | None = None
    itemsize: int = 4

    @property
    def params(self) -> int:
        total = 0
        for s in self.shapes:
            n = 1
            for d in s:
                n *= d
            total += n
        return total


@dataclass
class LayerTiming:
    """One layer's cost on the busiest node, as the planner and the DAG model see it.

    Each direction of the node's link is a FIFO: the layer holds its sending side for ``up_s``
    and its receiving side for ``down_s``, and no other layer's bytes go through a side while
    the layer holds it. So that a link never carries more than its bandwidth, a scheme's
    ``timing`` gives ``up_s >= beta * bytes_sent * ways`` and ``down_s >= beta *
    bytes_received * ways`` (beta of the node's whole link; tests/test_perf_physics.py checks
    it over random nets, schemes and links); pipelining inside one layer's round is priced
    inside these spans."""
    name: str
    scheme: str
    bytes_sent: float  # per iteration
    bytes_received: float
    up_s: float        # the span it holds the node's sending side
    down_s: float      # the span it holds its receiving side
    #: how long after the sending span starts the receiving span can start
    lag_s: float
    #: how long after the sending span ends the receiving span can end at the earliest
    tail_s: float
    reduce_s: float    # on the progress thread: reconstruction, sums, the update off-device
    update_s: float = 0.0  # the solver update of the layer
    #: from its release to when its first byte can go on the network (a two-level run's
    #: reduce-scatter inside the machine)
    start_s: float = 0.0
    #: how many flows like this node's go through the node's link at once (a machine's k
    #: workers share its one link): the link carries ``ways`` x the bytes above
    ways: float = 1.0
    #: the messages of Poseidon's transport a round of the layer costs a node, each counted
    #: at its send and at its receipt, averaged over the nodes (an engine's are its own)
    messages: float = 0.0
    #: the compute those messages' CPU takes where workers outnumber their machine's cores
    #: (``plan_layers``); the DAG model prices machines with cores to spare, and leaves it out
    cpu_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Release to applied for this layer alone on an idle link, and the compute its
        messages take from a crowded machine: what the planner compares."""
        return self.start_s + max(self.up_s + self.tail_s, self.lag_s + self.down_s) \
            + self.reduce_s + self.cpu_s


@dataclass(frozen=True)
class Device:
    """Costs outside the trace: what the machine running a worker and its shard spends on the
    solver update, on SFB's reconstruction and on sums."""
    name: str = "default: a GPU worker (update 300 GB/s, GEMM 5 TFLOP/s), CPU shard (8 GB/s)"
    #: the solver update streams about ``update_passes`` x 4 bytes per parameter
    update_bytes_per_s: float = 300e9
    update_passes: float = 5.0
    #: SFB's reconstruction u^T v (2 flops per multiply-add)
    gemm_flops_per_s: float = 5e12
    #: adding arrays (a shard's sums, a ring step's sums), on a CPU
    add_bytes_per_s: float = 8e9
    #: the update runs on the device that computes (a GPU's kernels queue behind backward's),
    #: so it takes compute time; False when the CPU does the update beside the compute
    update_on_device: bool = True

    def update_s(self, params_bytes: float) -> float:
        return self.update_passes * params_bytes / self.update_bytes_per_s


def shared(link: Any, ways: float) -> Any:
    """``link`` as each of ``ways`` nodes' flows through it at once sees it."""
    return replace(link, beta_s_per_byte=link.beta_s_per_byte * ways,
                   source=f"{link.source} / {ways:g}")


def level_timing(cls: Any, info: LayerInfo, world: int, slots: int, link: Any, local_link: Any,
                 device: Device, chunk_bytes: int, wire_itemsize: int) -> LayerTiming:
    """The cost of one layer by the scheme class ``cls`` on ``world`` workers, ``slots`` per machine: flat when
    one per machine; else, for a dense scheme, the local reduce-scatter and all-gather over
    ``local_link`` around the network scheme on 1/slots of the layer among the machines."""
    if slots <= 1 or world <= slots or not cls.leveled:
        return cls.timing(info, world, link, device, chunk_bytes, wire_itemsize)
    machines = world // slots
    if not cls.dense:
        return cls.timing_levels(info, machines, slots, link, local_link, device)  # type: ignore[attr-defined]
    part = LayerInfo(info.layer, info.name, [(-(-info.params // slots),)], None, info.itemsize)
    # the k owners of a machine send their parts at once through its one network link
    net = cls.timing(part, machines, shared(link, slots), device, chunk_bytes, wire_itemsize)
    share = (slots - 1) / slots * info.params * info.itemsize
    local = local_link.alpha_s + local_link.beta_s_per_byte * share
    adds = share / device.add_bytes_per_s
    update = device.update_s(info.params * info.itemsize)
    # the network round starts once the machine's reduce-scatter is summed, and the result
    # is handed to the mates after it; the k owners' parts cross the link at once (ways);
    # the reduce-scatter and all-gather send a part to and get one from each mate
    return LayerTiming(info.name, cls.name, net.bytes_sent, net.bytes_received, net.up_s,
                       net.down_s, net.lag_s, net.tail_s + local,
                       net.reduce_s - net.update_s * (not device.update_on_device) + (
                           0.0 if device.update_on_device else update), update,
                       start_s=local + adds, ways=slots,
                       messages=net.messages + 4 * (slots - 1))
