"""Hosts files, and the free ports a launcher hands out: how a run's host table is written.

A hosts file has one *machine* per line (blank lines and ``#`` comments ignored), in one of:

* Poseidon's original ``<id> <ip> <port>`` (ids must be 0..P-1, in any order): one worker;
* ``<ip>[:<port>]``: one worker;
* ``<ip>[:<port>] slots=N`` (the MPI / DeepSpeed hostfile convention): N workers.

A line without a port takes DEFAULT_PORT + 2 * (workers listed before it). Lines without an id
take the next ranks in file order. The table (engine/comm/hosts.py) checks the rest. Every host
name must resolve: a typo is named at once instead of waiting out the start-up timeout. Ports a
launcher draws for the workers it starts (``-n``, ``-H`` on this machine, a rendezvous) are
reserved while it draws them, so two draws at once do not collide.
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

from engine.comm.hosts import (
    HostEntry,
    HostsError,
    Machine,
    check_port,
    table_from_lines,
)

DEFAULT_PORT = 9999
#: a sanity bound on one machine's workers (a typo such as slots=800 is named)
MAX_SLOTS = 256
_FORMATS = "'<id> <ip> <port>' or '<ip>[:<port>] [slots=N]'"
#: where ports probed free are drawn: below the kernel's ephemeral range (32768..), where
#: outgoing connections cannot take them; POSEIDON_PORTS=LOW-HIGH narrows it (a firewall's
#: open range; the test suite gives each of its parallel workers a slice of its own)
PORTS = (20000, 32000)


def port_range() -> tuple[int, int]:
    """(low, high) of the ports drawn here: POSEIDON_PORTS, else ``PORTS``."""
    text = os.environ.get("POSEIDON_PORTS", "").strip()
    if not text:
        return PORTS
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = 0
    if not sep or not 1024 <= lo < hi <= 65535:
        raise HostsError(f"POSEIDON_PORTS={text!r}: expected LOW-HIGH between 1024 and 65535, "
                         f"such as {PORTS[0]}-{PORTS[1]}")
    return lo, hi


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
    return host, check_port(port, where)


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
            m = Machine(fields[1], check_port(fields[2], where), 1, where)
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
    return table_from_lines(lines, name)


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


def reserve_ports(n: int, host: str = "127.0.0.1",
                  avoid: frozenset[int] = frozenset()) -> tuple[int, list[socket.socket]]:
    """A base port such that base .. base + 2n - 1 are free on ``host``, and the sockets that
    hold them bound (not listening) until closed: workers of one machine that probe at once
    cannot draw the same ports. ``avoid``: ports already promised (a rendezvous port).

    Drawn from ``port_range()``. Each socket takes SO_REUSEADDR only once bound: a later probe
    (which binds without it) is refused while the hold lasts, but a ZeroMQ listener (which
    sets it) binds and listens beside it, as Linux lets two SO_REUSEADDR sockets share a port
    while neither listens. So a launcher holds its workers' ports until they have bound them,
    and two jobs started at once on one machine never draw the same ones.
    """
    low, high = port_range()
    if high - low < 2 * n:
        raise HostsError(f"POSEIDON_PORTS={low}-{high} holds fewer than the {2 * n} ports "
                         f"{n} workers need")
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - 2 * n + 1)
        if avoid.intersection(range(base, base + 2 * n)):
            continue
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + 2 * n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            return base, socks
        except OSError:
            for s in socks:
                s.close()
    raise HostsError(f"no {2 * n} consecutive free ports on {host} in {low}..{high}")


def free_base_port(n: int, host: str = "127.0.0.1") -> int:
    """A base port such that base .. base + 2n - 1 are free on ``host`` now."""
    base, socks = reserve_ports(n, host)
    for s in socks:
        s.close()
    return base
