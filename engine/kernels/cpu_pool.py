"""Compiled CPU forms of MAX pooling, forward and backward, when Numba is there
(engine/kernels/cpu.py's rule and machinery).

NumPy's forward (engine/layers/pool.py) makes kh*kw passes of five operations each over the
whole output (a compare, a maximum, and the argmax's arithmetic blend), with a padded copy of
the input first. Here each window is scanned once, as Caffe's loop does, with selects rather
than branches (on real data a branch on v > best is mispredicted half the time): 0.26 ms
against 0.36 on the bench's conv-heavy pool (32 images of 64 planes of 8x8), 1.51 against
1.74 on LeNet's pool1 (a row of outputs at a time, strided loads, ran at half NumPy's speed).
It follows the NumPy form's order and rules (equal values, NaN in the same places: the tests
check it; a zero's sign may differ where a window's maximum is 0.0 and -0.0 at once, which
NumPy leaves to its SIMD loop).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .cpu import flat, flat_out, jit


@jit
def _max_pool_forward(x, top, arg, planes, height, width, kh, kw, sh, sw, ph, pw, oh, ow,
                      ninf, floor):  # pragma: no cover - compiled
    # The NumPy form's scan: each window's offsets in row-major order from -inf, a cell
    # outside the image being -inf (its padding), so only the cells inside are read; strict >
    # moves the maximum and its offset (Caffe's first maximum), and a NaN, once met, stays
    # (np.maximum's rule); then Caffe's floor, -FLT_MAX. Of equal zeros the first stays, as
    # in Caffe (np.maximum's SIMD loop may take either).
    o = np.uint64(0)  # unsigned indices: no check for Python's negative indexing
    for p in range(planes):
        plane = p * height * width
        for y in range(oh):
            h0 = y * sh - ph
            i0, i1 = max(0, -h0), min(kh, height - h0)
            for xo in range(ow):
                w0 = xo * sw - pw
                j0, j1 = max(0, -w0), min(kw, width - w0)
                best = ninf
                where = 0
                for i in range(i0, i1):
                    row = np.uint64(plane + (h0 + i) * width + w0 + j0)
                    for j in range(j0, j1):
                        v = x[row]
                        row += np.uint64(1)
                        # selects, not branches: on real data a branch on v > best is
                        # mispredicted half the time
                        better = v > best
                        where = i * kw + j if better else where
                        best = v if better | (v != v) else best
                top[o] = best if (best >= floor or best != best) else floor
                arg[o] = where
                o += np.uint64(1)


@jit
def _max_pool_backward(dy, arg, out, planes, height, width, kh, kw, sh, sw, ph, pw, oh,
                       ow):  # pragma: no cover - compiled
    # Caffe's order: zero, then each output adds its gradient at its argmax, in scan order.
    # ``arg`` is the window offset (row-major in the kernel); tables turn it into (i, j)
    # without a division per output.
    di = np.empty(kh * kw, dtype=np.int64)
    dj = np.empty(kh * kw, dtype=np.int64)
    for k in range(kh * kw):
        di[k], dj[k] = k // kw, k % kw
    out[:] = 0
    o = np.uint64(0)
    for p in range(planes):
        plane = p * height * width
        for y in range(oh):
            h0 = y * sh - ph
            for xo in range(ow):
                k = np.uint64(arg[o])
                h = h0 + di[k]
                w = xo * sw - pw + dj[k]
                if 0 <= h < height and 0 <= w < width:
                    out[np.uint64(plane + h * width + w)] += dy[o]
                o += np.uint64(1)


def max_pool_forward(x: np.ndarray, g: Any, index: Any) -> tuple[np.ndarray, np.ndarray]:
    """MAX pooling of (n, C, H, W): the top and each output's window offset (``index`` dtype)."""
    n = x.shape[0]
    top = np.empty((n, g.channels, g.out_h, g.out_w), dtype=x.dtype)
    arg = np.empty(top.shape, dtype=index)
    _max_pool_forward(flat(x), flat_out(top), flat_out(arg), n * g.channels, g.height, g.width,
                      g.kernel_h, g.kernel_w, g.stride_h, g.stride_w, g.pad_h, g.pad_w,
                      g.out_h, g.out_w, x.dtype.type(-np.inf), np.finfo(x.dtype).min)
    return top, arg


def max_pool_backward(dy: np.ndarray, arg: np.ndarray, g: Any, out: np.ndarray) -> None:
    """Route each top gradient to its argmax, overwriting ``out`` (n, C, H, W)."""
    _max_pool_backward(flat(dy), flat(arg), flat_out(out), out.shape[0] * g.channels, g.height,
                       g.width, g.kernel_h, g.kernel_w, g.stride_h, g.stride_w, g.pad_h,
                       g.pad_w, g.out_h, g.out_w)


def warm(dtype: Any) -> None:
    """Compile, or load from the disk cache, this module's kernels for ``dtype`` arrays and
    every argmax index type, called as the pooling layer calls them."""
    from .geometry import INDEX_DTYPES, Geometry

    g = Geometry(channels=1, height=3, width=3, kernel_h=2, kernel_w=2, out_h=2, out_w=2)
    x = np.zeros((1, 1, 3, 3), dtype)
    for index in INDEX_DTYPES:
        _, arg = max_pool_forward(x, g, index)
        max_pool_backward(np.zeros(arg.shape, dtype), arg, g, np.empty_like(x))
