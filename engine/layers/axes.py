"""Axis helpers the layers share: an axis counted from 0 (and Caffe's V1-era fields for it),
a slice along one axis, softmax along one, and index-valued inputs checked and turned into
row indices (with the scatter-add their backward needs)."""
from __future__ import annotations

from typing import Any

from .. import backend
from ..blob import Blob
from .base import Layer


def softmax(x: Any, axis: int, out: Any) -> Any:
    """Softmax of ``x`` along ``axis`` into ``out`` (may be ``x``); the max is subtracted
    first, as Caffe does, so large logits do not overflow."""
    xp = backend.get_array_module(x)
    xmax = x.max(axis=axis, keepdims=True)
    xp.subtract(x, xmax, out=out)
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


def axis_slice(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    """Index selecting [start, stop) along ``axis`` and everything along the others."""
    return (slice(None),) * axis + (slice(start, stop),)


def legacy_axis(layer: Layer, blob: Blob, param: Any, legacy: str) -> int:
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


def row_indices(layer: Layer, values: Any, limit: int, what: str, whole: bool) -> Any:
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


def scatter_add_rows(target: Any, index: Any, rows: Any) -> None:
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


def legacy_shape(layer: Layer, blob: Blob) -> tuple[int, int, int, int]:
    """Caffe's legacy (num, channels, height, width) accessors: a blob of at most 4 axes,
    the missing trailing ones read as 1."""
    if blob.num_axes() > 4:
        raise layer.fail(f"needs a blob of at most 4 axes (num, channels, height, width), "
                         f"got shape {blob.shape}")
    n, c, h, w = blob.shape + (1,) * (4 - blob.num_axes())
    return n, c, h, w
