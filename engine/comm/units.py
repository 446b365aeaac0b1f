"""What the communicator synchronises: a layer's parameters (``ParamSlot``, ``LayerSlot``), the
*unit* that travels as one operation (one layer, or a fusion bucket of layers released by
backward one after the other), and a unit's gradients as one flat vector (``gather``, and
``scatter_sum`` back into the diffs: the solver's update takes the mean, in its own pass).
Below the schemes and the codecs, which both work on units.
"""
from __future__ import annotations

import ctypes
import sys
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from engine import backend


@dataclass
class ParamSlot:
    index: int       # learnable-parameter index
    name: str        # "layer/i"
    blob: Any        # has .data and .diff (numpy or cupy)


@dataclass
class LayerSlot:
    """What the communicator knows of one layer with learnable parameters."""
    layer: int
    name: str
    params: list[ParamSlot]
    #: returns the sufficient factors (u, v) of the last backward; None if the layer has none
    factors: Callable[[], tuple[Any, Any]] | None = None
    #: (K, M, N): u is K x N and v is K x M, the shapes peers' factors are checked against
    factor_shape: tuple[int, int, int] | None = None
    #: tells the layer that its weight gradient is rebuilt from the factors (skip the GEMM)
    defer_weight_gradient: Callable[[bool], None] | None = None
    #: (u, v): sets the layer's gradients to the sum of every worker's from their factors
    rebuild: Callable[[Any, Any], None] | None = None

    @property
    def count(self) -> int:
        return sum(int(p.blob.diff.size) for p in self.params)


@dataclass
class Unit:
    """One synchronisation operation's layers; ``id`` is its lowest layer index (on the wire)."""
    layers: list[LayerSlot]
    scheme: str
    id: int = field(init=False)

    def __post_init__(self) -> None:
        self.id = min(s.layer for s in self.layers)

    # a unit's layers and their parameters' sizes are fixed once it is planned; these are
    # read several times per unit and round on the gradient's path
    @cached_property
    def name(self) -> str:
        return "+".join(s.name for s in self.layers)

    @cached_property
    def params(self) -> list[ParamSlot]:
        return [p for s in self.layers for p in s.params]

    @cached_property
    def count(self) -> int:
        return sum(s.count for s in self.layers)

    @cached_property
    def alone(self) -> bool:
        """One layer: its round starts and is complete at that layer's release."""
        return len(self.layers) == 1

    @property
    def priority(self) -> int:
        """Lower goes first: the next forward needs the lowest layer first."""
        return self.id


def is_view(unit: Unit) -> bool:
    """Whether the unit's gradients are already one flat NumPy vector (one C-contiguous diff)."""
    params = unit.params
    return len(params) == 1 and isinstance(params[0].blob.diff, np.ndarray) \
        and params[0].blob.diff.flags.c_contiguous


def gather(unit: Unit, out: np.ndarray | None = None) -> np.ndarray:
    """The unit's local gradients as one flat host vector: a view of the diff when the unit
    is one C-contiguous NumPy parameter, else copied into ``out`` (allocated if None), but for
    the diffs that already lie there (``place_diffs``)."""
    params = unit.params
    if is_view(unit):
        return params[0].blob.diff.reshape(-1)
    if out is None:
        out = np.empty(unit.count, dtype=np.dtype(params[0].blob.diff.dtype))
    offset = 0
    for p in params:
        diff = p.blob.diff
        n = int(diff.size)
        if not lies_at(diff, out, offset):
            out[offset:offset + n] = backend.to_numpy(diff).reshape(-1)
        offset += n
    return out


def placed_vector(unit: Unit, behind: int = 0) -> np.ndarray:
    """The unit's host vector (with room for ``behind`` values after it) with its NumPy diffs
    placed in it (``place_diffs``). When every diff lies already, in order, in a vector made
    so before for a unit of this length (an elastic job's last generation's, whose diffs are
    views of it now) that vector is the unit's again: nothing moves, so no view of it goes
    stale. (One holding more, a bucket the new plan split, is not: it would be summed whole.)"""
    diff = unit.params[0].blob.diff
    old = diff.base if isinstance(diff, np.ndarray) else None
    dtype = np.dtype(diff.dtype)
    del diff  # a reference held here would keep place_diffs from moving it
    ref = _PLACED.get(id(old))
    if ref is not None and ref() is old and old.size == unit.count + behind \
            and in_place(unit, old):
        return old
    out = np.empty(unit.count + behind, dtype)
    place_diffs(unit, out)
    _PLACED[id(out)] = weakref.ref(out, lambda _, key=id(out): _PLACED.pop(key, None))
    return out


#: id -> each vector ``placed_vector`` made, while it lives
_PLACED: dict[int, weakref.ref] = {}


def in_place(unit: Unit, vec: np.ndarray) -> bool:
    """Whether every diff of the unit lies at its part of ``vec`` (``gather``'s order)."""
    offset = 0
    for p in unit.params:
        if not lies_at(p.blob.diff, vec, offset):
            return False
        offset += int(p.blob.diff.size)
    return True


class Placed:
    """A unit's host vector whose parts its diffs are views of (``placed_vector``'s, or a lone
    contiguous diff's flat view): summing it in place sums the diffs, with nothing gathered
    and nothing scattered, while each blob holds the diff it held when this was made (a
    reshape gives a blob a new diff). Asked every round: identity checks, where ``gather``
    and ``scatter_sum`` ask each diff's address."""
    __slots__ = ("vec", "_blobs", "_diffs", "_blob", "_diff")

    def __init__(self, unit: Unit, vec: np.ndarray) -> None:
        self.vec = vec
        self._blobs = [p.blob for p in unit.params]
        self._diffs = [b.diff for b in self._blobs]
        self._blob, self._diff = self._blobs[0], self._diffs[0]

    @classmethod
    def of(cls, unit: Unit, vec: np.ndarray | None) -> "Placed | None":
        """The unit's placement in ``vec`` (None: the unit's own diff, where it is one flat
        contiguous NumPy diff), or None where its diffs do not all lie there."""
        if vec is None:
            return cls(unit, unit.params[0].blob.diff.reshape(-1)) if is_view(unit) else None
        return cls(unit, vec) if in_place(unit, vec) else None

    def vector(self) -> np.ndarray | None:
        """The vector, while the diffs are still the ones placed in it; else None."""
        if self._blob.diff is not self._diff:  # the first without a loop: most units are one
            return None
        if len(self._blobs) > 1:
            for b, d in zip(self._blobs, self._diffs):
                if b.diff is not d:
                    return None
        return self.vec


def place_diffs(unit: Unit, out: np.ndarray) -> int:
    """Move the unit's NumPy diffs into ``out`` (the unit's vector, in ``gather``'s order),
    each diff becoming a view of its part, so that gathering the unit copies nothing: Caffe's
    multi-GPU path lays its diffs out in one buffer for the same reason. A diff that anything
    else holds (a shared parameter's view of it, say) stays where it is and is copied as
    before. Returns how many diffs moved."""
    # what a diff's reference count is when only its blob holds it (a view of it holds it
    # through its base), measured the same way, since interpreters count differently
    alone = _references(SimpleNamespace(diff=np.empty(1, out.dtype)))
    offset, moved = 0, 0
    for p in unit.params:
        held = _references(p.blob) != alone  # before this loop holds it too
        diff = p.blob.diff
        n = int(diff.size)
        if isinstance(diff, np.ndarray) and diff.flags.owndata and diff.dtype == out.dtype \
                and not held:
            part = out[offset:offset + n]
            part[...] = diff.reshape(-1)
            p.blob.diff = part.reshape(diff.shape)
            moved += 1
        offset += n
    return moved


def _references(blob: Any) -> int:
    diff = blob.diff
    return sys.getrefcount(diff)


def lies_at(diff: Any, vec: np.ndarray, offset: int = 0) -> bool:
    """Whether ``diff`` is the C-contiguous NumPy view of ``vec`` from element ``offset``."""
    if not (isinstance(diff, np.ndarray) and diff.flags.c_contiguous):
        return False
    try:  # ``address``'s way, inlined: a round asks this of its diffs (each call counts cold)
        return _addressof(_c_char(diff)) == _addressof(_c_char(vec)) + offset * vec.itemsize
    except (TypeError, ValueError, BufferError):
        return address(diff) == address(vec) + offset * vec.itemsize


_addressof, _c_char = ctypes.addressof, ctypes.c_char.from_buffer


def address(a: np.ndarray) -> int:
    """The address of an array's first byte. Through ctypes, which asks the array's buffer
    for it in C: NumPy's ``__array_interface__`` builds a dict to say it, a microsecond warm
    and tens once cold, and a round asks it of a fresh view of a diff (``gather``'s) each time.
    An array that lends no simple writable buffer (read-only, strided, empty) says it so."""
    try:
        return _addressof(_c_char(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]


def scatter_sum(unit: Unit, total: np.ndarray) -> None:
    """The summed vector ``total`` into the unit's diffs: nothing to do where a diff is that
    part of it (summed in place), else a copy (to the diff's device, where it has one)."""
    offset = 0
    for p in unit.params:
        diff = p.blob.diff
        n = int(diff.size)
        if not lies_at(diff, total, offset):
            part = total[offset:offset + n]
            diff[...] = backend.get_array_module(diff).asarray(part.reshape(diff.shape),
                                                               dtype=diff.dtype)
        offset += n


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` values cut into ``parts`` contiguous (offset, length) pieces, the first
    ``count % parts`` one longer; some are empty when count < parts."""
    base, extra = divmod(count, parts)
    out, offset = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((offset, n))
        offset += n
    return out
