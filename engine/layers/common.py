"""Caffe's "common" layers: Concat, Slice, Split, Flatten, Reshape, Eltwise, Softmax, Silence,
ArgMax, Tile, Reduction, Parameter, BatchReindex, Filter and Embed (InnerProduct, with its
sufficient factors, is inner_product.py).

Every layer computes what BVLC Caffe 1.0 computes, with one array code path for NumPy
and CuPy (``xp``). Reshape and Flatten do not copy: their top is a view of the bottom.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .. import backend
from ..blob import Blob
from ..fillers import fill
from .base import Layer, register


def softmax(x: Any, axis: int, out: Any) -> Any:
    """Softmax of ``x`` along ``axis`` into ``out`` (may be ``x``); the max is subtracted
    first, as Caffe does, so large logits do not overflow."""
    xp = backend.get_array_module(x)
    xmax = x.max(axis=axis, keepdims=True)
    xp.subtract(x, xmax, out=out)
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


def _axis_slice(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    """Index selecting [start, stop) along ``axis`` and everything along the others."""
    return (slice(None),) * axis + (slice(start, stop),)


def _legacy_axis(layer: Layer, blob: Blob, param: Any, legacy: str) -> int:
    """The axis from ``param.axis``, or from the V1-era field ``legacy`` (concat_dim,
    slice_dim) which counts from 0 only."""
    if param.HasField(legacy):
        if param.HasField("axis"):
            raise layer.fail(f"either axis or {legacy} may be given, not both")
        value = getattr(param, legacy)
        if not 0 <= value < blob.num_axes():
            raise layer.fail(f"{legacy} {value} out of range for bottom shape {blob.shape}")
        return value
    return canonical_axis(layer, blob, param.axis)


def canonical_axis(layer: Layer, blob: Blob, axis: int) -> int:
    """``axis`` counted from 0 on ``blob``, or the layer's error naming the shape."""
    try:
        return blob.canonical_axis(axis)
    except ValueError:
        raise layer.fail(f"axis {axis} out of range for bottom shape {blob.shape}") from None


# ---------------------------------------------------------------------------------------
@register("Concat", "CONCAT")
class ConcatLayer(Layer):
    """Joins its bottoms along ``axis`` (legacy ``concat_dim``)."""

    min_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.axis = _legacy_axis(self, bottom[0], self.param.concat_param, "concat_dim")

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
                b.diff[...] = top[0].diff[_axis_slice(self.axis, offset, offset + n)]
            offset += n


@register("Slice", "SLICE")
class SliceLayer(Layer):
    """Cuts its bottom along ``axis`` (legacy ``slice_dim``) at ``slice_point``s, or into
    equal parts when none are given."""

    exact_num_bottoms = 1
    min_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.slice_param
        self.axis = _legacy_axis(self, bottom[0], p, "slice_dim")
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
            t.data[...] = bottom[0].data[_axis_slice(self.axis, b, e)]

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


# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
@register("Eltwise", "ELTWISE")
class EltwiseLayer(Layer):
    """Element-wise PROD, SUM (with per-bottom ``coeff``) or MAX of same-shaped bottoms."""

    min_bottoms = 2
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.eltwise_param
        self.op = p.operation
        self.coeffs = list(p.coeff) or [1.0] * len(bottom)
        if p.coeff and self.op != p.SUM:
            raise self.fail("eltwise_param.coeff is only allowed with operation SUM")
        if len(self.coeffs) != len(bottom):
            raise self.fail(f"{len(p.coeff)} coeff(s) for {len(bottom)} bottoms; "
                            f"give one per bottom")
        self.stable_prod_grad = p.stable_prod_grad
        self.max_idx: Any = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != bottom[0].shape:
                raise self.fail(f"bottom {i} has shape {b.shape}, bottom 0 has "
                                f"{bottom[0].shape}; all must match")
        top[0].reshape(bottom[0].shape)
        if self.op == self.param.eltwise_param.MAX:
            xp = backend.get_array_module(bottom[0].data)
            if self.max_idx is None or self.max_idx.shape != bottom[0].shape:
                self.max_idx = xp.zeros(bottom[0].shape, dtype=xp.int32)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        p = self.param.eltwise_param
        out = top[0].data
        if self.op == p.PROD:
            xp.multiply(bottom[0].data, bottom[1].data, out=out)
            for b in bottom[2:]:
                out *= b.data
        elif self.op == p.SUM:
            xp.multiply(bottom[0].data, self.coeffs[0], out=out)
            for b, c in zip(bottom[1:], self.coeffs[1:]):
                out += b.data if c == 1.0 else b.data * c
        else:
            # Caffe's tie rule: bottom 1 wins a tie with bottom 0, later bottoms never do
            a, b = bottom[0].data, bottom[1].data
            self.max_idx[...] = xp.where(a > b, 0, 1)
            xp.maximum(a, b, out=out)
            for i, blob in enumerate(bottom[2:], 2):
                better = blob.data > out
                self.max_idx[better] = i
                xp.maximum(out, blob.data, out=out)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        xp = backend.get_array_module(top[0].diff)
        p = self.param.eltwise_param
        dy = top[0].diff
        for i, (b, down) in enumerate(zip(bottom, propagate_down)):
            if not down:
                continue
            if self.op == p.PROD:
                if self.stable_prod_grad:
                    others = [o.data for j, o in enumerate(bottom) if j != i]
                    xp.multiply(others[0], dy, out=b.diff)
                    for o in others[1:]:
                        b.diff *= o
                else:
                    xp.divide(top[0].data, b.data, out=b.diff)
                    b.diff *= dy
            elif self.op == p.SUM:
                xp.multiply(dy, self.coeffs[i], out=b.diff)
            else:
                xp.multiply(dy, self.max_idx == i, out=b.diff)


@register("Softmax", "SOFTMAX")
class SoftmaxLayer(Layer):
    """Softmax along ``softmax_param.axis`` (in place allowed)."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.axis = canonical_axis(self, bottom[0], self.param.softmax_param.axis)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        softmax(bottom[0].data, self.axis, top[0].data)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(top[0].diff)
        y, dy = top[0].data, top[0].diff
        dot = (dy * y).sum(axis=self.axis, keepdims=True)
        xp.subtract(dy, dot, out=bottom[0].diff)
        bottom[0].diff *= y


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


@register("ArgMax", "ARGMAX")
class ArgMaxLayer(Layer):
    """Indices (and with ``out_max_val`` the values) of the ``top_k`` largest entries.

    Without ``axis`` each item's values are flattened and the top is (N, 1 or 2, top_k);
    with ``axis`` the top is the bottom with that dim replaced by top_k, holding the
    indices, or the values when ``out_max_val``. Order follows Caffe's sort on
    (value, index) pairs: equal values rank the higher index first.
    """

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.argmax_param
        self.out_max_val = p.out_max_val
        self.top_k = p.top_k
        self.axis = canonical_axis(self, bottom[0], p.axis) if p.HasField("axis") else None
        if self.top_k < 1:
            raise self.fail("argmax_param.top_k must be at least 1")
        span = bottom[0].shape[self.axis] if self.axis is not None else bottom[0].count_range(1)
        if self.top_k > span:
            raise self.fail(f"top_k {self.top_k} exceeds the {span} values it ranks "
                            f"(bottom shape {bottom[0].shape})")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        s = bottom[0].shape
        if self.axis is not None:
            shape = s[:self.axis] + (self.top_k,) + s[self.axis + 1:]
        else:
            # Caffe keeps at least 3 axes and pads the rest with 1s
            shape = (s[0], 2 if self.out_max_val else 1, self.top_k) + (1,) * (len(s) - 3)
        top[0].reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        x = bottom[0].data
        rows = (xp.moveaxis(x, self.axis, -1) if self.axis is not None
                else x.reshape(x.shape[0], -1))
        dim = rows.shape[-1]
        # a stable sort of the reversed row puts the higher index first among equals
        order = xp.argsort(-rows[..., ::-1], axis=-1, kind="stable")[..., :self.top_k]
        idx = dim - 1 - order
        if self.axis is not None:
            out = xp.take_along_axis(rows, idx, axis=-1) if self.out_max_val else idx
            top[0].data[...] = xp.moveaxis(out, -1, self.axis)
            return
        t = top[0].data.reshape(x.shape[0], -1, self.top_k)
        t[:, 0, :] = idx
        if self.out_max_val:
            t[:, 1, :] = xp.take_along_axis(rows, idx, axis=-1)


# ---------------------------------------------------------------------------------------
def _row_indices(layer: Layer, values: Any, limit: int, what: str, whole: bool) -> Any:
    """Index-valued data as integers, Caffe's static_cast<int> (truncation), after checking
    every value lies in [0, ``limit``) and, with ``whole``, is a whole number."""
    xp = backend.get_array_module(values)
    flat = values.reshape(-1)
    # written so that NaN counts as bad
    bad = ~((flat >= 0) & (flat < limit))
    if whole:
        bad |= flat != xp.trunc(flat)
    if bool(bad.any()):
        k = int(xp.flatnonzero(bad)[0])
        kind = "a whole number " if whole else ""
        raise layer.fail(f"{what} {float(flat[k]):g} at position {k} is not {kind}in "
                         f"[0, {limit})")
    return flat.astype(xp.int64)


def _scatter_add_rows(target: Any, index: Any, rows: Any) -> None:
    """``target[index[i]] += rows[i]`` for every i, repeated indices adding up (Caffe's loop
    of axpys). Plain fancy ``+=`` would keep only one of the repeats, and ``ufunc.at`` is
    not in every CuPy; one bincount over the distinct indices works in NumPy and CuPy and
    needs no temporary larger than ``rows``."""
    xp = backend.get_array_module(rows)
    distinct, slot = xp.unique(index, return_inverse=True)
    width = rows.shape[1]
    flat = (slot.reshape(-1, 1) * width + xp.arange(width)).reshape(-1)
    sums = xp.bincount(flat, weights=rows.reshape(-1), minlength=distinct.size * width)
    target[distinct] += sums.reshape(distinct.size, width).astype(target.dtype, copy=False)


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


@register("Reduction")
class ReductionLayer(Layer):
    """One number per index of the dims before ``axis``, reducing all the dims from ``axis``
    on: SUM, ASUM (sum of |x|), SUMSQ (sum of x^2) or MEAN, times ``coeff``. The top's shape
    is the bottom's dims before ``axis``: a scalar for the default axis 0."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.reduction_param
        self.op = p.operation
        if self.op not in (p.SUM, p.ASUM, p.SUMSQ, p.MEAN):
            raise self.fail(f"unknown reduction_param.operation {self.op}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.reduction_param
        axis = canonical_axis(self, bottom[0], p.axis)
        self.num, self.dim = bottom[0].count_range(0, axis), bottom[0].count_range(axis)
        top[0].reshape(bottom[0].shape[:axis])
        self.coeff = float(p.coeff)
        if self.op == p.MEAN:
            # C++ float division: an empty mean is coeff * 0 / 0, NaN, not an exception
            self.coeff = self.coeff / self.dim if self.dim else math.inf

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        p = self.param.reduction_param
        x = bottom[0].data.reshape(self.num, self.dim)
        y = top[0].data.reshape(self.num)
        if self.op == p.ASUM:
            x = xp.abs(x)
        elif self.op == p.SUMSQ:
            x = x * x
        x.sum(axis=1, out=y)
        if self.coeff != 1:
            y *= y.dtype.type(self.coeff)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(top[0].diff)
        p = self.param.reduction_param
        scale = top[0].diff.reshape(self.num, 1) * top[0].dtype.type(self.coeff)
        x = bottom[0].data.reshape(self.num, self.dim)
        dx = bottom[0].diff.reshape(self.num, self.dim)
        if self.op == p.ASUM:
            xp.multiply(xp.sign(x), scale, out=dx)
        elif self.op == p.SUMSQ:
            xp.multiply(x, 2 * scale, out=dx)
        else:
            dx[...] = scale


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
        self._index = _row_indices(self, bottom[1].data, bottom[0].shape[0], "index",
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
        _scatter_add_rows(dx, self._index, top[0].diff.reshape(self._index.size, inner))

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


@register("Embed")
class EmbedLayer(Layer):
    """A lookup table: each bottom value is a row index into the (input_dim, num_output)
    weight, and the top, of shape bottom shape + (num_output,), holds that row plus the
    bias. InnerProduct on one-hot inputs, with the weight stored transposed; the index
    bottom takes no gradient."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.embed_param
        if p.num_output <= 0:
            raise self.fail("embed_param.num_output must be positive")
        if p.input_dim <= 0:
            raise self.fail("embed_param.input_dim (1 + the largest index) must be positive")
        self.num_output, self.input_dim = p.num_output, p.input_dim
        self.bias_term = p.bias_term
        xp = backend.get_array_module(bottom[0].data)
        dtype = bottom[0].dtype
        self.blobs = [Blob((self.input_dim, self.num_output), dtype=dtype, xp=xp,
                           name=f"{self.name}/0")]
        fill(p.weight_filler, self.blobs[0])
        if self.bias_term:
            self.blobs.append(Blob((self.num_output,), dtype=dtype, xp=xp, name=f"{self.name}/1"))
            fill(p.bias_filler, self.blobs[1])
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        # Caffe checks these only in debug builds; a release build reads out of bounds
        self._index = _row_indices(self, bottom[0].data, self.input_dim, "input",
                                   whole=True)
        y = top[0].data.reshape(self._index.size, self.num_output)
        y[...] = self.blobs[0].data[self._index]
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            raise self.fail("cannot backpropagate to the index input")
        dy = top[0].diff.reshape(self._index.size, self.num_output)
        if self.param_propagate_down[0]:
            _scatter_add_rows(self.blobs[0].diff, self._index, dy)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=0)

    def allow_force_backward(self, bottom_index: int) -> bool:
        return False
