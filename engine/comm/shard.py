"""A node's PS shard server: sums the workers' pushes of its chunks and answers with the sum.

The chunk table comes from rank 0 (LAYOUT, engine/comm/schemes/ps.py makes it); every worker
confirms it with its digest (READY). A shard receives the P workers' pushes of a chunk for
round t, sums them in rank order in float32 (so the result does not depend on arrival order,
and fp16 pushes are accumulated in float32), and sends the sum, in the wire's dtype, to every
worker. The bits of the pushes (signals, a codec's flags) are ORed into the sum; an fp16 sum
that overflows raises pb.REQUEST_OVERFLOW.

Two ways to sum, with bit-identical results: ``threads=0`` keeps every push of a round and
sums them on the receive thread into a new array when the last one comes (the reference);
``threads=N`` is PHub's fast server (engine/comm/aggregate.py): N threads with the chunks
pinned to them add each push in place into preallocated buffers as it comes, and send the
buffer itself. Either way the receive thread does the bookkeeping: duplicates, the round a
chunk expects, and how long a round has waited for whom.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import numpy as np

from engine import timeline
from engine.pb import poseidon_pb2 as pb

from .aggregate import AggregationPool, sum_in_rank_order
from .chunks import PUSH, SUM, Chunk, layout_digest
from .errors import CommError
from .hosts import HostEntry
from .stats import CommStats
from .transport import SHARD, WORKER, Endpoint, Message, header, message_key
from .wire import arrays_are

log = logging.getLogger("poseidon.comm")


#: aggregation threads of a shard (`poseidon train --shard-threads`); README, "PS shard
#: threads", gives the measurement it is chosen by
DEFAULT_THREADS = 1


class ShardServer:
    """One node's PS shard: sums pushes of its chunks and answers every worker with the sum."""

    def __init__(self, index: int, hosts: Sequence[HostEntry], *, key: bytes,
                 timeout: float = 30.0, stats: CommStats | None = None,
                 max_frame_bytes: int | None = None,
                 threads: int = DEFAULT_THREADS, startup: float | None = None) -> None:
        """``threads``: 0 sums on the receive thread (the reference), N >= 1 on N
        aggregation threads with the chunks pinned to them."""
        if threads < 0:
            raise ValueError(f"shard threads must be >= 0, got {threads}")
        self.index = index
        self.threads = threads
        self.world = len(hosts)
        self.workers = [(WORKER, r) for r in range(self.world)]
        self.ep = Endpoint((SHARD, index), hosts, self.workers, key=key, timeout=timeout,
                           stats=stats, max_frame_bytes=max_frame_bytes, startup=startup)
        self._chunks: dict[tuple[int, int], Chunk] = {}
        #: the workers that push each group's chunks, in the order their pushes are summed
        self._groups: list[tuple[int, ...]] = [tuple(range(self.world))]
        self._next: dict[tuple[int, int], int] = {}
        #: (param, chunk, round) -> (first push's time, the pushes so far by rank)
        self._pending: dict[tuple[int, int, int], tuple[float, dict[int, Message]]] = {}
        self._lock = threading.Lock()
        self._pool: AggregationPool | None = None

    def _check(self, msg: Message) -> str | None:
        h = msg.header
        if h.scheme != "ps" or h.op != PUSH:
            return f"a shard takes PS pushes only, not {h.scheme!r} op {h.op}"
        chunk = self._chunks.get((h.param, h.chunk))
        if chunk is None:
            return f"unknown param {h.param} chunk {h.chunk} for shard {self.index}"
        if h.layer != chunk.layer or h.phase != chunk.phase:
            return f"vector {h.param} belongs to unit {chunk.layer}, not {h.layer}"
        if msg.sender[1] not in self._groups[chunk.group]:
            return f"worker {msg.sender[1]} does not push vector {h.param}"
        nxt = self._next[(h.param, h.chunk)]
        if h.round < nxt:  # a chunk's rounds only grow (a sparse codec's phases skip some)
            return f"param {h.param} chunk {h.chunk}: round {h.round}, expected {nxt} or later"
        return arrays_are(msg, [((chunk.count,), chunk.dtype)])

    def _on_push(self, msg: Message) -> None:
        """A checked push, on the receive thread: bookkeeping, then the sum's way to go."""
        h = msg.header
        key = (h.param, h.chunk, h.round)
        with self._lock:
            started, got = self._pending.setdefault(key, (time.monotonic(), {}))
            if h.sender in got:
                log.warning("shard %d: dropped a duplicate push of param %d chunk %d round %d "
                            "from worker %d", self.index, h.param, h.chunk, h.round, h.sender)
                return
            got[h.sender] = msg
            group = self._group_of(self._chunks[(h.param, h.chunk)])
            complete = len(got) == len(group)
            if complete:
                del self._pending[key]
                self._next[(h.param, h.chunk)] = h.round + 1
        if self._pool is not None:
            self._pool.put(msg)
        elif complete:
            self._sum_here(self._chunks[(h.param, h.chunk)], h.round,
                           [got[r] for r in group])

    def _group_of(self, chunk: Chunk) -> tuple[int, ...]:
        """The workers that push ``chunk``, in the order their pushes are summed."""
        return self._groups[chunk.group]

    def _sum_here(self, chunk: Chunk, rnd: int, pushes: list[Message]) -> None:
        """The reference path: the round's pushes summed on the receive thread (in the order
        of the chunk's group: ranks when flat)."""
        tl = timeline.current
        start = tl.now()
        total, request = sum_in_rank_order(pushes, np.dtype(chunk.dtype))
        if tl.active:
            tl.complete(f"aggregate p{chunk.param}c{chunk.chunk}", "aggregate", start,
                        {"round": rnd, "layer": chunk.layer, "bytes": total.nbytes})
        self._send_sum(chunk, rnd, total, request)

    def _send_sum(self, chunk: Chunk, rnd: int, total: np.ndarray, request: int) -> None:
        """Send a chunk's sum to every worker of its group (zero-copy: ``total`` must not
        change until each has it; see aggregate.ChunkSum)."""
        tl = timeline.current
        start = tl.now()
        out = header(pb.DATA, scheme="ps", op=SUM, round=rnd, layer=chunk.layer,
                     param=chunk.param, chunk=chunk.chunk, phase=chunk.phase, request=request)
        self.ep.broadcast([(WORKER, r) for r in self._group_of(chunk)], out, [total])
        if tl.active:
            tl.complete(f"send sum p{chunk.param}c{chunk.chunk}", "send", start, {"round": rnd})
        self.ep.stats.note_round(chunk.layer, rnd)

    def start(self) -> None:
        """The start-up barrier: the chunk table from rank 0, confirmed by every worker."""
        ep = self.ep
        # worker 0 sends it after its own start-up barrier: that window, then the usual one
        msgs = ep.wait_for([message_key(pb.LAYOUT, (WORKER, 0))], "the parameter layout",
                           timeout=ep.startup + ep.timeout)
        readies = ep.wait_for([message_key(pb.READY, w) for w in self.workers], "worker READY")
        layout = [Chunk.from_pb(c) for c in msgs[0].header.layout]
        if msgs[0].header.groups:
            self._groups = [tuple(g.ranks) for g in msgs[0].header.groups]
        if any(c.group >= len(self._groups) or not set(self._groups[c.group]) <= set(range(
                self.world)) for c in layout):
            ep.fatal("the layout worker 0 sent names a group of workers that does not exist")
            raise CommError(ep.error)
        digest = layout_digest(layout)
        for m in readies:
            if m.header.layout_digest != digest:
                ep.fatal(f"worker {m.header.sender} built a different parameter layout than "
                         "worker 0 (different net or --chunk-bytes?)")
                raise CommError(ep.error)
        for c in layout:
            if c.shard == self.index:
                self._chunks[(c.param, c.chunk)] = c
                self._next[(c.param, c.chunk)] = 0
        if self.threads:
            self._pool = AggregationPool(ep.name, list(self._chunks.values()), self._groups,
                                         self.threads, self._send_sum, ep.fatal)
        ep.checker = self._check
        ep.handler = self._on_push
        ep.broadcast(self.workers, header(pb.READY))

    def serve(self) -> None:
        """Answer pushes until every worker said BYE; a chunk left incomplete is fatal."""
        ep = self.ep
        while not ep.all_gone(WORKER):
            if ep.error is not None:
                ep.disarm()
                raise CommError(ep.error)
            now = time.monotonic()
            with self._lock:
                late = [(k, set(got)) for k, (t0, got) in self._pending.items()
                        if now - t0 > ep.timeout]
                oldest = min((t0 for t0, _ in self._pending.values()), default=now)
            if late:
                (param, chunk, rnd), got = late[0]
                group = self._groups[self._chunks[(param, chunk)].group]
                ep.timed_out(f"the push of vector {param} chunk {chunk} round {rnd}",
                             [(WORKER, r) for r in group if r not in got])
                ep.disarm()
                raise CommError(ep.error)
            # the next thing due: the oldest incomplete chunk's time-out; BYEs and errors wake
            # it sooner (an idle shard wakes for nothing)
            ep.wait_change(lambda: ep.all_gone(WORKER), oldest + ep.timeout - now + 0.01)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        self.ep.close(say_bye=self.ep.error is None)
