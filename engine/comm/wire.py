"""Poseidon's wire format and its receiving side, without ZeroMQ: what a message is and how
the frames that arrive become one, checked before a byte of it is used.

A message is ``[header][array]...``: the header is a ``poseidon.Header`` protobuf, the arrays
raw C-contiguous bytes whose dtype and shape the header lists. Every message ends with an
authentication trailer (engine/comm/auth.py), checked before the header is read; a message with
more array bytes than a piece travels as several, each verified, and is released only when
every piece verified (engine/comm/pieces.py). The ``Parser`` then checks the structure (kinds,
senders, sizes: Python ints, every size capped) and hands the content to the owner's
``checker`` (layer, chunk, round, dtype, shape). It takes any frames with ``bytes`` and
``buffer`` (ZeroMQ's, or a test's), so it can be fuzzed without sockets
(tests/test_fuzz.py); the transport (engine/comm/transport.py) moves the frames, no larger
than ``frame_limit`` says a job's may be.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb

from .auth import Piece, Verifier
from .chunks import DEFAULT_CHUNK_BYTES
from .pieces import Assembly
from .stages import StageClock

WORKER, SHARD = "worker", "shard"
PeerId = tuple[str, int]
#: mailbox key: (kind, sender role, sender, round, layer, param, chunk)
Key = tuple[int, str, int, int, int, int, int]

ALLOWED_DTYPES = {np.dtype(t).str for t in ("<f2", "<f4", "<f8")}
_DTYPES = {t: np.dtype(t) for t in ALLOWED_DTYPES}
MAX_FRAMES = 64
MAX_DIMS = 8
#: a header frame's bound: the LAYOUT header lists every chunk (about 40 bytes each)
HEADER_BYTES_PER_CHUNK = 64
HEADER_BYTES = 1 << 16
_ROLE = {pb.WORKER: WORKER, pb.SHARD: SHARD}
ROLE_PB = {WORKER: pb.WORKER, SHARD: pb.SHARD}
_CONTROL = (pb.HELLO, pb.LAYOUT, pb.READY, pb.HEARTBEAT, pb.PLAN, pb.PROBE, pb.BYE, pb.ABORT,
            pb.CHECK, pb.STATE, pb.ENGINE)
#: PROBE's op: a request the receiver echoes at once, the echo, and a step of the shm probe
#: (engine/comm/schemes/shm.py)
PROBE_ASK, PROBE_ECHO, PROBE_SHM = 0, 1, 2


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


def peer_name(peer: PeerId, hosts: Sequence[Any]) -> str:
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


def byte_tag(hdr: pb.Header) -> str | None:
    """The tag a DATA message's bytes are counted under: the scheme that set it, and
    '<scheme>/index' for a codec's index vectors. None: not counted (control traffic)."""
    if hdr.kind != pb.DATA:
        return None
    return f"{hdr.scheme}/index" if hdr.phase == pb.PHASE_INDEX else hdr.scheme


class Parser:
    """The receiving side of one process: frames in, a complete and checked message out (or
    why it was dropped). ``senders``: who may send here; ``checker(message) -> reason |
    None`` checks a DATA message's content; ``on_drop(reason)`` hears of every drop."""

    def __init__(self, verifier: Verifier | None, senders: Collection[PeerId],
                 max_frame_bytes: int | None, name_of: Callable[[PeerId], str],
                 on_drop: Callable[[str], None]) -> None:
        self._verifier = verifier
        self._senders = frozenset(senders)
        self.max_frame_bytes = max_frame_bytes
        self.name_of = name_of
        self._drop = on_drop
        self.checker: Callable[[Message], str | None] | None = None
        #: when set, the stages each message passes are timed (`poseidon bench comm --stages`)
        self.clock: StageClock | None = None
        #: messages that failed authentication
        self.unauthenticated = 0
        #: messages in pieces dropped whole: a piece altered, lost or out of order
        self.incomplete = 0
        #: per sending session, its message whose pieces are coming
        self._assembling: dict[bytes, Assembly] = {}

    def parse(self, frames: list[Any]) -> tuple[Message | None, str]:
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

    def _unauthenticated(self, reason: str) -> tuple[None, str]:
        self.unauthenticated += 1
        return None, reason

    def _start(self, frames: list[Any], piece: Piece | None) -> tuple[Message | None, str]:
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
        if sender not in self._senders:
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

    def _continue(self, piece: Piece, frames: list[Any]) -> tuple[Message | None, str]:
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


def arrays_are(msg: "Message", want: list[tuple[tuple[int, ...], str]]) -> str | None:
    """None when ``msg``'s arrays have exactly these (shape, dtype) pairs, else why not."""
    got = [(a.shape, a.dtype.str) for a in msg.arrays]
    return None if got == want else f"unit {msg.header.layer}: arrays {got}, expected {want}"


def frame_limit(slots: Mapping[int, Any], world: int,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The largest frame a process of this job may send, whatever the plan: a PS chunk, a ring
    or local sub-chunk (at most ``chunk_bytes`` and one value), every worker's factors of a
    layer (SFB's leaders hand them down), or a header (LAYOUT lists every chunk).
    ZMQ_MAXMSGSIZE."""
    biggest = chunk_bytes + 8
    chunks = 0
    for s in slots.values():
        nbytes = s.count * 8
        # values, a codec's index, and its whole vector (sparse's dense rounds)
        chunks += 3 * (math.ceil(nbytes / chunk_bytes) + world)
        if s.factor_shape is not None:
            k, m, n = s.factor_shape
            biggest = max(biggest, 8 * world * k * max(m, n))
    return max(biggest, HEADER_BYTES + HEADER_BYTES_PER_CHUNK * chunks)
