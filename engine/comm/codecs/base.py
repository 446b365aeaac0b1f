"""The codec interface: how a dense scheme's vectors look on the wire, and what a round sums.

A codec composes with any scheme that sums dense vectors (PS, ring, hd): the scheme asks it for
the vectors a round sums (``vectors``: one per *phase*, so that PS's chunk table stays static),
encodes what it sends and decodes what it receives, and hands a unit's round to ``reduce``,
which calls the scheme's ``sum_vector`` one or more times and finally ``finish`` with the summed
gradient. Sums are always accumulated in float32. ``Codec`` itself is the identity (``fp32``).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from engine.pb import poseidon_pb2 as pb

from ..units import Unit

#: sum_vector(unit, rnd, phase, vec, bits, on_done(total, bits))
SumVector = Callable[[Unit, int, int, np.ndarray, int, Callable[[np.ndarray, int], None]], None]
Finish = Callable[[np.ndarray, int], None]

__all__ = ["Codec", "SumVector", "Finish"]


class Codec:
    """The identity codec: float32 on the wire."""

    name = "fp32"
    wire_dtype = np.dtype("<f4")
    #: ``reduce`` sums the unit's vector itself, once, in phase VALUES: a scheme may gather the
    #: gradients straight into where it sums from
    sums_as_given = True
    #: the momentum this codec applies to the gradients before it sums them (sparse's momentum
    #: correction); 0: none, the solver applies its own
    momentum = 0.0
    #: ``after_round`` must see every dense unit's round (fp16's loss scale): else the syncer
    #: does not call it (a call in every round)
    watches_rounds = False

    def vectors(self, count: int) -> dict[int, int]:
        """phase -> length of the vector each round sums for a unit of ``count`` values."""
        return {pb.PHASE_VALUES: count}

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
        sum_vector(unit, rnd, pb.PHASE_VALUES, vec, bits, finish)

    def after_round(self, unit_id: int, bits: int) -> bool:
        """Called once per unit and round with the agreed bits; False: skip this update."""
        return True

    def describe(self) -> str:
        """One line for the plan table."""
        return self.name

    def report(self) -> dict[str, float]:
        return {}

    @classmethod
    def from_plan(cls, plan: Any) -> "Codec":
        return cls()
