"""The rendezvous of a job a cluster manager started: every worker learns the whole host table.

Under srun, mpirun or a Kubernetes operator nobody writes a hosts file: each worker knows its
rank and the job's size (managers.py), not where the others listen. So each worker draws a
free port pair on its machine (held bound until the table is known, so that workers of one
machine cannot draw the same), and reports its rank, machine, address and port to rank 0 at
the rendezvous address (MASTER_ADDR:MASTER_PORT, or the first SLURM node). When every rank has
come, rank 0 numbers the machines, checks that each machine's local ranks are 0..k-1, and sends
the table to all; the job starts. A rank that does not come within the timeout is named, and
every worker that did come stops with that one message.

The wire is the job's (engine/comm/auth.py): every message is ``[json][trailer]``, the trailer
an AES-GMAC tag under the job key, checked before a byte of the JSON is read; messages that
fail it are dropped. Never pickled; every field's name, type and range is checked. A worker's
JOIN carries a fresh nonce that the answer must echo, so an answer recorded from another run
is not taken. A JOIN that authenticates but does not fit (another world size, a rank claimed
twice) comes from a process of this job: that stops the job, naming it.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Sequence

import zmq

from engine.comm.auth import Signer, Verifier
from engine.comm.errors import CommError
from engine.comm.hosts import (
    HostEntry,
    HostsError,
    check_fields,
    check_host,
    check_table,
    port_owner,
    table_from_rows,
    table_rows,
)

from .hostfile import reserve_ports
from .managers import Placement

#: the largest JOIN a rank may send (a few hundred bytes in practice)
JOIN_BYTES = 4096
#: bytes per worker in the table rank 0 sends, beyond a fixed part
TABLE_BYTES_PER_WORKER = 256
NONCE_BYTES = 16
_POLL_MS = 100


class Rendezvous:
    """Rank 0's side: a ROUTER socket at the rendezvous port that collects ``world`` JOINs,
    then answers each with the table (or with why the job cannot start)."""

    def __init__(self, where: str, port: int, world: int, key: bytes, timeout: float,
                 manager: str) -> None:
        self.where, self.port, self.world = where, port, world
        self.timeout, self.manager = timeout, manager
        self._signer = Signer(key)
        self._verifier = Verifier(key)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 2000)  # the answers must leave before we close
        self._sock.setsockopt(zmq.MAXMSGSIZE, JOIN_BYTES)
        try:
            self._sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            owner = port_owner(port)
            raise CommError(f"rendezvous at {where}: cannot bind port {port}"
                            f"{f' (held by {owner})' if owner else ''}: {e}; another job on "
                            "this node? set MASTER_PORT to a free port") from None
        #: rank -> (the sender's socket identity, its session, its JOIN)
        self.joined: dict[int, tuple[bytes, bytes, dict[str, Any]]] = {}
        #: messages dropped: not this job's (unauthenticated) or replayed
        self.dropped = 0
        self._stop = threading.Event()
        self._stop_reason = ""
        self._thread = threading.Thread(target=self._serve, name="poseidon-rendezvous",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str | None = None) -> None:
        """Wait for the rendezvous to end; with a ``reason`` (rank 0 failed on its own side),
        end it now and tell the ranks that came why."""
        if reason is not None:
            self._stop_reason = reason
            self._stop.set()
        self._thread.join(self.timeout + 5.0)

    def _serve(self) -> None:
        deadline = time.monotonic() + self.timeout
        tell: list[tuple[bytes, str]] = []  # whom to answer: (identity, nonce)
        try:
            while len(self.joined) < self.world and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(self.world) if r not in self.joined]
                    raise CommError(f"rendezvous at {self.where}: {_ranks(missing)} of "
                                    f"{self.world} did not come within {self.timeout:g} s "
                                    f"({self.manager}; started? the same MASTER_ADDR and "
                                    "MASTER_PORT, the same job key?)")
                if self._sock.poll(min(_POLL_MS, int(left * 1000) + 1)):
                    self._receive(self._sock.recv_multipart(), tell)
            if self._stop.is_set():
                raise CommError(self._stop_reason)
            joins = [self.joined[r][2] for r in range(self.world)]
            rows = table_rows(table_of_reports(joins, self.manager))
            for ident, nonce in tell:
                self._send(ident, {"kind": "table", "nonce": nonce, "hosts": rows})
        except CommError as e:
            for ident, nonce in tell:
                self._send(ident, {"kind": "abort", "nonce": nonce, "reason": str(e)})
            self._tell_latecomers(str(e), deadline)
        finally:
            self._sock.close()
            self._ctx.term()

    def _tell_latecomers(self, reason: str, deadline: float) -> None:
        """The job cannot start: until the deadline (or rank 0 stops it), answer every JOIN
        of this job that still comes, rank 0's own included, with why."""
        while not self._stop.is_set() and time.monotonic() < deadline:
            if not self._sock.poll(_POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or isinstance(self._verifier.verify(frames[1:2], frames[2]), str):
                continue
            nonce = _nonce_of(frames[1])
            if nonce is not None:
                self._send(frames[0], {"kind": "abort", "nonce": nonce, "reason": reason})

    def _receive(self, frames: list[bytes], tell: list[tuple[bytes, str]]) -> None:
        if len(frames) != 3:
            self.dropped += 1
            return
        ident, payload, trailer = frames
        verdict = self._verifier.verify([payload], trailer)
        if isinstance(verdict, str):  # not this job's: dropped, as the transport drops it
            self.dropped += 1
            return
        session = verdict.session
        try:
            join = check_join(payload)
        except CommError:
            nonce = _nonce_of(payload)
            if nonce is not None:
                tell.append((ident, nonce))
            raise
        rank = join["rank"]
        earlier = self.joined.get(rank)
        if earlier is not None and earlier[1] == session:
            self.dropped += 1  # the same JOIN again: a replay, not a second process
            return
        tell.append((ident, join["nonce"]))
        if join["world"] != self.world:
            raise CommError(f"rendezvous: rank {rank} says the job has {join['world']} workers, "
                            f"rank 0 says {self.world} ({self.manager}'s size differs between "
                            "them)")
        if earlier is not None:
            raise CommError(f"rendezvous: rank {rank} came twice (from {earlier[2]['host']} and "
                            f"{join['host']}): two processes claim one rank (how are the ranks "
                            f"set? {self.manager})")
        self.joined[rank] = (ident, session, join)

    def _send(self, ident: bytes, message: dict[str, Any]) -> None:
        payload = json.dumps(message, separators=(",", ":")).encode()
        self._sock.send_multipart([ident, payload, self._signer.trailer([payload])])


def _nonce_of(payload: bytes) -> str | None:
    """The nonce of a JOIN that failed its checks, to answer it with why (when it has one)."""
    try:
        nonce = json.loads(payload).get("nonce")
    except (ValueError, AttributeError):
        return None
    return nonce if isinstance(nonce, str) and len(nonce) == 2 * NONCE_BYTES else None


def check_join(payload: bytes) -> dict[str, Any]:
    """A JOIN's fields, each checked; CommError naming what is wrong."""
    try:
        d = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CommError("rendezvous: a JOIN that is not JSON (another Poseidon version?)") from None
    if not isinstance(d, dict):
        raise CommError("rendezvous: a JOIN that is not a JSON object")
    what = f"rendezvous: the JOIN of rank {str(d.get('rank'))[:20]}"
    # null where the manager does not say
    optional = {k: d.pop(k, "missing") for k in ("local_rank", "local_size")}
    try:
        check_fields(d, {"kind": str, "rank": int, "world": int, "machine": str, "host": str,
                         "port": int, "nonce": str}, what)
        check_host(d["host"], what)
    except HostsError as e:
        raise CommError(str(e)) from None
    for k, v in optional.items():
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise CommError(f"{what}: field {k!r} is {str(v)[:20]!r}, expected a number or null")
    d.update(optional)
    if d["kind"] != "join" or not 0 <= d["rank"] < d["world"] or not 0 < d["port"] < 65535 \
            or not 0 < len(d["machine"]) <= 255 or len(d["nonce"]) != 2 * NONCE_BYTES:
        raise CommError(f"{what}: a field out of range: {d!r}"[:400])
    return d


def table_of_reports(joins: Sequence[dict[str, Any]], manager: str) -> list[HostEntry]:
    """The host table from every rank's JOIN, in rank order: machines numbered by their lowest
    rank; a machine's local ranks as the manager gave them, else in rank order."""
    index: dict[str, int] = {}
    members: list[list[dict[str, Any]]] = []
    for j in joins:
        if j["machine"] not in index:
            index[j["machine"]] = len(members)
            members.append([])
        members[index[j["machine"]]].append(j)
    local: dict[int, int] = {}
    for group in members:
        given = [j["local_rank"] for j in group if j["local_rank"] is not None]
        free = iter(sorted(set(range(len(group))) - set(given)))
        for j in group:
            if j["local_size"] is not None and j["local_size"] != len(group):
                raise CommError(f"rendezvous: rank {j['rank']} says its machine runs "
                                f"{j['local_size']} workers, but ranks "
                                f"{[g['rank'] for g in group]} came from {j['machine']!r} "
                                f"({manager}'s local size)")
            local[j["rank"]] = j["local_rank"] if j["local_rank"] is not None else next(free, -1)
    entries = [HostEntry(j["rank"], j["host"], j["port"], index[j["machine"]], local[j["rank"]],
                         len(members[index[j["machine"]]]), f"rank {j['rank']} ({manager})")
               for j in joins]
    try:
        check_table(entries, f"rendezvous ({manager})")
    except HostsError as e:
        raise CommError(str(e)) from None
    loopback = {e.host.startswith("127.") for e in entries}
    if len(members) > 1 and len(loopback) > 1:
        raise CommError(f"rendezvous: some workers report a loopback address, others do not: "
                        f"{', '.join(sorted({e.host for e in entries}))} (MASTER_ADDR=localhost "
                        "on a job of several machines?)")
    return entries


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:20])) + (", ..." if len(ranks) > 20 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def own_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: what the others can reach it at.
    (A UDP socket's connect sends nothing; it only picks the route.)"""
    ip = resolve(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, port))
        return s.getsockname()[0]


def resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, UnicodeError) as e:
        raise CommError(f"rendezvous host {host!r} does not resolve "
                        f"({getattr(e, 'strerror', None) or e})") from None


def meet(placement: Placement, key: bytes, timeout: float) -> list[HostEntry]:
    """Take part in the rendezvous (and host it, as rank 0); returns the job's host table.
    Rank 0 waits ``timeout`` for the others and then names who is missing; the others wait
    twice as long for its answer (rank 0 may start later than they do)."""
    if placement.master is None:
        raise CommError(placement.no_master)
    host, port = placement.master
    server = None
    if placement.rank == 0:
        server = Rendezvous(f"{host}:{port}", port, placement.world, key, timeout,
                            placement.manager)
        server.start()
        target = "127.0.0.1"  # its own server, whatever MASTER_ADDR resolves to here
    else:
        target = resolve(host)
    held: list[socket.socket] = []
    try:
        me = own_address(host, port)
        base, held = reserve_ports(1, "0.0.0.0", avoid=frozenset({port}))
        # longer than rank 0 waits, so that its message naming who is missing comes first
        slack = 1.0 + timeout / 10
        wait = timeout + slack if server else 2 * timeout + slack
        entries = _join(placement, key, wait, f"tcp://{target}:{port}", f"{host}:{port}", me,
                        base)
    except CommError as e:
        if server is not None:
            server.stop(f"rendezvous: rank 0 failed: {e}")
        raise
    finally:
        for s in held:  # the worker and its shard bind them next
            s.close()
    if server is not None:
        server.stop()  # it has answered everybody; its socket lingers until they have it
    return entries


def _join(p: Placement, key: bytes, timeout: float, addr: str, where: str, me: str,
          port: int) -> list[HostEntry]:
    nonce = os.urandom(NONCE_BYTES).hex()
    join = {"kind": "join", "rank": p.rank, "world": p.world, "local_rank": p.local_rank,
            "local_size": p.local_size, "machine": p.machine, "host": me, "port": port,
            "nonce": nonce}
    signer, verifier = Signer(key), Verifier(key)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 4096 + TABLE_BYTES_PER_WORKER * p.world)
    try:
        sock.connect(addr)
        payload = json.dumps(join, separators=(",", ":")).encode()
        sock.send_multipart([payload, signer.trailer([payload])])
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommError(f"rendezvous at {where}: no answer from rank 0 within "
                                f"{timeout:g} s (rank {p.rank} of {p.world}; is rank 0 running, "
                                f"and is {where.rsplit(':', 1)[0]} its address?)")
            if not sock.poll(min(_POLL_MS, int(left * 1000) + 1)):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 2 or isinstance(verdict := verifier.verify(frames[:1], frames[1]),
                                              str):
                continue  # not from this job's rank 0: dropped
            if verifier.accept("rank 0", verdict.session, verdict.counter) is not None:
                continue
            answer = _check_answer(frames[0], nonce, where)
            if answer is None:
                continue  # an answer to another JOIN (a replay)
            if answer["kind"] == "abort":
                raise CommError(answer["reason"])
            entries = table_from_rows(answer["hosts"], f"the rendezvous' table ({where})")
            mine = entries[p.rank] if len(entries) == p.world else None
            if mine is None or (mine.host, mine.port) != (me, port):
                raise CommError(f"rendezvous at {where}: rank 0's table does not list rank "
                                f"{p.rank} at {me}:{port}")
            return entries
    finally:
        sock.close()
        ctx.term()


def _check_answer(payload: bytes, nonce: str, where: str) -> dict[str, Any] | None:
    try:
        d = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CommError(f"rendezvous at {where}: an answer that is not JSON") from None
    if not isinstance(d, dict) or d.get("nonce") != nonce:
        return None
    kinds = {"table": {"kind", "nonce", "hosts"}, "abort": {"kind", "nonce", "reason"}}
    if d.get("kind") not in kinds or set(d) != kinds[d["kind"]] or (
            d["kind"] == "abort" and not isinstance(d["reason"], str)):
        raise CommError(f"rendezvous at {where}: a malformed answer from rank 0")
    if d["kind"] == "abort":
        d["reason"] = d["reason"][:2000]
    return d
