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
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import zmq

from engine.allocator import tune_allocator
from engine.pb import poseidon_pb2 as pb

from .auth import Piece, Signer, Verifier
from .errors import CommError
from .hosts import HostEntry, port_owner
from .pieces import PIECE_BYTES, Assembly, signed
from .stages import StageClock
from .stats import CommStats

log = logging.getLogger("poseidon.comm")

WORKER, SHARD = "worker", "shard"
PeerId = tuple[str, int]
#: mailbox key: (kind, sender role, sender, round, layer, param, chunk)
Key = tuple[int, str, int, int, int, int, int]

ALLOWED_DTYPES = {np.dtype(t).str for t in ("<f2", "<f4", "<f8")}
_DTYPES = {t: np.dtype(t) for t in ALLOWED_DTYPES}
MAX_FRAMES = 64
#: frames below this are copied into the message, larger ones sent zero-copy: pyzmq's zero-copy
#: costs a fixed ~50 us per frame (its buffer tracking), a copy ~5 us per 64 KB. Sender and
#: receiver CPU per message, measured here, copied against zero-copy: 64 KB 203 us against 254,
#: 256 KB 328 against 364, 512 KB 384-403 against 441-483, 1 MB 707 against 549 (pyzmq's own
#: default cuts at 64 KB)
COPY_BELOW_BYTES = 1 << 20
MAX_DIMS = 8
#: a header frame's bound: the LAYOUT header lists every chunk (about 40 bytes each)
HEADER_BYTES_PER_CHUNK = 64
HEADER_BYTES = 1 << 16
_ROLE = {pb.WORKER: WORKER, pb.SHARD: SHARD}
_ROLE_PB = {WORKER: pb.WORKER, SHARD: pb.SHARD}
_CONTROL = (pb.HELLO, pb.LAYOUT, pb.READY, pb.HEARTBEAT, pb.PLAN, pb.PROBE, pb.BYE, pb.ABORT,
            pb.CHECK, pb.STATE, pb.ENGINE)
#: PROBE's op: a request the receiver echoes at once, and the echo
PROBE_ASK, PROBE_ECHO = 0, 1


@dataclass
class Message:
    header: pb.Header
    arrays: list[np.ndarray]

    @property
    def sender(self) -> PeerId:
        return (_ROLE[self.header.sender_role], self.header.sender)

    def key(self) -> Key:
        return message_key(self.header.kind, self.sender, self.header.round, self.header.layer,
                           self.header.param, self.header.chunk)


def message_key(kind: int, sender: PeerId, rnd: int = 0, layer: int = 0, param: int = 0,
                chunk: int = 0) -> Key:
    return (int(kind), sender[0], int(sender[1]), int(rnd), int(layer), int(param), int(chunk))


def peer_name(peer: PeerId, hosts: Sequence[HostEntry]) -> str:
    role, idx = peer
    if 0 <= idx < len(hosts):
        e = hosts[idx]
        return f"{role} {idx} ({e.label(e.port if role == WORKER else e.shard_port)})"
    return f"{role} {idx}"


def header(kind: int, **fields: object) -> pb.Header:
    return pb.Header(kind=kind, **fields)


def wire_frames(hdr: pb.Header, arrays: Sequence[np.ndarray]) -> list[object]:
    """``[header, array bytes...]``: the header lists each array's dtype and shape."""
    del hdr.arrays[:]
    views: list[object] = []
    for a in arrays:
        a = np.ascontiguousarray(a)
        hdr.arrays.add(dtype=a.dtype.str, shape=a.shape)
        views.append(memoryview(a).cast("B") if a.size else b"")
    return [hdr.SerializeToString(), *views]



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


def byte_tag(hdr: pb.Header) -> str | None:
    """The tag a DATA message's bytes are counted under: the scheme that set it, and
    '<scheme>/index' for a codec's index vectors. None: not counted (control traffic)."""
    if hdr.kind != pb.DATA:
        return None
    return f"{hdr.scheme}/index" if hdr.phase == pb.PHASE_INDEX else hdr.scheme


class Endpoint:
    """One process's view of the network: its bound socket, its peers, liveness and mailbox.

    ``checker(message) -> reason | None`` validates content; ``handler(message)``, when given,
    receives valid data messages on the receiver thread instead of the mailbox.
    """

    def __init__(self, me: PeerId, hosts: Sequence[HostEntry], peers: Iterable[PeerId], *,
                 key: bytes | None, timeout: float = 30.0, stats: CommStats | None = None,
                 exit_grace: float | None = None,
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
        self.exit_grace = exit_grace
        self.snapshot_hint = snapshot_hint
        self.max_frame_bytes = max_frame_bytes
        self.checker: Callable[[Message], str | None] | None = None
        self.handler: Callable[[Message], None] | None = None
        self.on_fatal: list[Callable[[str], None]] = []
        self.dropped = 0
        #: messages that failed authentication (counted among ``dropped``)
        self.unauthenticated = 0
        #: messages in pieces dropped whole: a piece altered, lost or out of order (counted
        #: among ``dropped``)
        self.incomplete = 0
        self.piece_bytes = int(piece_bytes)
        #: per sending session, its message whose pieces are coming (receive thread only)
        self._assembling: dict[bytes, Assembly] = {}
        #: when set, the stages each message passes are timed (`poseidon bench comm --stages`)
        self.clock: StageClock | None = None
        self._signer = Signer(key) if key is not None else None
        self._verifier = Verifier(key) if key is not None else None
        self.error: str | None = None
        #: True when the error came in an ABORT (some other process reports it first-hand)
        self.error_from_peer = False
        self._exit_timer: threading.Timer | None = None
        tune_allocator()  # before the context's I/O thread allocates messages
        self._ctx = zmq.Context()
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._mailbox: dict[Key, Message] = {}
        self._stop = threading.Event()
        start = time.monotonic()
        self._last_seen: dict[PeerId, float] = {p: start for p in self.peers}
        self._heard: set[PeerId] = set()
        self._gone: set[PeerId] = set()
        entry = self.hosts[me[1]]
        port = entry.port if me[0] == WORKER else entry.shard_port
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVTIMEO, 100)  # the receive thread looks at _stop this often
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
        self._threads = [threading.Thread(target=self._recv_loop, name="poseidon-recv", daemon=True),
                         threading.Thread(target=self._heartbeat_loop, name="poseidon-heartbeat",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def name(self) -> str:
        return peer_name(self.me, self.hosts)

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
        hdr.sender_role = _ROLE_PB[self.me[0]]
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
            try:  # a receive timeout, not a poll first: one wake-up per message, not two
                frames = self._pull.recv_multipart(copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                self.fatal(f"{self.name}: the receive thread failed: {e}")
                return
            clock = self.clock
            if clock is not None:
                clock.hold("received", first=True)
            try:
                msg, reason = self._parse(frames)
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

    def _unauthenticated(self, reason: str) -> tuple[None, str]:
        self.unauthenticated += 1
        return None, reason

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        if self.dropped <= 10 or self.dropped % 1000 == 0:  # a flood must not flood the log
            log.warning("%s: dropped a bad message (%d so far): %s", self.name, self.dropped, reason)

    def _parse(self, frames: list[zmq.Frame]) -> tuple[Message | None, str]:
        """A complete, checked message; or None and why it was dropped, or None and "" when a
        piece of a large message was taken and the message is not complete yet."""
        if not frames or len(frames) > MAX_FRAMES + 2:
            return None, f"{len(frames)} frames"
        if self._verifier is None:
            return self._start(frames, None)
        if len(frames) < 2:
            return self._unauthenticated("no authentication trailer")
        piece = self._verifier.verify(frames[:-1], frames[-1])
        if isinstance(piece, str):
            return self._unauthenticated(piece)
        if self.clock is not None:
            self.clock.hold("verified")
        if piece.index:
            return self._continue(piece, frames[:-1])
        return self._start(frames[:-1], piece)

    def _start(self, frames: list[zmq.Frame], piece: Piece | None) -> tuple[Message | None, str]:
        """A header piece (authenticated, or a benchmark's unauthenticated message): the
        message whole, or the start of one in pieces."""
        try:
            hdr = pb.Header.FromString(frames[0].bytes)
        except Exception:
            return None, "header is not a poseidon.Header"
        if hdr.kind != pb.DATA and hdr.kind not in _CONTROL:
            return None, f"unknown kind {hdr.kind}"
        if hdr.sender_role not in _ROLE:
            return None, f"unknown sender role {hdr.sender_role}"
        sender = (_ROLE[hdr.sender_role], hdr.sender)
        if sender not in self._last_seen:
            return None, f"unknown sender {sender[0]} {sender[1]}"
        if piece is not None and self._verifier is not None:
            replay = self._verifier.accept(sender, piece.session, piece.counter)
            if replay is not None:
                return None, f"from {self.name_of(sender)}: {replay}"
            if piece.session in self._assembling:  # its last piece never came
                late = self._assembling.pop(piece.session)
                self._incomplete(late, f"piece {late.next} of {late.count} never came")
        layout = self._layout(hdr)
        if isinstance(layout, str):
            return None, layout
        if piece is not None and piece.count > 1:
            total = sum(n for _, _, n in layout)
            if len(frames) != 1 or not 1 < piece.count <= total + 1:
                return None, (f"a header piece of {len(frames)} frames for {piece.count} pieces "
                              f"of {total} bytes")
            self._assembling[piece.session] = Assembly.start(hdr, sender, piece.counter,
                                                             piece.count, layout)
            return None, ""
        if len(layout) != len(frames) - 1:
            return None, f"header lists {len(layout)} arrays but {len(frames) - 1} frames came"
        arrays = []
        for (dt, shape, n), frame in zip(layout, frames[1:]):
            buf = frame.buffer
            if n != len(buf):
                return None, f"frame of {len(buf)} bytes for {dt.str}{shape}"
            arrays.append(np.frombuffer(buf, dtype=dt, count=n // dt.itemsize).reshape(shape))
        return self._checked(Message(hdr, arrays))

    def _continue(self, piece: Piece, frames: list[zmq.Frame]) -> tuple[Message | None, str]:
        """A data piece: the next one of its sender's message, or that message is dropped."""
        asm = self._assembling.get(piece.session)
        if asm is None:
            return None, f"piece {piece.index} of {piece.count} of no message being received"
        assert self._verifier is not None
        replay = self._verifier.accept(asm.sender, piece.session, piece.counter)
        if replay is not None:  # dropped alone: a recorded piece cannot break a message
            return None, f"from {self.name_of(asm.sender)}: {replay}"
        broken = (asm.add(piece.counter, piece.index, piece.count, frames[0].buffer)
                  if len(frames) == 1 else f"a piece of {len(frames)} frames")
        if broken is not None:
            del self._assembling[piece.session]
            self._incomplete(asm, broken)
            return None, ""
        if not asm.complete:
            return None, ""
        del self._assembling[piece.session]
        return self._checked(Message(asm.header, asm.arrays))

    def _incomplete(self, asm: Assembly, why: str) -> None:
        """A message in pieces that cannot complete: dropped whole, and counted."""
        self.incomplete += 1
        self._drop(f"from {self.name_of(asm.sender)}: a message in {asm.count} pieces dropped "
                   f"whole: {why}")

    def _layout(self, hdr: pb.Header) -> list[tuple[np.dtype, tuple[int, ...], int]] | str:
        """Each array's dtype, shape and bytes, computed with Python ints and capped; or why
        the header is refused."""
        if len(hdr.arrays) > MAX_FRAMES:
            return f"{len(hdr.arrays)} arrays"
        out = []
        for meta in hdr.arrays:
            dt = _DTYPES.get(meta.dtype)
            if dt is None:
                return f"dtype {meta.dtype!r} not allowed"
            shape = tuple(meta.shape)  # Python ints: a product cannot wrap around
            if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
                return f"shape {shape} not allowed"
            n = dt.itemsize
            for d in shape:
                n *= d
            if self.max_frame_bytes is not None and n > self.max_frame_bytes:
                return f"an array of {n} bytes (at most {self.max_frame_bytes} here)"
            out.append((dt, shape, n))
        return out

    def _checked(self, msg: Message) -> tuple[Message | None, str]:
        if msg.header.kind == pb.DATA:
            if self.checker is None:
                return None, f"{pb.Kind.Name(msg.header.kind)} before this process can check it"
            reason = self.checker(msg)
            if reason is not None:
                return None, f"from {self.name_of(msg.sender)}: {reason}"
        return msg, ""

    def _dispatch(self, msg: Message) -> None:
        sender, kind = msg.sender, msg.header.kind
        with self._cond:
            self._last_seen[sender] = time.monotonic()
            self._heard.add(sender)
        if kind == pb.HEARTBEAT:
            return
        if kind == pb.BYE:
            with self._cond:
                self._gone.add(sender)
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

    def wait_for(self, keys: Sequence[Key], what: str, timeout: float | None = None) -> list[Message]:
        """Take the messages with ``keys`` from the mailbox, waiting up to ``timeout`` seconds.

        A timeout is fatal: the error names the peers whose messages did not come.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
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
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
        self.timed_out(what, [(k[1], k[2]) for k in missing])
        raise CommError(self.error)

    def timed_out(self, what: str, peers: Sequence[PeerId]) -> None:
        """Waiting for ``what`` from ``peers`` took longer than the timeout: fatal, naming the
        real cause (a silent peer upstream, if any, rather than the one waited on)."""
        silent = self._silent(3 * self._hb_interval)
        if silent:
            self.fatal(self._lost(silent[0]))
        else:
            who = ", ".join(sorted({self.name_of(p) for p in peers})) or "this worker"
            self.fatal(f"{self.name}: timed out after {self.timeout:g} s waiting for {what} "
                       f"from {who}")

    # ---------------------------------------------------------------------------- liveness
    @property
    def _hb_interval(self) -> float:
        return max(0.05, min(1.0, self.timeout / 5))

    def _silent(self, seconds: float) -> list[PeerId]:
        """Peers (not gone) from which nothing was heard for ``seconds``."""
        now = time.monotonic()
        with self._cond:
            return [p for p in self.peers
                    if p not in self._gone and now - self._last_seen[p] > seconds]

    def _lost(self, peer: PeerId) -> str:
        with self._cond:
            heard = peer in self._heard
        if heard:
            return (f"lost {self.name_of(peer)}: nothing heard for {self.timeout:g} s "
                    "(the process died or hangs)")
        return f"{self.name_of(peer)} did not come within {self.timeout:g} s (start-up barrier)"

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._hb_interval):
            for p in self.peers:
                if p not in self._gone:
                    self.send(p, header(pb.HEARTBEAT))
            late = self._silent(self.timeout)
            if late:
                self.fatal(self._lost(late[0]))
                return

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
            if self.exit_grace is not None:
                # The training thread may be busy in a long compute; stop the process
                # regardless, unless that thread takes the error first (disarm) and exits.
                self._exit_timer = threading.Timer(self.exit_grace, _hard_exit, (reason,))
                self._exit_timer.daemon = True
                self._exit_timer.start()
            self._cond.notify_all()
        if propagate:
            self.broadcast([p for p in self.peers if p not in self._gone], header(pb.ABORT, reason=reason))
        for cb in self.on_fatal:
            cb(reason)

    def disarm(self) -> None:
        """The main thread has the error in hand and will exit: no forced exit needed."""
        with self._cond:
            if self._exit_timer is not None:
                self._exit_timer.cancel()

    def all_gone(self, role: str) -> bool:
        with self._cond:
            return all(p in self._gone for p in self.peers if p[0] == role)

    def close(self, say_bye: bool = True) -> None:
        if self.dropped:
            log.warning("%s: dropped %d bad messages in all, %d of them failed authentication",
                        self.name, self.dropped, self.unauthenticated)
        self.stats.extra.update(dropped_messages=self.dropped,
                                unauthenticated_messages=self.unauthenticated,
                                incomplete_messages=self.incomplete)
        if say_bye and self.error is None:
            self.broadcast([p for p in self.peers if p not in self._gone], header(pb.BYE))
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2)
        with self._send_lock:
            for s in self._push.values():
                s.close(linger=2000 if say_bye else 0)
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass


def _hard_exit(reason: str) -> None:
    sys.stderr.write(f"poseidon: error: {reason}\n")
    sys.stderr.flush()
    os._exit(1)
