"""Sufficient-factor broadcasting (Poseidon's SFB) for fully connected layers.

A fully connected layer's weight gradient over a batch of K rows is ``uᵀ·v`` (``vᵀ·u`` for a
transposed weight) with u the top diff (K x N) and v the bottom data (K x M); its bias gradient
is the sum of u's rows. Each worker broadcasts (u, v) to every peer and rebuilds
``Σ_p u_pᵀ v_p`` from the factors concatenated in rank order, so every replica forms the very
same matrices and the result is bit-identical. The layer skips its own weight-gradient GEMM
(``LayerSlot.defer_weight_gradient``): the rebuild overwrites it.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine import backend
from engine.perf import timeline

from ..transport import WORKER, Message, PeerId
from .base import Device, LayerSlot, LayerTiming, Scheme, Unit, arrays_are

FACTORS = 0


class SFB(Scheme):
    name = "sfb"
    dense = False

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int) -> None:
        super().__init__(host, units, chunk_bytes)
        self._shapes: dict[int, list[tuple[tuple[int, ...], str]]] = {}
        for u in units:
            [slot] = u.layers
            k, m, n = slot.factor_shape  # type: ignore[misc]
            dtype = np.dtype(slot.params[0].blob.diff.dtype).str
            self._shapes[u.id] = [((k, n), dtype), ((k, m), dtype)]
            if slot.defer_weight_gradient is not None:
                slot.defer_weight_gradient(True)
        #: (unit, round) -> rank -> (u, v); the bits the round's messages carried
        self._got: dict[tuple[int, int], dict[int, list[np.ndarray]]] = {}
        self._bits: dict[tuple[int, int], int] = {}
        self._started: set[tuple[int, int]] = set()

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
        one_way = link.alpha_s + link.beta_s_per_byte * sent
        return LayerTiming(info.name, cls.name, sent, recv, one_way, one_way, 0.0, 0.0,
                           rebuild + (0.0 if device.update_on_device else update), update)

    def capture(self, unit: Unit) -> list[np.ndarray]:
        # copies: the next forward may overwrite the layer's input before they are sent
        [slot] = unit.layers
        return [np.array(backend.to_numpy(a), copy=True) for a in slot.factors()]  # type: ignore[misc]

    def start(self, unit: Unit, rnd: int, bits: int, captured: Any) -> None:
        host = self.host
        peers = [(WORKER, r) for r in range(host.world) if r != host.rank]
        host.send(unit, peers, self.header(unit, rnd, FACTORS, bits), captured)
        key = (unit.id, rnd)
        self._got.setdefault(key, {})[host.rank] = captured
        self._bits[key] = self._bits.get(key, 0) | bits
        self._started.add(key)
        self._maybe_rebuild(unit, rnd)

    def check(self, msg: Message, rounds: tuple[int, int]) -> str | None:
        h = msg.header
        if h.op != FACTORS or msg.sender[0] != WORKER or msg.sender[1] == self.host.rank:
            return f"unit {h.layer}: not sufficient factors from a peer (op {h.op})"
        if h.round not in rounds:
            return f"unit {h.layer}: round {h.round}, expected {rounds[0]}"
        return arrays_are(msg, self._shapes[h.layer])

    def receive(self, msg: Message) -> None:
        h = msg.header
        key = (h.layer, h.round)
        got = self._got.setdefault(key, {})
        if msg.sender[1] in got:
            raise RuntimeError(f"second set of factors of unit {h.layer} round {h.round} from "
                               f"worker {msg.sender[1]}")
        got[msg.sender[1]] = msg.arrays
        self._bits[key] = self._bits.get(key, 0) | h.request
        self._maybe_rebuild(self.units[h.layer], h.round)

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        got = self._got.get((unit.id, rnd), {})
        return [(WORKER, r) for r in range(self.host.world) if r not in got]

    def largest_frame(self) -> int:
        return max((int(np.prod(s)) * np.dtype(d).itemsize for shapes in self._shapes.values()
                    for s, d in shapes), default=0)

    def _maybe_rebuild(self, unit: Unit, rnd: int) -> None:
        key = (unit.id, rnd)
        got = self._got[key]
        if key not in self._started or len(got) < self.host.world:
            return
        del self._got[key]
        self._started.discard(key)
        bits = self._bits.pop(key)
        world = self.host.world
        tl = timeline.current
        start = tl.now()
        # Rank order: every replica forms the very same matrices, so results are bit-identical.
        u = np.concatenate([got[r][0] for r in range(world)])
        v = np.concatenate([got[r][1] for r in range(world)])
        [slot] = unit.layers
        for p in slot.params:
            if p.role == "weight":
                g = u.T @ v
            elif p.role == "weight_t":
                g = v.T @ u
            elif p.role == "bias":
                g = u.sum(axis=0)
            else:
                raise RuntimeError(f"layer {slot.name}: parameter {p.name} cannot be rebuilt "
                                   "from sufficient factors")
            g /= world
            xp = backend.get_array_module(p.blob.diff)
            p.blob.diff[...] = xp.asarray(g.reshape(p.blob.diff.shape), dtype=p.blob.diff.dtype)
        if tl.active:
            tl.complete(f"rebuild {unit.name}", "rebuild", start, {"round": rnd})
        self.host.done(unit, rnd, bits)
