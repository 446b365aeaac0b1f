"""SACP planner: per layer, parameter server or sufficient-factor broadcasting, by cost.

Costs are floats sent + received per node per iteration (DESIGN.md), for an FC layer with an
M x N weight, batch K, P1 workers and P2 server shards:

    PS, worker only               2MN
    PS, node = worker + server    2MN(P1+P2-2)/P2
    SFB                           2K(P1-1)(M+N)
    ring allreduce                4MN(P1-1)/P1          (reported, not chosen)

Poseidon runs a shard on every node, so PS is priced with the worker+server formula. A layer
can use SFB only when it hands out sufficient factors (an InnerProduct weight whose gradient
is exactly uᵀ·v); its bias rides along for free (the sum of u's rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field

SCHEMES = ("ps", "sfb", "hybrid")


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
class LayerPlan:
    info: LayerInfo
    scheme: str
    ps_bytes: float
    sfb_bytes: float | None
    ring_bytes: float
    reason: str = ""
    bytes_per_node: float = field(init=False)

    def __post_init__(self) -> None:
        self.bytes_per_node = self.sfb_bytes if self.scheme == "sfb" else self.ps_bytes


def plan_layers(layers: list[LayerInfo], p1: int, p2: int | None = None,
                comm: str = "hybrid", allow_sfb: bool = True) -> list[LayerPlan]:
    """One plan per layer. ``comm`` forces a scheme where the layer allows it."""
    if comm not in SCHEMES:
        raise ValueError(f"--comm must be one of {', '.join(SCHEMES)}, got {comm!r}")
    p2 = p1 if p2 is None else p2
    plans = []
    for info in layers:
        size = info.itemsize
        ps = cost_ps_node(info.params, p1, p2) * size
        ring = cost_ring(info.params, p1) * size
        sfb = None
        if info.factors is not None:
            k, m, n = info.factors
            sfb = cost_sfb(m, n, k, p1) * size
        if sfb is None or not allow_sfb:
            scheme = "ps"
            reason = "no sufficient factors" if sfb is None else "SFB not allowed (iter_size > 1)"
        elif comm == "hybrid":
            scheme = "sfb" if sfb < ps else "ps"
            reason = "cheaper"
        else:
            scheme, reason = comm, "forced"
        plans.append(LayerPlan(info, scheme, ps, sfb, ring, reason))
    return plans


def plan_table(plans: list[LayerPlan], p1: int, p2: int | None = None) -> str:
    """The plan as the text table rank 0 prints at start-up."""
    p2 = p1 if p2 is None else p2
    rows = [f"Communication plan: {p1} workers, {p2} server shards (bytes sent+received per node per iteration)",
            f"{'layer':<16} {'shape':<24} {'scheme':<6} {'bytes/iter':>12} {'PS':>12} {'SFB':>12} {'ring':>12}"]
    total = 0.0
    for p in plans:
        shape = " + ".join("x".join(str(d) for d in s) for s in p.info.shapes)
        sfb = _mb(p.sfb_bytes) if p.sfb_bytes is not None else "-"
        rows.append(f"{p.info.name:<16} {shape:<24} {p.scheme:<6} {_mb(p.bytes_per_node):>12} "
                    f"{_mb(p.ps_bytes):>12} {sfb:>12} {_mb(p.ring_bytes):>12}")
        total += p.bytes_per_node
    rows.append(f"{'total':<16} {'':<24} {'':<6} {_mb(total):>12}")
    return "\n".join(rows)


def _mb(b: float) -> str:
    return f"{b / 1e6:.3f} MB"
