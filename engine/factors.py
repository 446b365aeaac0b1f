"""The sufficient-factor contract: what a layer offers the communicator so that SFB can send
two small factors instead of its weight gradient (Poseidon's sufficient-factor broadcasting).

A layer declares it by deriving from ``SufficientFactors`` (engine/layers/inner_product.py),
and rebuilds its own gradient from every worker's factors: the arithmetic stays the layer's, on
its device (replayed compute, engine/perf/replay.py, waits instead). The communicator (engine/comm/bind.py) asks ``isinstance(layer, SufficientFactors)`` and knows
no layer class. Below both.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FactorSpec:
    """A weight gradient as sufficient factors: u (k x n, the top diff) and v (k x m, the
    bottom data); the gradient is uᵀ·v, or vᵀ·u when ``transposed`` (the weight is m x n)."""
    k: int
    m: int
    n: int
    transposed: bool


class SufficientFactors(ABC):
    """A layer whose weight gradient is the product of two factors of its last backward."""

    #: set by a communicator that rebuilds the weight gradient from the factors (SFB):
    #: backward then skips its own weight-gradient product
    defer_weight_gradient: bool = False

    @abstractmethod
    def factor_spec(self) -> FactorSpec:
        """The shapes and orientation of the factors (after reshape)."""

    @abstractmethod
    def sufficient_factors(self) -> tuple[Any, Any]:
        """(u, v) of the last backward, views valid until the next forward."""

    @abstractmethod
    def remember_factors(self, top: Any, bottom: Any) -> None:
        """Take this pass's factors without computing the gradient (replayed compute)."""

    @abstractmethod
    def rebuild_gradient(self, u: Any, v: Any) -> None:
        """Set the weight gradient, and the bias's if the layer has one, to the sum over the
        workers from their factors: ``u`` and ``v`` hold every worker's rows, in
        an order every worker shares, so every replica computes the very same bits. On the
        device the parameters live on (the layer's work, as its backward is)."""
