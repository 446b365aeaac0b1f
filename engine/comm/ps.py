"""Sharded parameter server: the chunk table and the shard server process.

Parameters synchronised by PS are cut into chunks of at most ``chunk_bytes`` (and, when large
enough, into at least one chunk per shard so that every shard carries a fair share); chunks go
to the least-loaded shard, largest first, which balances bytes. Every worker computes the same
table; rank 0 sends it to the shards and every worker sends its digest, so a worker that built
a different net is caught at start-up.

A shard server receives the P workers' pushes of a chunk for round t, sums them in rank order
(so the result does not depend on arrival order) and sends the sum to every worker.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb
from engine.perf import timeline

from .errors import CommError
from .hosts import HostEntry
from .stats import CommStats
from .transport import SHARD, WORKER, Endpoint, Message, header, message_key

log = logging.getLogger("poseidon.comm")

DEFAULT_CHUNK_BYTES = 4 << 20
#: below this a parameter is not split further just to spread it over the shards
MIN_SPLIT_BYTES = 64 << 10


@dataclass(frozen=True)
class Chunk:
    param: int
    chunk: int
    offset: int
    count: int
    shard: int
    dtype: str
    layer: int

    def to_pb(self) -> pb.ChunkSpec:
        return pb.ChunkSpec(param=self.param, chunk=self.chunk, offset=self.offset,
                            count=self.count, shard=self.shard, dtype=self.dtype, layer=self.layer)


@dataclass(frozen=True)
class PSParam:
    """What the chunker needs to know of one learnable parameter."""
    index: int
    layer: int
    count: int
    dtype: str


def make_layout(params: Sequence[PSParam], n_shards: int,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    """The chunk table, ordered by (param, chunk); identical on every worker."""
    if chunk_bytes <= 0:
        raise ValueError(f"--chunk-bytes must be positive, got {chunk_bytes}")
    pieces = []
    for p in params:
        itemsize = np.dtype(p.dtype).itemsize
        nbytes = p.count * itemsize
        n = max(math.ceil(nbytes / chunk_bytes),
                min(n_shards, math.ceil(nbytes / MIN_SPLIT_BYTES)), 1)
        n = min(n, max(p.count, 1))
        base, extra = divmod(p.count, n)
        offset = 0
        for c in range(n):
            count = base + (1 if c < extra else 0)
            pieces.append((p, c, offset, count))
            offset += count
    load = [0] * n_shards
    shard_of: dict[tuple[int, int], int] = {}
    for p, c, _, count in sorted(pieces, key=lambda t: -t[3] * np.dtype(t[0].dtype).itemsize):
        s = min(range(n_shards), key=lambda i: (load[i], i))
        load[s] += count * np.dtype(p.dtype).itemsize
        shard_of[(p.index, c)] = s
    return [Chunk(p.index, c, off, count, shard_of[(p.index, c)], p.dtype, p.layer)
            for p, c, off, count in pieces]


def layout_digest(layout: Sequence[Chunk]) -> bytes:
    h = hashlib.sha256()
    for c in layout:
        h.update(f"{c.param},{c.chunk},{c.offset},{c.count},{c.shard},{c.dtype},{c.layer};".encode())
    return h.digest()


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
        self._next: dict[tuple[int, int], int] = {}
        self._pending: dict[tuple[int, int, int], tuple[float, dict[int, np.ndarray]]] = {}
        self._requests: dict[tuple[int, int, int], int] = {}  # signal bits of the pushes
        self._lock = threading.Lock()

    def _check(self, msg: Message) -> str | None:
        h = msg.header
        if h.kind != pb.PUSH:
            return f"a shard does not take kind {pb.Kind.Name(h.kind)}"
        chunk = self._chunks.get((h.param, h.chunk))
        if chunk is None:
            return f"unknown param {h.param} chunk {h.chunk} for shard {self.index}"
        if h.layer != chunk.layer:
            return f"param {h.param} belongs to layer {chunk.layer}, not {h.layer}"
        nxt = self._next[(h.param, h.chunk)]
        if h.round not in (nxt, nxt + 1):
            return f"param {h.param} chunk {h.chunk}: round {h.round}, expected {nxt}"
        if len(msg.arrays) != 1:
            return f"PUSH carries {len(msg.arrays)} arrays, expected 1"
        a = msg.arrays[0]
        if a.dtype.str != chunk.dtype or a.shape != (chunk.count,):
            return (f"param {h.param} chunk {h.chunk}: got {a.dtype.str}{a.shape}, "
                    f"expected {chunk.dtype}({chunk.count},)")
        return None

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
            if len(got) < self.world:
                return
            del self._pending[key]
            request = self._requests.pop(key)
            self._next[(h.param, h.chunk)] = h.round + 1
        tl = timeline.current
        start = tl.now()
        total = got[0].copy()
        for r in range(1, self.world):  # rank order: the sum is the same whatever came first
            total += got[r]
        if tl.active:
            tl.complete(f"aggregate p{h.param}c{h.chunk}", "aggregate", start,
                        {"round": h.round, "layer": h.layer, "bytes": total.nbytes})
            start = tl.now()
        out = header(pb.SUM, round=h.round, layer=h.layer, param=h.param, chunk=h.chunk,
                     request=request)
        self.ep.broadcast(self.workers, out, [total])
        if tl.active:
            tl.complete(f"send sum p{h.param}c{h.chunk}", "send", start, {"round": h.round})
        self.ep.stats.note_round(h.layer, h.round)

    def start(self) -> None:
        """The start-up barrier: layout from rank 0, agreeing digests from every worker."""
        ep = self.ep
        msgs = ep.wait_for([message_key(pb.LAYOUT, (WORKER, 0))], "the parameter layout")
        hellos = ep.wait_for([message_key(pb.HELLO, w) for w in self.workers], "start-up HELLO")
        digest = hellos[0].header.layout_digest
        for m in hellos[1:]:
            if m.header.layout_digest != digest:
                ep.fatal(f"worker {m.header.sender} built a different parameter layout than "
                         "worker 0 (different net or --chunk-bytes?)")
                raise CommError(ep.error)
        layout = [Chunk(c.param, c.chunk, c.offset, c.count, c.shard, c.dtype, c.layer)
                  for c in msgs[0].header.layout]
        if layout_digest(layout) != digest:
            ep.fatal("the layout worker 0 sent does not match its digest")
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
                missing = ", ".join(ep.name_of((WORKER, r)) for r in range(self.world) if r not in got)
                ep.fatal(f"{ep.name}: timed out after {ep.timeout:g} s waiting for the push of "
                         f"param {param} chunk {chunk} round {rnd} from {missing}")
                ep.disarm()
                raise CommError(ep.error)
            time.sleep(0.1)

    def close(self) -> None:
        self.ep.close(say_bye=self.ep.error is None)
