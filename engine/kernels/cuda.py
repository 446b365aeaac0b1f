"""The vision layers' CUDA kernels for CuPy (im2col, col2im, max and average pooling and their
backwards), compiled once per dtype on first use; the NumPy forms in engine/layers are their
reference. Only reached with CuPy arrays.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .geometry import Geometry

SOURCE = r"""
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


def kernel(name: str, dtype: Any) -> Any:
    """The compiled RawKernel ``name`` for float32 or float64."""
    import cupy  # only reached with CuPy arrays

    ctype = {np.dtype(np.float32): ("float", "3.402823466e+38F"),
             np.dtype(np.float64): ("double", "1.7976931348623158e+308")}.get(np.dtype(dtype))
    if ctype is None:
        raise TypeError(f"GPU vision kernels take float32 or float64, not {np.dtype(dtype)}")
    key = (name, ctype[0])
    if key not in _kernels:
        header = f"#define T {ctype[0]}\n#define FLT_MAX_T {ctype[1]}\n"
        module = cupy.RawModule(code=header + SOURCE)
        for kname in ("im2col", "col2im", "max_pool_forward", "max_pool_backward",
                      "ave_pool_forward", "ave_pool_backward"):
            _kernels[(kname, ctype[0])] = module.get_function(kname)
    return _kernels[key]


def launch(name: str, dtype: Any, total: int, *args: Any) -> None:
    threads = 256
    blocks = max(1, min((total + threads - 1) // threads, 65535))
    kernel(name, dtype)((blocks,), (threads,), args)


def geometry_args(g: Geometry) -> tuple[np.int32, ...]:
    return tuple(np.int32(v) for v in (g.channels, g.height, g.width, g.kernel_h, g.kernel_w,
                                       g.stride_h, g.stride_w, g.pad_h, g.pad_w))


def conv_args(g: Geometry, n: int) -> tuple[np.int32, ...]:
    return tuple(np.int32(v) for v in (n, g.channels, g.height, g.width, g.kernel_h, g.kernel_w,
                                       g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dilation_h,
                                       g.dilation_w, g.out_h, g.out_w))
