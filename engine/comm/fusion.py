"""Fusion (GradientFlow's lazy allreduce, Horovod's tensor fusion): small layers travel together.

Backward releases layers top-down. Consecutive layers synchronised by the same dense scheme
(PS, ring, hd) are packed into one bucket, one operation per round, until the bucket would hold
more than ``fusion_bytes`` or its first layer would wait longer than ``fusion_s`` for its last (by
the estimated backward times of the layers in between). A bucket travels the moment its last
layer is released; the end of backward is a bucket's end too. Buckets are fixed for the whole
run and chosen by rank 0, so every worker packs the same layers (a ring needs that).
Non-dense schemes (SFB) never fuse.
"""
from __future__ import annotations

from typing import Sequence


def buckets(layers: Sequence[tuple[int, str, int, bool]], fusion_bytes: int,
            fusion_s: float = float("inf"), backward_s: Sequence[float] | None = None
            ) -> list[tuple[list[int], str]]:
    """``layers``: (layer index, scheme, gradient bytes, dense) of every synchronised layer.
    Returns the units as ([layer indices in release order], scheme), in release order."""
    units: list[tuple[list[int], str]] = []
    size = 0
    for layer, scheme, nbytes, dense in sorted(layers, key=lambda t: -t[0]):
        if units and dense and fusion_bytes > 0:
            members, s = units[-1]
            if s == scheme and size + nbytes <= fusion_bytes and \
                    _wait(backward_s, layer, members[0]) <= fusion_s and _dense_unit(units[-1], layers):
                members.append(layer)
                size += nbytes
                continue
        units.append(([layer], scheme))
        size = nbytes
    return units


def _dense_unit(unit: tuple[list[int], str], layers: Sequence[tuple[int, str, int, bool]]) -> bool:
    dense = {t[0]: t[3] for t in layers}
    return all(dense[l] for l in unit[0])


def _wait(backward_s: Sequence[float] | None, layer: int, first: int) -> float:
    """Estimated seconds from the release of layer ``first`` to that of ``layer`` (< first):
    the backward of the layers in between and of ``layer`` itself."""
    if backward_s is None:
        return 0.0
    return sum(backward_s[layer:first])
