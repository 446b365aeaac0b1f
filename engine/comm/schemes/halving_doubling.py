"""Recursive halving and doubling allreduce (Rabenseifner; Gloo's ``allreduce_halving_doubling``).

Ring allreduce moves the fewest bytes, but its 2(P-1) steps each wait for the one before, so a
small or mid-sized unit pays 2(P-1) message latencies. Halving-doubling moves the same bytes,
2(P-1)/P of the vector per node, in 2·log2(P) steps:

- recursive halving (a reduce-scatter): at step k a worker and its partner at distance
  P/2^(k+1) split the range they both still sum in two halves; each sends the half it gives up
  and adds the partner's copy of the half it keeps. After log2(P) steps every worker holds the
  complete sum of its own 1/P of the vector;
- recursive doubling (an all-gather): the same pairs in reverse order swap what they hold, so
  each worker's complete range doubles per step until it is the whole vector.

When P is not a power of two, the first 2·(P - q) workers (q the largest power of two below P)
pair up first: the even one of each pair sends its whole vector to the odd one (FOLD) and waits;
the q workers left run the algorithm, and each odd one finally sends the whole sum back
(UNFOLD). That costs two whole-vector messages on those pairs, as in Rabenseifner's paper.

Every value's sum is formed by one worker, which keeps exactly what its peers decode (the
codec's round trip), and then only its wire bytes travel, unchanged: replicas are
bit-identical. A step's messages are processed only once the step before is complete, so the
order of additions, and hence the sum, is the same in every run. A step's range travels in
pieces of at most ``chunk_bytes`` (the frame limit), each a message.

Sends are zero-copy (large frames): a halving send of the work vector is never written again in
its round, and the round cannot complete until every such piece is in (each feeds a sum that
comes back); the doubling and unfold sends come from the round's wire buffer, which the next
round writes only after every partner has started it, hence received them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..cost import Device, LayerTiming
from ..transport import WORKER, Message, PeerId
from ..units import Unit, split
from ..wire import arrays_are
from .base import DenseScheme

Pieces = tuple[tuple[int, int], ...]
FOLD = 0


@dataclass(frozen=True)
class Step:
    """One step of a worker's schedule: the wire op, the partner (an index in the group), the
    pieces (offset, length) it sends and receives, and whether what it receives is added into
    the work vector (fold, halving) or is final wire bytes (doubling, unfold)."""
    op: int
    peer: int
    send: Pieces
    recv: Pieces
    adds: bool


@dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]
    #: the range whose complete sum this worker forms (None: a folded worker forms none)
    own: tuple[int, int] | None
    #: the index of the first step that sends complete sums (the owner encodes its range then)
    gather_from: int


def schedule(count: int, p: int, r: int, pieces: Callable[[int, int], Pieces]) -> Schedule:
    """Worker ``r``'s steps for a vector of ``count`` values among ``p`` workers;
    ``pieces(lo, hi)`` cuts a range into the messages that carry it."""
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    levels = q.bit_length() - 1
    unfold = 2 * levels + 1
    whole = pieces(0, count)
    if r < 2 * extra and r % 2 == 0:
        return Schedule((Step(FOLD, r + 1, whole, (), True),
                         Step(unfold, r + 1, (), whole, False)), None, 1)
    steps: list[Step] = []
    if r < 2 * extra:
        steps.append(Step(FOLD, r - 1, (), whole, True))
    v = r // 2 if r < 2 * extra else r - extra  # this worker among the q

    def real(w: int) -> int:
        return 2 * w + 1 if w < extra else w + extra

    lo, hi = 0, count
    halves = []
    for k in range(levels):
        mask = q >> (k + 1)
        mid = lo + split(hi - lo, 2)[1][0]
        keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        steps.append(Step(1 + k, real(v ^ mask), pieces(*give), pieces(*keep), True))
        halves.append((keep, give))
        lo, hi = keep
    gather_from = len(steps)
    for k in reversed(range(levels)):
        keep, give = halves[k]
        steps.append(Step(2 * levels - k, real(v ^ (q >> (k + 1))), pieces(*keep),
                          pieces(*give), False))
    if r < 2 * extra:
        steps.append(Step(unfold, r - 1, whole, (), False))
    return Schedule(tuple(steps), (lo, hi), gather_from)


class _Op:
    __slots__ = ("vec", "wire", "sched", "pos", "got", "early", "bits", "on_done")

    def __init__(self, vec: np.ndarray, wire: np.ndarray, sched: Schedule, bits: int,
                 on_done: Any) -> None:
        self.vec, self.wire, self.sched, self.bits, self.on_done = vec, wire, sched, bits, on_done
        self.pos = self.got = 0
        #: messages of a later step than the current one: op -> messages
        self.early: dict[int, list[Message]] = {}


class HalvingDoubling(DenseScheme):
    name = "hd"

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int,
                 groups: Sequence[tuple[int, ...]] | None = None, mine: int = 0) -> None:
        super().__init__(host, units, chunk_bytes, groups, mine)
        self._itemsize = host.codec.wire_dtype.itemsize
        per_piece = max(1, chunk_bytes // self._itemsize)

        def pieces(lo: int, hi: int) -> Pieces:
            n = max(1, math.ceil((hi - lo) / per_piece))
            return tuple((lo + o, m) for o, m in split(hi - lo, n))

        self._sched = {(u.id, phase): schedule(count, self.size, self.index, pieces)
                       for u in units for phase, count in self.sizes(u, mine).items()}
        #: (unit, phase) -> op -> step, for the receive thread's checks
        self._recv_step = {key: {s.op: s for s in sc.steps if s.recv}
                           for key, sc in self._sched.items()}
        self._wire: dict[tuple[int, int], np.ndarray] = {}
        self._ops: dict[tuple[int, int, int], _Op] = {}
        self._early: dict[tuple[int, int, int], list[Message]] = {}

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int) -> LayerTiming:
        nbytes = info.params * wire_itemsize
        q = 1 << (world.bit_length() - 1)
        levels = q.bit_length() - 1
        sizes = [nbytes / 2 ** (k + 1) for k in range(levels)]
        hops = [(s, True) for s in sizes] + [(s, False) for s in reversed(sizes)]
        if world > q:  # the busiest node is an odd one of a folded pair
            hops = [(nbytes, True)] + hops + [(nbytes, False)]
        # per direction: the halves, the gathered halves, and a folded pair's whole vector
        moved = 2 * sum(sizes) + (nbytes if world > q else 0.0)
        # every step waits for the one before: its latency, its bytes and, halving, the adds.
        # The partners of a step swap the same bytes at once, so both sides of the link are
        # held from the first step to the last: the gaps of the adds are the layer's, not
        # another layer's (the next layer's bytes would otherwise share the link with its steps)
        beta = link.beta_s_per_byte * link.slowdown(1)  # one partner at a time
        chain = sum(link.alpha_s + beta * s + (s / device.add_bytes_per_s if adds else 0.0)
                    for s, adds in hops)
        update = device.update_s(info.params * info.itemsize)
        # a hop's bytes go in pieces of at most chunk_bytes, each a message out and one in
        pieces = sum(max(1, math.ceil(s / chunk_bytes)) for s, _ in hops)
        return LayerTiming(info.name, cls.name, moved, moved, chain, chain, 0.0, 0.0,
                           0.0 if device.update_on_device else update, update,
                           messages=2.0 * pieces)

    # ---------------------------------------------------------------------------- rounds
    def sum_vector(self, unit: Unit, rnd: int, phase: int, vec: np.ndarray, bits: int,
                   on_done: Any) -> None:
        key = (unit.id, phase)
        sched = self._sched[key]
        if not sched.steps:  # a group of one
            on_done(vec, bits)
            return
        if key not in self._wire:
            self._wire[key] = np.empty(vec.size, self.host.codec.wire_dtype)
        op = _Op(vec, self._wire[key], sched, bits, on_done)
        self._ops[(unit.id, rnd, phase)] = op
        for msg in self._early.pop((unit.id, rnd, phase), []):
            op.early.setdefault(msg.header.op, []).append(msg)
        self._run(unit, rnd, phase, op)

    def receive(self, msg: Message) -> None:
        self.deliver(self._ops, self._early, msg, self._take)

    def _take(self, op: _Op, msg: Message) -> None:
        h = msg.header
        step = op.sched.steps[op.pos]
        if h.op != step.op:  # a partner of a later step is ahead of this worker
            op.early.setdefault(h.op, []).append(msg)
            return
        self._apply(op, step, msg)
        if op.got == len(step.recv):
            op.pos += 1
            self._run(self.units[h.layer], h.round, h.phase, op)

    def _run(self, unit: Unit, rnd: int, phase: int, op: _Op) -> None:
        """Enter steps from ``op.pos`` until one waits for a message, or the round is done."""
        codec = self.host.codec
        steps = op.sched.steps
        while op.pos < len(steps):
            step = steps[op.pos]
            if op.pos == op.sched.gather_from and op.sched.own is not None:
                lo, hi = op.sched.own  # the complete sum of this range: keep its wire bytes
                wire, flag = codec.encode(unit.id, op.vec[lo:hi])
                op.bits |= flag
                op.wire[lo:hi] = wire
            peer = [(WORKER, self.group[step.peer])]
            for c, (off, n) in enumerate(step.send):
                if step.adds:  # a partial sum (fold, halving)
                    wire, flag = codec.encode(unit.id, op.vec[off:off + n])
                    op.bits |= flag
                else:          # complete sums, as their owner encoded them
                    wire = op.wire[off:off + n]
                self.host.send(unit, peer, self.header(unit, rnd, step.op, op.bits, chunk=c,
                                                       phase=phase), [wire])
            op.got = 0
            for msg in op.early.pop(step.op, []):
                self._apply(op, step, msg)
            if op.got < len(step.recv):
                return
            op.pos += 1
        del self._ops[(unit.id, rnd, phase)]
        op.on_done(codec.decode(unit.id, op.wire), op.bits)

    def _apply(self, op: _Op, step: Step, msg: Message) -> None:
        h = msg.header
        off, n = step.recv[h.chunk]
        op.bits |= h.request
        if step.adds:
            op.vec[off:off + n] += self.host.codec.decode(h.layer, msg.arrays[0])
        else:
            op.wire[off:off + n] = msg.arrays[0]
        op.got += 1

    # ---------------------------------------------------------------------------- checks
    def check(self, msg: Message, rounds: tuple[int, int]) -> str | None:
        h = msg.header
        if h.round not in rounds:
            return f"unit {h.layer}: round {h.round}, expected {rounds[0]}"
        step = self._recv_step.get((h.layer, h.phase), {}).get(h.op)
        if step is None:
            return f"unit {h.layer}: this worker receives no step {h.op} of phase {h.phase}"
        if msg.sender != (WORKER, self.group[step.peer]):
            return f"unit {h.layer}: step {h.op} from {msg.sender}, not this step's partner"
        if h.chunk >= len(step.recv):
            return f"unit {h.layer}: step {h.op} has no piece {h.chunk}"
        return arrays_are(msg, [((step.recv[h.chunk][1],), self.host.codec.wire_dtype.str)])

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        waiting = {(WORKER, self.group[op.sched.steps[op.pos].peer])
                   for (uid, r, _), op in self._ops.items()
                   if uid == unit.id and r == rnd and op.pos < len(op.sched.steps)}
        return sorted(waiting) or sorted({(WORKER, self.group[s.peer])
                                          for sc in self._sched.values() for s in sc.steps})

    def largest_frame(self) -> int:
        return max((n * self._itemsize for sc in self._sched.values() for s in sc.steps
                    for _, n in s.send + s.recv), default=0)
