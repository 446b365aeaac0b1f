"""A node's PS shard server: sums the workers' pushes of its chunks and answers with the sum.

The chunk table comes from rank 0 (LAYOUT, engine/comm/schemes/ps.py makes it); every worker
confirms it with its digest (READY). A shard receives the P workers' pushes of a chunk for
round t, sums them in rank order in float32 (so the result does not depend on arrival order,
and fp16 pushes are accumulated in float32), and sends the sum, in the wire's dtype, to every
worker. The bits of the pushes (signals, a codec's flags) are ORed into the sum; an fp16 sum
that overflows raises OVERFLOW_BIT.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb
from engine.perf import timeline

from .errors import CommError
from .hosts import HostEntry
from .schemes.base import OVERFLOW_BIT, arrays_are
from .schemes.ps import PUSH, SUM, Chunk, layout_digest
from .stats import CommStats
from .transport import SHARD, WORKER, Endpoint, Message, header, message_key

log = logging.getLogger("poseidon.comm")


class ShardServer:
    """One node's PS shard: sums pushes of its chunks and answers every worker with the sum."""

    def __init__(self, index: int, hosts: Sequence[HostEntry], *, key: bytes,
                 timeout: float = 30.0, stats: CommStats | None = None,
                 exit_grace: float | None = None, max_frame_bytes: int | None = None) -> None:
        self.index = index
        self.world = len(hosts)
        self.workers = [(WORKER, r) for r in range(self.world)]
        self.ep = Endpoint((SHARD, index), hosts, self.workers, key=key, timeout=timeout,
                           stats=stats, exit_grace=exit_grace, max_frame_bytes=max_frame_bytes)
        self._chunks: dict[tuple[int, int], Chunk] = {}
        #: the workers that push each group's chunks, in the order their pushes are summed
        self._groups: list[tuple[int, ...]] = [tuple(range(self.world))]
        self._next: dict[tuple[int, int], int] = {}
        self._pending: dict[tuple[int, int, int], tuple[float, dict[int, np.ndarray]]] = {}
        self._requests: dict[tuple[int, int, int], int] = {}  # signal bits of the pushes
        self._lock = threading.Lock()

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
        if h.round not in (nxt, nxt + 1):
            return f"param {h.param} chunk {h.chunk}: round {h.round}, expected {nxt}"
        return arrays_are(msg, [((chunk.count,), chunk.dtype)])

    def _on_push(self, msg: Message) -> None:
        h = msg.header
        key = (h.param, h.chunk, h.round)
        with self._lock:
            started, got = self._pending.setdefault(key, (time.monotonic(), {}))
            if h.sender in got:
                log.warning("shard %d: dropped a duplicate push of param %d chunk %d round %d "
                            "from worker %d", self.index, h.param, h.chunk, h.round, h.sender)
                return
            got[h.sender] = msg.arrays[0]
            self._requests[key] = self._requests.get(key, 0) | h.request
            group = self._groups[self._chunks[(h.param, h.chunk)].group]
            if len(got) < len(group):
                return
            del self._pending[key]
            request = self._requests.pop(key)
            self._next[(h.param, h.chunk)] = h.round + 1
        tl = timeline.current
        start = tl.now()
        wire = got[group[0]].dtype
        total = got[group[0]].astype(np.float32)
        for r in group[1:]:  # the group's order: the sum is the same whatever came first
            total += got[r]
        if total.dtype != wire:  # fp16 on the wire: the float32 sum rounded once
            with np.errstate(over="ignore", invalid="ignore"):
                total = total.astype(wire)
            if not np.isfinite(total).all():
                request |= OVERFLOW_BIT
        if tl.active:
            tl.complete(f"aggregate p{h.param}c{h.chunk}", "aggregate", start,
                        {"round": h.round, "layer": h.layer, "bytes": total.nbytes})
            start = tl.now()
        out = header(pb.DATA, scheme="ps", op=SUM, round=h.round, layer=h.layer,
                     param=h.param, chunk=h.chunk, phase=h.phase, request=request)
        self.ep.broadcast([(WORKER, r) for r in group], out, [total])
        if tl.active:
            tl.complete(f"send sum p{h.param}c{h.chunk}", "send", start, {"round": h.round})
        self.ep.stats.note_round(h.layer, h.round)

    def start(self) -> None:
        """The start-up barrier: the chunk table from rank 0, confirmed by every worker."""
        ep = self.ep
        msgs = ep.wait_for([message_key(pb.LAYOUT, (WORKER, 0))], "the parameter layout")
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
            if late:
                (param, chunk, rnd), got = late[0]
                group = self._groups[self._chunks[(param, chunk)].group]
                ep.timed_out(f"the push of vector {param} chunk {chunk} round {rnd}",
                             [(WORKER, r) for r in group if r not in got])
                ep.disarm()
                raise CommError(ep.error)
            time.sleep(0.1)

    def close(self) -> None:
        self.ep.close(say_bye=self.ep.error is None)
