"""Ring allreduce (Baidu, Horovod, GradientFlow): reduce-scatter, then all-gather.

The unit's vector is cut into P segments; segment j is cut again into sub-chunks of at most
``chunk_bytes`` so that a step's transfer, addition and forwarding pipeline. Worker r talks to
its right neighbour r+1 and hears from its left neighbour r-1 only:

- reduce-scatter, step s = 0..P-2: r sends segment (r - s) and adds what comes from the left
  into segment (r - s - 1), which it sends on at the next step; after P-1 steps r holds the
  complete sum of segment (r + 1);
- all-gather, step s = P-1..2P-3: the complete segments travel once around the ring, each
  worker keeping and forwarding the very bytes it received.

Every segment's sum is formed on one worker and copied everywhere, so replicas are
bit-identical; the owner keeps what its peers decode (the codec's round trip). A node sends and
receives 2(P-1)/P of the vector. Steps run as their messages arrive (event-driven), so several
units may be in flight and complete in any order.

Sends are zero-copy, so no buffer may change while a send of it can be in flight. Every
reduce-scatter send of the work vector is needed for this worker's own completion (its segment
comes back through the all-gather), so the next round may reuse the work vector; the
all-gather's sends are not, so they come from a buffer of their own, which the next round
writes only after the right neighbour (which needed them) has moved on.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..cost import Device, LayerTiming
from ..transport import WORKER, Message, PeerId
from ..units import Unit, split
from ..wire import arrays_are
from .base import DenseScheme


class _Op:
    __slots__ = ("work", "out", "remaining", "bits", "on_done")

    def __init__(self, work: np.ndarray, out: np.ndarray, remaining: int, bits: int,
                 on_done: Any) -> None:
        self.work, self.out, self.remaining, self.bits, self.on_done = (
            work, out, remaining, bits, on_done)


class Ring(DenseScheme):
    name = "ring"

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int,
                 groups: Sequence[tuple[int, ...]] | None = None, mine: int = 0) -> None:
        super().__init__(host, units, chunk_bytes, groups, mine)
        p, r = self.size, self.index
        self.left: PeerId = (WORKER, self.group[(r - 1) % p])
        self.right: PeerId = (WORKER, self.group[(r + 1) % p])
        self._geometry: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
        itemsize = host.codec.wire_dtype.itemsize
        for u in units:
            for phase, count in self.sizes(u, mine).items():
                segments = split(count, p)
                longest = max(n for _, n in segments)
                subs = max(1, math.ceil(longest * itemsize / chunk_bytes))
                # absolute (offset, length) of sub-chunk c of segment j
                self._geometry[(u.id, phase)] = [
                    [(off + o, n) for o, n in split(length, min(subs, max(length, 1)))]
                    for off, length in segments]
        self._out: dict[tuple[int, int], np.ndarray] = {}
        self._ops: dict[tuple[int, int, int], _Op] = {}
        self._early: dict[tuple[int, int, int], list[Message]] = {}

    @classmethod
    def machine_share(cls, workers: int, slots: int) -> float:
        # a ring in rank order crosses between machines at one hop per machine, and that hop
        # carries one worker's flow alone
        return 1.0

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int) -> LayerTiming:
        nbytes = info.params * wire_itemsize
        seg = nbytes / world
        sub = seg / max(1, math.ceil(seg / chunk_bytes))
        steps = 2 * (world - 1)
        moved = steps * seg
        # Every node sends to its right while it receives from its left the same bytes at the
        # same moments, so both sides of its link are held for one span. A step's first
        # sub-chunk waits for the step before's (its latency and transfer, and in the
        # reduce-scatter its addition), so the last step starts that chain in at the earliest
        # and then sends its whole segment; a large layer is bandwidth-bound, the sub-chunks
        # of each step pipelining behind the first, and the latency counts once per step.
        beta = link.beta_s_per_byte * link.slowdown(1)  # one peer each way
        hop = link.alpha_s + beta * sub
        chain = (steps - 1) * hop + (world - 1) * sub / device.add_bytes_per_s
        busy = beta * moved + steps * link.alpha_s
        span = max(busy, chain + link.alpha_s + beta * seg)
        update = device.update_s(info.params * info.itemsize)
        # the progress thread's additions are also priced after the round, as if they did not
        # overlap the transfers: the planner's choices between ring and PS rest on it
        adds = (world - 1) * seg / device.add_bytes_per_s
        return LayerTiming(info.name, cls.name, moved, moved, span, span, 0.0, 0.0,
                           adds + (0.0 if device.update_on_device else update), update,
                           messages=2.0 * steps * max(1, math.ceil(seg / chunk_bytes)))

    # ---------------------------------------------------------------------------- rounds
    def sum_vector(self, unit: Unit, rnd: int, phase: int, vec: np.ndarray, bits: int,
                   on_done: Any) -> None:
        geo = self._geometry[(unit.id, phase)]
        key = (unit.id, phase)
        if key not in self._out:
            self._out[key] = np.empty(vec.size, vec.dtype)
        p, r = self.size, self.index
        # reduce-scatter brings every segment but r, all-gather every segment but r + 1
        expected = sum(len(g) for j, g in enumerate(geo) if j != r) + \
            sum(len(g) for j, g in enumerate(geo) if j != (r + 1) % p)
        op = _Op(vec, self._out[key], expected, bits, on_done)
        self._ops[(unit.id, rnd, phase)] = op
        for c, (off, n) in enumerate(geo[r]):
            self._send(unit, rnd, phase, 0, c, vec[off:off + n], op)
        for msg in self._early.pop((unit.id, rnd, phase), []):
            self._step(op, msg)

    def receive(self, msg: Message) -> None:
        self.deliver(self._ops, self._early, msg, self._step)

    def _step(self, op: _Op, msg: Message) -> None:
        h = msg.header
        p, r = self.size, self.index
        unit = self.units[h.layer]
        codec = self.host.codec
        s = h.op
        op.bits |= h.request
        if s <= p - 2:  # reduce-scatter: add the left's partial sum into ours
            off, n = self._geometry[(h.layer, h.phase)][(r - s - 1) % p][h.chunk]
            part = op.work[off:off + n]
            part += codec.decode(h.layer, msg.arrays[0])
            if s < p - 2:
                self._send(unit, h.round, h.phase, s + 1, h.chunk, part, op)
            else:  # this segment's sum is complete here: keep what the others will get
                wire, flag = codec.encode(h.layer, part)
                op.bits |= flag
                op.out[off:off + n] = codec.decode(h.layer, wire)
                if wire is part:  # send the kept copy: the next round's gather reuses the
                    wire = op.out[off:off + n]  # work vector before this send must be done
                self.host.send(unit, [self.right], self.header(
                    unit, h.round, s + 1, op.bits, chunk=h.chunk, phase=h.phase), [wire])
        else:           # all-gather: keep the complete segment and pass the same bytes on
            t = s - (p - 1)
            off, n = self._geometry[(h.layer, h.phase)][(r - t) % p][h.chunk]
            op.out[off:off + n] = codec.decode(h.layer, msg.arrays[0])
            if t < p - 2:
                self.host.send(unit, [self.right], self.header(
                    unit, h.round, s + 1, op.bits, chunk=h.chunk, phase=h.phase),
                    [msg.arrays[0]])
        op.remaining -= 1
        if op.remaining == 0:
            del self._ops[(h.layer, h.round, h.phase)]
            op.on_done(op.out, op.bits)

    def _send(self, unit: Unit, rnd: int, phase: int, step: int, chunk: int,
              part: np.ndarray, op: _Op) -> None:
        wire, flag = self.host.codec.encode(unit.id, part)
        op.bits |= flag
        self.host.send(unit, [self.right], self.header(unit, rnd, step, op.bits, chunk=chunk,
                                                       phase=phase), [wire])

    # ---------------------------------------------------------------------------- checks
    def check(self, msg: Message, rounds: tuple[int, int]) -> str | None:
        h = msg.header
        p, r = self.size, self.index
        if msg.sender != self.left:
            return f"unit {h.layer}: ring message from {msg.sender}, not the left neighbour"
        if h.round not in rounds:
            return f"unit {h.layer}: round {h.round}, expected {rounds[0]}"
        geo = self._geometry.get((h.layer, h.phase))
        if geo is None or h.op > 2 * p - 3:
            return f"unit {h.layer}: no ring step {h.op} of phase {h.phase}"
        seg = (r - h.op - 1) % p if h.op <= p - 2 else (r - (h.op - (p - 1))) % p
        if h.chunk >= len(geo[seg]):
            return f"unit {h.layer}: segment {seg} has no sub-chunk {h.chunk}"
        return arrays_are(msg, [((geo[seg][h.chunk][1],), self.host.codec.wire_dtype.str)])

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        return [self.left]

    def largest_frame(self) -> int:
        itemsize = self.host.codec.wire_dtype.itemsize
        return max((n * itemsize for geo in self._geometry.values() for seg in geo
                    for _, n in seg), default=0)
