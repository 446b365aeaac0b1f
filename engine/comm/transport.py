"""ZeroMQ transport: one bound socket per process, validated multipart messages, liveness.

Every process (a worker, or a node's shard server) binds one PULL socket at its own port and
keeps one PUSH socket connected to each peer. A message is ``[header][array]...``: the header is
a ``poseidon.Header`` protobuf, the arrays are raw C-contiguous bytes sent with ``copy=False``.

Every message ends with an authentication trailer (engine/comm/auth.py): a receiver checks it
before it reads the header, so a process without the job's key can neither change a weight nor
stop the job; its messages are dropped and counted. A message with more array bytes than a
piece goes as several ZeroMQ messages, tagged, sent and verified one by one, and is released
only when all of them verified (engine/comm/pieces.py). Then the receiver thread parses and
validates the message before a byte of it is used (structure here, with Python ints and a cap
on every size; content — layer, chunk, round, dtype, shape — by the owner's ``checker``). A bad
message is logged (rate-limited), counted and dropped; nothing a peer sends can end the
thread. Good data messages go to a handler (the shard server) or to a mailbox
the syncer waits on with a timeout that names who is missing. A heartbeat thread keeps peers
informed and notices peers that went silent; any fatal error is broadcast (ABORT) so that every
process stops with the same message naming the culprit.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import zmq

from engine.allocator import tune_allocator
from engine.pb import poseidon_pb2 as pb

from .auth import Signer, Verifier
from .errors import CommError
from .hosts import HostEntry, port_owner
from .liveness import Liveness
from .pieces import PIECE_BYTES, signed
from .stages import StageClock
from .stats import CommStats
from .wire import (HEADER_BYTES, HEADER_BYTES_PER_CHUNK, PROBE_ASK, PROBE_ECHO, ROLE_PB, SHARD,
                   WORKER, Key, Message, Parser, PeerId, byte_tag, header, message_key,
                   peer_name, wire_frames)

__all__ = ["COPY_BELOW_BYTES", "HEADER_BYTES", "HEADER_BYTES_PER_CHUNK", "PROBE_ASK",
           "PROBE_ECHO", "SHARD", "WORKER", "Endpoint", "Key", "Message", "PeerId", "header",
           "message_key", "peer_name"]

log = logging.getLogger("poseidon.comm")

#: a wait for peers says whom it waits for this often (seconds)
SAY_EVERY = 3.0
#: a closing process waits this long (seconds) for its last messages to leave
LINGER_S = 2.0
#: frames below this are copied into the message, larger ones sent zero-copy: pyzmq's zero-copy
#: costs a fixed ~50 us per frame (its buffer tracking), a copy ~5 us per 64 KB. Sender and
#: receiver CPU per message, measured here, copied against zero-copy: 64 KB 203 us against 254,
#: 256 KB 328 against 364, 512 KB 384-403 against 441-483, 1 MB 707 against 549 (pyzmq's own
#: default cuts at 64 KB)
COPY_BELOW_BYTES = 1 << 20
def ipc_address(host: str, port: int) -> str:
    """The Unix socket a process bound at ``host``:``port`` also listens on, for its machine
    mates: in a directory of this user's only (the messages are authenticated regardless)."""
    d = Path(tempfile.gettempdir()) / f"poseidon-ipc-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    tag = hashlib.sha1(host.encode()).hexdigest()[:12]  # a host name may be long; a path not
    return f"ipc://{d}/{tag}-{port}"


def _same_machine(a: HostEntry, b: HostEntry) -> bool:
    """One machine of the host table (a hosts line, a manager's node), at one address."""
    return a.machine == b.machine and a.host == b.host


class Endpoint:
    """One process's view of the network: its bound socket, its peers, liveness and mailbox.

    ``checker(message) -> reason | None`` validates content; ``handler(message)``, when given,
    receives valid data messages on the receiver thread instead of the mailbox.
    """

    def __init__(self, me: PeerId, hosts: Sequence[HostEntry], peers: Iterable[PeerId], *,
                 key: bytes | None, timeout: float = 30.0, stats: CommStats | None = None,
                 startup: float | None = None,
                 snapshot_hint: Callable[[], str | None] | None = None,
                 max_frame_bytes: int | None = None, local_ipc: bool = True,
                 piece_bytes: int = PIECE_BYTES) -> None:
        """``key``: the job key every message is authenticated with; None only for a
        benchmark's unauthenticated baseline. ``max_frame_bytes``: the largest frame a
        legitimate peer sends (ZMQ_MAXMSGSIZE: a peer announcing more is disconnected).
        ``local_ipc``: reach peers on this machine through a Unix socket (ipc://) rather than
        TCP on loopback (False: a benchmark of the TCP path). ``piece_bytes``: a message
        with more array bytes goes in authenticated pieces of this size."""
        self.me = me
        self.hosts = list(hosts)
        self.peers = [p for p in peers if p != me]
        self.timeout = float(timeout)
        self.stats = stats or CommStats()
        self.snapshot_hint = snapshot_hint
        self.max_frame_bytes = max_frame_bytes
        self.handler: Callable[[Message], None] | None = None
        #: called with the reason once this process's communication failed; and when the
        #: training thread took the error in hand (``disarm``): a worker's forced exit
        #: (poseidon_cli/launch/exits.py) arms and disarms by them
        self.on_fatal: list[Callable[[str], None]] = []
        self.on_disarm: list[Callable[[], None]] = []
        self.dropped = 0
        self.piece_bytes = int(piece_bytes)
        self._signer = Signer(key) if key is not None else None
        #: the receiving side (engine/comm/wire.py), on the receive thread only
        self.parser = Parser(Verifier(key) if key is not None else None, self.peers,
                             max_frame_bytes, self.name_of, self._drop)
        self.liveness = Liveness(self.peers, self.timeout, self.name_of, startup)
        #: how long the start-up barrier waits for a peer (machines started by hand)
        self.startup = self.liveness.startup
        self.error: str | None = None
        #: True when the error came in an ABORT (some other process reports it first-hand)
        self.error_from_peer = False
        tune_allocator()  # before the context's I/O thread allocates messages
        self._ctx = zmq.Context()
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._mailbox: dict[Key, Message] = {}
        self._stop = threading.Event()
        entry = self.hosts[me[1]]
        port = entry.port if me[0] == WORKER else entry.shard_port
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # the receive thread blocks until a message comes: close() wakes it through this
        # in-process address (nothing outside the process can reach an inproc endpoint)
        self._wake = f"inproc://wake-{id(self):x}"
        self._pull.bind(self._wake)
        if max_frame_bytes is not None:
            self._pull.setsockopt(zmq.MAXMSGSIZE, int(max_frame_bytes))
        try:
            self._pull.bind(f"tcp://*:{port}")  # peers on other machines must reach it
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            owner = port_owner(port)
            held = f" (held by {owner})" if owner else ""
            raise CommError(f"{peer_name(me, self.hosts)}: cannot bind port {port}{held}: {e}") from None
        mine = self.hosts[me[1]]
        local = [p for p in self.peers if local_ipc and _same_machine(self.hosts[p[1]], mine)]
        #: the Unix socket's file, removed at close (a stale one, of a killed process, is
        #: replaced by the next bind: the TCP port above says nobody alive holds it)
        self._ipc_path: str | None = None
        if local:  # machine mates (and a worker's own shard) talk through a Unix socket
            address = ipc_address(mine.host, port)
            self._pull.bind(address)
            self._ipc_path = address[len("ipc://"):]
        self._push: dict[PeerId, zmq.Socket] = {}
        for p in self.peers:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.copy_threshold = COPY_BELOW_BYTES
            e = self.hosts[p[1]]
            peer_port = e.port if p[0] == WORKER else e.shard_port
            s.connect(ipc_address(e.host, peer_port) if p in local else
                      f"tcp://{e.host}:{peer_port}")
            self._push[p] = s
        #: when each peer was last sent anything: a heartbeat goes only where nothing else
        #: went for an interval (any message tells a peer this process lives)
        self._sent_at: dict[PeerId, float] = {}
        beat = self._heartbeat
        self._threads = [threading.Thread(target=self._recv_loop, name="poseidon-recv", daemon=True),
                         threading.Thread(target=self.liveness.run, name="poseidon-heartbeat",
                                          args=(self._stop, beat, self.fatal), daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def name(self) -> str:
        return peer_name(self.me, self.hosts)

    # the parser's, as the owner sets and reads them
    @property
    def checker(self) -> Callable[[Message], str | None] | None:
        """Checks a DATA message's content before any byte is used: a reason, or None."""
        return self.parser.checker

    @checker.setter
    def checker(self, fn: Callable[[Message], str | None] | None) -> None:
        self.parser.checker = fn

    @property
    def clock(self) -> StageClock | None:
        """When set, the stages each message passes are timed (`poseidon bench comm
        --stages`)."""
        return self.parser.clock

    @clock.setter
    def clock(self, clock: StageClock | None) -> None:
        self.parser.clock = clock

    @property
    def unauthenticated(self) -> int:
        """Messages that failed authentication (counted among ``dropped``)."""
        return self.parser.unauthenticated

    @property
    def incomplete(self) -> int:
        """Messages in pieces dropped whole (counted among ``dropped``)."""
        return self.parser.incomplete

    def name_of(self, peer: PeerId) -> str:
        return peer_name(peer, self.hosts)

    # ----------------------------------------------------------------------------- sending
    def send(self, peer: PeerId, hdr: pb.Header, arrays: Sequence[np.ndarray] = ()) -> None:
        """Send a header and arrays (zero-copy: do not modify them until the peer answered)."""
        self.broadcast([peer], hdr, arrays)

    def broadcast(self, peers: Iterable[PeerId], hdr: pb.Header,
                  arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one message to each of ``peers``, authenticated once: every receiver sees the
        sender's counters grow, since they are taken in sending order under the lock. A large
        message goes in pieces (engine/comm/pieces.py), each sent as soon as it is tagged; the
        lock keeps one message's pieces together on every socket."""
        clock = self.clock
        if clock is not None:
            clock.mark(hdr.round, "call")
        hdr.sender_role = ROLE_PB[self.me[0]]
        hdr.sender = self.me[1]
        frames = wire_frames(hdr, arrays)
        if clock is not None:
            clock.mark(hdr.round, "serialised")
        nbytes = sum(a.nbytes for a in arrays)
        tag = byte_tag(hdr)
        sent = []
        with self._send_lock:
            socks = [(p, self._push.get(p)) for p in peers]
            socks = [(p, s) for p, s in socks if s is not None]
            if not socks:
                return
            for k, piece in enumerate(signed(frames, self._signer, self.piece_bytes)):
                if clock is not None and k == 0:
                    clock.mark(hdr.round, "tagged")
                for _, sock in socks:
                    sock.send_multipart(piece, copy=False)
            sent = [p for p, _ in socks]
            now = time.monotonic()
            for p in sent:
                self._sent_at[p] = now
        if tag is not None:
            for p in sent:
                self.stats.add_bytes(hdr.layer, tag, True, nbytes, self._network(p))

    def _network(self, peer: PeerId) -> bool:
        """True when traffic to ``peer`` leaves this machine (a worker and its shard, and the
        workers of one hosts line, are one machine)."""
        return self.hosts[peer[1]].machine != self.hosts[self.me[1]].machine

    # --------------------------------------------------------------------------- receiving
    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            try:  # blocking, no poll first: one wake-up per message, none while idle
                frames = self._pull.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                self.fatal(f"{self.name}: the receive thread failed: {e}")
                return
            if self._stop.is_set():  # close()'s wake-up
                return
            clock = self.clock
            if clock is not None:
                clock.hold("received", first=True)
            try:
                msg, reason = self.parser.parse(frames)
            except Exception as e:  # nothing a peer sends may end this thread
                msg, reason = None, f"unparsable message ({type(e).__name__}: {e})"
            if msg is None:
                if reason:
                    self._drop(reason)
                continue
            if clock is not None:
                clock.hold("checked")
                clock.release(msg.header.round)
            try:
                self._dispatch(msg)
            except Exception as e:  # a bug in a handler must stop the run, not hang it
                self.fatal(f"{self.name}: internal error handling a message from "
                           f"{self.name_of(msg.sender)}: {type(e).__name__}: {e}")

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        if self.dropped <= 10 or self.dropped % 1000 == 0:  # a flood must not flood the log
            log.warning("%s: dropped a bad message (%d so far): %s", self.name, self.dropped, reason)

    def _dispatch(self, msg: Message) -> None:
        sender, kind = msg.sender, msg.header.kind
        self.liveness.heard(sender)
        if kind == pb.HEARTBEAT:
            return
        if kind == pb.BYE:
            self.liveness.said_bye(sender)
            with self._cond:
                self._cond.notify_all()
            return
        if kind == pb.ABORT:
            self.fatal(msg.header.reason or f"{self.name_of(sender)} aborted", propagate=False)
            return
        if kind == pb.PROBE and msg.header.op == PROBE_ASK:  # answered here: no thread's turn
            self.send(sender, header(pb.PROBE, op=PROBE_ECHO, round=msg.header.round), msg.arrays)
            return
        tag = byte_tag(msg.header)
        if tag is not None:
            self.stats.add_bytes(msg.header.layer, tag, False,
                                 sum(a.nbytes for a in msg.arrays), self._network(sender))
        if self.clock is not None:
            self.clock.mark(msg.header.round, "handed")
        if self.handler is not None and kind == pb.DATA:
            self.handler(msg)
            return
        with self._cond:
            key = msg.key()
            if key in self._mailbox:
                self._drop(f"duplicate message from {self.name_of(sender)}")
                return
            self._mailbox[key] = msg
            self._cond.notify_all()

    def wait_for(self, keys: Sequence[Key], what: str, timeout: float | None = None,
                 startup: bool = False) -> list[Message]:
        """Take the messages with ``keys`` from the mailbox, waiting up to ``timeout`` seconds
        (the start-up window with ``startup``: the first meeting of machines started by hand).
        Every ``SAY_EVERY`` seconds of waiting it says whom it waits for and how much longer.

        A timeout is fatal: the error names the peers whose messages did not come.
        """
        start = time.monotonic()
        window = timeout if timeout is not None else self.startup if startup else self.timeout
        deadline = start + window
        said = start
        with self._cond:
            while True:
                if self.error is not None:
                    raise CommError(self.error)
                missing = [k for k in keys if k not in self._mailbox]
                if not missing:
                    if self.clock is not None:
                        for k in keys:
                            self.clock.mark(k[3], "woken")
                    return [self._mailbox.pop(k) for k in keys]
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    break
                if now - said >= SAY_EVERY:  # never a blind wait: who, and for how long
                    said = now
                    who = ", ".join(sorted({self.name_of((k[1], k[2])) for k in missing}))
                    log.warning("%s: waiting %.0f s for %s from %s (at most %.0f s more)",
                                self.name, now - start, what, who, left)
                # woken by a message, a BYE or an error; else only when the next word is due
                self._cond.wait(min(left, said + SAY_EVERY - now))
        self.timed_out(what, [(k[1], k[2]) for k in missing], window,
                       barrier=startup and timeout is None)
        raise CommError(self.error)

    def timed_out(self, what: str, peers: Sequence[PeerId], waited: float | None = None,
                  barrier: bool = False) -> None:
        """Waiting ``waited`` seconds (the timeout) for ``what`` from ``peers`` was too long:
        fatal, naming the real cause (at the start-up ``barrier`` a peer never heard from;
        else a silent peer upstream, if any, rather than the one waited on)."""
        silent = self.liveness.silent(3 * self.liveness.interval)
        absent = self.liveness.never_heard(peers) if barrier else []
        if absent:
            self.fatal(self.liveness.lost(absent[0]))
        elif silent:
            self.fatal(self.liveness.lost(silent[0]))
        else:
            who = ", ".join(sorted({self.name_of(p) for p in peers})) or "this worker"
            waited = self.timeout if waited is None else waited
            self.fatal(f"{self.name}: timed out after {waited:g} s waiting for {what} "
                       f"from {who}")

    def _heartbeat(self, peer: PeerId) -> None:
        if time.monotonic() - self._sent_at.get(peer, 0.0) >= self.liveness.interval / 2:
            self.send(peer, header(pb.HEARTBEAT))

    def fatal(self, reason: str, propagate: bool = True) -> None:
        """Stop this process's communication with ``reason``; tell every peer (once)."""
        with self._cond:
            if self.error is not None:
                return
            hint = self.snapshot_hint() if self.snapshot_hint else None
            if hint is not None and "last good snapshot" not in reason:
                reason += f"; last good snapshot: {hint}"
            self.error = reason
            self.error_from_peer = not propagate
            self._cond.notify_all()
        for cb in self.on_fatal:
            cb(reason)
        if propagate:
            self.broadcast(self.liveness.present(), header(pb.ABORT, reason=reason))

    def disarm(self) -> None:
        """The main thread has the error in hand and will exit (``on_disarm``)."""
        for cb in self.on_disarm:
            cb()

    def all_gone(self, role: str) -> bool:
        return self.liveness.all_gone(role)

    def wait_change(self, done: Callable[[], bool], seconds: float) -> None:
        """Sleep until ``done()``, an error, or ``seconds``: a BYE, a mailbox message and an
        error wake it, so a waiting process polls nothing. ``done`` is checked under the lock
        that those notify under: no wake-up is lost between the check and the sleep."""
        with self._cond:
            if self.error is None and not done():
                self._cond.wait(max(seconds, 0.0))

    def close(self, say_bye: bool = True, answered: bool = False) -> None:
        """Say BYE (with ``say_bye``) and release the sockets, waiting at most ``LINGER_S`` for
        the messages still on their way. ``answered``: every worker is ending too (the replica
        check passed); each waits for the others' BYEs before it closes, so no worker closes
        while a message to it is on its way: else a BYE to a worker that closed first would
        hold this process for the whole linger. (A shard stays until every worker's BYE is in.)"""
        if self.dropped:
            log.warning("%s: dropped %d bad messages in all, %d of them failed authentication",
                        self.name, self.dropped, self.unauthenticated)
        self.stats.extra.update(dropped_messages=self.dropped,
                                unauthenticated_messages=self.unauthenticated,
                                incomplete_messages=self.incomplete)
        if say_bye and self.error is None:
            # answered: every worker waits for this BYE, also one whose own came first
            self.broadcast([p for p in self.peers if answered and p[0] == WORKER
                            or p in self.liveness.present()], header(pb.BYE))
            if answered:
                deadline = time.monotonic() + LINGER_S
                with self._cond:
                    while not self.liveness.all_gone(WORKER) and time.monotonic() < deadline:
                        self._cond.wait(deadline - time.monotonic())  # a BYE wakes it
        self._stop.set()
        if any(t.is_alive() and t is not threading.current_thread() for t in self._threads):
            wake = self._ctx.socket(zmq.PUSH)
            wake.connect(self._wake)
            wake.send(b"", zmq.NOBLOCK)  # the receive thread sees _stop and returns
            wake.close(linger=1000)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2)
        with self._send_lock:
            for s in self._push.values():
                s.close(linger=int(LINGER_S * 1000) if say_bye else 0)
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
