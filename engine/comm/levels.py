"""Two levels: inside a machine first, then the network scheme per part, then inside again.

A run of M machines with k workers each (engine/comm/topology.py) sums a dense unit's vector
as BytePS and PHub do, without a leader that does all the work:

1. local reduce-scatter: the vector is cut into k parts; local worker i receives part i from
   its k-1 machine mates and sums the k contributions in local-rank order;
2. network: local worker i runs the network scheme (PS, ring or hd, with the wire codec) on
   its part with the owners of part i on the other machines (its network group);
3. local all-gather: each owner hands its summed part to its machine mates.

So a machine's network link carries one copy of the vector, as one worker per machine with k
times the batch would, not k copies. Every part is summed once and copied, so replicas stay
bit-identical. Local traffic is tagged ``<scheme>.local`` and goes through Unix sockets
(ZeroMQ ipc://, engine/comm/transport.py); the byte counters tell it from network traffic.

``compose`` builds the scheme instance a unit needs, flat or in levels: the syncer calls it for
every scheme and has no branch of its own.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb

from .cost import Device, LayerTiming
from .schemes import Scheme
from .schemes.base import DenseScheme
from .wire import arrays_are
from .transport import WORKER, Message, PeerId
from .units import Unit, split

RS, AG = 0, 1


def compose(cls: type[Scheme], host: Any, units: Sequence[Unit], chunk_bytes: int) -> Scheme:
    """A dense scheme in two levels when the run has them, else the scheme itself."""
    if host.topology.two_level and cls.dense and cls.leveled:
        return Levels(host, units, chunk_bytes, cls)
    return cls(host, units, chunk_bytes)


class _Op:
    __slots__ = ("vec", "acc", "out", "got", "summed", "have", "bits", "on_done", "started")

    def __init__(self, vec: np.ndarray, acc: np.ndarray, out: np.ndarray, bits: int,
                 on_done: Callable[[np.ndarray, int], None]) -> None:
        self.vec, self.acc, self.out, self.bits, self.on_done = vec, acc, out, bits, on_done
        #: sub-chunk of my part -> local rank -> that mate's contribution to it
        self.got: dict[int, dict[int, np.ndarray]] = {}
        self.summed = 0        # sub-chunks of my part summed over the machine
        self.have = 0          # sub-chunks of the result in ``out``
        self.started = False   # the network round on my part


class Levels(DenseScheme):
    """``inner`` (PS, ring or hd) across machines on each local worker's part of a unit."""

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int,
                 inner: type[DenseScheme]) -> None:
        super().__init__(host, units, chunk_bytes)
        topo = host.topology
        self.name = inner.name  # the units' scheme: the syncer finds this instance by it
        self.local_tag = f"{inner.name}.local"
        self.local = topo.local
        self.part = topo.local_rank
        self.inner = inner(host, units, chunk_bytes, topo.groups(), self.part)
        self._acc: dict[tuple[int, int], np.ndarray] = {}
        self._out: dict[tuple[int, int], np.ndarray] = {}
        self._ops: dict[tuple[int, int, int], _Op] = {}
        self._early: dict[tuple[int, int, int], list[Message]] = {}
        self._geo: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
        self._lengths = {(u.id, phase): n for u in units
                         for phase, n in host.codec.vectors(u.count).items()}

    def tags(self) -> list[str]:
        return [self.name, self.local_tag]

    def shard_table(self) -> tuple[list, list[tuple[int, ...]]]:
        """The inner PS's chunk table and groups, for the shards."""
        return self.inner.shard_table()  # type: ignore[attr-defined]

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int) -> LayerTiming:
        raise TypeError("Levels is priced by levels.timing (it needs the inner scheme)")

    # ---------------------------------------------------------------------------- rounds
    def _geometry(self, unit_id: int, phase: int) -> list[list[tuple[int, int]]]:
        """Sub-chunks (absolute offset, length) of every part of a vector: local messages are
        no longer than the network's (``chunk_bytes``)."""
        key = (unit_id, phase)
        geo = self._geo.get(key)
        if geo is None:
            n = self._lengths[key]
            itemsize = np.dtype(self.units[unit_id].params[0].blob.diff.dtype).itemsize
            geo = [[(off + o, m) for o, m in split(length, max(1, min(
                -(-length * itemsize // self.chunk_bytes), length)))]
                for off, length in split(n, len(self.local))]
            self._geo[key] = geo
        return geo

    def sum_vector(self, unit: Unit, rnd: int, phase: int, vec: np.ndarray, bits: int,
                   on_done: Any) -> None:
        geo = self._geometry(unit.id, phase)
        key = (unit.id, phase)
        if key not in self._out:
            self._out[key] = np.empty(vec.size, vec.dtype)
            self._acc[key] = np.empty(sum(n for _, n in geo[self.part]), vec.dtype)
        op = _Op(vec, self._acc[key], self._out[key], bits, on_done)
        self._ops[(unit.id, rnd, phase)] = op
        for j, peer in enumerate(self.local):
            if j != self.part:
                for c, (o, m) in enumerate(geo[j]):
                    self._send(unit, rnd, phase, RS, c, [peer], vec[o:o + m], op.bits)
        for c, (o, m) in enumerate(geo[self.part]):
            self._contribute(unit, rnd, phase, op, c, self.part, vec[o:o + m])
        for msg in self._early.pop((unit.id, rnd, phase), []):
            self._local_step(op, msg)

    def receive(self, msg: Message) -> None:
        h = msg.header
        if h.scheme != self.local_tag:
            self.inner.receive(msg)
            return
        self.deliver(self._ops, self._early, msg, self._local_step)

    def _local_step(self, op: _Op, msg: Message) -> None:
        h = msg.header
        unit = self.units[h.layer]
        j = self.local.index(msg.sender[1])
        op.bits |= h.request
        if h.op == RS:
            self._contribute(unit, h.round, h.phase, op, h.chunk, j, msg.arrays[0])
        else:
            o, m = self._geometry(h.layer, h.phase)[j][h.chunk]
            op.out[o:o + m] = msg.arrays[0]
            op.have += 1
            self._maybe_done(unit, h.round, h.phase, op)

    def _contribute(self, unit: Unit, rnd: int, phase: int, op: _Op, c: int, j: int,
                    piece: np.ndarray) -> None:
        """Mate ``j``'s piece of sub-chunk ``c`` of my part; once all k are in, sum them in
        local-rank order, and once every sub-chunk is summed run the network scheme."""
        pieces = op.got.setdefault(c, {})
        pieces[j] = piece
        if len(pieces) < len(self.local):
            return
        geo = self._geometry(unit.id, phase)
        start = geo[self.part][0][0]
        o, m = geo[self.part][c]
        acc = op.acc[o - start:o - start + m]
        acc[...] = pieces[0]
        for i in range(1, len(self.local)):
            acc += pieces[i]
        del op.got[c]
        op.summed += 1
        if op.summed < len(geo[self.part]) or op.started:
            return
        op.started = True

        def owned(total: np.ndarray, bits: int) -> None:
            op.bits |= bits
            op.out[start:start + total.size] = total
            mates = [p for i, p in enumerate(self.local) if i != self.part]
            for sub, (so, sm) in enumerate(geo[self.part]):
                self._send(unit, rnd, phase, AG, sub, mates, op.out[so:so + sm], op.bits)
            op.have += len(geo[self.part])
            self._maybe_done(unit, rnd, phase, op)

        self.inner.sum_vector(unit, rnd, phase, op.acc, op.bits, owned)

    def _maybe_done(self, unit: Unit, rnd: int, phase: int, op: _Op) -> None:
        if op.have == sum(len(g) for g in self._geometry(unit.id, phase)):
            del self._ops[(unit.id, rnd, phase)]
            op.on_done(op.out, op.bits)

    def _send(self, unit: Unit, rnd: int, phase: int, step: int, chunk: int,
              ranks: Sequence[int], piece: np.ndarray, bits: int) -> None:
        hdr = pb.Header(kind=pb.DATA, scheme=self.local_tag, layer=unit.id, round=rnd, op=step,
                        chunk=chunk, phase=phase, request=bits)
        self.host.send(unit, [(WORKER, r) for r in ranks], hdr, [piece])

    # ---------------------------------------------------------------------------- checks
    def check(self, msg: Message, rounds: tuple[int, int]) -> str | None:
        h = msg.header
        if h.scheme != self.local_tag:
            return self.inner.check(msg, rounds)
        if msg.sender[0] != WORKER or msg.sender[1] not in self.local or \
                msg.sender[1] == self.host.rank:
            return f"unit {h.layer}: a local message from {msg.sender}, not a machine mate"
        if h.round not in rounds:
            return f"unit {h.layer}: round {h.round}, expected {rounds[0]}"
        if (h.layer, h.phase) not in self._lengths or h.op not in (RS, AG):
            return f"unit {h.layer}: no local step {h.op} of phase {h.phase}"
        part = self.part if h.op == RS else self.local.index(msg.sender[1])
        geo = self._geometry(h.layer, h.phase)[part]
        if h.chunk >= len(geo):
            return f"unit {h.layer}: part {part} has no sub-chunk {h.chunk}"
        dtype = np.dtype(self.units[h.layer].params[0].blob.diff.dtype).str
        return arrays_are(msg, [((geo[h.chunk][1],), dtype)])

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        out = list(self.inner.missing(unit, rnd))
        for (uid, r, _), op in self._ops.items():
            if uid == unit.id and r == rnd:
                waiting = {j for pieces in op.got.values() for j in range(len(self.local))
                           if j not in pieces}
                out += [(WORKER, self.local[j]) for j in waiting or range(len(self.local))
                        if j != self.part]
        return sorted(set(out))

    def largest_frame(self) -> int:
        return max(self.chunk_bytes + 8, self.inner.largest_frame())

    def close(self) -> None:
        self.inner.close()
