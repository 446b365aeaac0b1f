"""``fp16``: half the bytes on the wire.

Values are multiplied by a per-unit scale before rounding (small gradients stay normal
numbers). A sum that overflows raises the REQUEST_OVERFLOW bit in the round's messages; every
worker sees it
(the bits are ORed along the way), skips that unit's update for the round, halves the unit's
scale and counts the skip. After ``GROW_AFTER`` clean rounds the scale doubles again. The scale
depends only on those bits, so it is the same everywhere.
"""
from __future__ import annotations

import numpy as np

from engine.pb import poseidon_pb2 as pb

from .base import Codec


class Fp16Codec(Codec):
    name = "fp16"
    wire_dtype = np.dtype("<f2")
    watches_rounds = True  # the loss scale halves on an overflow, grows after clean rounds
    INITIAL_SCALE = 2.0 ** 8
    MAX_SCALE = 2.0 ** 16
    GROW_AFTER = 1000

    def __init__(self) -> None:
        self._scale: dict[int, float] = {}
        self._clean: dict[int, int] = {}
        self.skipped = 0

    def scale(self, unit_id: int) -> float:
        return self._scale.get(unit_id, self.INITIAL_SCALE)

    def encode(self, unit_id: int, x: np.ndarray) -> tuple[np.ndarray, int]:
        with np.errstate(over="ignore", invalid="ignore"):
            h = (x * np.float32(self.scale(unit_id))).astype(np.float16)
        return h, 0 if np.isfinite(h).all() else pb.REQUEST_OVERFLOW

    def decode(self, unit_id: int, a: np.ndarray) -> np.ndarray:
        out = a.astype(np.float32)
        out /= np.float32(self.scale(unit_id))
        return out

    def roundtrip(self, unit_id: int, x: np.ndarray) -> tuple[np.ndarray, int]:
        h, bits = self.encode(unit_id, x)
        return self.decode(unit_id, h), bits

    def after_round(self, unit_id: int, bits: int) -> bool:
        if bits & pb.REQUEST_OVERFLOW:
            self._scale[unit_id] = self.scale(unit_id) / 2
            self._clean[unit_id] = 0
            self.skipped += 1
            return False
        n = self._clean.get(unit_id, 0) + 1
        if n >= self.GROW_AFTER and self.scale(unit_id) < self.MAX_SCALE:
            self._scale[unit_id] = self.scale(unit_id) * 2
            n = 0
        self._clean[unit_id] = n
        return True

    def report(self) -> dict[str, float]:
        return {"fp16_skipped_updates": self.skipped,
                "fp16_min_scale": min(self._scale.values(), default=self.INITIAL_SCALE)}
