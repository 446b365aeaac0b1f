"""Window kernels behind the vision layers: im2col/col2im and max/average pooling.

Each operation has a fast CPU form (NumPy stride tricks: no Python loop over the batch,
only over the kh*kw window offsets) and a GPU form (CuPy RawKernels), chosen by the
array module of the input.

Column layout (both forms): ``col`` has shape ``(C*kh*kw, n*oh*ow)``; rows are ordered
``(c, i, j)`` as Caffe's im2col orders them, columns ``(image, y, x)``. Putting a whole
chunk of the minibatch into the columns turns a convolution into one GEMM per group
instead of Caffe's one GEMM per image.

Pooling follows Caffe's CPU loops exactly: MAX keeps the first maximum in row-major scan
order (Caffe's strict ``>``), windows are clipped to the image, AVE divides by the window
clipped to the padded image (``pool_size`` computed before clipping to the image).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import backend
from . import compiled

#: CPU convolutions process the minibatch in chunks whose column buffer is about this big,
#: so im2col writes and the GEMM reads stay in cache (one image per chunk at least).
CHUNK_BYTES = 1 << 21
#: On the GPU the chunks only bound the column buffer's memory.
GPU_CHUNK_BYTES = 1 << 28


@dataclass(frozen=True)
class Geometry:
    """Shape of one windowed operation on a (n, channels, height, width) image batch.

    ``out_h`` x ``out_w`` is the grid of window positions (a convolution's output, or a
    pooling output computed with Caffe's ceil-and-clip rule by the caller).
    """

    channels: int
    height: int
    width: int
    kernel_h: int
    kernel_w: int
    stride_h: int = 1
    stride_w: int = 1
    pad_h: int = 0
    pad_w: int = 0
    dilation_h: int = 1
    dilation_w: int = 1
    out_h: int = 0
    out_w: int = 0

    @property
    def col_rows(self) -> int:
        return self.channels * self.kernel_h * self.kernel_w

    @property
    def window(self) -> int:
        return self.kernel_h * self.kernel_w


def conv_out_size(size: int, kernel: int, pad: int, stride: int, dilation: int) -> int:
    """Caffe's convolution output size (floor)."""
    extent = dilation * (kernel - 1) + 1
    return (size + 2 * pad - extent) // stride + 1


def pool_out_size(size: int, kernel: int, pad: int, stride: int, any_pad: bool) -> int:
    """Caffe's pooling output size: ceil, then drop a last window that starts in the padding.

    ``any_pad`` is whether either spatial pad is non-zero: Caffe clips both axes then.
    """
    out = -(-(size + 2 * pad - kernel) // stride) + 1
    if any_pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


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


def _index_dtype(window: int) -> Any:
    return np.int8 if window <= 127 else np.int16 if window <= 32767 else np.int32


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
    idt = _index_dtype(g.window)
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


# ----------------------------------------------------------------------------- GPU forms

_GPU_SOURCE = r"""
#define LOOP(i, n) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; \
                        i < (n); i += (long long)blockDim.x * gridDim.x)

extern "C" __global__ void im2col(const T* x, T* col, long long total, int n, int C, int H,
        int W, int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw, int oh, int ow) {
  LOOP(idx, total) {
    long long r = idx;
    const int ox = r % ow; r /= ow;
    const int oy = r % oh; r /= oh;
    const int b = r % n; r /= n;
    const int j = r % kw; r /= kw;
    const int i = r % kh;
    const int c = r / kh;
    const int h = oy * sh - ph + i * dh;
    const int w = ox * sw - pw + j * dw;
    col[idx] = (h >= 0 && h < H && w >= 0 && w < W)
        ? x[((long long)(b * C + c) * H + h) * W + w] : (T)0;
  }
}

// Gather form of col2im: each image element sums the column entries that cover it,
// so no atomics are needed and the sum order is fixed.
extern "C" __global__ void col2im(const T* col, T* im, long long total, int n, int C, int H,
        int W, int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw, int oh, int ow) {
  LOOP(idx, total) {
    long long r = idx;
    const int w = r % W; r /= W;
    const int h = r % H; r /= H;
    const int c = r % C;
    const int b = r / C;
    T val = 0;
    for (int i = 0; i < kh; ++i) {
      const int hh = h + ph - i * dh;
      if (hh < 0 || hh % sh != 0 || hh / sh >= oh) continue;
      for (int j = 0; j < kw; ++j) {
        const int ww = w + pw - j * dw;
        if (ww < 0 || ww % sw != 0 || ww / sw >= ow) continue;
        val += col[((((long long)c * kh + i) * kw + j) * n + b) * oh * ow
                   + (hh / sh) * ow + ww / sw];
      }
    }
    im[idx] = val;
  }
}

extern "C" __global__ void max_pool_forward(const T* x, T* top, int* arg, long long total,
        int C, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw, int oh, int ow) {
  LOOP(idx, total) {
    const int ox = idx % ow;
    const int oy = (idx / ow) % oh;
    const long long plane = idx / ((long long)ow * oh);
    int hs = oy * sh - ph, ws = ox * sw - pw;
    const int he = min(hs + kh, H), we = min(ws + kw, W);
    hs = max(hs, 0); ws = max(ws, 0);
    const T* src = x + plane * H * W;
    T best = -FLT_MAX_T;
    int where = -1;
    for (int h = hs; h < he; ++h)
      for (int w = ws; w < we; ++w)
        if (src[h * W + w] > best) { best = src[h * W + w]; where = h * W + w; }
    top[idx] = best;
    arg[idx] = where;
  }
}

extern "C" __global__ void max_pool_backward(const T* dy, const int* arg, T* dx,
        long long total, int C, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw,
        int oh, int ow) {
  LOOP(idx, total) {
    const int w = idx % W;
    const int h = (idx / W) % H;
    const long long plane = idx / ((long long)W * H);
    const int y0 = (h + ph < kh) ? 0 : (h + ph - kh) / sh + 1;
    const int y1 = min((h + ph) / sh + 1, oh);
    const int x0 = (w + pw < kw) ? 0 : (w + pw - kw) / sw + 1;
    const int x1 = min((w + pw) / sw + 1, ow);
    const long long off = plane * oh * ow;
    T g = 0;
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x)
        if (arg[off + y * ow + x] == h * W + w) g += dy[off + y * ow + x];
    dx[idx] = g;
  }
}

extern "C" __global__ void ave_pool_forward(const T* x, T* top, long long total, int C, int H,
        int W, int kh, int kw, int sh, int sw, int ph, int pw, int oh, int ow) {
  LOOP(idx, total) {
    const int ox = idx % ow;
    const int oy = (idx / ow) % oh;
    const long long plane = idx / ((long long)ow * oh);
    int hs = oy * sh - ph, ws = ox * sw - pw;
    int he = min(hs + kh, H + ph), we = min(ws + kw, W + pw);
    const int size = (he - hs) * (we - ws);
    hs = max(hs, 0); ws = max(ws, 0); he = min(he, H); we = min(we, W);
    const T* src = x + plane * H * W;
    T s = 0;
    for (int h = hs; h < he; ++h)
      for (int w = ws; w < we; ++w) s += src[h * W + w];
    top[idx] = s / size;
  }
}

extern "C" __global__ void ave_pool_backward(const T* dy, T* dx, long long total, int C, int H,
        int W, int kh, int kw, int sh, int sw, int ph, int pw, int oh, int ow) {
  LOOP(idx, total) {
    const int w = idx % W + pw;
    const int h = (idx / W) % H + ph;
    const long long plane = idx / ((long long)W * H);
    const int y0 = (h < kh) ? 0 : (h - kh) / sh + 1;
    const int y1 = min(h / sh + 1, oh);
    const int x0 = (w < kw) ? 0 : (w - kw) / sw + 1;
    const int x1 = min(w / sw + 1, ow);
    const T* src = dy + plane * oh * ow;
    T g = 0;
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) {
        const int hs = y * sh - ph, ws = x * sw - pw;
        const int size = (min(hs + kh, H + ph) - hs) * (min(ws + kw, W + pw) - ws);
        g += src[y * ow + x] / size;
      }
    dx[idx] = g;
  }
}
"""

_kernels: dict[tuple[str, str], Any] = {}


def _kernel(name: str, dtype: Any) -> Any:
    """The compiled RawKernel ``name`` for float32 or float64."""
    import cupy  # only reached with CuPy arrays

    ctype = {np.dtype(np.float32): ("float", "3.402823466e+38F"),
             np.dtype(np.float64): ("double", "1.7976931348623158e+308")}.get(np.dtype(dtype))
    if ctype is None:
        raise TypeError(f"GPU vision kernels take float32 or float64, not {np.dtype(dtype)}")
    key = (name, ctype[0])
    if key not in _kernels:
        header = f"#define T {ctype[0]}\n#define FLT_MAX_T {ctype[1]}\n"
        module = cupy.RawModule(code=header + _GPU_SOURCE)
        for kname in ("im2col", "col2im", "max_pool_forward", "max_pool_backward",
                      "ave_pool_forward", "ave_pool_backward"):
            _kernels[(kname, ctype[0])] = module.get_function(kname)
    return _kernels[key]


def _launch(name: str, dtype: Any, total: int, *args: Any) -> None:
    threads = 256
    blocks = max(1, min((total + threads - 1) // threads, 65535))
    _kernel(name, dtype)((blocks,), (threads,), args)


def _gpu_geometry_args(g: Geometry) -> tuple[np.int32, ...]:
    return tuple(np.int32(v) for v in (g.channels, g.height, g.width, g.kernel_h, g.kernel_w,
                                       g.stride_h, g.stride_w, g.pad_h, g.pad_w))


def _conv_args(g: Geometry, n: int) -> tuple[np.int32, ...]:
    return tuple(np.int32(v) for v in (n, g.channels, g.height, g.width, g.kernel_h, g.kernel_w,
                                       g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dilation_h,
                                       g.dilation_w, g.out_h, g.out_w))


# ----------------------------------------------------------------------------- public API

def im2col(x: Any, g: Geometry) -> Any:
    """Columns (C*kh*kw, n*out_h*out_w) of the image batch ``x`` (n, C, H, W)."""
    if not backend.is_gpu_array(x):
        return compiled.im2col(x, g) if compiled.available() else _im2col_cpu(x, g)
    import cupy
    x = cupy.ascontiguousarray(x)
    n = x.shape[0]
    col = cupy.empty((g.col_rows, n * g.out_h * g.out_w), dtype=x.dtype)
    _launch("im2col", x.dtype, col.size, x, col, np.int64(col.size), *_conv_args(g, n))
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
    _launch("col2im", col.dtype, im.size, col, im, np.int64(im.size), *_conv_args(g, n))
    return im


def max_pool_forward(x: Any, g: Geometry) -> tuple[Any, Any]:
    """MAX pooling of (n, C, H, W): the top and an argmax record for the backward pass."""
    if not backend.is_gpu_array(x):
        return _max_pool_forward_cpu(x, g)
    import cupy
    x = cupy.ascontiguousarray(x)
    top = cupy.empty((x.shape[0], g.channels, g.out_h, g.out_w), dtype=x.dtype)
    arg = cupy.empty(top.shape, dtype=cupy.int32)
    _launch("max_pool_forward", x.dtype, top.size, x, top, arg, np.int64(top.size),
            *_gpu_geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))
    return top, arg


def max_pool_backward(dy: Any, arg: Any, g: Geometry, out: Any) -> None:
    """Route each top gradient to its argmax, overwriting ``out`` (n, C, H, W), C-contiguous."""
    if not backend.is_gpu_array(dy):
        if compiled.available() and not _is_global(g):
            compiled.max_pool_backward(dy, arg, g, out)
        else:
            _max_pool_backward_cpu(dy, arg, g, out)
        return
    import cupy
    dy = cupy.ascontiguousarray(dy)
    _launch("max_pool_backward", dy.dtype, out.size, dy, arg, out, np.int64(out.size),
            *_gpu_geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))


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
    _launch("ave_pool_forward", x.dtype, top.size, x, top, np.int64(top.size),
            *_gpu_geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))
    return top


def ave_pool_backward(dy: Any, g: Geometry, out: Any) -> None:
    """Spread each top gradient over its window, overwriting ``out`` (n, C, H, W), C-contiguous."""
    if not backend.is_gpu_array(dy):
        _ave_pool_backward_cpu(dy, g, out)
        return
    import cupy
    dy = cupy.ascontiguousarray(dy)
    _launch("ave_pool_backward", dy.dtype, out.size, dy, out, np.int64(out.size),
            *_gpu_geometry_args(g), np.int32(g.out_h), np.int32(g.out_w))
