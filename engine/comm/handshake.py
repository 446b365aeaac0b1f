"""The start-up handshake of a worker's syncer: who agrees on what before the first gradient.

1. HELLO: every worker and shard says it is up, with the digest of its net's synchronised
   layers and settings (``config_digest``); a worker of another configuration is named. A
   worker also says which collective engines it can run, and in which version, and which
   kernel it runs on with how many cores (``Met.crowding``).
2. ENGINE: rank 0 chooses the engines every worker can run (of those the job allows), makes
   each one's rendezvous and sends it; every worker joins them and probes them at once
   (``join_engines``, engine/comm/schemes/collective.py). Where auto may choose between them
   and shm (every worker on one machine), all probe shm after them, through a segment rank 0
   names in ENGINE (``wants_shm_probe``). Rank 0 always sends it (maybe empty), and every
   worker waits for it.
3. PLAN: rank 0 probes the links (unless one was given), makes the plan (its planner, or a
   pinned one) and sends it to every worker; the others wait for it. Every worker follows
   rank 0's plan, so all agree even where their own measurements would differ.
4. Each worker checks that the plan fits its own net (``units_of``): its units and codec.
5. LAYOUT and READY: rank 0 sends the PS chunk table to the shards; every worker sends the
   digest of the plan and table it installed, and a worker that installed another is named.

Every wait is bounded by the endpoint's timeout, and its error names who did not come.
"""
from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, NoReturn, Sequence

from engine.pb import poseidon_pb2 as pb

from .codecs import Codec, make_codec
from .engines import Collective, EngineCost, EngineError
from .engines import probe as probe_engine
from .errors import CommError
from .link import Link
from .planner import DEFAULT_LINK, Plan
from .probe import probe_link
from .schemes import SCHEMES
from .schemes import shm
from .chunks import layout_digest
from .topology import Topology, crowding, machine_id, usable_cores
from .transport import SHARD, WORKER, Endpoint, header, message_key
from .units import LayerSlot, Unit

#: ``fail(reason)``: stop every process of the job with this one-line reason (never returns)
Fail = Callable[[str], NoReturn]


@dataclass
class Installed:
    """What a worker runs from the plan: the wire codec and the synchronisation units."""
    codec: Codec
    units: list[Unit]


def workers(ep: Endpoint) -> list[tuple[str, int]]:
    """Every other worker of the job."""
    return [(WORKER, r) for r in range(len(ep.hosts)) if (WORKER, r) != ep.me]


def config_digest(slots: Mapping[int, LayerSlot], chunk_bytes: int) -> bytes:
    """What every worker of a job must agree on before a plan can fit them all."""
    h = hashlib.sha256(f"chunk_bytes={chunk_bytes};".encode())
    for li in sorted(slots):
        s = slots[li]
        shapes = [tuple(p.blob.diff.shape) for p in s.params]
        h.update(f"{li},{s.name},{shapes},{s.factor_shape};".encode())
    return h.digest()


def offers(names: Sequence[str], on_gpu: bool) -> list[pb.EngineSpec]:
    """What this worker says in HELLO of the engines ``names``: its version of each, or why
    it cannot run it."""
    out = []
    for name in names:
        backend = SCHEMES[name].backend  # type: ignore[attr-defined]
        why = backend.missing(on_gpu)
        out.append(pb.EngineSpec(name=name, version="" if why else backend.version(),
                                 missing=why))
    return out


@dataclass
class Met:
    """What every worker said in HELLO."""
    #: each worker's engine offers (``offers``), by rank, this one's included
    offered: dict[int, list[pb.EngineSpec]]
    #: the workers on this worker's machine per core it may use (above 1, they take turns)
    crowding: float


def hello(ep: Endpoint, layers: Mapping[int, LayerSlot], chunk_bytes: int, fail: Fail,
          engines: Sequence[pb.EngineSpec] = ()) -> Met:
    """Say HELLO to every peer and wait for every worker's; one of another configuration (hosts
    file, net or chunk size) fails the job, named."""
    world = len(ep.hosts)
    digest = config_digest(layers, chunk_bytes)
    mine, cores = machine_id(), usable_cores()
    ep.broadcast(ep.peers, header(pb.HELLO, layout_digest=digest, world_size=world,
                                  engines=list(engines), machine=mine, cores=cores))
    offered = {ep.me[1]: list(engines)}
    machines = [mine]
    for m in ep.wait_for([message_key(pb.HELLO, w) for w in workers(ep)], "start-up HELLO",
                         startup=True):
        if m.header.world_size != world or m.header.layout_digest != digest:
            fail(f"{ep.name_of(m.sender)} runs a different configuration "
                 "(hosts file, net or --chunk-bytes differ)")
        offered[m.sender[1]] = list(m.header.engines)
        machines.append(m.header.machine)
    return Met(offered, crowding(mine, cores, machines))


@dataclass
class Engines:
    """The collective engines this worker joined, and how the planner prices them."""
    joined: dict[str, Collective]
    costs: tuple[EngineCost, ...]
    #: rank 0's: what the rendezvous needs kept alive while the job runs (a store's server)
    keep: list[Any]
    #: rank 0's: the engines the job allowed but not every worker could run, and why
    dropped: list[str]
    #: shm's start-up probe, where the workers of one machine ran it beside the engines
    #: (``wants_shm_probe``): the plan prices shm as it does them, from a measured round
    shm: Link | None = None
    #: rank 0's: why shm was not probed where it would have been (its segment not made)
    shm_unprobed: str = ""

    def report(self) -> list[str]:
        """The log's lines: each engine joined and its probe, each dropped, shm's probe."""
        return ([f"Collective engine {c.name} joined ({c.version}, {c.algorithm}): "
                 f"{c.link.source}" for c in self.costs]
                + [f"Collective engine not planned: {why}" for why in self.dropped]
                + ([f"Shared memory (shm) probed beside them: {self.shm.source}"]
                   if self.shm is not None else [])
                + ([f"Shared memory (shm) not probed, priced by its cost model: "
                    f"{self.shm_unprobed}"] if self.shm_unprobed else []))

    def close(self, keep_only: Collection[str] = (), clean: bool = True) -> None:
        """Leave every engine but ``keep_only`` (not ``clean``: the job failed, and an
        engine's collective may never complete)."""
        for name in [n for n in self.joined if n not in keep_only]:
            self.joined.pop(name).close(clean)
        if not self.joined:
            self.keep.clear()


def join_engines(ep: Endpoint, wanted: Sequence[str], required: Sequence[str],
                 offered: Mapping[int, Sequence[pb.EngineSpec]], fail: Fail,
                 call_soon: Callable[[Callable[[], None]], None] | None = None) -> Engines:
    """Rank 0 chooses, of the engines ``wanted``, those every worker offers in its own
    version (one of ``required`` that a worker lacks fails the job, naming it; another is
    dropped, saying why) and sends ENGINE with each one's rendezvous; then every worker joins
    each engine and all probe them at once, and shm after them where rank 0 asks
    (``wants_shm_probe``; its rounds summed by ``call_soon``'s thread, the syncer's progress
    thread)."""
    rank, world = ep.me[1], len(ep.hosts)
    keep: list[Any] = []
    dropped: list[str] = []
    seg, unprobed = None, ""
    if rank == 0:
        mine = {s.name: s for s in offered[0]}
        specs = []
        for name in wanted:
            own = mine.get(name)
            lacking = None
            for r in range(world):
                spec = {s.name: s for s in offered.get(r, ())}.get(name)
                who = ep.name_of((WORKER, r))
                if spec is None:
                    lacking = f"{who} does not offer it (run every worker with the same --comm)"
                elif spec.missing:
                    lacking = f"{who} cannot run it: {spec.missing}"
                elif own is not None and not own.missing and spec.version != own.version:
                    lacking = (f"{who} has {spec.version}, {ep.name_of((WORKER, 0))} "
                               f"{own.version}: every worker needs the same version")
                if lacking:
                    break
            if lacking:
                if name in required:
                    fail(f"--comm {name}: {lacking}")
                dropped.append(f"{name}: {lacking}")
                continue
            backend = SCHEMES[name].backend  # type: ignore[attr-defined]
            try:
                setup, kept = backend.setup(ep.hosts[0].host, world, ep.timeout)
            except Exception as e:
                fail(f"{ep.name}: cannot make {name}'s rendezvous: {e}")
            keep.append(kept)
            specs.append(pb.EngineSpec(name=name, version=own.version,
                                       algorithm=backend.algorithm(), setup=setup))
        nonce = os.urandom(16) if wants_shm_probe(ep, specs, required) else b""
        if nonce:  # made before anyone is told its name (in the try below: removed on any path)
            try:
                seg = shm.open_probe(nonce, world, True, ep.name)
            except CommError as e:
                unprobed, nonce = str(e), b""
    else:
        [m] = ep.wait_for([message_key(pb.ENGINE, (WORKER, 0))], "the collective engines")
        specs = list(m.header.engines)
        nonce = m.header.shm_probe
        mine = {s.name: s for s in offered[rank]}
        for spec in specs:
            own = mine.get(spec.name)
            if own is None or own.missing or own.version != spec.version:
                fail(f"{ep.name} cannot join {spec.name} {spec.version}: "
                     f"{own.missing or own.version if own else 'it was not offered'}")
    joined: dict[str, Collective] = {}
    costs = []
    probed = None
    try:
        if rank == 0:
            ep.broadcast(workers(ep), header(pb.ENGINE, engines=specs, shm_probe=nonce))
        for spec in specs:
            backend = SCHEMES[spec.name].backend  # type: ignore[attr-defined]
            c = joined[spec.name] = Collective(
                backend, spec.setup, rank, world, ep.hosts[rank].host, ep.timeout,
                lambda why: ep.fatal(f"{ep.name}: {why}"))
            costs.append(EngineCost(spec.name, spec.version, spec.algorithm, probe_engine(c)))
        if nonce:
            seg = seg or shm.open_probe(nonce, world, False, ep.name)
            probed = shm.probe(ep, seg, lambda fn: on_thread(ep, call_soon, fn))
    except CommError as e:  # an engine's (EngineError) does not say where
        for c in joined.values():
            c.close(clean=False)
        fail(f"{ep.name}: {e}" if isinstance(e, EngineError) else str(e))
    finally:
        if seg is not None:
            seg.close()
        if rank == 0 and nonce:  # every worker mapped it before its first step
            shm.unlink_quietly(shm.segment_path(nonce))
    return Engines(joined, tuple(costs), keep, dropped, probed, unprobed)


def on_thread(ep: Endpoint, call_soon: Callable[[Callable[[], None]], None] | None,
              fn: Callable[[], None]) -> None:
    """``fn`` on ``call_soon``'s thread (here without one), returned once it is done; its
    error raised here."""
    if call_soon is None:
        fn()
        return
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            failed.append(e)
        finally:
            done.set()

    call_soon(run)
    while not done.wait(0.5):  # a thread that stopped (the job failed) never sets it
        if ep.error is not None:
            raise CommError(ep.error)
    if failed:
        raise failed[0]


def wants_shm_probe(ep: Endpoint, specs: Sequence[pb.EngineSpec],
                    required: Sequence[str]) -> bool:
    """Rank 0's choice: shm is probed beside the engines where the plan may choose between
    them (an engine the job allows but does not require, so auto on a trusted network) and
    every worker is on this one machine. Priced by its cost model, shm was chosen over MPI at
    half MPI's speed (4 workers, 2 cores, the FC-heavy bench net: shm 1.27x DDP, mpi 1.40x)."""
    return (len(ep.hosts) > 1 and any(s.name not in required for s in specs)
            and len(Topology.of(ep.hosts, 0).machines) == 1 and shm.Shm.available())


def probe(ep: Endpoint, link: Link | None) -> tuple[Link, Link | None]:
    """Rank 0's links: to a worker on another machine (unless ``link`` is given), and to a
    machine mate when machines run several workers."""
    # the machines as they are, also when every worker runs as a node of its own
    # (--no-levels): a machine mate's loopback is no measure of the network
    real = Topology.of(ep.hosts, ep.me[1])
    machines, mates = real.machines, real.local
    local = probe_link(ep, (WORKER, mates[1])) if len(mates) > 1 else None
    if link is None:  # one machine: all its traffic is the machine's own
        link = probe_link(ep, (WORKER, machines[1][0])) if len(machines) > 1 \
            else local or DEFAULT_LINK
    return link, local


#: rank 0's planner: (the network link, the link inside a machine or None, the engines every
#: worker joined, the workers per core on rank 0's machine, shm's probe or None) -> the plan
Planner = Callable[[Link, "Link | None", tuple[EngineCost, ...], float, "Link | None"], Plan]


def agree_plan(ep: Endpoint, planner: Planner | None, link: Link | None,
               on_plan: Callable[[Plan], None] | None = None,
               engines: tuple[EngineCost, ...] = (), crowding: float = 1.0,
               shm_probe: Link | None = None) -> pb.Plan:
    """Rank 0 plans (``planner`` on the probed or given links, the engines' probes, its
    machine's ``crowding`` and shm's probe) and sends the plan to every worker; the others
    receive it."""
    if ep.me[1] != 0:
        [m] = ep.wait_for([message_key(pb.PLAN, (WORKER, 0))], "the communication plan")
        return m.header.plan
    if planner is None:
        raise CommError("rank 0 needs a planner")
    plan = planner(*probe(ep, link), engines, crowding, shm_probe)
    if on_plan is not None:
        on_plan(plan)
    made = plan.to_pb()
    ep.broadcast(workers(ep), header(pb.PLAN, plan=made))
    return made


def units_of(plan: pb.Plan, layers: dict[int, LayerSlot], me: str, fail: Fail,
             engines: Sequence[str] = ()) -> Installed:
    """The codec and units ``plan`` (rank 0's) gives this worker's ``layers``: every layer in
    exactly one unit of a scheme that can synchronise it (an engine's: one it joined)."""
    def unfit(why: str) -> NoReturn:
        fail(f"the plan of worker 0 does not fit {me}'s net: {why}")

    try:
        codec = make_codec(plan.codec or "fp32", plan)
    except ValueError as e:
        unfit(str(e))
    units, seen = [], set()
    for up in plan.units:
        scheme = SCHEMES.get(up.scheme)
        if scheme is None or not up.layers:
            unfit(f"unknown scheme {up.scheme!r} or an empty unit")
        if scheme.engine and up.scheme not in engines:
            unfit(f"it sums on {up.scheme}, which this worker did not join")
        missing = [layer for layer in up.layers if layer not in layers or layer in seen]
        if missing:
            unfit(f"layer {missing[0]} is not a synchronised layer, or twice in the plan")
        slots = [layers[layer] for layer in up.layers]
        if not all(scheme.applies(s) for s in slots) or (len(slots) > 1 and not scheme.dense):
            unfit(f"{up.scheme} cannot synchronise {'+'.join(s.name for s in slots)}")
        seen.update(up.layers)
        units.append(Unit(slots, up.scheme))
    if seen != set(layers):
        unfit(f"layers {sorted(set(layers) - seen)} have no unit")
    return Installed(codec, units)


def ready(ep: Endpoint, plan: pb.Plan, ps: Any, fail: Fail) -> None:
    """Rank 0 sends the PS chunk table (``ps``: the PS scheme, or None) to the shards; every
    worker says READY with the digest of what it installed and waits for everyone's."""
    layout, groups = ps.shard_table() if ps is not None else ([], [])
    shards = [p for p in ep.peers if p[0] == SHARD]
    if ep.me[1] == 0:
        ep.broadcast(shards, header(pb.LAYOUT, layout=[c.to_pb() for c in layout],
                                    groups=[pb.GroupSpec(ranks=g) for g in groups]))
    table = layout_digest(layout)
    mine = hashlib.sha256(plan.SerializeToString(deterministic=True) + table).digest()
    others = workers(ep)
    ep.broadcast(others, header(pb.READY, layout_digest=mine))
    ep.broadcast(shards, header(pb.READY, layout_digest=table))
    for m in ep.wait_for([message_key(pb.READY, w) for w in others], "READY"):
        if m.header.layout_digest != mine:
            fail(f"{ep.name_of(m.sender)} installed a different plan")
    ep.wait_for([message_key(pb.READY, s) for s in shards], "shard READY")
