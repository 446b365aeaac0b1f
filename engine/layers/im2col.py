"""im2col and col2im, the convolution's window kernels (pooling's are in pool.py).

Each has a fast CPU form (NumPy stride tricks: no Python loop over the batch, only over the
kh*kw window offsets; Numba's loops in engine/kernels/cpu.py when it is there) and a GPU form
(engine/kernels/cuda.py), chosen by the array module of the input.

Column layout (both forms): ``col`` has shape ``(C*kh*kw, n*oh*ow)``; rows are ordered
``(c, i, j)`` as Caffe's im2col orders them, columns ``(image, y, x)``. Putting a whole
chunk of the minibatch into the columns turns a convolution into one GEMM per group
instead of Caffe's one GEMM per image.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import backend
from ..kernels import cpu as compiled
from ..kernels import cuda
from ..kernels.geometry import Geometry

#: CPU convolutions process the minibatch in chunks whose column buffer is about this big,
#: so im2col writes and the GEMM reads stay in cache (one image per chunk at least).
CHUNK_BYTES = 1 << 21
#: On the GPU the chunks only bound the column buffer's memory.
GPU_CHUNK_BYTES = 1 << 28


def chunk_size(xp: Any, n: int, bytes_per_image: int) -> int:
    """Images per chunk: a cache-sized chunk on the CPU, a memory-bounded one on the GPU."""
    budget = CHUNK_BYTES if xp is np else GPU_CHUNK_BYTES
    return max(1, min(n, budget // max(1, bytes_per_image)))


# ----------------------------------------------------------------------------- CPU forms

def _im2col_cpu(x: np.ndarray, g: Geometry) -> np.ndarray:
    n = x.shape[0]
    buf = x
    if g.pad_h or g.pad_w:
        buf = np.zeros((n, g.channels, g.height + 2 * g.pad_h, g.width + 2 * g.pad_w),
                       dtype=x.dtype)
        buf[:, :, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width] = x
    s_n, s_c, s_h, s_w = buf.strides
    view = as_strided(buf, (g.channels, g.kernel_h, g.kernel_w, n, g.out_h, g.out_w),
                      (s_c, s_h * g.dilation_h, s_w * g.dilation_w, s_n,
                       s_h * g.stride_h, s_w * g.stride_w), writeable=False)
    col = np.empty(view.shape, dtype=x.dtype)
    np.copyto(col, view)
    return col.reshape(g.col_rows, n * g.out_h * g.out_w)


def _col2im_cpu(col: np.ndarray, g: Geometry, n: int) -> np.ndarray:
    hp, wp = g.height + 2 * g.pad_h, g.width + 2 * g.pad_w
    if col.shape[1] != n * g.out_h * g.out_w:
        # wide grid: each offset's columns are one contiguous run per (channel, image) of
        # the flattened padded planes (the junk columns are zeros and land harmlessly),
        # plus one spare row that the last runs spill into
        buf = np.zeros((g.channels, n, (hp + 1) * wp), dtype=col.dtype)
        col5 = col.reshape(g.channels, g.kernel_h, g.kernel_w, n, g.out_h * wp)
        run = g.out_h * wp
        for i in range(g.kernel_h):
            for j in range(g.kernel_w):
                start = i * g.dilation_h * wp + j * g.dilation_w
                buf[:, :, start:start + run] += col5[:, i, j]
        buf = buf[:, :, :hp * wp].reshape(g.channels, n, hp, wp)
    else:
        buf = np.zeros((g.channels, n, hp, wp), dtype=col.dtype)
        col6 = col.reshape(g.channels, g.kernel_h, g.kernel_w, n, g.out_h, g.out_w)
        span_h = (g.out_h - 1) * g.stride_h + 1
        span_w = (g.out_w - 1) * g.stride_w + 1
        for i in range(g.kernel_h):
            h0 = i * g.dilation_h
            for j in range(g.kernel_w):
                w0 = j * g.dilation_w
                buf[:, :, h0:h0 + span_h:g.stride_h, w0:w0 + span_w:g.stride_w] += col6[:, i, j]
    return buf[:, :, g.pad_h:g.pad_h + g.height, g.pad_w:g.pad_w + g.width].transpose(1, 0, 2, 3)


# ----------------------------------------------------------------------------- public API

def im2col(x: Any, g: Geometry) -> Any:
    """Columns (C*kh*kw, n*out_h*out_w) of the image batch ``x`` (n, C, H, W)."""
    if not backend.is_gpu_array(x):
        return compiled.im2col(x, g) if compiled.available() else _im2col_cpu(x, g)
    import cupy
    x = cupy.ascontiguousarray(x)
    n = x.shape[0]
    col = cupy.empty((g.col_rows, n * g.out_h * g.out_w), dtype=x.dtype)
    cuda.launch("im2col", x.dtype, col.size, x, col, np.int64(col.size), *cuda.conv_args(g, n))
    return col


#: Cost model for the wide grid (ns, measured on a 1-thread AVX2 core with OpenBLAS):
#: NumPy's overhead per inner loop, one add, and one GEMM multiply-add.
_NS_PER_ROW, _NS_PER_ADD, _NS_PER_FMA = 15.0, 0.3, 0.04


def grid_width(g: Geometry, xp: Any, inner: int) -> int:
    """Columns per row of the window-position grid handed to ``col2im``.

    ``out_w`` in general. On the CPU with unit strides it may be the padded image width:
    the grid is then "wide" (junk columns past ``out_w``, holding zeros), and col2im's
    kh*kw shifted adds become long contiguous runs instead of rows of out_w elements.
    That costs the GEMM producing the columns (inner dimension ``inner``) the extra
    columns, so the wide grid is used where the saved loop overhead is larger, and never
    with the compiled col2im, which has no loop overhead to save.
    """
    wide = g.width + 2 * g.pad_w
    if xp is not np or g.stride_h != 1 or g.stride_w != 1 or compiled.available():
        return g.out_w
    if (wide - g.out_w) * (inner * _NS_PER_FMA + _NS_PER_ADD) < _NS_PER_ROW:
        return wide
    return g.out_w


def grid_operand(a: Any, g: Geometry, groups: int) -> Any:
    """(n, C, out_h, out_w) -> (groups, C/groups, n*out_h*grid_width) for the GEMM whose
    product goes to ``col2im``; junk columns of a wide grid are zeros."""
    xp = backend.get_array_module(a)
    n, c = a.shape[:2]
    gw = grid_width(g, xp, c // groups)
    out = (xp.zeros if gw != g.out_w else xp.empty)((c, n, g.out_h, gw), dtype=a.dtype)
    out[..., :g.out_w] = a.transpose(1, 0, 2, 3)
    return out.reshape(groups, c // groups, n * g.out_h * gw)


def col2im(col: Any, g: Geometry, n: int, out: Any = None) -> Any:
    """Sum the columns back onto an (n, C, H, W) batch (the adjoint of ``im2col``).

    ``col`` is (C*kh*kw, n*out_h*width), from a GEMM with a ``grid_operand``: width is
    ``out_w`` or, for a wide grid, the padded image width. Writes into ``out`` (C-contiguous)
    and returns it when given; else the NumPy form may return a non-contiguous view.
    """
    if not backend.is_gpu_array(col):
        if compiled.available():
            shape = (n, g.channels, g.height, g.width)
            return compiled.col2im(col, g, np.empty(shape, col.dtype) if out is None else out)
        if out is None:
            return _col2im_cpu(col, g, n)
        out[...] = _col2im_cpu(col, g, n)
        return out
    import cupy
    col = cupy.ascontiguousarray(col)
    im = cupy.empty((n, g.channels, g.height, g.width), dtype=col.dtype) if out is None else out
    cuda.launch("col2im", col.dtype, im.size, col, im, np.int64(im.size), *cuda.conv_args(g, n))
    return im
