"""Wire codecs: how a dense scheme's vectors look on the wire, and what a round sums.

A codec composes with any scheme that sums dense vectors (PS, ring): the scheme asks it for
the vectors a round sums (``vectors``), encodes what it sends and decodes what it receives,
and hands a unit's round to ``reduce``, which calls the scheme's ``sum_vector`` one or more
times and finally ``finish`` with the summed gradient. Sums are always accumulated in float32.

- ``fp32``: the gradients as they are;
- ``fp16``: half the bytes. Values are multiplied by a per-unit scale before rounding (small
  gradients stay normal numbers). A sum that overflows raises OVERFLOW_BIT in the round's
  messages; every worker sees it (the bits are ORed along the way), skips that unit's update
  for the round, halves the unit's scale and counts the skip. After ``GROW_AFTER`` clean rounds
  the scale doubles again. The scale depends only on those bits, so it is the same everywhere.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .schemes.base import OVERFLOW_BIT, Unit

#: sum_vector(unit, rnd, phase, vec, bits, on_done(total, bits))
SumVector = Callable[[Unit, int, int, np.ndarray, int, Callable[[np.ndarray, int], None]], None]
Finish = Callable[[np.ndarray, int], None]


class Codec:
    """The identity codec: float32 on the wire."""

    name = "fp32"
    wire_dtype = np.dtype("<f4")

    def vectors(self, count: int) -> dict[int, int]:
        """phase -> length of the vector each round sums for a unit of ``count`` values."""
        return {0: count}

    def encode(self, unit_id: int, x: np.ndarray) -> tuple[np.ndarray, int]:
        """``x`` (float32) as it goes on the wire, and the flag bits it raises."""
        return x, 0

    def decode(self, unit_id: int, a: np.ndarray) -> np.ndarray:
        """A received array as float32 (a view when nothing needs converting)."""
        return a

    def roundtrip(self, unit_id: int, x: np.ndarray) -> tuple[np.ndarray, int]:
        """What a peer gets when ``x`` is sent: the sender keeps exactly that (replicas stay
        bit-identical)."""
        return x, 0

    def reduce(self, unit: Unit, rnd: int, vec: np.ndarray, bits: int, sum_vector: SumVector,
               finish: Finish) -> None:
        """Sum ``vec`` (the unit's local gradients) over the workers, then ``finish``."""
        sum_vector(unit, rnd, 0, vec, bits, finish)

    def after_round(self, unit_id: int, bits: int) -> bool:
        """Called once per unit and round with the agreed bits; False: skip this update."""
        return True

    def report(self) -> dict[str, float]:
        return {}

    @classmethod
    def from_plan(cls, plan: Any) -> "Codec":
        return cls()


class Fp16Codec(Codec):
    name = "fp16"
    wire_dtype = np.dtype("<f2")
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
        return h, 0 if np.isfinite(h).all() else OVERFLOW_BIT

    def decode(self, unit_id: int, a: np.ndarray) -> np.ndarray:
        out = a.astype(np.float32)
        out /= np.float32(self.scale(unit_id))
        return out

    def roundtrip(self, unit_id: int, x: np.ndarray) -> tuple[np.ndarray, int]:
        h, bits = self.encode(unit_id, x)
        return self.decode(unit_id, h), bits

    def after_round(self, unit_id: int, bits: int) -> bool:
        if bits & OVERFLOW_BIT:
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


CODECS: dict[str, type[Codec]] = {"fp32": Codec, "fp16": Fp16Codec}


def make_codec(name: str, plan: Any = None) -> Codec:
    """The codec ``name``; ``plan`` (a poseidon.Plan) carries its settings."""
    if name not in CODECS:
        raise ValueError(f"--wire must be one of {', '.join(CODECS)}, got {name!r}")
    return CODECS[name].from_plan(plan)
