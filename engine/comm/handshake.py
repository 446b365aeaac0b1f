"""The start-up handshake of a worker's syncer: who agrees on what before the first gradient.

1. HELLO: every worker and shard says it is up, with the digest of its net's synchronised
   layers and settings (``config_digest``); a worker of another configuration is named.
2. PLAN: rank 0 probes the links (unless one was given), makes the plan (its planner, or a
   pinned one) and sends it to every worker; the others wait for it. Every worker follows
   rank 0's plan, so all agree even where their own measurements would differ.
3. Each worker checks that the plan fits its own net (``units_of``): its units and codec.
4. LAYOUT and READY: rank 0 sends the PS chunk table to the shards; every worker sends the
   digest of the plan and table it installed, and a worker that installed another is named.

Every wait is bounded by the endpoint's timeout, and its error names who did not come.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn

from engine.pb import poseidon_pb2 as pb

from .codecs import Codec, make_codec
from .errors import CommError
from .link import Link
from .planner import DEFAULT_LINK, Plan
from .probe import probe_link
from .schemes import SCHEMES
from .schemes.ps import layout_digest
from .topology import Topology
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


def hello(ep: Endpoint, layers: Mapping[int, LayerSlot], chunk_bytes: int, fail: Fail) -> None:
    """Say HELLO to every peer and wait for every worker's; one of another configuration (hosts
    file, net or chunk size) fails the job, named."""
    world = len(ep.hosts)
    digest = config_digest(layers, chunk_bytes)
    ep.broadcast(ep.peers, header(pb.HELLO, layout_digest=digest, world_size=world))
    for m in ep.wait_for([message_key(pb.HELLO, w) for w in workers(ep)], "start-up HELLO"):
        if m.header.world_size != world or m.header.layout_digest != digest:
            fail(f"{ep.name_of(m.sender)} runs a different configuration "
                 "(hosts file, net or --chunk-bytes differ)")


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


def agree_plan(ep: Endpoint, planner: Callable[[Link, Link | None], Plan] | None,
               link: Link | None, on_plan: Callable[[Plan], None] | None = None) -> pb.Plan:
    """Rank 0 plans (``planner`` on the probed or given links) and sends the plan to every
    worker; the others receive it."""
    if ep.me[1] != 0:
        [m] = ep.wait_for([message_key(pb.PLAN, (WORKER, 0))], "the communication plan")
        return m.header.plan
    if planner is None:
        raise CommError("rank 0 needs a planner")
    plan = planner(*probe(ep, link))
    if on_plan is not None:
        on_plan(plan)
    made = plan.to_pb()
    ep.broadcast(workers(ep), header(pb.PLAN, plan=made))
    return made


def units_of(plan: pb.Plan, layers: dict[int, LayerSlot], me: str, fail: Fail) -> Installed:
    """The codec and units ``plan`` (rank 0's) gives this worker's ``layers``: every layer in
    exactly one unit of a scheme that can synchronise it."""
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
