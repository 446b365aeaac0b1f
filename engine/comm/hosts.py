"""Hosts files: who takes part in a run, at which address, and which entries are this machine.

Two formats are accepted, one entry per line (blank lines and ``#`` comments ignored):

* Poseidon's original ``<id> <ip> <port>`` (ids must be 0..P-1, in any order), and
* ``<ip>[:<port>]`` where a missing port is DEFAULT_PORT + 2 * line index.

Each entry is one *node*: a worker process bound at ``port`` and that node's parameter-server
shard bound at ``port + 1``. Several entries may share an address (local emulation of a
cluster); their port pairs must then not overlap.
"""
from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CommError

DEFAULT_PORT = 9999


class HostsError(CommError, ValueError):
    """A hosts file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class HostEntry:
    rank: int
    host: str
    port: int
    #: where the entry was read ("hosts.txt:3"), for error messages
    where: str = field(default="", compare=False)

    @property
    def shard_port(self) -> int:
        return self.port + 1

    def worker_addr(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def shard_addr(self) -> str:
        return f"tcp://{self.host}:{self.shard_port}"

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def _parse_port(text: str, where: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise HostsError(f"{where}: port {text!r} is not a number") from None
    if not 0 < port < 65535:  # port + 1 must be valid too
        raise HostsError(f"{where}: port {port} out of range 1..65534")
    return port


def parse_hosts_text(text: str, name: str = "<hosts>") -> list[HostEntry]:
    """Entries ordered by rank; raises HostsError naming ``name`` and the line."""
    by_rank: dict[int, HostEntry] = {}
    index = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        fields = line.split()
        if len(fields) == 3:
            try:
                rank = int(fields[0])
            except ValueError:
                raise HostsError(f"{where}: id {fields[0]!r} is not a number "
                                 "(expected '<id> <ip> <port>' or '<ip>[:<port>]')") from None
            entry = HostEntry(rank, fields[1], _parse_port(fields[2], where), where)
        elif len(fields) == 1:
            host, _, port = fields[0].rpartition(":") if ":" in fields[0] else (fields[0], "", "")
            entry = HostEntry(index, host,
                              _parse_port(port, where) if port else DEFAULT_PORT + 2 * index,
                              where)
        else:
            raise HostsError(f"{where}: expected '<id> <ip> <port>' or '<ip>[:<port>]', got {line!r}")
        if entry.rank in by_rank:
            raise HostsError(f"{where}: id {entry.rank} appears twice")
        by_rank[entry.rank] = entry
        index += 1
    if not by_rank:
        raise HostsError(f"{name}: no hosts listed")
    ranks = sorted(by_rank)
    if ranks != list(range(len(ranks))):
        raise HostsError(f"{name}: ids must be 0..{len(ranks) - 1}, got {ranks}")
    entries = [by_rank[r] for r in ranks]
    _check_ports(entries, name)
    return entries


def _check_ports(entries: list[HostEntry], name: str) -> None:
    used: dict[tuple[str, int], str] = {}
    for e in entries:
        for port, what in ((e.port, f"worker {e.rank}"), (e.shard_port, f"shard {e.rank}")):
            key = (e.host, port)
            if key in used:
                raise HostsError(f"{name}: {what} at {e.host}:{port} collides with {used[key]} "
                                 "(each entry uses its port and port+1)")
            used[key] = what


def parse_hosts(path: str | Path) -> list[HostEntry]:
    """The entries of a hosts file; every host name must resolve."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise HostsError(f"cannot read hosts file {p}: {e.strerror}") from None
    entries = parse_hosts_text(text, str(p))
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
    local = local_addresses() if local is None else local
    return entry.host in local or entry.host.startswith("127.")


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


def free_base_port(n: int) -> int:
    """A base port such that base .. base + 2n - 1 are all free on 127.0.0.1.

    Drawn below the kernel's ephemeral range, where outgoing connections cannot take it.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - 2 * n)
        socks = []
        try:
            for p in range(base, base + 2 * n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")
