"""A unit's gradients as one vector: diffs placed in it are gathered without a copy, a diff
that something else holds stays where it is, an elastic job's next generation sums in the
vector its diffs lie in already, and where a diff lies is known without asking NumPy twice."""
from __future__ import annotations

import numpy as np

from engine.comm import units
from engine.comm.units import (LayerSlot, ParamSlot, Placed, Unit, gather, in_place, lies_at,
                               place_diffs, placed_vector, scatter_sum)


class Blob:
    def __init__(self, shape: tuple[int, ...], v: float) -> None:
        self.data = np.zeros(shape, np.float32)
        self.diff = np.full(shape, v, np.float32)


def test_placed_diffs_are_gathered_in_place_and_a_held_diff_is_copied():
    blobs = [Blob((3, 2), 1.0), Blob((4,), 2.0), Blob((2, 2), 3.0)]
    held = blobs[1].diff.reshape(2, 2)  # a view of it, as a PERMISSIVE shared parameter's
    unit = Unit([LayerSlot(0, "a", [ParamSlot(0, "a/0", blobs[0]), ParamSlot(1, "a/1", blobs[1])]),
                 LayerSlot(1, "b", [ParamSlot(2, "b/0", blobs[2])])], "gloo")
    vec = np.empty(unit.count, np.float32)
    assert place_diffs(unit, vec) == 2
    assert np.shares_memory(blobs[0].diff, vec) and np.shares_memory(blobs[2].diff, vec)
    assert not np.shares_memory(blobs[1].diff, vec) and np.shares_memory(held, blobs[1].diff)
    assert blobs[0].diff.shape == (3, 2) and blobs[2].diff.shape == (2, 2)

    blobs[0].diff[...] += 1  # backward accumulates into the placed diffs
    blobs[1].diff[...] += 1
    got = gather(unit, vec)
    assert got is vec
    np.testing.assert_array_equal(vec, [2] * 6 + [3] * 4 + [3] * 4)

    total = vec * 2  # the sum of two workers (a scheme's own vector), back into every diff
    scatter_sum(unit, total)
    for b, want in zip(blobs, (4, 6, 6)):
        np.testing.assert_array_equal(b.diff, np.full(b.diff.shape, want, np.float32))
    assert held[0, 0] == 6  # the held view sees its diff's sum
    vec *= 2  # summed in place: nothing moves
    scatter_sum(unit, vec)
    for b, want in zip(blobs, (8, 6, 12)):
        np.testing.assert_array_equal(b.diff, np.full(b.diff.shape, want, np.float32))


def test_a_next_generation_sums_in_the_vector_its_diffs_lie_in():
    blobs = [Blob((3, 2), 1.0), Blob((4,), 2.0)]
    unit = Unit([LayerSlot(0, "a", [ParamSlot(0, "a/0", blobs[0]), ParamSlot(1, "a/1", blobs[1])])],
                "ring")
    first = placed_vector(unit, behind=4)  # the signal unit of an engine: room for 4 behind
    assert first.size == 14 and in_place(unit, first)
    views = [b.diff for b in blobs]
    # the next generation's scheme (the last one gone): the same vector, nothing moved
    again = placed_vector(unit, behind=4)
    assert again is first and all(b.diff is v for b, v in zip(blobs, views))
    # one that needs other room behind: a new vector, into which views of the old one
    # (not owning their memory) do not move; gathering copies them in
    bigger = placed_vector(unit, behind=8)
    assert bigger is not first and not in_place(unit, bigger)
    np.testing.assert_array_equal(gather(unit, bigger)[:10], [1] * 6 + [2] * 4)
    # nor one for a unit of another length: a bucket the next plan splits is not summed whole
    first_layer = Unit([LayerSlot(0, "a", [ParamSlot(0, "a/0", blobs[0])])], "ring")
    blobs[0].diff = bigger[:6].reshape(3, 2)  # lies at the start of a longer vector
    assert placed_vector(first_layer) is not bigger
    # a vector nobody made so is never taken for one
    other = np.empty(10, np.float32)
    blobs[0].diff = other[:6].reshape(3, 2)
    blobs[1].diff = other[6:]
    assert placed_vector(unit) is not other


def test_a_placement_holds_while_each_blob_keeps_its_placed_diff() -> None:
    """A round sums a placed unit's vector in place, with nothing gathered or scattered,
    only while every blob still holds the diff placed there (a reshape gives it a new one)."""
    blobs = [Blob((3, 2), 1.0), Blob((4,), 2.0)]
    unit = Unit([LayerSlot(0, "a", [ParamSlot(0, "a/0", blobs[0]), ParamSlot(1, "a/1", blobs[1])])],
                "mpi")
    vec = placed_vector(unit, behind=4)
    placed = Placed.of(unit, vec)
    assert placed is not None and placed.vector() is vec
    blobs[1].diff = np.full((4,), 5.0, np.float32)  # the second diff replaced
    assert placed.vector() is None
    np.testing.assert_array_equal(gather(unit, vec)[:10], [1] * 6 + [5] * 4)  # copied in
    # where a diff does not lie in the vector there is no placement to start with
    assert Placed.of(unit, np.empty(14, np.float32)) is None
    # a lone contiguous diff is its own vector: placed with no vector of the scheme's
    lone = Unit([LayerSlot(2, "c", [ParamSlot(0, "c/0", Blob((2, 3), 7.0))])], "mpi")
    flat = Placed.of(lone, None)
    assert flat is not None and np.shares_memory(flat.vector(), lone.params[0].blob.diff)
    lone.params[0].blob.diff = np.zeros((2, 3), np.float32)
    assert flat.vector() is None


def test_lies_at_compares_addresses_of_any_array() -> None:
    """``lies_at``: a view at its offset lies there, a copy or a strided view does not; the
    address of an array that lends no writable buffer (read-only, strided, empty) is read
    NumPy's way and is the same."""
    vec = np.zeros(100, np.float32)
    assert lies_at(vec[10:30], vec, 10)
    assert not lies_at(vec[10:30], vec, 11)
    assert not lies_at(vec[10:30].copy(), vec, 10)
    assert not lies_at(vec[10:30:2], vec, 10)
    for a in (vec, vec[10:30], vec.reshape(10, 10)[2]):
        assert units.address(a) == a.__array_interface__["data"][0]
    frozen = vec[10:]
    frozen.flags.writeable = False
    for a in (frozen, vec[10:30:2], vec[:0]):
        assert units.address(a) == a.__array_interface__["data"][0]
    assert lies_at(frozen[5:], vec, 15) and not lies_at(frozen[5:], vec, 14)
