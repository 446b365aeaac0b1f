"""Layers that move, copy, split, join, select or reshape data without arithmetic on it:
Concat, Slice, Split, Silence, Flatten and Reshape (views of their bottom: no copy), Tile,
BatchReindex, Filter and Parameter (a learnable blob as a top). Each computes what BVLC Caffe
1.0 computes, with one array code path for NumPy and CuPy (``xp``).
"""
from __future__ import annotations

from typing import Sequence

from .. import backend
from ..blob import Blob
from .axes import axis_slice, canonical_axis, legacy_axis, row_indices, scatter_add_rows
from .base import Layer, register


@register("Concat", "CONCAT")
class ConcatLayer(Layer):
    """Joins its bottoms along ``axis`` (legacy ``concat_dim``)."""

    min_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.axis = legacy_axis(self, bottom[0], self.param.concat_param, "concat_dim")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        first = bottom[0].shape
        total = 0
        for i, b in enumerate(bottom):
            s = b.shape
            if len(s) != len(first) or s[:self.axis] + s[self.axis + 1:] != \
                    first[:self.axis] + first[self.axis + 1:]:
                raise self.fail(f"bottom {i} has shape {s}, bottom 0 has {first}: all dims "
                                f"but axis {self.axis} must match")
            total += s[self.axis]
        top[0].reshape(first[:self.axis] + (total,) + first[self.axis + 1:])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(top[0].data)
        xp.concatenate([b.data for b in bottom], axis=self.axis, out=top[0].data)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        offset = 0
        for b, down in zip(bottom, propagate_down):
            n = b.shape[self.axis]
            if down:
                b.diff[...] = top[0].diff[axis_slice(self.axis, offset, offset + n)]
            offset += n

@register("Slice", "SLICE")
class SliceLayer(Layer):
    """Cuts its bottom along ``axis`` (legacy ``slice_dim``) at ``slice_point``s, or into
    equal parts when none are given."""

    exact_num_bottoms = 1
    min_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.slice_param
        self.axis = legacy_axis(self, bottom[0], p, "slice_dim")
        self.slice_points = list(p.slice_point)
        if self.slice_points and len(self.slice_points) != len(top) - 1:
            raise self.fail(f"{len(self.slice_points)} slice_point(s) for {len(top)} tops; "
                            f"need one fewer than the tops")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        dim = shape[self.axis]
        if self.slice_points:
            bounds = [0] + self.slice_points + [dim]
            if any(b >= e for b, e in zip(bounds, bounds[1:])):
                raise self.fail(f"slice_point {self.slice_points} must increase strictly "
                                f"within (0, {dim}) (bottom shape {shape}, axis {self.axis})")
        else:
            if dim % len(top):
                raise self.fail(f"cannot slice axis {self.axis} of size {dim} into "
                                f"{len(top)} equal parts; give slice_point")
            step = dim // len(top)
            bounds = list(range(0, dim + 1, step))
        self.bounds = bounds
        for t, (b, e) in zip(top, zip(bounds, bounds[1:])):
            t.reshape(shape[:self.axis] + (e - b,) + shape[self.axis + 1:])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t, (b, e) in zip(top, zip(self.bounds, self.bounds[1:])):
            t.data[...] = bottom[0].data[axis_slice(self.axis, b, e)]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            xp = backend.get_array_module(bottom[0].diff)
            xp.concatenate([t.diff for t in top], axis=self.axis, out=bottom[0].diff)

@register("Split", "SPLIT")
class SplitLayer(Layer):
    """Hands one blob to several consumers: copies forward, sums the diffs backward."""

    exact_num_bottoms = 1
    min_tops = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t in top:
            if t is bottom[0]:
                raise self.fail("does not allow in-place computation")
            t.reshape(bottom[0].shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t in top:
            t.data[...] = bottom[0].data

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(bottom[0].diff)
        if len(top) == 1:
            bottom[0].diff[...] = top[0].diff
            return
        xp.add(top[0].diff, top[1].diff, out=bottom[0].diff)
        for t in top[2:]:
            bottom[0].diff += t.diff

@register("Silence", "SILENCE")
class SilenceLayer(Layer):
    """Swallows its bottoms (so they are not net outputs); their diff is zero."""

    min_bottoms = 1
    exact_num_tops = 0

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff[...] = 0

class _ViewLayer(Layer):
    """A layer whose top is its bottom under another shape, sharing memory (no copy).

    The top's data is a view of the bottom's data; in backward the bottom's diff becomes a
    view of the top's diff. The top keeps a diff array of its own until then, so whoever
    writes the top diff never clobbers a bottom diff that is still being read.
    """

    exact_num_bottoms = 1
    exact_num_tops = 1

    def top_shape(self, bottom: Blob) -> tuple[int, ...]:
        raise NotImplementedError

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if top[0] is bottom[0]:
            raise self.fail("does not allow in-place computation")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = self.top_shape(bottom[0])
        self._top_dims = shape
        t = top[0]
        t.data = bottom[0].data.reshape(shape)
        if t.diff.shape != shape:
            xp = backend.get_array_module(t.data)
            t.diff = (t.diff.reshape(shape) if t.diff.size == t.data.size
                      else xp.zeros_like(t.data))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        # re-view each pass: an upstream layer may have rebound its array since reshape
        top[0].data = bottom[0].data.reshape(self._top_dims)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            bottom[0].diff = top[0].diff.reshape(bottom[0].shape)

@register("Flatten", "FLATTEN")
class FlattenLayer(_ViewLayer):
    """Collapses dims ``axis`` .. ``end_axis`` (inclusive) into one."""

    def top_shape(self, bottom: Blob) -> tuple[int, ...]:
        p = self.param.flatten_param
        start = canonical_axis(self, bottom, p.axis)
        end = canonical_axis(self, bottom, p.end_axis)
        if end < start:
            raise self.fail(f"end_axis {p.end_axis} comes before axis {p.axis} "
                            f"for bottom shape {bottom.shape}")
        s = bottom.shape
        return s[:start] + (bottom.count_range(start, end + 1),) + s[end + 1:]

@register("Reshape")
class ReshapeLayer(_ViewLayer):
    """Caffe's Reshape: ``shape`` replaces dims [axis, axis + num_axes) of the bottom;
    a 0 copies the bottom's dim at that place, one -1 is inferred from the count."""

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().setup(bottom, top)
        dims = list(self.param.reshape_param.shape.dim)
        if any(d < -1 for d in dims):
            raise self.fail(f"reshape_param.shape {dims}: dims must be >= -1")
        if dims.count(-1) > 1:
            raise self.fail(f"reshape_param.shape {dims}: at most one -1 (inferred) dim")
        self.dims = dims

    def top_shape(self, bottom: Blob) -> tuple[int, ...]:
        p = self.param.reshape_param
        n = bottom.num_axes()
        # axis may equal num_axes (append at the end); -1 means "after the last axis"
        start = p.axis if p.axis >= 0 else n + p.axis + 1
        if not 0 <= start <= n:
            raise self.fail(f"reshape_param.axis {p.axis} out of range for bottom shape "
                            f"{bottom.shape}")
        if p.num_axes < -1:
            raise self.fail(f"reshape_param.num_axes must be >= -1, got {p.num_axes}")
        end = n if p.num_axes == -1 else start + p.num_axes
        if end > n:
            raise self.fail(f"reshape_param axis {p.axis} + num_axes {p.num_axes} exceeds "
                            f"the bottom's {n} axes (shape {bottom.shape})")
        new = []
        for i, d in enumerate(self.dims):
            if d == 0:
                if start + i >= n:
                    raise self.fail(f"shape dim {i} is 0 (copy) but the bottom shape "
                                    f"{bottom.shape} has no axis {start + i}")
                d = bottom.shape[start + i]
            new.append(d)
        s = bottom.shape
        if -1 in new:
            known = bottom.count_range(0, start) * bottom.count_range(end)
            for d in new:
                known *= d if d != -1 else 1
            if known == 0 or bottom.count % known:
                raise self.fail(f"cannot infer the -1 dim of {self.dims}: bottom count "
                                f"{bottom.count} (shape {s}) is not a multiple of {known}")
            new[new.index(-1)] = bottom.count // known
        shape = s[:start] + tuple(new) + s[end:]
        count = 1
        for d in shape:
            count *= d
        if count != bottom.count:
            raise self.fail(f"cannot reshape bottom {s} (count {bottom.count}) to {shape} "
                            f"(count {count})")
        return shape

@register("Tile")
class TileLayer(Layer):
    """Repeats the bottom ``tiles`` times along ``axis``: for each index of the dims before
    ``axis``, the whole block of the dims from ``axis`` on is copied ``tiles`` times."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.tile_param
        if not p.HasField("tiles"):
            raise self.fail("tile_param.tiles (the number of copies) must be given")
        if p.tiles <= 0:
            raise self.fail(f"tile_param.tiles must be positive, got {p.tiles}")
        self.tiles = p.tiles

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        axis = canonical_axis(self, bottom[0], self.param.tile_param.axis)
        s = bottom[0].shape
        self.outer, self.inner = bottom[0].count_range(0, axis), bottom[0].count_range(axis)
        top[0].reshape(s[:axis] + (s[axis] * self.tiles,) + s[axis + 1:])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        y = top[0].data.reshape(self.outer, self.tiles, self.inner)
        y[...] = bottom[0].data.reshape(self.outer, 1, self.inner)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            dy = top[0].diff.reshape(self.outer, self.tiles, self.inner)
            dy.sum(axis=1, out=bottom[0].diff.reshape(self.outer, self.inner))

@register("BatchReindex")
class BatchReindexLayer(Layer):
    """``top[i] = bottom0[int(bottom1[i])]`` along the first axis: selects, reorders or
    repeats the items of a batch. The gradient sums back into every item picked; the index
    bottom (1 axis, values in [0, num)) takes none."""

    exact_num_bottoms = 2
    exact_num_tops = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[1].num_axes() != 1:
            raise self.fail(f"the index bottom must have 1 axis, got shape {bottom[1].shape}")
        if bottom[0].num_axes() < 1:
            raise self.fail("bottom 0 needs a first (batch) axis to index, got a scalar")
        top[0].reshape(bottom[1].shape[:1] + bottom[0].shape[1:])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._index = row_indices(self, bottom[1].data, bottom[0].shape[0], "index",
                                   whole=False)
        top[0].data[...] = bottom[0].data[self._index]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[1]:
            raise self.fail("cannot backpropagate to the index bottom (bottom 1)")
        if not propagate_down[0]:
            return
        inner = bottom[0].count_range(1)
        dx = bottom[0].diff.reshape(bottom[0].shape[0], inner)
        dx[...] = 0
        scatter_add_rows(dx, self._index, top[0].diff.reshape(self._index.size, inner))

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index == 0

@register("Filter")
class FilterLayer(Layer):
    """Keeps the items (first axis) whose selector, the last bottom, is nonzero: top i gets
    those items of bottom i. The selector's dims after the first must be 1; it takes no
    gradient, and the items filtered out get a zero one.

    As in Caffe, the tops get the full batch size at the first reshape (setup, before the
    selector holds data) and the kept items' count at every reshape after that.
    """

    min_bottoms = 2
    min_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if len(top) != len(bottom) - 1:
            raise self.fail(f"needs one top per bottom to filter (all bottoms but the last, "
                            f"the selector): {len(bottom) - 1} to filter, {len(top)} tops")
        self.selector = len(bottom) - 1
        self._first_reshape = True

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        sel = bottom[self.selector]
        if sel.num_axes() < 1 or any(d != 1 for d in sel.shape[1:]):
            raise self.fail(f"the selector (last bottom) must be (N, 1, ...) with every dim "
                            f"after the first 1, got shape {sel.shape}")
        num = sel.shape[0]
        for i, b in enumerate(bottom[:self.selector]):
            if b.num_axes() < 1 or b.shape[0] != num:
                raise self.fail(f"bottom {i} has shape {b.shape}; its first dim must equal "
                                f"the selector's {num}")
        xp = backend.get_array_module(sel.data)
        self.kept = xp.flatnonzero(sel.data.reshape(-1))
        if self._first_reshape:
            self._first_reshape = False
        else:
            num = int(self.kept.size)
        for t, b in zip(top, bottom):
            t.reshape((num,) + b.shape[1:])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t, b in zip(top, bottom):
            # the first reshape's full size, when no reshape came between setup and here
            t.reshape((self.kept.size,) + b.shape[1:])
            t.data[...] = b.data[self.kept]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[self.selector]:
            raise self.fail(f"cannot backpropagate to the selector (bottom {self.selector})")
        for t, b, down in zip(top, bottom, propagate_down):
            if down:
                b.diff[...] = 0
                b.diff[self.kept] = t.diff

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != self.selector

@register("Parameter")
class ParameterLayer(Layer):
    """Outputs its one parameter blob, of ``parameter_param.shape`` (zeros until trained or
    loaded). The top's data is the parameter's array itself, as in Caffe, so nothing is
    copied; the top keeps its own diff, which backward adds into the parameter's (Caffe
    shares the diff too, which a consumer then overwrites rather than accumulates, so it
    would lose all but the last pass of iter_size)."""

    exact_num_bottoms = 0
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        dims = list(self.param.parameter_param.shape.dim)
        if any(d < 0 for d in dims):
            raise self.fail(f"parameter_param.shape {dims}: dims must be >= 0")
        xp = backend.get_array_module(top[0].data)
        self.blobs = [Blob(dims, dtype=top[0].dtype, xp=xp, name=f"{self.name}/0")]
        self.param_propagate_down = [True]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        t, w = top[0], self.blobs[0]
        t.data = w.data
        if t.diff.shape != w.shape or t.diff.dtype != w.dtype:
            t.diff = backend.get_array_module(w.data).zeros_like(w.data)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        # again each pass: the Net may have swapped in a shared or loaded blob since reshape
        self.reshape(bottom, top)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if self.param_propagate_down[0]:
            self.blobs[0].diff += top[0].diff
