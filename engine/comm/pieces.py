"""Large messages in pieces: authenticated one by one, released only when every one verified.

A message whose arrays hold more than ``piece_bytes`` goes out as consecutive ZeroMQ messages,
each with its own trailer (engine/comm/auth.py): piece 0 is the header alone, then every array
in slices of at most ``piece_bytes``. The sender tags piece k+1 while ZeroMQ's I/O thread
sends piece k; the receiver verifies piece k while piece k+1 arrives and copies it, still hot
in the cache, into the message's buffer. The message reaches its checker and the scheme only
when its last piece verified: nothing unverified is ever read.

The pieces of one message carry consecutive counters, their index and their count, all under
the tag. A receiver keeps at most one message in assembly per sending session, and takes its
pieces strictly in order: an authentic piece that is new but not the next one (reordered, or
the one before it was lost or altered) drops the whole message; a replayed piece (its counter
not above the sender's last) is dropped alone, so whoever recorded the traffic cannot break a
message in flight. A piece of another sender's session is checked against that session's
message; a piece that failed authentication cannot be attributed and touches no message. So
pieces reordered, repeated or taken from another message or sender never add up to an
accepted message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb

from .auth import Signer

#: the piece size. Measured on this 2-core EPYC (loopback, alternating, medians of 7), 64 MB
#: messages in pieces of 256 KB, 1 MB, 4 MB, whole: streamed at 0.35, 0.43, 0.50, 0.55 of a
#: raw TCP stream, one message alone one-way in 31.9, 25.3, 23.5, 27.7 ms. Each piece costs a
#: ZeroMQ message, a tag call and, at the receiver, a copy into the message's buffer, which a
#: whole message does not need: so a PS chunk (4 MB by default) goes whole, and only larger
#: messages are pipelined, in pieces that still fit this machine's 8 MB L3
PIECE_BYTES = 4 << 20


def split(frames: Sequence[object], piece_bytes: int) -> list[list[object]]:
    """The pieces of ``[header, array bytes...]``: the message whole when its arrays hold at
    most ``piece_bytes``, else the header, then each array in slices of ``piece_bytes``."""
    views = [memoryview(f) for f in frames[1:]]  # type: ignore[arg-type]
    if sum(v.nbytes for v in views) <= piece_bytes:
        return [list(frames)]
    return [[frames[0]]] + [[v[o:o + piece_bytes]] for v in views
                            for o in range(0, v.nbytes, piece_bytes)]


def signed(frames: Sequence[object], signer: Signer | None,
           piece_bytes: int) -> Iterator[list[object]]:
    """What goes on the wire for ``[header, array bytes...]``, piece by piece, each with its
    trailer; a generator, so that a piece is tagged only when the one before it is on its
    way. Without a signer (a benchmark's unauthenticated baseline): the frames as they are."""
    if signer is None:
        yield list(frames)
        return
    pieces = split(frames, piece_bytes)
    for k, piece in enumerate(pieces):
        yield [*piece, signer.trailer(piece, k, len(pieces))]


@dataclass
class Assembly:
    """A large message whose header piece authenticated: its arrays, filled piece by piece."""
    header: pb.Header
    sender: tuple[str, int]
    first: int          # the header piece's counter: piece k carries first + k
    count: int
    arrays: list[np.ndarray]
    flat: np.ndarray    # every array's bytes, one buffer
    filled: int = 0
    next: int = 1

    @classmethod
    def start(cls, hdr: pb.Header, sender: tuple[str, int], first: int, count: int,
              layout: Sequence[tuple[np.dtype, tuple[int, ...], int]]) -> "Assembly":
        """``layout``: each array's dtype, shape and byte count (already checked)."""
        flat = np.empty(sum(n for _, _, n in layout), np.uint8)
        arrays, at = [], 0
        for dt, shape, n in layout:
            arrays.append(flat[at:at + n].view(dt).reshape(shape))
            at += n
        return cls(hdr, sender, first, count, arrays, flat)

    def add(self, counter: int, index: int, count: int, data: memoryview) -> str | None:
        """Take the next piece (authenticated, not a replay); why the message breaks, if it
        does. Call ``complete`` after it."""
        if index != self.next or counter != self.first + index or count != self.count:
            return (f"piece {index} of {count} (counter {counter}) where piece {self.next} of "
                    f"{self.count} (counter {self.first + self.next}) was due")
        end = self.filled + data.nbytes
        if not data.nbytes or end > self.flat.nbytes:
            return f"piece {index} of {data.nbytes} bytes overflows the message"
        self.flat[self.filled:end] = np.frombuffer(data, np.uint8)
        self.filled, self.next = end, index + 1
        if self.next == self.count and self.filled != self.flat.nbytes:
            return f"the last piece came with {self.flat.nbytes - self.filled} bytes missing"
        return None

    @property
    def complete(self) -> bool:
        return self.next == self.count
