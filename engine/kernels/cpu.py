"""Compiled CPU forms of im2col, col2im, LRN, ReLU and SGD's update step, when Numba is
there (MAX pooling's: engine/kernels/cpu_pool.py; Winograd's: engine/layers/winograd.py).

NumPy pays per inner loop, and the window kernels' inner loops are a window row (LeNet's
conv2: 8 elements), so its forms in ``im2col`` run at a few GB/s; Caffe's plain C loops run
several times faster, and they decide whether Poseidon keeps up with Caffe on the small nets.
SGD's update (the workers' mean, Caffe's Normalize, L2 Regularize and the momentum step) is up
to nine NumPy passes and two temporaries over a layer's history, gradient and weights; here it
is one (an fc layer's momentum step alone: 0.38 ms against 0.74).
LRN in NumPy is some twenty passes over blobs that do not fit in cache (AlexNet's norm1:
37 MB); here it is one pass per image. These are Caffe's loops, compiled by Numba, in the
NumPy forms' operation order (equal to the bit: the tests check it); the NumPy forms stay
the reference, and these are used only when Numba imports (``pip install -e '.[fast]'`` in
the checkout) and POSEIDON_NUMBA is not 0. Compiled code is cached on disk, so the
compilation (about a second per kernel and dtype) is paid once per machine: by `poseidon
warmup` or `poseidon train` ahead of time (``warm``), or by the first use, which says so once.

Numba itself is imported on the first call of a kernel, not with this module: importing it
costs 0.3 s of CPU, and most processes that import the engine never run a kernel (a
launcher, a shard, `simulate`, a run on the NumPy forms).
"""
from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any, Callable

import numpy as np

from .. import glog

#: Numba's module once a kernel has been called (``_realise``); None before, or without it
numba: Any = None
_INSTALLED = importlib.util.find_spec("numba") is not None  # optional: NumPy forms serve


def available() -> bool:
    """True when the compiled forms are to be used."""
    return _INSTALLED and os.environ.get("POSEIDON_NUMBA", "1") != "0"


#: error_model "numpy": IEEE division (x/0 is inf, as in NumPy) instead of Python's check for
#: a zero divisor, a branch that keeps a loop from vectorising (LRN's forward: 4x)
_OPTIONS = dict(boundscheck=False, error_model="numpy")


#: every kernel ``jit`` compiles (Numba's dispatchers)
KERNELS: list[Any] = []

#: called with a kernel's label ("im2col float32") as it starts to compile; None: the first
#: compilation in this process logs one line saying so (``report_compiles``)
_reporter: Callable[[str], None] | None = None
_told = False


def report_compiles(reporter: Callable[[str], None] | None) -> None:
    """Have ``reporter`` told of every kernel compilation from now on (a warm-up's progress);
    None: say it once per process, in the log, as training does.

    A kernel compiles only when Numba's disk cache lacks it, so the line is said once per
    machine: the first run after an install or a change of these sources."""
    global _reporter
    _reporter = reporter


def kernel_label(dispatcher: Any, args: Any) -> str:
    """A kernel's name and the dtypes of its array arguments: ``max_pool_backward float32,int8``."""
    dtypes = dict.fromkeys(str(a.dtype) for a in args if isinstance(a, numba.types.Array))
    return f"{dispatcher.py_func.__name__.lstrip('_')} {','.join(dtypes)}"


def _compiling(dispatcher: Any, args: Any) -> None:
    global _told
    if not any(dispatcher is k for k in KERNELS):  # Numba's own helpers, inlined loops
        return
    if _reporter is not None:
        _reporter(kernel_label(dispatcher, args))
    elif not _told:
        _told = True
        glog.info(f"Compiling the CPU kernels (Numba) for this machine, once: about a second "
                  f"each, cached in {dispatcher.stats.cache_path}. `poseidon warmup` compiles "
                  "them all ahead of time")


class _Deferred:
    """A kernel or inner loop as written, standing in its module's namespace until the first
    call of any kernel; ``_realise`` then replaces every one of them there by its Numba
    dispatcher, before anything compiles, since a compiled kernel finds the loops it inlines
    among its globals."""

    def __init__(self, fn: Any, options: dict[str, Any], kernel: bool) -> None:
        self.py_func, self.options, self.kernel = fn, options, kernel

    def __call__(self, *args: Any) -> Any:
        _realise()
        return self.py_func.__globals__[self.py_func.__name__](*args)


_DEFERRED: list[_Deferred] = []
_realised = threading.Lock()


def _realise() -> None:
    global numba
    with _realised:
        if numba is not None:
            return
        import numba as nb
        from numba.core import event as numba_event

        class _CompileListener(numba_event.Listener):
            """Numba's "numba:compile" event starts only on a disk-cache miss: a real compile."""

            def on_start(self, event: Any) -> None:
                _compiling(event.data["dispatcher"], event.data["args"])

            def on_end(self, event: Any) -> None:
                pass

        numba_event.register("numba:compile", _CompileListener())
        numba = nb
        for d in _DEFERRED:
            _compile(d)
        _DEFERRED.clear()


def _compile(d: _Deferred) -> Any:
    """``d``'s dispatcher (Numba compiles it at its first call), in ``d``'s place."""
    dispatcher = numba.njit(**d.options)(d.py_func)
    d.py_func.__globals__[d.py_func.__name__] = dispatcher
    if d.kernel:
        KERNELS.append(dispatcher)
    return dispatcher


def _defer(fn: Any, kernel: bool, **options: Any) -> Any:
    if not _INSTALLED:
        return fn
    d = _Deferred(fn, {**_OPTIONS, **options}, kernel)
    with _realised:
        if numba is None:
            _DEFERRED.append(d)
            return d
    return _compile(d)  # a module imported after the first kernel ran (winograd's, say)


def jit(fn: Any) -> Any:
    """A compiled kernel (cached on disk, GIL released); ``fn`` itself without Numba."""
    return _defer(fn, True, cache=True, nogil=True)


def inline(fn: Any) -> Any:
    """An inner loop, inlined into its caller (a call per window row costs more than its work)."""
    return _defer(fn, False, inline="always")


@inline
def _span(offset, stride, out, size):  # pragma: no cover - compiled
    # the outputs o in [lo, hi) whose input o * stride + offset lies in [0, size)
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    hi = 0 if offset >= size else (size - offset + stride - 1) // stride
    return min(lo, out), max(min(hi, out), min(lo, out))


# The kernels take flat C-contiguous arrays and clip each window row to the image once,
# so their inner loops have no branch; the inner loops index with unsigned integers, for
# which Numba drops its negative-index wraparound, and LLVM then vectorises them (3x).

@inline
def _gather(dst, d, src, s, stride, count):  # pragma: no cover - compiled
    d, s, stride = np.uint64(d), np.uint64(s), np.uint64(stride)
    for t in range(np.uint64(count)):
        dst[d + t] = src[s + t * stride]


@inline
def _scatter_add(dst, d, stride, src, s, count):  # pragma: no cover - compiled
    d, s, stride = np.uint64(d), np.uint64(s), np.uint64(stride)
    for t in range(np.uint64(count)):
        dst[d + t * stride] += src[s + t]


@inline
def _fill(dst, d, count):  # pragma: no cover - compiled
    d = np.uint64(d)
    for t in range(np.uint64(count)):
        dst[d + t] = 0

@jit
def _im2col(im, col, adjoint, n, channels, height, width, kh, kw, sh, sw, ph, pw, dh, dw, oh,
            ow):  # pragma: no cover - compiled
    # col rows (c, i, j), columns (image, y, x): the layout of im2col's NumPy form. The
    # adjoint (col2im) is Caffe's col2im_cpu: zero, then add the columns in (kernel row,
    # kernel col) order.
    ncols = n * oh * ow
    if adjoint:
        _fill(im, 0, im.size)
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                row = ((c * kh + i) * kw + j) * ncols
                w0 = j * dw - pw
                lo, hi = _span(w0, sw, ow, width)
                for b in range(n):
                    plane = (b * channels + c) * height * width
                    for y in range(oh):
                        dst = row + (b * oh + y) * ow
                        h = y * sh - ph + i * dh
                        inside = 0 <= h < height
                        if adjoint:
                            if inside:
                                _scatter_add(im, plane + h * width + w0 + lo * sw, sw, col,
                                             dst + lo, hi - lo)
                        elif inside:
                            _fill(col, dst, lo)
                            _gather(col, dst + lo, im, plane + h * width + w0 + lo * sw, sw,
                                    hi - lo)
                            _fill(col, dst + hi, ow - hi)
                        else:
                            _fill(col, dst, ow)


@inline
def _channel_window(buf, c, channels, plane, pre, size, out, o):  # pragma: no cover
    # out[o:o+plane] = the sum of buf's planes c-pre .. c-pre+size-1, zero padded, added in
    # the order of lrn._window_sum (it starts from the first window slot, a padding zero or
    # a plane, and adds the rest; a padding zero added changes the sign of a -0.0 sum)
    first = c - pre
    lo, hi = max(first, 0), min(first + size, channels)
    lo_u, o_u, plane_u = np.uint64(lo * plane), np.uint64(o), np.uint64(plane)
    for t in range(plane_u):
        out[o_u + t] = buf[lo_u + t] + 0 if first < 0 else buf[lo_u + t]
    for k in range(lo + 1, hi):
        k_u = np.uint64(k * plane)
        for t in range(plane_u):
            out[o_u + t] += buf[k_u + t]
    if first + size > channels:
        for t in range(plane_u):
            out[o_u + t] += 0


@jit
def _lrn_forward(x, top, scale, factor, n, channels, plane, pre, size, a, k, one,
                 beta_mode):  # pragma: no cover - compiled
    # scale^-beta as lrn._neg_power computes it (beta 0.75, 0.5, 1), one loop per beta so
    # that the loops vectorise (a branch in them made norm1's forward 10x slower)
    per_image = channels * plane
    sq = np.empty(per_image, dtype=x.dtype)
    for b in range(n):
        base = b * per_image
        for t in range(np.uint64(per_image)):
            v = x[np.uint64(base) + t]
            sq[t] = v * v
        for c in range(channels):
            o = base + c * plane
            _channel_window(sq, c, channels, plane, pre, size, scale, o)
            span = range(np.uint64(o), np.uint64(o + plane))
            for t in span:
                s = scale[t] * a
                scale[t] = s + k
            if beta_mode == 0:
                for t in span:
                    r = np.sqrt(scale[t])
                    r = r * np.sqrt(r)
                    factor[t] = one / r
            elif beta_mode == 1:
                for t in span:
                    factor[t] = one / np.sqrt(scale[t])
            else:
                for t in span:
                    factor[t] = one / scale[t]
            for t in span:
                top[t] = x[t] * factor[t]


@jit
def _lrn_backward(x, top, dy, scale, factor, dx, n, channels, plane, pre, size,
                  coeff):  # pragma: no cover - compiled
    per_image = channels * plane
    ratio = np.empty(per_image, dtype=x.dtype)
    for b in range(n):
        base = b * per_image
        for t in range(np.uint64(per_image)):
            i = np.uint64(base) + t
            r = dy[i] * top[i]
            ratio[t] = r / scale[i]
        for c in range(channels):
            o = base + c * plane
            _channel_window(ratio, c, channels, plane, pre, size, dx, o)
            for t in range(np.uint64(o), np.uint64(o + plane)):
                acc = dx[t] * x[t]
                acc = acc * coeff
                d = dy[t] * factor[t]
                dx[t] = d - acc


#: the betas whose power the compiled LRN computes as lrn._neg_power does
_BETA_MODES = {0.75: 0, 0.5: 1, 1.0: 2}


def lrn_supports(beta: float) -> bool:
    return available() and beta in _BETA_MODES


def lrn_forward(x: np.ndarray, size: int, alpha: float, beta: float,
                k: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ACROSS_CHANNELS LRN of (n, C, H, W) ``x``: (top, scale, scale^-beta)."""
    n, channels = x.shape[:2]
    top, scale, factor = (np.empty(x.shape, x.dtype) for _ in range(3))
    dt = x.dtype.type
    _lrn_forward(flat(x), top.reshape(-1), scale.reshape(-1), factor.reshape(-1), n, channels,
                 x[0, 0].size, (size - 1) // 2, size, dt(alpha / size), dt(k), dt(1),
                 _BETA_MODES[beta])
    return top, scale, factor


def lrn_backward(x: np.ndarray, top: np.ndarray, dy: np.ndarray, scale: np.ndarray,
                 factor: np.ndarray, size: int, coeff: float, dx: np.ndarray) -> None:
    """The bottom gradient of ``lrn_forward`` into ``dx`` (C-contiguous), overwriting it."""
    n, channels = x.shape[:2]
    _lrn_backward(flat(x), flat(top), flat(dy), flat(scale), flat(factor), flat_out(dx), n,
                  channels, x[0, 0].size, (size - 1) // 2, size, x.dtype.type(coeff))


def flat(a: np.ndarray) -> np.ndarray:
    """``a`` as one contiguous run, for a kernel to read (copied only when it must be)."""
    return np.ascontiguousarray(a).reshape(-1)


def flat_out(a: np.ndarray) -> np.ndarray:
    """``a`` as one run for a kernel to write into: a view, so ``a`` must be contiguous."""
    if not a.flags.c_contiguous:
        raise ValueError("the compiled kernels write into C-contiguous arrays")
    return a.reshape(-1)


def im2col(x: np.ndarray, g: Any) -> np.ndarray:
    """Columns (C*kh*kw, n*out_h*out_w) of (n, C, H, W) ``x``, as engine/layers/im2col.py's."""
    col = np.empty((g.col_rows, x.shape[0] * g.out_h * g.out_w), dtype=x.dtype)
    _im2col(flat(x), col.reshape(-1), False, x.shape[0], g.channels, g.height, g.width, g.kernel_h,
            g.kernel_w, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dilation_h, g.dilation_w,
            g.out_h, g.out_w)
    return col


def col2im(col: np.ndarray, g: Any, out: np.ndarray) -> np.ndarray:
    """Sum the (C*kh*kw, n*out_h*out_w) columns onto ``out`` (n, C, H, W), overwriting it."""
    _im2col(flat_out(out), flat(col), True, out.shape[0], g.channels, g.height, g.width, g.kernel_h,
            g.kernel_w, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dilation_h, g.dilation_w,
            g.out_h, g.out_w)
    return out


@jit
def _sgd_step(h, d, x, divisor, inverse, scale, decay, momentum, rate, divide, mean, normal,
              regular):  # pragma: no cover - compiled
    for i in range(np.uint64(h.size)):
        g = d[i]
        if divide:
            g = g / divisor
        elif mean:
            g = g * inverse
        if normal:
            g = g * scale
        if regular:
            g = g + decay * x[i]
        v = momentum * h[i] + rate * g
        h[i] = v
        d[i] = v


def sgd_step(history: Any, diff: Any, data: Any, workers: int, iter_size: int,
             decay: np.floating, momentum: np.floating, rate: np.floating) -> bool:
    """SGD's whole update of one parameter in one pass: the mean of ``workers`` workers'
    summed gradients, Caffe's Normalize (``iter_size``), L2 Regularize (``decay``, 0: none),
    then ``history = momentum * history + rate * diff; diff = history``, each in NumPy's
    order of operations and in the arrays' dtype (solvers.normalize and regularize's), so
    equal to the bit. False, doing nothing, when the arrays are not contiguous NumPy arrays
    of one dtype and shape."""
    if not (available() and all(isinstance(a, np.ndarray) and a.flags.c_contiguous
                                for a in (history, diff, data))
            and history.dtype == diff.dtype == data.dtype
            and history.shape == diff.shape == data.shape):
        return False
    kind, f32 = history.dtype.type, np.float32
    divide = bool(workers & (workers - 1))
    # the scales as the NumPy forms have them, float32 whatever the arrays' dtype
    _sgd_step(history.reshape(-1), diff.reshape(-1), data.reshape(-1), kind(workers),
              kind(f32(1) / f32(workers)), kind(f32(1) / f32(max(iter_size, 1))), kind(decay),
              kind(momentum), kind(rate), divide, workers > 1 and not divide, iter_size > 1,
              bool(decay))
    return True


# ReLU's kernels work in place: with a second array LLVM cannot rule out that the two overlap,
# and its loop ran at scalar speed (in place: 11 us against 54 for 128 K floats; a copy first
# costs 20)
@jit
def _relu(y, zero):  # pragma: no cover - compiled
    # Caffe's std::max(y, 0): y unless y < 0 (NaN and -0.0 stay as they are)
    for i in range(np.uint64(y.size)):
        v = y[i]
        y[i] = zero if v < zero else v


@jit
def _relu_mask(y, d, zero, one):  # pragma: no cover - compiled
    for i in range(np.uint64(y.size)):
        d[i] = d[i] * (one if y[i] > zero else zero)


def _contiguous(*arrays: Any) -> bool:
    first = arrays[0]
    return available() and all(isinstance(a, np.ndarray) and a.dtype == first.dtype
                               and a.shape == first.shape and a.flags.c_contiguous
                               for a in arrays)


def relu(x: Any, y: Any) -> bool:
    """ReLU's ``y = max(x, 0)`` in one pass (NumPy's maximum with a scalar ran at 1 ns an
    element here, several times a copy's time); False, doing nothing, unless both are
    contiguous NumPy arrays of one dtype and shape (``y`` may be ``x``)."""
    if not _contiguous(x, y):
        return False
    if y is not x:
        np.copyto(y, x)
    _relu(y.reshape(-1), y.dtype.type(0))
    return True


def relu_gradient(y: Any, dy: Any, dx: Any) -> bool:
    """ReLU's ``dx = dy * (y > 0)``, the product as Caffe makes it (a negative gradient
    masked is -0.0); False, doing nothing, as ``relu``'s."""
    if not _contiguous(y, dy, dx) or np.may_share_memory(y, dx):
        return False
    if dx is not dy:
        np.copyto(dx, dy)
    kind = y.dtype.type
    _relu_mask(y.reshape(-1), dx.reshape(-1), kind(0), kind(1))
    return True


def warm(dtype: Any) -> None:
    """Compile, or load from the disk cache, every kernel of this module for ``dtype`` arrays,
    called as the layers and solvers call them (the same argument types, so the same
    signatures), on inputs of a few elements."""
    from .geometry import Geometry

    g = Geometry(channels=1, height=3, width=3, kernel_h=2, kernel_w=2, out_h=2, out_w=2)
    x = np.zeros((1, 1, 3, 3), dtype)
    col2im(im2col(x, g), g, np.empty_like(x))
    top, scale, factor = lrn_forward(x, 1, 1.0, 0.75, 1.0)
    lrn_backward(x, top, top, scale, factor, 1, 1.0, np.empty_like(x))
    sgd_step(np.zeros(1, dtype), np.zeros(1, dtype), np.zeros(1, dtype), 1, 1, np.float32(0),
             np.float32(0.9), np.float32(0.1))
    relu(x, x)
    relu_gradient(x, np.zeros_like(x), np.zeros_like(x))
