"""PHub's fast server, the summing half: chunks pinned to threads, summed in place.

A PS shard (engine/comm/shard.py) with ``threads >= 1`` hands each checked push to the thread
its chunk is pinned to (chunks spread over the threads by bytes, largest first); the receive
thread only checks and dispatches. Each chunk owns float32 accumulation buffers allocated
once, at start, from the layout. A push is added into them as it comes, in rank order: a push
of rank k that arrives before the ranks below k is held back (a reference to the received
frame, no copy) until they are in, so the sum is bit-identical to the reference path
(``threads=0``, ``sum_in_rank_order``) whatever order the pushes come in. When the last rank
is added the buffer itself is sent to every worker, zero-copy (fp16 wire: the float32 sum
rounded into a preallocated fp16 buffer, which is sent).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

import numpy as np

from engine import timeline
from engine.pb import poseidon_pb2 as pb

from .chunks import Chunk
from .transport import Message

#: on_sum(chunk, round, the sum as it goes on the wire, the ORed request bits)
OnSum = Callable[[Chunk, int, np.ndarray, int], None]
F32 = np.dtype(np.float32)


def to_wire(total: np.ndarray, out: np.ndarray) -> int:
    """Round the float32 ``total`` into ``out`` (the wire's dtype); the REQUEST_OVERFLOW
    bit when a value does not fit, else 0."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out, total, casting="same_kind")
    return 0 if np.isfinite(out).all() else pb.REQUEST_OVERFLOW


def sum_in_rank_order(pushes: Sequence[Message], wire: np.dtype) -> tuple[np.ndarray, int]:
    """The reference sum (``threads=0``): the P pushes, rank 0 first, in a new float32 array;
    returns it in the wire's dtype and the request bits (ORed, plus REQUEST_OVERFLOW)."""
    total = pushes[0].arrays[0].astype(np.float32)
    request = pushes[0].header.request
    for m in pushes[1:]:
        total += m.arrays[0]
        request |= m.header.request
    if wire == F32:
        return total, request
    out = np.empty(total.shape, wire)
    return out, request | to_wire(total, out)


class ChunkSum:
    """One chunk's running sum; only its aggregation thread touches it.

    Which buffer may be overwritten when: a sum is sent zero-copy, so its buffer must stay
    unchanged until every worker has received it (a change under a send in flight makes the
    receiver drop the sum as failed authentication). A chunk's sums alternate between two
    buffers (a chunk need not take part in every round: a sparse codec's phases skip some), so
    a buffer is written again only by the chunk's sum after next. That sum's round starts only
    once the next one is complete (pushes of a later round are held back like early ranks),
    which needs every member's push of it; a worker pushes a later round of a chunk only after
    its update of every earlier round, which needs that round's sum in hand. So when a buffer
    is written again, every worker has received the sum sent from it.
    (This is BSP's guarantee; bounded staleness s would need s + 2 buffers.)
    One buffer would not do: round r+1's first push can come while round r's sum is still
    going out to a slow worker. On the fp16 wire the float32 accumulator is never sent, so one
    of it is enough; the two fp16 buffers that are sent alternate as above.
    """

    def __init__(self, chunk: Chunk, members: Sequence[int]) -> None:
        """``members``: the workers that push the chunk, in the order their pushes are added
        (every rank when flat; a two-level run's network group)."""
        self.chunk = chunk
        self.members = tuple(members)
        self.round = -1       # the round being summed (-1: none yet)
        self._flip = 0        # the buffer of the round being summed
        self._added = 0       # members 0 .. _added-1 of it are in the buffer
        self._request = 0
        self._early: dict[tuple[int, int], Message] = {}  # (round, rank) -> a push held back
        wire = np.dtype(chunk.dtype)
        # zeros (not empty): the pages are touched now, not during the first round
        self._acc = [np.zeros(chunk.count, F32) for _ in range(2 if wire == F32 else 1)]
        self._wire = [] if wire == F32 else [np.zeros(chunk.count, wire) for _ in range(2)]

    def add(self, msg: Message) -> list[tuple[int, np.ndarray, int]]:
        """Take one checked push; return (round, sum as sent, request bits) for each round it
        completes (usually none or one; more when held-back pushes of the next round finish it).

        The caller has dropped duplicates and rounds before the chunk's next (the shard's
        bookkeeping on the receive thread), so a (round, rank) is never taken twice."""
        h = msg.header
        self._early[(h.round, h.sender)] = msg
        done = []
        if self._added == 0:  # the next round is the lowest held: a chunk's rounds only grow
            self.round = min(r for r, _ in self._early)
        while self._added < len(self.members) and \
                (self.round, self.members[self._added]) in self._early:
            m = self._early.pop((self.round, self.members[self._added]))
            acc = self._acc[self._flip % len(self._acc)]
            if self._added == 0:
                np.copyto(acc, m.arrays[0])  # as astype(float32) does for the reference
                self._request = m.header.request
            else:
                np.add(acc, m.arrays[0], out=acc)
                self._request |= m.header.request
            self._added += 1
            if self._added == len(self.members):
                done.append(self._finish(acc))
        return done

    def _finish(self, acc: np.ndarray) -> tuple[int, np.ndarray, int]:
        rnd, request, flip = self.round, self._request, self._flip
        self._added, self._request, self._flip = 0, 0, flip ^ 1
        if self._early:
            self.round = min(r for r, _ in self._early)
        if not self._wire:
            return rnd, acc, request
        out = self._wire[flip]
        return rnd, out, request | to_wire(acc, out)


def pin(chunks: Sequence[Chunk], threads: int) -> list[list[Chunk]]:
    """Chunks per thread, balanced by bytes: largest first, each to the least-loaded thread."""
    groups: list[list[Chunk]] = [[] for _ in range(threads)]
    load = [0] * threads
    for c in sorted(chunks, key=lambda c: (-c.count * np.dtype(c.dtype).itemsize,
                                           c.param, c.chunk)):
        t = min(range(threads), key=lambda i: (load[i], i))
        groups[t].append(c)
        load[t] += c.count * np.dtype(c.dtype).itemsize
    return [g for g in groups if g]


class AggregationPool:
    """The threads of a shard's chunks: ``put`` a checked push (receive thread); each thread
    adds its chunks' pushes and calls ``on_sum`` with every completed sum."""

    def __init__(self, name: str, chunks: Sequence[Chunk], groups: Sequence[Sequence[int]],
                 threads: int, on_sum: OnSum, on_error: Callable[[str], None]) -> None:
        """``groups``: the layout's groups of workers (a chunk's ``group`` indexes them)."""
        if threads < 1:
            raise ValueError(f"an aggregation pool needs at least one thread, got {threads}")
        self.name = name
        self._on_sum = on_sum
        self._on_error = on_error
        self._sums: dict[tuple[int, int], ChunkSum] = {}
        self._queue_of: dict[tuple[int, int], queue.SimpleQueue] = {}
        self._threads = []
        for i, group in enumerate(pin(chunks, threads)):
            q: queue.SimpleQueue = queue.SimpleQueue()
            for c in group:
                self._sums[(c.param, c.chunk)] = ChunkSum(c, groups[c.group])
                self._queue_of[(c.param, c.chunk)] = q
            t = threading.Thread(target=self._loop, args=(q,), name=f"poseidon-sum{i}",
                                 daemon=True)
            self._threads.append((t, q))
            t.start()

    @property
    def threads(self) -> int:
        """Threads started (fewer than asked when the shard has fewer chunks)."""
        return len(self._threads)

    def put(self, msg: Message) -> None:
        self._queue_of[(msg.header.param, msg.header.chunk)].put(msg)

    def _loop(self, q: queue.SimpleQueue) -> None:
        while True:
            msg = q.get()
            if msg is None:
                return
            h = msg.header
            try:
                s = self._sums[(h.param, h.chunk)]
                tl = timeline.current
                start = tl.now()
                done = s.add(msg)
                if tl.active:
                    tl.complete(f"aggregate p{h.param}c{h.chunk}", "aggregate", start,
                                {"round": h.round, "rank": h.sender, "bytes": msg.arrays[0].nbytes})
                for rnd, total, request in done:
                    self._on_sum(s.chunk, rnd, total, request)
            except Exception as e:  # a bug here must stop the run, not hang it
                self._on_error(f"{self.name}: internal error summing vector {h.param} chunk "
                               f"{h.chunk} round {h.round}: {type(e).__name__}: {e}")
                return

    def close(self) -> None:
        for t, q in self._threads:
            q.put(None)
        for t, _ in self._threads:
            t.join(timeout=5)
