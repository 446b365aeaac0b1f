"""Sufficient-factor broadcasting (Poseidon's SFB) for fully connected layers.

A fully connected layer's weight gradient over a batch of K rows is ``uᵀ·v`` (``vᵀ·u`` for a
transposed weight) with u the top diff (K x N) and v the bottom data (K x M); its bias gradient
is the sum of u's rows. Each worker broadcasts (u, v) to every peer and rebuilds
``Σ_p u_pᵀ v_p`` from the factors concatenated in rank order, so every replica forms the very
same matrices and the result is bit-identical. The layer skips its own weight-gradient GEMM
(``LayerSlot.defer_weight_gradient``) and does the rebuild itself (``LayerSlot.rebuild``), on
its device.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine import backend, timeline

from ..cost import Device, LayerTiming
from ..transport import WORKER, Message, PeerId
from ..units import LayerSlot, Unit
from ..wire import arrays_are
from .base import Scheme

FACTORS, UP, PEER, DOWN = 0, 1, 2, 3


class SFB(Scheme):
    """Flat: every worker broadcasts its factors to every peer. In two levels (several
    workers per machine), one *leader* per layer and machine (local rank = unit id mod k, so
    the layers' leaders spread over the machine's workers) gathers its machine mates' factors
    (UP), sends the machine's k·K rows to the other machines' leaders (PEER) and hands every
    machine's rows down to its mates (DOWN): a machine's link carries its k·K rows to M-1
    machines, as one worker with k times the batch would, not k² copies. The rebuild takes the
    rows machine by machine, each machine's in local-rank order, on every worker alike."""

    name = "sfb"
    dense = False

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int) -> None:
        super().__init__(host, units, chunk_bytes)
        topo = host.topology
        self.levels = topo.two_level
        self.machines = topo.machines
        self.machine = topo.machine
        self._shapes: dict[int, tuple[int, int, int, str]] = {}
        for u in units:
            [slot] = u.layers
            k, m, n = slot.factor_shape  # type: ignore[misc]
            self._shapes[u.id] = (k, m, n, np.dtype(slot.params[0].blob.diff.dtype).str)
            if slot.defer_weight_gradient is not None:
                slot.defer_weight_gradient(True)
        #: (unit, round) -> block -> (u, v): ranks (flat, or a leader's machine mates),
        #: machines (a leader's M blocks, 'm<i>'), or 'all' (a mate's DOWN)
        self._got: dict[tuple[int, int], dict[Any, list[np.ndarray]]] = {}
        self._bits: dict[tuple[int, int], int] = {}
        self._started: set[tuple[int, int]] = set()
        self._peered: set[tuple[int, int]] = set()

    @classmethod
    def applies(cls, layer: Any) -> bool:
        shape = getattr(layer, "factor_shape", None) if isinstance(layer, LayerSlot) \
            else getattr(layer, "factors", None)
        return shape is not None

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int) -> LayerTiming:
        k, m, n = info.factors
        sent = recv = (world - 1) * k * (m + n) * info.itemsize
        rebuild = 2.0 * world * k * m * n / device.gemm_flops_per_s
        update = device.update_s(info.params * info.itemsize)
        # to and from P-1 peers at once: the round ends with the slowest flow
        one_way = link.alpha_s + link.beta_s_per_byte * link.slowdown(world - 1) * sent
        return LayerTiming(info.name, cls.name, sent, recv, one_way, one_way, 0.0, 0.0,
                           rebuild + (0.0 if device.update_on_device else update), update,
                           messages=2.0 * (world - 1))

    @classmethod
    def timing_levels(cls, info: Any, machines: int, slots: int, link: Any, local_link: Any,
                      device: Device) -> LayerTiming:
        """Two levels: up to the leader and down again on the local link, k·K rows to and
        from M-1 machines on the network (the leader's node is the busiest)."""
        k, m, n = info.factors
        row = (m + n) * info.itemsize
        sent = recv = (machines - 1) * slots * k * row
        up = local_link.alpha_s + local_link.beta_s_per_byte * (slots - 1) * k * row
        down = local_link.alpha_s + local_link.beta_s_per_byte * machines * slots * k * row
        rebuild = 2.0 * machines * slots * k * m * n / device.gemm_flops_per_s
        update = device.update_s(info.params * info.itemsize)
        one_way = link.alpha_s + link.beta_s_per_byte * link.slowdown(machines - 1) * sent
        # the leader sends once its mates' factors are in, and hands every machine's rows down
        # (messages: a mate's factors up and the rows down; the leader's from its mates, to and
        # from the other leaders, and down to its mates)
        return LayerTiming(info.name, cls.name, sent, recv, one_way, one_way, 0.0, down,
                           rebuild + (0.0 if device.update_on_device else update), update,
                           start_s=up,
                           messages=(4.0 * (slots - 1) + 2.0 * (machines - 1)) / slots)

    # ---------------------------------------------------------------------------- roles
    def _leader(self, unit: Unit, machine: int) -> int:
        mates = self.machines[machine]
        return mates[unit.id % len(mates)]

    def _is_leader(self, unit: Unit) -> bool:
        return self._leader(unit, self.machine) == self.host.rank

    def _rows(self, unit: Unit, op: int) -> int:
        k = self._shapes[unit.id][0]
        slots = len(self.machines[self.machine])
        return {FACTORS: k, UP: k, PEER: slots * k, DOWN: self.host.world * k}[op]

    # ---------------------------------------------------------------------------- rounds
    def capture(self, unit: Unit, rnd: int, bits: int) -> list[np.ndarray]:
        # copies: the next forward may overwrite the layer's input before they are sent
        [slot] = unit.layers
        return [np.array(backend.to_numpy(a), copy=True) for a in slot.factors()]  # type: ignore[misc]

    def start(self, unit: Unit, rnd: int, bits: int, captured: Any) -> None:
        host = self.host
        key = (unit.id, rnd)
        got = self._got.setdefault(key, {})
        self._bits[key] = self._bits.get(key, 0) | bits
        self._started.add(key)
        if not self.levels:
            peers = [(WORKER, r) for r in range(host.world) if r != host.rank]
            host.send(unit, peers, self.header(unit, rnd, FACTORS, bits), captured)
            got[host.rank] = captured
        elif self._is_leader(unit):
            got[host.rank] = captured
        else:
            host.send(unit, [(WORKER, self._leader(unit, self.machine))],
                      self.header(unit, rnd, UP, bits), captured)
        self._advance(unit, rnd)

    def receive(self, msg: Message) -> None:
        h = msg.header
        key = (h.layer, h.round)
        got = self._got.setdefault(key, {})
        block = {FACTORS: msg.sender[1], UP: msg.sender[1], DOWN: "all",
                 PEER: f"m{self._machine_of(msg.sender[1])}"}[h.op]
        if block in got:
            raise RuntimeError(f"second set of factors of unit {h.layer} round {h.round} "
                               f"from worker {msg.sender[1]}")
        got[block] = msg.arrays
        self._bits[key] = self._bits.get(key, 0) | h.request
        self._advance(self.units[h.layer], h.round)

    def _machine_of(self, rank: int) -> int:
        return next(i for i, m in enumerate(self.machines) if rank in m)

    def _advance(self, unit: Unit, rnd: int) -> None:
        """Move the round on as far as what has come allows: a leader sends its machine's rows
        once its mates' are in and hands all rows down once every machine's are; a rebuild
        once this worker has every row."""
        key = (unit.id, rnd)
        if key not in self._started:
            return
        got = self._got[key]
        if not self.levels:
            if len(got) == self.host.world:
                self._rebuild(unit, rnd, [got[r] for r in range(self.host.world)])
            return
        if not self._is_leader(unit):
            if "all" in got:
                self._rebuild(unit, rnd, [got["all"]])
            return
        mates = self.machines[self.machine]
        mine = f"m{self.machine}"
        if key not in self._peered and all(r in got for r in mates):
            self._peered.add(key)
            rows = [got.pop(r) for r in mates]
            got[mine] = [np.concatenate([f[i] for f in rows]) for i in (0, 1)]
            leaders = [(WORKER, self._leader(unit, m)) for m in range(len(self.machines))
                       if m != self.machine]
            self.host.send(unit, leaders, self.header(unit, rnd, PEER, self._bits[key]),
                           got[mine])
        blocks = [f"m{m}" for m in range(len(self.machines))]
        if key in self._peered and all(b in got for b in blocks):
            rows = [np.concatenate([got[b][i] for b in blocks]) for i in (0, 1)]
            down = [(WORKER, r) for r in mates if r != self.host.rank]
            self.host.send(unit, down, self.header(unit, rnd, DOWN, self._bits[key]), rows)
            self._peered.discard(key)
            self._rebuild(unit, rnd, [rows])

    def check(self, msg: Message, rounds: tuple[int, int]) -> str | None:
        h = msg.header
        unit = self.units[h.layer]
        sender = msg.sender[1]
        if msg.sender[0] != WORKER or sender == self.host.rank:
            return f"unit {h.layer}: not sufficient factors from a peer"
        if self.levels:
            mine = self._machine_of(sender) == self.machine
            ok = {UP: mine and self._is_leader(unit),
                  PEER: not mine and self._is_leader(unit) and
                  sender == self._leader(unit, self._machine_of(sender)),
                  DOWN: mine and sender == self._leader(unit, self.machine)}.get(h.op, False)
        else:
            ok = h.op == FACTORS
        if not ok:
            return f"unit {h.layer}: op {h.op} from worker {sender} is not this worker's to take"
        if h.round not in rounds:
            return f"unit {h.layer}: round {h.round}, expected {rounds[0]}"
        k, m, n, dtype = self._shapes[h.layer]
        rows = self._rows(unit, h.op)
        return arrays_are(msg, [((rows, n), dtype), ((rows, m), dtype)])

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        got = self._got.get((unit.id, rnd), {})
        if not self.levels:
            return [(WORKER, r) for r in range(self.host.world) if r not in got]
        if not self._is_leader(unit):
            return [(WORKER, self._leader(unit, self.machine))]
        return [(WORKER, r) for r in self.machines[self.machine] if r not in got] + [
            (WORKER, self._leader(unit, m)) for m in range(len(self.machines))
            if f"m{m}" not in got and m != self.machine]

    def largest_frame(self) -> int:
        return max((self.host.world * k * max(m, n) * np.dtype(d).itemsize
                    for k, m, n, d in self._shapes.values()), default=0)

    def _rebuild(self, unit: Unit, rnd: int, blocks: list[list[np.ndarray]]) -> None:
        key = (unit.id, rnd)
        del self._got[key]
        self._started.discard(key)
        bits = self._bits.pop(key)
        tl = timeline.current
        start = tl.now()
        # One order on every worker: the very same matrices, so results are bit-identical.
        u = np.concatenate([b[0] for b in blocks]) if len(blocks) > 1 else blocks[0][0]
        v = np.concatenate([b[1] for b in blocks]) if len(blocks) > 1 else blocks[0][1]
        [slot] = unit.layers
        slot.rebuild(u, v)  # type: ignore[misc]
        if tl.active:
            tl.complete(f"rebuild {unit.name}", "rebuild", start, {"round": rnd})
        self.host.done(unit, rnd, bits)
