"""Which workers share a machine: the two levels of a run.

From the host table (engine/comm/hosts.py: each entry's machine and local rank). A run is
two-level when it has several machines and each runs the same number k > 1 of workers: then a
unit's vector is cut into k parts; local worker i owns part i, sums it inside its machine
(without the network), runs the network scheme on it with the owners of part i on the other
machines (its *network group*), and hands the result back to its machine (engine/comm/levels.py).
Otherwise every worker is its own group of one part: the flat schemes.

Which workers share a machine's cores is another matter: workers in network namespaces of one
kernel are machines of their own to the network, but compute on the same cores. Each says its
kernel (``machine_id``) and cores in HELLO, and the planner prices the CPU of messages where
workers outnumber cores (``crowding``; engine/comm/planner.py).
"""
from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Topology:
    #: the worker ranks of each machine, machine by machine, each in local-rank order
    machines: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def of(cls, hosts: Sequence[Any], rank: int) -> "Topology":
        """From HostEntries (``machine``, ``local_rank``)."""
        count = 1 + max((getattr(e, "machine", i) for i, e in enumerate(hosts)), default=0)
        out: list[list[tuple[int, int]]] = [[] for _ in range(count)]
        for i, e in enumerate(hosts):
            out[getattr(e, "machine", i)].append((getattr(e, "local_rank", 0), i))
        return cls(tuple(tuple(r for _, r in sorted(m)) for m in out), rank)

    @classmethod
    def flat(cls, world: int, rank: int) -> "Topology":
        return cls(tuple((r,) for r in range(world)), rank)

    @property
    def slots(self) -> int:
        """Workers per machine when every machine runs the same number, else 0."""
        sizes = {len(m) for m in self.machines}
        return sizes.pop() if len(sizes) == 1 else 0

    @property
    def two_level(self) -> bool:
        return len(self.machines) > 1 and self.slots > 1

    @property
    def machine(self) -> int:
        return next(i for i, m in enumerate(self.machines) if self.rank in m)

    @property
    def local(self) -> tuple[int, ...]:
        """This machine's workers, in local-rank order."""
        return self.machines[self.machine]

    @property
    def local_rank(self) -> int:
        return self.local.index(self.rank)

    def network_group(self, part: int) -> tuple[int, ...]:
        """The owners of part ``part``: local worker ``part`` of every machine."""
        return tuple(m[part] for m in self.machines)

    def groups(self) -> list[tuple[int, ...]]:
        """The network groups of a two-level run (one per part), else one group of all."""
        if self.two_level:
            return [self.network_group(i) for i in range(self.slots)]
        return [tuple(r for m in self.machines for r in m)]


def machine_id() -> bytes:
    """This kernel's name among a job's workers: those that share it share its cores, each
    in a network namespace of its own or not (a hash of its boot id, else of the host name)."""
    try:
        ident = Path("/proc/sys/kernel/random/boot_id").read_bytes()
    except OSError:
        ident = socket.gethostname().encode()
    return hashlib.sha256(b"poseidon machine " + ident).digest()[:16]


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def crowding(mine: bytes, cores: int, machines: Sequence[bytes]) -> float:
    """Workers per core on the machine ``mine`` (of ``cores``), from every worker's machine."""
    return sum(1 for m in machines if m == mine) / max(cores, 1)
