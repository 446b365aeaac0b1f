"""The parameter server's chunk table: how each vector is cut into chunks and spread over the
shards, identical on every worker and every shard (the layout's digest proves it).

Apart from the PS scheme (schemes/ps.py) because a shard process needs the table and nothing
else of the schemes: importing it does not import every scheme.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 << 20
#: below this a vector is not split further just to spread it over the shards
MIN_SPLIT_BYTES = 64 << 10
PUSH, SUM = 0, 1


@dataclass(frozen=True)
class Chunk:
    param: int   # the vector's index in the table
    chunk: int
    offset: int
    count: int
    shard: int
    dtype: str   # as on the wire
    layer: int   # the unit's id
    phase: int = 0
    #: the group of workers that push it (a two-level run's network group; 0 when flat)
    group: int = 0

    def to_pb(self) -> pb.ChunkSpec:
        return pb.ChunkSpec(param=self.param, chunk=self.chunk, offset=self.offset,
                            count=self.count, shard=self.shard, dtype=self.dtype,
                            layer=self.layer, phase=self.phase, group=self.group)

    @classmethod
    def from_pb(cls, c: pb.ChunkSpec) -> "Chunk":
        return cls(c.param, c.chunk, c.offset, c.count, c.shard, c.dtype, c.layer, c.phase,
                   c.group)


@dataclass(frozen=True)
class PSParam:
    """What the chunker needs to know of one vector."""
    index: int
    layer: int
    count: int
    dtype: str
    phase: int = 0


def make_layout(params: Sequence[PSParam], n_shards: int,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    """The chunk table, ordered by (vector, chunk); identical on every worker."""
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
    return [Chunk(p.index, c, off, count, shard_of[(p.index, c)], p.dtype, p.layer, p.phase)
            for p, c, off, count in pieces]


def layout_digest(layout: Sequence[Chunk]) -> bytes:
    h = hashlib.sha256()
    for c in layout:
        h.update(f"{c.param},{c.chunk},{c.offset},{c.count},{c.shard},{c.dtype},{c.layer},"
                 f"{c.phase},{c.group};".encode())
    return h.digest()
