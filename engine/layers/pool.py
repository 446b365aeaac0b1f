"""Pooling's window kernels: max and average pooling and their backwards.

Each has a fast CPU form (NumPy over the kh*kw window offsets of wide, cache-sized runs of
planes; MAX's in Numba when it is there, engine/kernels/cpu_pool.py) and a GPU form
(engine/kernels/cuda.py), chosen by the array module of the input. They follow Caffe's CPU
loops exactly: MAX keeps the first maximum in row-major scan order (Caffe's strict ``>``),
windows are clipped to the image, AVE divides by the window clipped to the padded image
(``pool_size`` computed before clipping to the image).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..kernels import cpu as compiled
from ..kernels import cpu_pool
from ..kernels import cuda
from ..kernels.geometry import Geometry, index_dtype


#: CPU pooling handles this many bytes of (padded) input planes at a time, so the
#: kh*kw passes over them hit the cache.
POOL_CHUNK_BYTES = 1 << 20


class _Windows:
    """The kh*kw window-offset views of a stack of image planes, laid out for NumPy.

    NumPy's cost is per inner loop, so (planes, out_h, out_w) views with rows of out_w
    elements are slow. Here every plane is padded to ``qw`` columns and each offset's
    view is one contiguous run of ``out_h * qw`` elements per plane (the "wide" grid:
    columns past ``out_w`` hold junk and are dropped by ``narrow``). With a stride the
    padded planes are split into their stride phases, so the runs stay contiguous.
    Planes are processed in cache-sized chunks (``chunks``).
    """

    def __init__(self, g: Geometry, itemsize: int):
        self.g = g
        need_h = max((g.out_h - 1) * g.stride_h + g.kernel_h, g.pad_h + g.height)
        need_w = max((g.out_w - 1) * g.stride_w + g.kernel_w, g.pad_w + g.width)
        # one spare row: the run of the last offset spills up to qw - 1 elements past it
        self.qh = -(-need_h // g.stride_h) + 1
        self.qw = -(-need_w // g.stride_w)
        self.run = g.out_h * self.qw
        self.plane_bytes = g.stride_h * g.stride_w * self.qh * self.qw * itemsize
        self.phases = []  # per stride phase: image rows/cols it holds, and where they sit
        for pi in range(g.stride_h):
            h0 = (pi - g.pad_h) % g.stride_h
            q0, nh = (h0 + g.pad_h - pi) // g.stride_h, len(range(h0, g.height, g.stride_h))
            for pj in range(g.stride_w):
                w0 = (pj - g.pad_w) % g.stride_w
                r0, nw = (w0 + g.pad_w - pj) // g.stride_w, len(range(w0, g.width, g.stride_w))
                self.phases.append((pi, pj, (slice(h0, None, g.stride_h),
                                             slice(w0, None, g.stride_w)),
                                    (slice(q0, q0 + nh), slice(r0, r0 + nw))))

    def chunks(self, planes: int) -> list[slice]:
        step = max(1, POOL_CHUNK_BYTES // self.plane_bytes)
        return [slice(p, min(p + step, planes)) for p in range(0, planes, step)]

    def layout(self, planes: np.ndarray, fill: float) -> np.ndarray:
        """(stride_h, stride_w, planes, qh*qw): the padded planes split into stride phases."""
        g = self.g
        arr = np.full((g.stride_h, g.stride_w, planes.shape[0], self.qh, self.qw), fill,
                      dtype=planes.dtype)
        for pi, pj, (rows, cols), (qrows, qcols) in self.phases:
            arr[pi, pj, :, qrows, qcols] = planes[:, rows, cols]
        return arr.reshape(g.stride_h, g.stride_w, planes.shape[0], self.qh * self.qw)

    def zeros(self, planes: int, dtype: Any) -> np.ndarray:
        g = self.g
        return np.zeros((g.stride_h, g.stride_w, planes, self.qh * self.qw), dtype=dtype)

    def view(self, arr: np.ndarray, k: int) -> np.ndarray:
        """The (planes, out_h*qw) run of window offset k (row-major in the kernel)."""
        g = self.g
        i, j = divmod(k, g.kernel_w)
        start = (i // g.stride_h) * self.qw + j // g.stride_w
        return arr[i % g.stride_h, j % g.stride_w, :, start:start + self.run]

    def narrow(self, wide: np.ndarray) -> np.ndarray:
        """(planes, out_h*qw) -> (planes, out_h, out_w), dropping the junk columns."""
        return wide.reshape(-1, self.g.out_h, self.qw)[..., :self.g.out_w]

    def widen(self, a: np.ndarray, fill: Any) -> np.ndarray:
        """(planes, out_h, out_w) -> (planes, out_h*qw) with ``fill`` in the junk columns."""
        g = self.g
        wide = np.full((a.shape[0], g.out_h, self.qw), fill, dtype=a.dtype)
        wide[..., :g.out_w] = a
        return wide.reshape(a.shape[0], self.run)

    def image_into(self, acc: np.ndarray, planes: np.ndarray) -> None:
        """Write the image part of a ``zeros()``-shaped accumulator into (planes, H, W)."""
        g = self.g
        acc = acc.reshape(g.stride_h, g.stride_w, planes.shape[0], self.qh, self.qw)
        for pi, pj, (rows, cols), (qrows, qcols) in self.phases:
            planes[:, rows, cols] = acc[pi, pj, :, qrows, qcols]


def _planes(a: np.ndarray, out: bool = False) -> np.ndarray:
    """(n, C, h, w) as a stack of planes; an output must be a view, so C-contiguous."""
    if out and not a.flags.c_contiguous:
        raise ValueError("pooling gradients are written into a C-contiguous array")
    return a.reshape(-1, *a.shape[2:])


def _is_global(g: Geometry) -> bool:
    """One window covering each whole plane: reduce over the plane instead of looping
    over its kh*kw offsets (the window offset is then the flat index h*W + w)."""
    return (g.out_h == g.out_w == 1 and g.pad_h == g.pad_w == 0
            and (g.kernel_h, g.kernel_w) == (g.height, g.width))


def _max_pool_forward_cpu(x: np.ndarray, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    if _is_global(g):
        flat = x.reshape(x.shape[0], g.channels, -1)
        arg = flat.argmax(axis=-1)[..., None]  # the first maximum, as Caffe's strict >
        top = np.take_along_axis(flat, arg, axis=-1)
        return top[..., None], arg[..., None]
    win = _Windows(g, x.dtype.itemsize)
    xs = _planes(x)
    idt = index_dtype(g.window)
    top = np.empty((xs.shape[0], g.out_h, g.out_w), dtype=x.dtype)
    arg = np.empty(top.shape, dtype=idt)
    for s in win.chunks(xs.shape[0]):
        arr = win.layout(xs[s], -np.inf)
        best = win.view(arr, 0).copy()
        where = np.zeros(best.shape, dtype=idt)
        better = np.empty(best.shape, dtype=bool)
        step = np.empty(best.shape, dtype=idt)
        for k in range(1, g.window):
            v = win.view(arr, k)
            # strict >: ties keep the earlier offset, Caffe's first maximum in scan order.
            # Masked writes (copyto where=) branch per element and are several times
            # slower than this arithmetic blend.
            np.greater(v, best, out=better)
            np.maximum(best, v, out=best)
            np.subtract(idt(k), where, out=step)
            step *= better.view(np.int8).astype(idt, copy=False)
            where += step
        top[s] = win.narrow(best)
        arg[s] = win.narrow(where)
    # Caffe starts each window at -FLT_MAX, so that is the floor of its output
    np.maximum(top, np.finfo(x.dtype).min, out=top)
    return top.reshape(x.shape[0], g.channels, g.out_h, g.out_w), arg.reshape(
        x.shape[0], g.channels, g.out_h, g.out_w)


def _max_pool_backward_cpu(dy: np.ndarray, arg: np.ndarray, g: Geometry, out: np.ndarray) -> None:
    if _is_global(g):
        flat = out.reshape(out.shape[0], g.channels, -1)
        flat[...] = 0
        np.put_along_axis(flat, arg.reshape(*flat.shape[:2], 1), dy.reshape(*flat.shape[:2], 1),
                          axis=-1)
        return
    win = _Windows(g, dy.dtype.itemsize)
    dys, args, outs = _planes(dy), _planes(arg), _planes(out, out=True)
    for s in win.chunks(dys.shape[0]):
        acc = win.zeros(s.stop - s.start, dy.dtype)
        dyw = win.widen(dys[s], 0)
        argw = win.widen(args[s], -1)
        hit = np.empty(argw.shape, dtype=bool)
        share = np.empty(dyw.shape, dtype=dy.dtype)
        for k in range(g.window):
            np.equal(argw, k, out=hit)
            np.multiply(dyw, hit, out=share)
            v = win.view(acc, k)
            np.add(v, share, out=v)
        win.image_into(acc, outs[s])


def _pool_sizes(g: Geometry, dtype: Any) -> np.ndarray:
    """Caffe's AVE divisor per output position: the window clipped to the padded image."""
    def sizes(out: int, stride: int, pad: int, kernel: int, size: int) -> np.ndarray:
        start = np.arange(out) * stride - pad
        return np.minimum(start + kernel, size + pad) - start
    hs = sizes(g.out_h, g.stride_h, g.pad_h, g.kernel_h, g.height)
    ws = sizes(g.out_w, g.stride_w, g.pad_w, g.kernel_w, g.width)
    return np.outer(hs, ws).astype(dtype)


def _ave_pool_forward_cpu(x: np.ndarray, g: Geometry) -> np.ndarray:
    if _is_global(g):
        return x.sum(axis=(2, 3), keepdims=True) / x.dtype.type(g.window)
    win = _Windows(g, x.dtype.itemsize)
    xs = _planes(x)
    top = np.empty((xs.shape[0], g.out_h, g.out_w), dtype=x.dtype)
    for s in win.chunks(xs.shape[0]):
        arr = win.layout(xs[s], 0.0)
        total = win.view(arr, 0).copy()
        for k in range(1, g.window):
            total += win.view(arr, k)
        top[s] = win.narrow(total)
    top /= _pool_sizes(g, x.dtype)
    return top.reshape(x.shape[0], g.channels, g.out_h, g.out_w)


def _ave_pool_backward_cpu(dy: np.ndarray, g: Geometry, out: np.ndarray) -> None:
    if _is_global(g):
        out[...] = dy / dy.dtype.type(g.window)
        return
    win = _Windows(g, dy.dtype.itemsize)
    dys, outs = _planes(dy / _pool_sizes(g, dy.dtype)), _planes(out, out=True)
    for s in win.chunks(dys.shape[0]):
        share = win.widen(dys[s], 0)
        acc = win.zeros(s.stop - s.start, dy.dtype)
        for k in range(g.window):
            v = win.view(acc, k)
            np.add(v, share, out=v)
        win.image_into(acc, outs[s])


def max_pool_forward(x: Any, g: Geometry) -> tuple[Any, Any]:
    """MAX pooling of (n, C, H, W): the top and an argmax record for the backward pass."""
    if not backend.is_gpu_array(x):
        if compiled.available() and not _is_global(g):
            return cpu_pool.max_pool_forward(x, g, index_dtype(g.window))
        return _max_pool_forward_cpu(x, g)
    import cupy
    x = cupy.ascontiguousarray(x)
    top = cupy.empty((x.shape[0], g.channels, g.out_h, g.out_w), dtype=x.dtype)
    arg = cupy.empty(top.shape, dtype=cupy.int32)
    cuda.launch("max_pool_forward", x.dtype, top.size, x, top, arg, np.int64(top.size),
            *cuda.geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))
    return top, arg


def max_pool_backward(dy: Any, arg: Any, g: Geometry, out: Any) -> None:
    """Route each top gradient to its argmax, overwriting ``out`` (n, C, H, W), C-contiguous."""
    if not backend.is_gpu_array(dy):
        if compiled.available() and not _is_global(g):
            cpu_pool.max_pool_backward(dy, arg, g, out)
        else:
            _max_pool_backward_cpu(dy, arg, g, out)
        return
    import cupy
    dy = cupy.ascontiguousarray(dy)
    cuda.launch("max_pool_backward", dy.dtype, out.size, dy, arg, out, np.int64(out.size),
            *cuda.geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))


def max_pool_mask(arg: Any, g: Geometry) -> Any:
    """Caffe's mask top: the argmax as a flat index h*W + w into each input plane."""
    if backend.is_gpu_array(arg):
        return arg
    i, j = np.divmod(arg.astype(np.int64), g.kernel_w)
    h = (np.arange(g.out_h) * g.stride_h - g.pad_h)[:, None] + i
    w = (np.arange(g.out_w) * g.stride_w - g.pad_w)[None, :] + j
    return h * g.width + w


def ave_pool_forward(x: Any, g: Geometry) -> Any:
    """AVE pooling of (n, C, H, W) with Caffe's divisor."""
    if not backend.is_gpu_array(x):
        return _ave_pool_forward_cpu(x, g)
    import cupy
    x = cupy.ascontiguousarray(x)
    top = cupy.empty((x.shape[0], g.channels, g.out_h, g.out_w), dtype=x.dtype)
    cuda.launch("ave_pool_forward", x.dtype, top.size, x, top, np.int64(top.size),
            *cuda.geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))
    return top


def ave_pool_backward(dy: Any, g: Geometry, out: Any) -> None:
    """Spread each top gradient over its window, overwriting ``out`` (n, C, H, W), C-contiguous."""
    if not backend.is_gpu_array(dy):
        _ave_pool_backward_cpu(dy, g, out)
        return
    import cupy
    dy = cupy.ascontiguousarray(dy)
    cuda.launch("ave_pool_backward", dy.dtype, out.size, dy, out, np.int64(out.size),
            *cuda.geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))
