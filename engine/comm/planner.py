"""The planner: per layer the cheapest scheme, fusion buckets, and the plan every worker follows.

Each scheme prices a layer with its own ``timing`` (engine/comm/schemes) on the job's link
(alpha, beta: probed at start-up or given with ``--link``) and device (update, GEMM and add
speeds), the same functions the DAG model of ``poseidon simulate`` uses. ``--comm`` picks:

    auto    per layer the fastest of the schemes that can run (the default)
    hybrid  Poseidon's SACP: SFB where it moves fewer bytes than PS, else PS
    ps | sfb | ring | hd | shm   that scheme wherever the layer allows it (else PS)

shm (shared memory) runs only when every worker is on one machine; it is then offered beside
the others, priced by the memory it copies and its two signals.

SACP's byte counts, the layer facts and the timings it compares are engine/comm/cost.py's.

Then consecutive layers with the same dense scheme (PS, ring, hd) are fused into buckets
(engine/comm/fusion.py). Rank 0 makes the plan and sends it to every worker (engine/comm/plan
travels as a poseidon.Plan), so all follow one plan even where their measurements differ.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from engine.pb import poseidon_pb2 as pb

from .codecs import make_codec
from .cost import (
    Device,
    LayerInfo,
    LayerTiming,
    cost_ps_node,
    cost_ring,
    cost_sfb,
    level_timing,
)
from .auto_passes import join_buckets, spinning_engine_alone, unify_runs
from .engines import EngineCost, probed_timing
from .fusion import buckets
from .link import Link
from .schemes import SCHEMES
from .chunks import DEFAULT_CHUNK_BYTES

#: what --comm takes: the planner's two modes, then every registered scheme
COMM_MODES = ("auto", "hybrid", *SCHEMES)
#: a loopback-like link for planning when none is known (tests, simulate without --link)
DEFAULT_LINK = Link(50e-6, 1 / 1.25e9, "default: 10 Gbit/s, 50 us")
#: inside a machine, when no machine mate was probed
DEFAULT_LOCAL_LINK = Link(20e-6, 1 / 5e9, "default: inside a machine, 40 Gbit/s, 20 us")


@dataclass
class LayerPlan:
    info: LayerInfo
    scheme: str
    #: every scheme that can carry the layer -> its cost
    timings: dict[str, LayerTiming]
    world: int
    reason: str = ""
    ps_bytes: float = field(init=False)
    sfb_bytes: float | None = field(init=False)
    ring_bytes: float = field(init=False)

    def __post_init__(self) -> None:
        size, p = self.info.itemsize, self.world
        self.ps_bytes = cost_ps_node(self.info.params, p, p) * size
        f = self.info.factors
        self.sfb_bytes = cost_sfb(f[1], f[2], f[0], p) * size if f else None
        self.ring_bytes = cost_ring(self.info.params, p) * size

    @property
    def predicted_s(self) -> float:
        return self.timings[self.scheme].total_s

    @property
    def bytes_per_node(self) -> float:
        t = self.timings[self.scheme]
        return t.bytes_sent + t.bytes_received


def split_comm(text: str) -> tuple[str, dict[str, str]]:
    """``--comm MODE[,LAYER=SCHEME...]``: the mode, and the layers given a scheme by name."""
    mode, *rest = [t.strip() for t in str(text).split(",")]
    overrides = {}
    for item in rest:
        layer, _, scheme = item.partition("=")
        if not layer or scheme not in SCHEMES:
            raise ValueError(f"--comm {text!r}: {item!r} is not LAYER=SCHEME with a scheme "
                             f"of {', '.join(SCHEMES)}")
        overrides[layer] = scheme
    if mode not in COMM_MODES:
        raise ValueError(f"--comm must be one of {', '.join(COMM_MODES)} (then LAYER=SCHEME "
                         f"items), got {mode!r}")
    return mode, overrides


def overhead_of(link: Link, local_link: Link) -> float:
    """A message's overhead at each end as probed: on the network's link, else (a given
    ``--link``) on the link inside the machine."""
    return link.overhead_s or local_link.overhead_s


def plan_layers(layers: Sequence[LayerInfo], p1: int, comm: str = "auto",
                allow_sfb: bool = True, link: Link | None = None, device: Device | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, wire_itemsize: int = 4,
                slots: int = 1, local_link: Link | None = None,
                machines: int | None = None, fusion: bool = False,
                engines: Sequence[EngineCost] = (), crowding: float = 1.0,
                probed: Mapping[str, Link] | None = None) -> list[LayerPlan]:
    """One plan per layer. ``comm`` (MODE[,LAYER=SCHEME...]) forces a scheme where the layer
    allows it. ``slots`` workers per machine: dense schemes are priced in two levels, the
    machine's own ``local_link`` around the network's ``link``. ``machines``: how many
    machines the workers are on (default: p1 / slots); one-machine schemes need 1.
    ``fusion``: auto prices fusion in (engine/comm/auto_passes.py). ``engines``: the
    collective engines every worker joined, priced by their probes; no other engine runs.
    ``crowding``: workers per core on the planning machine; above 1 every core computes, and
    the CPU a layer's messages cost (the link's overhead at each end) is compute taken from
    the workers that share them: ``crowding`` x that, each worker's share of every worker's
    (measured: 4 workers on 2 cores, FC-heavy net through 1 Gbit/s, ip2 on hd cost rank 0's
    node 0.9 ms more CPU an iteration than on PS, and 3.3 ms of its 62 ms iteration); and the
    CPU of its sums and rebuilds (``reduce_s`` less the update, which every scheme pays)
    takes ``crowding`` x as long on a shared core. A probed scheme was timed crowded: none of
    this is added to it.
    ``probed``: schemes of Poseidon's own whose whole round was probed at start-up beside the
    engines (shm, ``handshake.wants_shm_probe``), priced from it as the engines are."""
    comm, overrides = split_comm(comm)
    unknown = set(overrides) - {info.name for info in layers}
    if unknown:
        raise ValueError(f"--comm: no layer with parameters named {', '.join(sorted(unknown))}")
    machines = machines if machines is not None else max(1, p1 // max(slots, 1))
    joined = {e.name: e.link for e in engines}
    rounds = {**(probed or {}), **joined}
    runnable = {name for name, scheme in SCHEMES.items()
                if (name in joined if scheme.engine else scheme.available())
                and (not scheme.one_machine or (machines == 1 and p1 > 1))}
    for name in {comm, *overrides.values()} & (set(SCHEMES) - runnable):
        scheme = SCHEMES[name]
        raise ValueError(f"--comm {name}: the workers did not join it" if scheme.engine else
                         f"--comm {name}: it synchronises the workers of one machine, and these "
                         f"{p1} workers are on {machines} machines" if scheme.available()
                         else f"--comm {name}: this machine cannot run it")
    link = link or DEFAULT_LINK
    local_link = local_link or DEFAULT_LOCAL_LINK
    device = device or Device()
    overhead = overhead_of(link, local_link) * crowding if crowding > 1 else 0.0
    plans = []
    #: (layer, dense scheme) -> its time inside a bucket: without the per-message latency,
    #: which the bucket pays once
    marginal: dict[tuple[int, str], float] = {}
    no_latency = [Link(0.0, k.beta_s_per_byte, k.source) for k in (link, local_link)]
    for info in layers:
        timings = {}
        for name, scheme in SCHEMES.items():
            if name not in runnable or not scheme.applies(info) or (name == "sfb" and not allow_sfb):
                continue
            itemsize = wire_itemsize if scheme.dense else info.itemsize
            if name in rounds:  # a whole round as measured: crowding and all
                timings[name] = probed_timing(name, info, p1, rounds[name], device)
                marginal[(info.layer, name)] = probed_timing(
                    name, info, p1, replace(rounds[name], alpha_s=0.0), device).total_s
                continue
            t = level_timing(scheme, info, p1, slots, link, local_link, device, chunk_bytes,
                             itemsize)
            if crowding > 1:
                own = t.reduce_s - (0.0 if device.update_on_device else t.update_s)
                t = replace(t, cpu_s=overhead * t.messages + (crowding - 1) * own)
            timings[name] = t
            if scheme.dense:
                marginal[(info.layer, name)] = level_timing(
                    scheme, info, p1, slots, no_latency[0], no_latency[1], device, chunk_bytes,
                    itemsize).total_s
        if info.name in overrides:
            scheme = overrides[info.name]
            if scheme not in timings:
                raise ValueError(f"--comm {info.name}={scheme}: layer {info.name} cannot be "
                                 f"synchronised by {scheme}" + (
                                     " (iter_size > 1)" if info.factors else
                                     " (no sufficient factors)"))
            plans.append(LayerPlan(info, scheme, timings, p1, "given by name"))
            continue
        if comm == "auto":
            scheme = min(timings, key=lambda s: timings[s].total_s)
            reason = "fastest"
        elif comm == "hybrid":
            sfb_ok = "sfb" in timings
            scheme = "sfb" if sfb_ok and cost_sfb(*_mnk(info), p1) < cost_ps_node(
                info.params, p1, p1) else "ps"
            reason = "fewer bytes" if sfb_ok else "no sufficient factors"
        elif comm in timings:
            scheme, reason = comm, "forced"
        else:
            scheme = "ps"
            reason = ("SFB not allowed (iter_size > 1)" if info.factors is not None
                      else "no sufficient factors")
        plans.append(LayerPlan(info, scheme, timings, p1, reason))
    if comm == "auto":
        spinning_engine_alone(plans, set(overrides))
    if comm == "auto" and fusion:
        unify_runs(plans, marginal, set(overrides))
        join_buckets(plans, marginal, set(overrides))
    return plans


def _mnk(info: LayerInfo) -> tuple[int, int, int]:
    k, m, n = info.factors  # type: ignore[misc]
    return m, n, k


@dataclass
class Plan:
    """The job's plan: each layer's scheme, the units (fusion buckets) and the wire codec."""
    layers: list[LayerPlan]
    units: list[tuple[list[int], str]]
    link: Link
    codec: str = "fp32"
    sparse_ratio: float = 0.0
    sparse_warmup: int = 0
    sparse_momentum: float = 0.0
    #: workers per machine (two levels when > 1) and the link inside a machine
    slots: int = 1
    local_link: Link = DEFAULT_LOCAL_LINK
    #: this job's own: what a scheme creates outside the process is named by it (shm)
    nonce: bytes = field(default_factory=lambda: os.urandom(16))
    #: the --comm it was made with
    comm: str = "auto"
    #: the collective engines the workers joined (those its units use are recorded)
    engines: tuple[EngineCost, ...] = ()

    @property
    def used_engines(self) -> list[EngineCost]:
        """The engines some unit sums on."""
        used = {s for _, s in self.units}
        return [e for e in self.engines if e.name in used]

    @property
    def world(self) -> int:
        return self.layers[0].world if self.layers else 0

    def to_pb(self) -> pb.Plan:
        names = {p.info.layer: p.info.name for p in self.layers}
        return pb.Plan(units=[pb.UnitPlan(layers=l, scheme=s, names=[names[i] for i in l])
                              for l, s in self.units],
                       alpha_s=self.link.alpha_s, beta_s_per_byte=self.link.beta_s_per_byte,
                       codec=self.codec, sparse_ratio=self.sparse_ratio,
                       sparse_warmup=self.sparse_warmup, sparse_momentum=self.sparse_momentum,
                       nonce=self.nonce, world_size=self.world, slots=self.slots,
                       comm=self.comm, engines=[e.to_pb() for e in self.used_engines])

    def why(self) -> str:
        """How the plan was chosen, for the log's one line."""
        mode = split_comm(self.comm)[0]
        if mode == "auto":
            k = self.link
            return (f"auto: the fastest scheme per layer by the cost model, fusion priced in, "
                    f"for a link of {k.bits_per_s / 1e9:.2f} Gbit/s and {k.alpha_s * 1e6:.0f} us "
                    f"({k.source.split(' (')[0]})")
        if mode == "hybrid":
            return "hybrid: SFB where it moves fewer bytes than PS, else PS"
        return f"--comm {mode}: wherever the layer allows it, else PS"

    def wire(self) -> str:
        """How the gradients travel: 'fp32', or the codec's description."""
        return make_codec(self.codec, self.to_pb()).describe()

    def summary(self) -> str:
        """Each unit's layers and scheme, in release order: 'ip2 sfb; conv1+ip1 ring'."""
        names = {p.info.layer: p.info.name for p in self.layers}
        shown = [f"{'+'.join(names[l] for l in ls)} {s}" for ls, s in self.units[:SUMMARY_UNITS]]
        more = len(self.units) - SUMMARY_UNITS
        return "; ".join(shown) + (f"; and {more} more units" if more > 0 else "")


#: units named in a plan's one-line summary (the table, at start-up and in --stats, has all)
SUMMARY_UNITS = 8


class PlanMismatch(ValueError):
    """A recorded plan that does not fit this run: other workers, machines, wire or net."""


class EngineMismatch(ValueError):
    """A recorded plan that sums on a collective engine this run has in another version (or
    not at all): refused, also on a resume, since the engine decides the order of the sums."""


@dataclass(frozen=True)
class PlanOptions:
    """How rank 0 plans: what the job asks (``comm``: MODE[,LAYER=SCHEME...], the wire codec,
    fusion) and what it knows (the links, the machine's speeds, where the workers are)."""
    comm: str = "auto"
    #: SFB needs one backward per update (iter_size 1)
    allow_sfb: bool = True
    link: Link = DEFAULT_LINK
    #: inside a machine (two levels), when machines run several workers
    local_link: Link = DEFAULT_LOCAL_LINK
    device: Device = field(default_factory=Device)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: "fp32", "fp16" or "sparse" (then ``sparse``: its ratio, warmup and momentum,
    #: engine/comm/codecs/sparse.py; the cost model prices its layers as dense fp32)
    codec: str = "fp32"
    sparse: tuple[float, int, float] = (0.0, 0, 0.0)
    #: fusion buckets: at most this many bytes (0: no fusion), nor a first layer waiting
    #: longer than ``fusion_s`` for its last by ``backward_s`` (estimated backward seconds of
    #: every net layer, index = layer)
    fusion_bytes: int = 0
    fusion_s: float = float("inf")
    backward_s: tuple[float, ...] | None = None
    #: workers per machine (dense schemes priced in two levels when > 1), and machines
    #: (default: workers / slots; one-machine schemes need 1)
    slots: int = 1
    machines: int | None = None
    #: the collective engines every worker joined, each priced by its start-up probe
    engines: tuple[EngineCost, ...] = ()
    #: workers per core on the planning machine (``plan_layers``)
    crowding: float = 1.0
    #: shm's start-up probe, where it ran (``plan_layers``'s ``probed``)
    shm_probe: Link | None = None
    #: this run may sum on these engines (--comm names one, or --trusted-network); a recorded
    #: plan that uses another is not followed
    trusted_engines: tuple[str, ...] = ()
    #: this run's (name, version, pinned algorithm) of each engine it may use, where it has
    #: one (a recorded plan made on another version or algorithm is refused)
    engine_versions: tuple[tuple[str, str, str], ...] = ()

    @property
    def wire_itemsize(self) -> int:
        return 2 if self.codec == "fp16" else 4

    def layers(self, layers: Sequence[LayerInfo], world: int,
               comm: str | None = None) -> list[LayerPlan]:
        """``plan_layers`` with these options (``comm`` in place of theirs)."""
        return plan_layers(layers, world, comm or self.comm, allow_sfb=self.allow_sfb,
                           link=self.link, device=self.device, chunk_bytes=self.chunk_bytes,
                           wire_itemsize=self.wire_itemsize, slots=self.slots,
                           local_link=self.local_link, machines=self.machines,
                           fusion=self.fusion_bytes > 0, engines=self.engines,
                           crowding=self.crowding,
                           probed={"shm": self.shm_probe} if self.shm_probe else None)

    def plan(self, plans: list[LayerPlan], units: list[tuple[list[int], str]],
             comm: str) -> Plan:
        return Plan(plans, units, self.link, self.codec, *self.sparse, self.slots,
                    self.local_link, comm=comm, engines=self.engines)


def make_plan(layers: Sequence[LayerInfo], world: int,
              options: PlanOptions | None = None) -> Plan:
    """Rank 0's plan: schemes per layer, then fusion buckets of consecutive dense layers."""
    options = options or PlanOptions()
    plans = options.layers(layers, world)
    units = buckets([(p.info.layer, p.scheme, p.info.params * p.info.itemsize
                      if SCHEMES[p.scheme].fusion_capped else 0, SCHEMES[p.scheme].dense)
                     for p in plans],
                    options.fusion_bytes, options.fusion_s, options.backward_s)
    return options.plan(plans, units, options.comm)


def pin_plan(recorded: pb.Plan, layers: Sequence[LayerInfo], world: int,
             options: PlanOptions | None = None) -> Plan:
    """The plan ``recorded`` (a snapshot's, or a --plan file's) for this run: its schemes and
    units exactly, priced on the link it was made for (for the table). PlanMismatch says why
    it cannot be followed here (``options``: this run's)."""
    options = options or PlanOptions()
    if recorded.world_size != world:
        raise PlanMismatch(f"it was made for {recorded.world_size} workers, this run has {world}")
    if max(recorded.slots, 1) != options.slots:
        raise PlanMismatch(f"it reduces inside machines of {max(recorded.slots, 1)} workers, "
                           f"this run's machines run {options.slots}")
    if (recorded.codec or "fp32") != options.codec:
        raise PlanMismatch(f"it sends {recorded.codec or 'fp32'} gradients, this run "
                           f"{options.codec}")
    by_index = {i.layer: i for i in layers}
    given: dict[str, str] = {}
    for u in recorded.units:
        for k, index in enumerate(u.layers):
            info = by_index.get(index)
            name = u.names[k] if k < len(u.names) else ""
            if info is None or (name and name != info.name) or info.name in given:
                raise PlanMismatch(f"its layer {name or index} (index {index}) is not a layer "
                                   "with parameters of this net, or is named twice")
            if u.scheme not in SCHEMES or not SCHEMES[u.scheme].applies(info):
                raise PlanMismatch(f"its scheme {u.scheme!r} cannot synchronise {info.name}")
            given[info.name] = u.scheme
    missing = [i.name for i in layers if i.name not in given]
    if missing:
        raise PlanMismatch(f"it gives no scheme to {', '.join(missing)}")
    engines = recorded_engines(recorded, options)
    priced = replace(options, link=Link(recorded.alpha_s, recorded.beta_s_per_byte,
                                        "the link the plan was made for"), fusion_bytes=0,
                     engines=engines)
    comm = ",".join(["auto", *(f"{n}={s}" for n, s in given.items())])
    try:
        plans = priced.layers(layers, world, comm)
    except ValueError as e:
        raise PlanMismatch(str(e).replace(f"--comm {comm!r}: ", "")) from None
    for p in plans:
        p.reason = "pinned"
    return priced.plan(plans, [(list(u.layers), u.scheme) for u in recorded.units],
                       recorded.comm or "auto")


def recorded_engines(recorded: pb.Plan, options: PlanOptions) -> tuple[EngineCost, ...]:
    """The engines a recorded plan sums on, as it recorded them (its probes price them).
    PlanMismatch where this run does not allow one; EngineMismatch where this run has
    another version of one, pins another algorithm (a user's MPICH or NCCL variable), or has
    none."""
    used = {u.scheme for u in recorded.units if u.scheme in SCHEMES and SCHEMES[u.scheme].engine}
    specs = {e.name: e for e in recorded.engines}
    builds = {name: (version, algorithm) for name, version, algorithm in options.engine_versions}
    out = []
    for name in sorted(used):
        spec = specs.get(name)
        if spec is None:
            raise PlanMismatch(f"it sums on {name} but does not record which {name}")
        if name not in options.trusted_engines:
            raise PlanMismatch(f"it sums on {name}, which authenticates nothing, and this run "
                               f"does not allow it (give --comm {name} or --trusted-network)")
        mine = builds.get(name)
        # (a plan recorded without its algorithm is judged by its version alone)
        if mine is None or mine[0] != spec.version or (spec.algorithm and
                                                        mine[1] != spec.algorithm):
            here = f"this run has {mine[0]} ({mine[1]})" if mine else \
                f"this run cannot run {name}"
            raise EngineMismatch(f"it sums on {name} {spec.version} ({spec.algorithm}), {here}: "
                                 "another version or algorithm may sum in another order")
        out.append(EngineCost.from_pb(spec, f"{name} as the plan recorded it"))
    return tuple(out)


def plan_table(plan: Plan | Sequence[LayerPlan], p1: int) -> str:
    """The plan as the text table rank 0 prints at start-up, with predicted times."""
    plans = plan.layers if isinstance(plan, Plan) else list(plan)
    head = f"Plan table: {p1} workers, {p1} server shards"
    if isinstance(plan, Plan) and plan.slots > 1:
        head += (f"; {p1 // plan.slots} machines of {plan.slots}, reducing inside each machine "
                 f"first (alpha {plan.local_link.alpha_s * 1e6:.1f} us, "
                 f"{plan.local_link.bits_per_s / 1e9:.2f} Gbit/s: {plan.local_link.source})")
    if isinstance(plan, Plan):
        head += (f"; link alpha {plan.link.alpha_s * 1e6:.1f} us, "
                 f"{plan.link.bits_per_s / 1e9:.2f} Gbit/s ({plan.link.source}); "
                 f"wire {plan.wire()}")
    shown = [s for s in SCHEMES if any(s in p.timings for p in plans)]
    rows = [head, "(bytes sent+received per node per iteration; time: release to applied, "
            "alone on the link)",
            f"{'layer':<16} {'shape':<24} {'scheme':<6} {'bytes/iter':>12} {'time':>9} "
            + " ".join(f"{name:>9}" for name in shown)]
    total_b = total_t = 0.0
    for p in plans:
        shape = " + ".join("x".join(str(d) for d in s) for s in p.info.shapes)
        times = [_ms(p.timings[s].total_s) if s in p.timings else "-" for s in shown]
        rows.append(f"{p.info.name:<16} {shape:<24} {p.scheme:<6} {_mb(p.bytes_per_node):>12} "
                    f"{_ms(p.predicted_s):>9} " + " ".join(f"{t:>9}" for t in times))
        total_b += p.bytes_per_node
        total_t += p.predicted_s
    rows.append(f"{'total':<16} {'':<24} {'':<6} {_mb(total_b):>12} {_ms(total_t):>9}")
    if isinstance(plan, Plan):
        names = {p.info.layer: p.info.name for p in plans}
        fused = [u for u in plan.units if len(u[0]) > 1]
        rows.append(f"{len(plan.units)} units" + (
            ": fused " + "; ".join(f"{'+'.join(names[l] for l in ls)} ({s})" for ls, s in fused)
            if fused else " (no fusion)"))
    return "\n".join(rows)


def _mb(b: float) -> str:
    return f"{b / 1e6:.3f} MB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"
