"""A unit's gradients as one vector: diffs placed in it are gathered without a copy, a diff
that something else holds stays where it is, and an elastic job's next generation sums in the
vector its diffs lie in already."""
from __future__ import annotations

import numpy as np

from engine.comm.units import (LayerSlot, ParamSlot, Unit, gather, in_place, place_diffs,
                               placed_vector, scatter_mean)


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

    vec *= 2  # the sum of two workers, then the mean back into every diff
    scatter_mean(unit, vec, 2, vec)
    for b, want in zip(blobs, (2, 3, 3)):
        np.testing.assert_array_equal(b.diff, np.full(b.diff.shape, want, np.float32))
    assert held[0, 0] == 3  # the held view sees its diff's mean


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


def test_the_mean_over_a_power_of_two_multiplies_and_keeps_every_bit():
    """``mean_into`` multiplies by 1/P when P is a power of two (exact, and 2.3x faster than
    a divide here): the bits equal the divide's for every float, subnormals, infinities and
    NaN included; any other P divides."""
    from engine.comm.units import mean_into
    rng = np.random.default_rng(0)
    for dtype, bits in ((np.float32, np.uint32), (np.float64, np.uint64)):
        info = np.finfo(dtype)
        scales = np.repeat([1e-40, 1.0, 1e30, float(info.max) / 16], 10000)
        x = (rng.standard_normal(40000) * scales).astype(dtype)
        x[:9] = [0.0, -0.0, np.inf, -np.inf, np.nan, info.tiny, info.smallest_subnormal,
                 3 * info.smallest_subnormal, info.max]
        for world in (1, 2, 4, 8, 64, 3, 6):
            got, want = np.empty_like(x), np.empty_like(x)
            mean_into(x, world, got)
            np.divide(x, world, out=want)
            assert got.dtype == dtype
            assert np.array_equal(got.view(bits), want.view(bits)), (dtype, world)
    # a changed division would show: 1/3 is not exact, so a multiply by it differs
    y = np.float32([1.0, 7.0, 10.0])
    assert not np.array_equal(y * np.float32(1 / 3), y / np.float32(3))
