"""The host table a launcher starts from: a hosts file, ``-H host:N,...``, ``-n N`` or ``--gpus``.

A hosts file is taken as written. ``-H`` (horovodrun's spelling: ``host1:4,host2:4``) lists
machines and their worker counts; ``-n N`` is N workers here. Each machine's workers take ports
from a base (worker i at base + 2i, its shard at base + 2i + 1). When every machine listed is
this one, the launcher starts every worker and hands each the table, so each base is probed
free at start (two jobs on one machine do not collide); when some machine is elsewhere, its
workers are started there from the same ``-H`` and must derive the same ports, so the bases are
the hosts file's defaults.

``--gpus`` pins one worker to each listed GPU on every machine: a machine's worker count is the
number of GPUs unless a line says otherwise, and then it must agree; ``gpus_of`` deals each
rank its GPU (--gpus: one each; --gpu: round robin).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

from engine.comm.hosts import (
    HostEntry,
    HostsError,
    Machine,
    is_local_host,
    local_addresses,
    table_of,
)

from ..job_config import JobConfig
from .hostfile import (
    DEFAULT_PORT,
    check_resolvable,
    parse_hosts,
    parse_slots,
    reserve_ports,
)


def resolve(hosts: str | None, host_list: str | None, nproc: int | None,
            pinned: Sequence[int] | None,
            hold: contextlib.ExitStack | None = None) -> list[HostEntry]:
    """The table of exactly one of ``hosts`` (a file), ``host_list`` (-H) or ``nproc`` (-n);
    ``pinned``: the GPUs of --gpus, whose count is each machine's default worker count.
    ``hold``: the ports probed here stay held until it closes (the job's own workers bind them
    meanwhile, another job's probe cannot draw them: ``reserve_ports``); without it they are
    released on return."""
    slots = len(pinned) if pinned else 1
    with contextlib.ExitStack() as probed:
        if hosts is not None:
            entries = parse_hosts(hosts, default_slots=slots)
        elif host_list is not None:
            entries = from_host_list(host_list, slots, probed)
        else:
            assert nproc is not None
            entries = table_of([Machine("127.0.0.1", _reserve(nproc, probed), nproc,
                                        f"-n {nproc}")], f"-n {nproc}")
        if pinned:
            check_pinned(entries, pinned)
        if hold is not None:
            hold.enter_context(probed.pop_all())
    return entries


def _reserve(n: int, probed: contextlib.ExitStack) -> int:
    """The base of ``n`` workers' ports here, held until ``probed`` closes."""
    base, socks = reserve_ports(n)
    for s in socks:
        probed.enter_context(s)
    return base


def from_host_list(spec: str, default_slots: int = 1,
                   probed: contextlib.ExitStack | None = None) -> list[HostEntry]:
    """``-H host1:4,host2:4`` (a host without ``:N`` runs ``default_slots`` workers). When
    every host is this machine its ports are probed, and held until ``probed`` closes (none:
    until every machine has its base, so that no two draw the same ports)."""
    where = f"-H {spec}"
    listed: list[tuple[str, int]] = []
    for item in spec.split(","):
        host, sep, count = item.strip().rpartition(":")
        if not sep:
            host, count = count, ""
        if not host:
            raise HostsError(f"{where}: expected host[:slots],... got {item!r}")
        listed.append((host, parse_slots(count, where) if count else default_slots))
    here = local_addresses()
    probe = all(is_local_host(h, here) for h, _ in listed)
    machines, before = [], 0
    with contextlib.ExitStack() as held:
        for host, n in listed:
            base = _reserve(n, held) if probe else DEFAULT_PORT + 2 * before
            machines.append(Machine(host, base, n, where))
            before += n
        if probed is not None:
            probed.enter_context(held.pop_all())
    entries = table_of(machines, where)
    check_resolvable(entries)
    return entries


def check_pinned(entries: Sequence[HostEntry], gpus: Sequence[int]) -> None:
    """--gpus: every machine runs one worker per listed GPU."""
    for e in entries:
        if e.local_size != len(gpus):
            raise HostsError(f"{e.where}: machine {e.machine} ({e.host}) runs {e.local_size} "
                             f"workers, but --gpus {','.join(map(str, gpus))} pins one worker "
                             f"to each of {len(gpus)} GPUs")


def assign_gpus(entries: list[HostEntry], gpus: Sequence[int] | None) -> dict[int, int | None]:
    """Each rank's GPU for --gpu: the workers at one address take ``gpus`` round robin, in
    rank order (several workers may share a GPU)."""
    if gpus is None:
        return {e.rank: None for e in entries}
    ids = list(gpus)
    seen: dict[str, int] = {}
    out: dict[int, int | None] = {}
    for e in entries:
        i = seen.get(e.host, 0)
        seen[e.host] = i + 1
        out[e.rank] = ids[i % len(ids)]
    return out


def gpus_of(entries: list[HostEntry], config: JobConfig) -> dict[int, int | None]:
    """Each rank's GPU: with --gpus, local worker i of each machine takes the i-th GPU listed
    (tables.check_pinned made the counts agree); with --gpu, round robin; else None (CPU)."""
    if config.pin_gpus and config.gpus is not None:
        return {e.rank: config.gpus[e.local_rank] for e in entries}
    return assign_gpus(entries, config.gpus)
