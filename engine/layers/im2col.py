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

#: CPU convolutions process the minibatch in chunks whose column buffer is about this big,
#: so im2col writes and the GEMM reads stay in cache (one image per chunk at least).
CHUNK_BYTES = 1 << 21


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
    """Images per chunk: the whole batch on the GPU, a cache-sized chunk on the CPU."""
    if xp is not np:
        return n
    return max(1, min(n, CHUNK_BYTES // max(1, bytes_per_image)))


# ----------------------------------------------------------------------------- CPU forms

def _padded(x: np.ndarray, g: Geometry, rows: int, cols: int, fill: float) -> np.ndarray:
    """x placed at (pad_h, pad_w) inside a (n, C, rows, cols) buffer of ``fill``."""
    n, c, h, w = x.shape
    if rows == h and cols == w and g.pad_h == 0 and g.pad_w == 0:
        return x
    buf = np.full((n, c, rows, cols), fill, dtype=x.dtype)
    buf[:, :, g.pad_h:g.pad_h + h, g.pad_w:g.pad_w + w] = x
    return buf


def _im2col_cpu(x: np.ndarray, g: Geometry) -> np.ndarray:
    n = x.shape[0]
    buf = _padded(x, g, g.height + 2 * g.pad_h, g.width + 2 * g.pad_w, 0.0)
    s_n, s_c, s_h, s_w = buf.strides
    view = as_strided(buf, (g.channels, g.kernel_h, g.kernel_w, n, g.out_h, g.out_w),
                      (s_c, s_h * g.dilation_h, s_w * g.dilation_w, s_n,
                       s_h * g.stride_h, s_w * g.stride_w), writeable=False)
    col = np.empty(view.shape, dtype=x.dtype)
    np.copyto(col, view)
    return col.reshape(g.col_rows, n * g.out_h * g.out_w)


def _col2im_cpu(col: np.ndarray, g: Geometry, n: int) -> np.ndarray:
    hp, wp = g.height + 2 * g.pad_h, g.width + 2 * g.pad_w
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


class _Windows:
    """The kh*kw window-offset views of a batch, laid out so NumPy runs long loops.

    NumPy's cost is per inner loop, so (n, C, out_h, out_w) views with rows of out_w
    elements are slow. Here every image plane is padded to ``qw`` columns and each
    offset's view is one contiguous run of ``out_h * qw`` elements per plane (the "wide"
    grid: columns past ``out_w`` hold junk and are dropped by ``narrow``). With a stride
    the padded planes are first split into their stride phases (one pass), so that the
    runs stay contiguous. ``zeros``/``image`` map a gradient accumulated in the same
    layout back to (n, C, H, W).
    """

    def __init__(self, g: Geometry, n: int, dtype: Any):
        self.g, self.n, self.dtype = g, n, dtype
        self.planes = n * g.channels
        need_h = max((g.out_h - 1) * g.stride_h + g.kernel_h, g.pad_h + g.height)
        need_w = max((g.out_w - 1) * g.stride_w + g.kernel_w, g.pad_w + g.width)
        # one spare row: the run of the last offset spills up to qw - 1 elements past it
        self.qh = -(-need_h // g.stride_h) + 1
        self.qw = -(-need_w // g.stride_w)
        self.run = g.out_h * self.qw

    def _phases(self) -> list[tuple[int, int, tuple[slice, slice], tuple[slice, slice]]]:
        """Per stride phase (pi, pj): the image rows/cols it holds and where they sit in it."""
        g = self.g
        out = []
        for pi in range(g.stride_h):
            h0 = (pi - g.pad_h) % g.stride_h
            q0, nh = (h0 + g.pad_h - pi) // g.stride_h, len(range(h0, g.height, g.stride_h))
            for pj in range(g.stride_w):
                w0 = (pj - g.pad_w) % g.stride_w
                r0, nw = (w0 + g.pad_w - pj) // g.stride_w, len(range(w0, g.width, g.stride_w))
                out.append((pi, pj, (slice(h0, None, g.stride_h), slice(w0, None, g.stride_w)),
                            (slice(q0, q0 + nh), slice(r0, r0 + nw))))
        return out

    def layout(self, x: np.ndarray, fill: float) -> np.ndarray:
        """(stride_h, stride_w, planes, qh*qw): the padded planes split into stride phases."""
        g = self.g
        arr = np.full((g.stride_h, g.stride_w, self.planes, self.qh, self.qw), fill,
                      dtype=x.dtype)
        planes = x.reshape(self.planes, g.height, g.width)
        for pi, pj, (rows, cols), (qrows, qcols) in self._phases():
            arr[pi, pj, :, qrows, qcols] = planes[:, rows, cols]
        return arr.reshape(g.stride_h, g.stride_w, self.planes, self.qh * self.qw)

    def zeros(self) -> np.ndarray:
        g = self.g
        return np.zeros((g.stride_h, g.stride_w, self.planes, self.qh * self.qw),
                        dtype=self.dtype)

    def view(self, arr: np.ndarray, k: int) -> np.ndarray:
        """The (planes, out_h*qw) run of window offset k (row-major in the kernel)."""
        g = self.g
        i, j = divmod(k, g.kernel_w)
        start = (i // g.stride_h) * self.qw + j // g.stride_w
        return arr[i % g.stride_h, j % g.stride_w, :, start:start + self.run]

    def narrow(self, wide: np.ndarray) -> np.ndarray:
        """(planes, out_h*qw) -> (n, C, out_h, out_w), dropping the junk columns."""
        g = self.g
        return wide.reshape(self.n, g.channels, g.out_h, self.qw)[..., :g.out_w]

    def widen(self, a: np.ndarray, fill: Any) -> np.ndarray:
        """(n, C, out_h, out_w) -> (planes, out_h*qw) with ``fill`` in the junk columns."""
        g = self.g
        wide = np.full((self.n, g.channels, g.out_h, self.qw), fill, dtype=a.dtype)
        wide[..., :g.out_w] = a
        return wide.reshape(self.planes, self.run)

    def image_into(self, acc: np.ndarray, out: np.ndarray) -> None:
        """Write the image part of a ``zeros()``-shaped accumulator into out (n, C, H, W)."""
        g = self.g
        acc = acc.reshape(g.stride_h, g.stride_w, self.planes, self.qh, self.qw)
        if not out.flags.c_contiguous:
            raise ValueError("pooling gradients are written into a C-contiguous array")
        planes = out.reshape(self.planes, g.height, g.width)
        for pi, pj, (rows, cols), (qrows, qcols) in self._phases():
            planes[:, rows, cols] = acc[pi, pj, :, qrows, qcols]


def _index_dtype(window: int) -> Any:
    return np.int8 if window <= 127 else np.int16 if window <= 32767 else np.int32


def _max_pool_forward_cpu(x: np.ndarray, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    win = _Windows(g, x.shape[0], x.dtype)
    arr = win.layout(x, -np.inf)
    top = win.view(arr, 0).copy()
    idt = _index_dtype(g.window)
    arg = np.zeros(top.shape, dtype=idt)
    better = np.empty(top.shape, dtype=bool)
    step = np.empty(top.shape, dtype=idt)
    for k in range(1, g.window):
        v = win.view(arr, k)
        # strict >: ties keep the earlier offset, Caffe's first maximum in scan order.
        # Masked writes (copyto where=) branch per element and are several times slower
        # than these arithmetic blends.
        np.greater(v, top, out=better)
        np.maximum(top, v, out=top)
        np.subtract(idt(k), arg, out=step)
        step *= better.view(np.int8).astype(idt, copy=False)
        arg += step
    return win.narrow(top), win.narrow(arg)


def _max_pool_backward_cpu(dy: np.ndarray, arg: np.ndarray, g: Geometry, out: np.ndarray) -> None:
    win = _Windows(g, dy.shape[0], dy.dtype)
    acc = win.zeros()
    dyw = win.widen(dy, 0)
    argw = win.widen(arg, -1)
    hit = np.empty(argw.shape, dtype=bool)
    share = np.empty(dyw.shape, dtype=dy.dtype)
    for k in range(g.window):
        np.equal(argw, k, out=hit)
        np.multiply(dyw, hit, out=share)
        win.view(acc, k).__iadd__(share)
    win.image_into(acc, out)


def pool_sizes(g: Geometry, xp: Any, dtype: Any) -> Any:
    """Caffe's AVE divisor per output position: the window clipped to the padded image."""
    def sizes(out: int, stride: int, pad: int, kernel: int, size: int) -> np.ndarray:
        start = np.arange(out) * stride - pad
        return np.minimum(start + kernel, size + pad) - start
    hs = sizes(g.out_h, g.stride_h, g.pad_h, g.kernel_h, g.height)
    ws = sizes(g.out_w, g.stride_w, g.pad_w, g.kernel_w, g.width)
    return xp.asarray(np.outer(hs, ws).astype(dtype))


def _ave_pool_forward_cpu(x: np.ndarray, g: Geometry) -> np.ndarray:
    win = _Windows(g, x.shape[0], x.dtype)
    arr = win.layout(x, 0.0)
    top = win.view(arr, 0).copy()
    for k in range(1, g.window):
        top += win.view(arr, k)
    out = win.narrow(top)
    out /= pool_sizes(g, np, x.dtype)
    return out


def _ave_pool_backward_cpu(dy: np.ndarray, g: Geometry, out: np.ndarray) -> None:
    win = _Windows(g, dy.shape[0], dy.dtype)
    share = win.widen(dy / pool_sizes(g, np, dy.dtype), 0)
    acc = win.zeros()
    for k in range(g.window):
        win.view(acc, k).__iadd__(share)
    win.image_into(acc, out)


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
        return _im2col_cpu(x, g)
    import cupy
    x = cupy.ascontiguousarray(x)
    n = x.shape[0]
    col = cupy.empty((g.col_rows, n * g.out_h * g.out_w), dtype=x.dtype)
    _launch("im2col", x.dtype, col.size, x, col, np.int64(col.size), *_conv_args(g, n))
    return col


def col2im(col: Any, g: Geometry, n: int) -> Any:
    """Sum the columns back onto an (n, C, H, W) batch (the adjoint of ``im2col``).

    The CPU form may return a non-contiguous view; callers copy it where it must go.
    """
    if not backend.is_gpu_array(col):
        return _col2im_cpu(col, g, n)
    import cupy
    col = cupy.ascontiguousarray(col)
    im = cupy.empty((n, g.channels, g.height, g.width), dtype=col.dtype)
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
