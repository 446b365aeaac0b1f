"""Host tables: which workers take part in a run, where they listen, and which share a machine.

A table is built from *machines* (a hosts file's lines, ``-H`` items, poseidon_cli/launch/
hostfile.py reads them): worker i of a machine binds ``port + 2i`` and its parameter-server
shard the port after it, and a machine's workers have consecutive ranks.

Each worker is a HostEntry that knows its machine (``machine``: 0.. in the order of each
machine's lowest rank), its place there (``local_rank``) and how many workers the machine runs
(``local_size``): what a two-level reduction groups by. A machine is a line, not an address:
several lines may name one address (a cluster emulated on one box); their ports must not
overlap. A table built any way (a file, ``-H``, a rendezvous) passes the same checks
(``check_table``) and travels between processes as JSON (``table_json`` / ``table_from_json``).
"""
from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

from .errors import CommError

#: a sanity bound on a job's workers
MAX_WORKERS = 65536
#: a host name or IPv4 address as it may appear in tcp://host:port
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,252}$")


class HostsError(CommError, ValueError):
    """A host table that cannot be used; the message names its source (file and line)."""


@dataclass(frozen=True)
class HostEntry:
    """One worker: its rank, where it listens, and its place on its machine."""
    rank: int
    host: str
    port: int
    #: the machine's index: 0.. in the order of each machine's lowest rank
    machine: int
    #: this worker's index among its machine's workers, and how many those are
    local_rank: int
    local_size: int
    #: where the entry was read ("hosts.txt:3"), for error messages
    where: str = field(default="", compare=False)

    @property
    def shard_port(self) -> int:
        return self.port + 1

    def worker_addr(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def shard_addr(self) -> str:
        return f"tcp://{self.host}:{self.shard_port}"

    def label(self, port: int | None = None) -> str:
        """'host:port', and which machine and local worker it is when its machine runs
        several: what an error names."""
        at = f"{self.host}:{self.port if port is None else port}"
        if self.local_size == 1:
            return at
        return f"{at}, machine {self.machine} local rank {self.local_rank}"

    def __str__(self) -> str:
        return self.label()


class Machine(NamedTuple):
    """One line of a hosts file (or one ``-H`` item): ``slots`` workers from ``port`` up."""
    host: str
    port: int
    slots: int
    where: str


def machines(entries: Sequence[HostEntry]) -> list[list[HostEntry]]:
    """The workers of each machine, machine by machine, each in local-rank order."""
    out: list[list[HostEntry]] = [[] for _ in range(1 + max(e.machine for e in entries))]
    for e in sorted(entries, key=lambda e: e.local_rank):
        out[e.machine].append(e)
    return out


def check_port(text: str, where: str) -> int:
    """``text`` as a port a worker may bind (its shard takes the next one), or HostsError."""
    try:
        port = int(text)
    except ValueError:
        raise HostsError(f"{where}: port {text!r} is not a number") from None
    if not 0 < port < 65535:  # port + 1 must be valid too
        raise HostsError(f"{where}: port {port} out of range 1..65534")
    return port


def table_of(machine_list: Sequence[Machine], name: str) -> list[HostEntry]:
    """The table of machines listed in order, each taking the next ranks (``-H``)."""
    lines, listed = [], 0
    for m in machine_list:
        lines.append((list(range(listed, listed + m.slots)), m))
        listed += m.slots
    return table_from_lines(lines, name)


def table_from_lines(lines: list[tuple[list[int], Machine]], name: str) -> list[HostEntry]:
    """The table of machines, each line with the ranks it takes (a hosts file's ids)."""
    lines = sorted(lines, key=lambda rl: min(rl[0]))  # machines numbered by their lowest rank
    entries = []
    for index, (ranks, m) in enumerate(lines):
        if m.port + 2 * m.slots - 1 > 65535:
            raise HostsError(f"{m.where}: {m.slots} workers from port {m.port} run past 65535")
        entries += [HostEntry(r, m.host, m.port + 2 * i, index, i, m.slots, m.where)
                    for i, r in enumerate(ranks)]
    entries.sort(key=lambda e: e.rank)
    check_table(entries, name)
    return entries


def check_table(entries: Sequence[HostEntry], name: str) -> None:
    """Everything a host table promises, whoever built it: ranks 0..P-1 in order; machines
    numbered 0.. by their lowest rank, each at one address with local ranks 0..k-1 and
    local_size k; no two workers or shards on one address and port."""
    if not entries:
        raise HostsError(f"{name}: no hosts listed")
    seen: list[HostEntry] = []  # each machine's first worker, by machine index
    members: dict[int, list[HostEntry]] = {}
    for i, e in enumerate(entries):
        if e.rank != i:
            raise HostsError(f"{name}: entry {i} has rank {e.rank}: ranks must be 0..P-1 in order")
        if e.machine == len(seen):
            seen.append(e)
        elif e.machine > len(seen):
            raise HostsError(f"{name}: rank {i} is on machine {e.machine} before machine "
                             f"{len(seen)} appears: machines are numbered by their lowest rank")
        first = seen[e.machine]
        if e.host != first.host:
            raise HostsError(f"{name}: machine {e.machine} has workers at {first.host} (rank "
                             f"{first.rank}) and {e.host} (rank {i}): one machine, one address")
        members.setdefault(e.machine, []).append(e)
    for m, group in members.items():
        local = sorted(e.local_rank for e in group)
        if local != list(range(len(group))) or any(e.local_size != len(group) for e in group):
            raise HostsError(f"{name}: machine {m} ({group[0].host}) runs ranks "
                             f"{[e.rank for e in group]} with local ranks "
                             f"{[e.local_rank for e in group]} of "
                             f"{sorted({e.local_size for e in group})}: expected 0..{len(group) - 1} "
                             f"of {len(group)}")
    used: dict[tuple[str, int], str] = {}
    for e in entries:
        for port, what in ((e.port, f"worker {e.rank}"), (e.shard_port, f"shard {e.rank}")):
            key = (e.host, port)
            if key in used:
                raise HostsError(f"{e.where or name}: {what} at {e.host}:{port} collides with "
                                 f"{used[key]} (each worker uses its port and port+1)")
            used[key] = what


def table_rows(entries: Sequence[HostEntry]) -> list[dict[str, Any]]:
    """The table as JSON-ready rows, in rank order."""
    return [{"host": e.host, "port": e.port, "machine": e.machine, "local_rank": e.local_rank}
            for e in entries]


def table_json(entries: Sequence[HostEntry]) -> str:
    """The table as one line of JSON, as it travels to a worker and its shard (never pickled)."""
    return json.dumps({"hosts": table_rows(entries)}, separators=(",", ":"))


def table_from_json(text: str | bytes, name: str) -> list[HostEntry]:
    """A table from ``table_json``'s text, every field checked; HostsError naming ``name``."""
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HostsError(f"{name}: not a host table (not JSON: {e})") from None
    if not isinstance(d, dict) or set(d) != {"hosts"}:
        raise HostsError(f"{name}: not a host table (expected {{\"hosts\": [...]}})")
    return table_from_rows(d["hosts"], name)


def table_from_rows(rows: Any, name: str) -> list[HostEntry]:
    """A table from ``table_rows``' rows, every field checked."""
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_WORKERS:
        raise HostsError(f"{name}: not a host table (expected a list of 1..{MAX_WORKERS} "
                         "workers)")
    for i, row in enumerate(rows):
        check_fields(row, {"host": str, "port": int, "machine": int, "local_rank": int},
                     f"{name}: worker {i}")
        check_host(row["host"], f"{name}: worker {i}")
        check_port(str(row["port"]), f"{name}: worker {i}")
    sizes: dict[int, int] = {}
    for row in rows:
        sizes[row["machine"]] = sizes.get(row["machine"], 0) + 1
    entries = [HostEntry(i, r["host"], r["port"], r["machine"], r["local_rank"],
                         sizes[r["machine"]], name) for i, r in enumerate(rows)]
    check_table(entries, name)
    return entries


def check_fields(d: Any, kinds: dict[str, type], what: str) -> None:
    """``d`` is an object with exactly these fields, of these types (ints not bools, >= 0),
    or HostsError naming ``what`` and the field."""
    if not isinstance(d, dict):
        raise HostsError(f"{what}: not a JSON object")
    if set(d) != set(kinds):
        raise HostsError(f"{what}: fields {sorted(d)}, expected {sorted(kinds)}")
    for key, kind in kinds.items():
        v = d[key]
        ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 0) if kind is int \
            else isinstance(v, kind)
        if not ok:
            raise HostsError(f"{what}: field {key!r} has the wrong type or sign: {v!r}")


def check_host(host: str, what: str) -> None:
    if not _HOST.match(host):
        raise HostsError(f"{what}: {host[:80]!r} is not a host name or IPv4 address")


def local_addresses() -> set[str]:
    """Names and addresses that mean this machine."""
    names = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()}
    for n in list(names):
        try:
            names.update(socket.gethostbyname_ex(n)[2])
        except OSError:
            pass
    return names


def is_local(entry: HostEntry, local: set[str] | None = None) -> bool:
    return is_local_host(entry.host, local)


def is_local_host(host: str, local: set[str] | None = None) -> bool:
    local = local_addresses() if local is None else local
    return host in local or host.startswith("127.")


def port_owner(port: int, among: Iterable[int] | None = None) -> str | None:
    """'pid 123 (python3)' for the process listening on TCP ``port`` here, when /proc tells
    (Linux, and a process this user may inspect); None otherwise. ``among``: only these
    pids are looked at (reading every process's descriptors takes seconds on a busy
    machine)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    procs = Path("/proc").iterdir() if among is None else (Path(f"/proc/{p}") for p in among)
    for proc in procs:
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    name = (proc / "comm").read_text().strip()
                    return f"pid {proc.name} ({name})"
        except OSError:
            continue
    return None


