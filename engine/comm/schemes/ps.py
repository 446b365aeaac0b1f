"""Sharded parameter server (Bösen/PHub), the worker's side, and the chunk table.

Each vector a PS unit sums per round is cut into chunks of at most ``chunk_bytes`` (and, when
large enough, into at least one chunk per shard so that every shard carries a fair share);
chunks go to the least-loaded shard, largest first, which balances bytes. Every worker computes
the same table; rank 0 sends it to the shards and every worker sends its digest, so a worker
that built a different plan is caught at start-up. A worker pushes each chunk of its local
vector to the chunk's shard; the shard (engine/comm/shard.py) answers every worker with the
sum, which the worker writes back in place.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np


from ..chunks import PUSH, SUM, Chunk, PSParam, make_layout
from ..cost import Device, LayerTiming
from ..transport import SHARD, Message, PeerId
from ..units import Unit, split
from ..wire import arrays_are
from .base import DenseScheme

def unit_vectors(units: Sequence[Unit], vectors: Any, dtype: str, part: int = 0,
                 parts: int = 1, first: int = 0) -> list[PSParam]:
    """The vectors PS units sum per round (``vectors(count) -> {phase: length}``, the codec's),
    or part ``part`` of ``parts`` of each; numbered from ``first``."""
    out = []
    for u in sorted(units, key=lambda u: u.id):
        for phase, count in sorted(vectors(u.count).items()):
            out.append(PSParam(first + len(out), u.id, split(count, parts)[part][1], dtype,
                               phase))
    return out


def group_layout(units: Sequence[Unit], vectors: Any, dtype: str,
                 groups: Sequence[Sequence[int]], chunk_bytes: int) -> list[Chunk]:
    """The chunk table of every group: group g sums part g of each vector over the shards of
    its members (one group of every worker when flat, so shard j is worker j's)."""
    out: list[Chunk] = []
    for g, members in enumerate(groups):
        first = 1 + max(c.param for c in out) if out else 0
        params = unit_vectors(units, vectors, dtype, g, len(groups), first)
        for c in make_layout(params, len(members), chunk_bytes):
            out.append(replace(c, shard=members[c.shard], group=g))
    return out


class _Op:
    __slots__ = ("vec", "remaining", "bits", "on_done", "chunks", "seen")

    def __init__(self, vec: np.ndarray, chunks: list[Chunk], bits: int, on_done: Any) -> None:
        self.vec, self.chunks, self.bits, self.on_done = vec, chunks, bits, on_done
        self.remaining = len(chunks)
        self.seen: set[int] = set()


class PS(DenseScheme):
    """Push chunks to their shards, take every chunk's sum back."""

    name = "ps"

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int,
                 groups: Sequence[tuple[int, ...]] | None = None, mine: int = 0) -> None:
        super().__init__(host, units, chunk_bytes, groups, mine)
        codec = host.codec
        #: every group's chunks: rank 0 hands the whole table to the shards
        self.layout = group_layout(units, codec.vectors, codec.wire_dtype.str, self.groups,
                                   chunk_bytes)
        own = [c for c in self.layout if c.group == mine]
        self._chunks: dict[tuple[int, int], list[Chunk]] = {}
        self._by_id = {(c.param, c.chunk): c for c in own}
        for c in own:
            self._chunks.setdefault((c.layer, c.phase), []).append(c)
        self._ops: dict[tuple[int, int, int], _Op] = {}

    def shard_table(self) -> tuple[list[Chunk], list[tuple[int, ...]]]:
        """Every group's chunks and the groups: what rank 0 sends the shards (LAYOUT)."""
        return self.layout, self.groups

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int, chunks: list[tuple[int, int]] | None = None,
               node: int | None = None) -> LayerTiming:
        """``chunks``: [(bytes, shard)] of the layer in the job's whole table; None: the layer's
        own chunks spread over the shards by themselves. ``node``: the node whose link is
        priced (the job's busiest over all its layers); None: this layer's busiest."""
        if chunks is None:
            table = make_layout([PSParam(0, info.layer, info.params, f"<f{wire_itemsize}")],
                                world, chunk_bytes)
            chunks = [(c.count * wire_itemsize, c.shard) for c in table]
        p = world
        sent, recv, adds = [0.0] * p, [0.0] * p, [0.0] * p
        for nbytes, shard in chunks:
            for n in range(p):
                if n == shard:  # its shard takes P-1 remote pushes and sends P-1 sums
                    sent[n] += (p - 1) * nbytes
                    recv[n] += (p - 1) * nbytes
                    adds[n] += (p - 1) * nbytes
                else:           # its worker pushes the chunk and gets the sum back
                    sent[n] += nbytes
                    recv[n] += nbytes
        busiest = node if node is not None else max(
            range(p), key=lambda n: (max(sent[n], recv[n]), adds[n]))
        largest = max((b for b, _ in chunks), default=0)
        update = device.update_s(info.params * info.itemsize)
        # a node pushes to P-1 shards and its shard answers P-1 workers at once: a chunk's sum
        # leaves once the slowest push of it is in and every worker's round ends with the
        # slowest answer, so the many flows' unfair shares stretch both sides (Link.slowdown)
        beta = link.beta_s_per_byte * link.slowdown(p - 1)
        # the answers trail the pushes by one chunk's transfer and addition, at the start and
        # at the end
        add = (p - 1) * largest / device.add_bytes_per_s
        # each chunk: P pushes to its shard (its own worker's too: a shard is a peer of its
        # own) and P sums back, over the P nodes
        return LayerTiming(info.name, cls.name, sent[busiest], recv[busiest],
                           link.alpha_s + beta * sent[busiest],
                           link.alpha_s + beta * recv[busiest],
                           link.alpha_s + beta * largest + add, beta * largest + add,
                           0.0 if device.update_on_device else update, update,
                           messages=4.0 * len(chunks))

    def sum_vector(self, unit: Unit, rnd: int, phase: int, vec: np.ndarray, bits: int,
                   on_done: Any) -> None:
        chunks = self._chunks.get((unit.id, phase), [])
        op = _Op(vec, chunks, bits, on_done)
        if not chunks:
            on_done(vec, bits)
            return
        self._ops[(unit.id, rnd, phase)] = op
        codec = self.host.codec
        for c in chunks:
            wire, flag = codec.encode(unit.id, vec[c.offset:c.offset + c.count])
            self.host.send(unit, [(SHARD, c.shard)],
                           self.header(unit, rnd, PUSH, bits | flag, param=c.param,
                                       chunk=c.chunk, phase=phase), [wire])

    def check(self, msg: Message, rounds: tuple[int, int]) -> str | None:
        h = msg.header
        c = self._by_id.get((h.param, h.chunk))
        if h.op != SUM or c is None:
            return f"no PS sum of vector {h.param} chunk {h.chunk} (op {h.op})"
        if msg.sender != (SHARD, c.shard) or h.layer != c.layer or h.phase != c.phase:
            return f"vector {h.param} chunk {h.chunk} does not come from {msg.sender} / unit {h.layer}"
        if h.round not in rounds:
            return f"unit {h.layer}: round {h.round}, expected {rounds[0]}"
        return arrays_are(msg, [((c.count,), c.dtype)])

    def receive(self, msg: Message) -> None:
        h = msg.header
        op = self._ops.get((h.layer, h.round, h.phase))
        c = self._by_id[(h.param, h.chunk)]
        if op is None or c.chunk in op.seen:
            raise RuntimeError(f"a sum of unit {h.layer} round {h.round} chunk {c.chunk} that "
                               "was not pushed")
        op.seen.add(c.chunk)
        op.vec[c.offset:c.offset + c.count] = self.host.codec.decode(h.layer, msg.arrays[0])
        op.bits |= h.request
        op.remaining -= 1
        if op.remaining == 0:
            del self._ops[(h.layer, h.round, h.phase)]
            op.on_done(op.vec, op.bits)

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        out: list[PeerId] = []
        for (uid, r, _), op in self._ops.items():
            if uid == unit.id and r == rnd:
                out += [(SHARD, c.shard) for c in op.chunks if c.chunk not in op.seen]
        return sorted(set(out))

    def largest_frame(self) -> int:
        return max((c.count * np.dtype(c.dtype).itemsize for c in self.layout), default=0)
