"""Host tables: which workers take part in a run, where they listen, and which share a machine.

A hosts file has one *machine* per line (blank lines and ``#`` comments ignored), in one of:

* Poseidon's original ``<id> <ip> <port>`` (ids must be 0..P-1, in any order): one worker;
* ``<ip>[:<port>]``: one worker;
* ``<ip>[:<port>] slots=N`` (the MPI / DeepSpeed hostfile convention): N workers.

A line without a port takes DEFAULT_PORT + 2 * (workers listed before it). Worker i of a line
binds ``port + 2i`` and its parameter-server shard the port after it. Lines without an id take
the next ranks in file order, so a machine's workers have consecutive ranks.

Each worker is a HostEntry that knows its machine (``machine``: 0.. in the order of each
machine's lowest rank), its place there (``local_rank``) and how many workers the machine runs
(``local_size``): what a two-level reduction groups by. A machine is a line, not an address:
several lines may name one address (a cluster emulated on one box); their ports must not
overlap. A table built any other way (``-H``, a rendezvous) passes the same checks
(``check_table``) and travels between processes as JSON (``table_json`` / ``table_from_json``).
"""
from __future__ import annotations

import json
import os
import random
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from .errors import CommError

DEFAULT_PORT = 9999
#: a sanity bound on one machine's workers and on a job's (a typo such as slots=800 is named)
MAX_SLOTS = 256
MAX_WORKERS = 65536
#: a host name or IPv4 address as it may appear in tcp://host:port
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,252}$")
_FORMATS = "'<id> <ip> <port>' or '<ip>[:<port>] [slots=N]'"


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


def _parse_port(text: str, where: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise HostsError(f"{where}: port {text!r} is not a number") from None
    if not 0 < port < 65535:  # port + 1 must be valid too
        raise HostsError(f"{where}: port {port} out of range 1..65534")
    return port


def parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise HostsError(f"{where}: slots {text!r} is not a number") from None
    if not 1 <= slots <= MAX_SLOTS:
        raise HostsError(f"{where}: slots={slots} out of range 1..{MAX_SLOTS}")
    return slots


def _split_host_port(text: str, where: str) -> tuple[str, int | None]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, None
    if not host:
        raise HostsError(f"{where}: no host before ':{port}'")
    return host, _parse_port(port, where)


def parse_hosts_text(text: str, name: str = "<hosts>", default_slots: int = 1) -> list[HostEntry]:
    """Entries ordered by rank; raises HostsError naming ``name`` and the line.
    ``default_slots``: the workers of a ``<ip>[:<port>]`` line that does not say (--gpus)."""
    lines: list[tuple[list[int], Machine]] = []  # each line's ranks, and the line
    taken: dict[int, str] = {}
    listed = 0  # workers listed before this line
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        fields = line.split()
        if len(fields) == 3:
            try:
                ranks = [int(fields[0])]
            except ValueError:
                raise HostsError(f"{where}: id {fields[0]!r} is not a number "
                                 f"(expected {_FORMATS})") from None
            m = Machine(fields[1], _parse_port(fields[2], where), 1, where)
        elif len(fields) in (1, 2):
            slots = default_slots
            if len(fields) == 2:
                key, eq, value = fields[1].partition("=")
                if key != "slots" or not eq:
                    raise HostsError(f"{where}: expected {_FORMATS}, got {line!r}")
                slots = parse_slots(value, where)
            host, port = _split_host_port(fields[0], where)
            m = Machine(host, DEFAULT_PORT + 2 * listed if port is None else port, slots, where)
            ranks = list(range(listed, listed + slots))
        else:
            raise HostsError(f"{where}: expected {_FORMATS}, got {line!r}")
        for r in ranks:
            if r in taken:
                raise HostsError(f"{where}: id {r} appears twice (also {taken[r]})")
            taken[r] = where
        lines.append((ranks, m))
        listed += len(ranks)
    if not lines:
        raise HostsError(f"{name}: no hosts listed")
    if sorted(taken) != list(range(len(taken))):
        raise HostsError(f"{name}: ids must be 0..{len(taken) - 1}, got {sorted(taken)}")
    return _table(lines, name)


def table_of(machine_list: Sequence[Machine], name: str) -> list[HostEntry]:
    """The table of machines listed in order, each taking the next ranks (``-H``)."""
    lines, listed = [], 0
    for m in machine_list:
        lines.append((list(range(listed, listed + m.slots)), m))
        listed += m.slots
    return _table(lines, name)


def _table(lines: list[tuple[list[int], Machine]], name: str) -> list[HostEntry]:
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
        _parse_port(str(row["port"]), f"{name}: worker {i}")
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


def parse_hosts(path: str | Path, default_slots: int = 1) -> list[HostEntry]:
    """The entries of a hosts file; every host name must resolve."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise HostsError(f"cannot read hosts file {p}: {e.strerror}") from None
    entries = parse_hosts_text(text, str(p), default_slots)
    check_resolvable(entries)
    return entries


def check_resolvable(entries: list[HostEntry]) -> None:
    """A name that does not resolve (a typo such as 'localhsot') is named at once: otherwise
    it passes for a remote machine and the run waits out its whole start-up timeout."""
    seen: set[str] = set()
    for e in entries:
        if e.host in seen:
            continue
        seen.add(e.host)
        try:
            socket.getaddrinfo(e.host, None)
        except (OSError, UnicodeError) as err:
            why = getattr(err, "strerror", None) or str(err)
            raise HostsError(f"{e.where or 'hosts'}: host {e.host!r} does not resolve ({why})") from None


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


def port_owner(port: int) -> str | None:
    """'pid 123 (python3)' for the process listening on TCP ``port`` here, when /proc tells
    (Linux, and a process this user may inspect); None otherwise."""
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
    for proc in Path("/proc").iterdir():
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


def reserve_ports(n: int, host: str = "127.0.0.1",
                  avoid: frozenset[int] = frozenset()) -> tuple[int, list[socket.socket]]:
    """A base port such that base .. base + 2n - 1 are free on ``host``, and the sockets that
    hold them bound (not listening) until closed: workers of one machine that probe at once
    cannot draw the same ports. ``avoid``: ports already promised (a rendezvous port).

    Drawn below the kernel's ephemeral range, where outgoing connections cannot take it.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - 2 * n)
        if avoid.intersection(range(base, base + 2 * n)):
            continue
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + 2 * n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base, socks
        except OSError:
            for s in socks:
                s.close()
    raise HostsError(f"no {2 * n} consecutive free ports on {host} in 20000..32000")


def free_base_port(n: int, host: str = "127.0.0.1") -> int:
    """A base port such that base .. base + 2n - 1 are free on ``host`` now."""
    base, socks = reserve_ports(n, host)
    for s in socks:
        s.close()
    return base
