"""Winograd's F(2x2, 3x3) convolution on the CPU: 2.25x fewer multiplies than im2col + GEMM.

A 3x3, stride 1 convolution computes each 2x2 output tile from a 4x4 input tile. Winograd's
minimal filtering (Lavin & Gray, arXiv:1509.09308) transforms the tile (``B^T d B``) and the
filter (``G g G^T``) into 16 points where the convolution is an elementwise product, so the
work is 16 GEMMs (output channels x input channels x tiles) and cheap adds around them:
4 x 4 = 16 multiplies per output pair of channels and tile of 4 outputs, where im2col's GEMM
does 36. OpenBLAS runs both GEMMs at the same speed, so the small 3x3 convolutions of
conv-heavy nets run ~1.5x faster here (measured in ``poseidon bench time``); PyTorch's oneDNN
and cuDNN choose this algorithm for such layers too.

The backward passes are the exact adjoints of that computation (the transposed transforms),
so the gradients are those of the forward, whatever the rounding. The result equals the
direct convolution up to float32 rounding (relative 1e-7 to 1e-6, like a different GEMM
blocking): `engine: CAFFE` in a layer's convolution_param keeps Caffe's im2col for users who
want Caffe's own order of sums.

Layout: the tiles' images are the innermost axis (C, tile rows, tile cols, images), so the
transforms' inner loops run over contiguous images and vectorise even when a tile row is
short (the 8x8 and 4x4 maps of small nets). The kernels need Numba; without it the layer
keeps im2col.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import cpu as compiled
from ..kernels.cpu import flat, flat_out, inline, jit

#: the filter transform G (4x3) as one (16, 9) matrix acting on a flattened 3x3 filter
_G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
_GG = {np.dtype(t): np.kron(_G, _G).astype(t) for t in (np.float32, np.float64)}

#: Winograd pays from this many input channels per group: below it the transforms cost more
#: than the GEMM saves (LeNet-like first layers with 1-3 channels)
MIN_CHANNELS = 16
#: ... and from this many images: they are the transforms' inner loop (fewer, on large maps:
#: one 56x56 image ran 0.5-0.8x im2col's speed)
MIN_IMAGES = 8
#: images per chunk: their transformed tiles (input and output) in about this many bytes
#: (measured 0.25-4 MB and unchunked: 2 MB was best or within noise on every shape; with
#: no chunks, 64 images of 16x16 ran 1.6x slower, their tiles out of cache)
CHUNK_BYTES = 2 << 20


def suits(geometry: Any, channels_per_group: int, images: int) -> bool:
    """Whether a convolution of this geometry runs faster as F(2x2, 3x3) on this CPU."""
    g = geometry
    return (compiled.available() and (g.kernel_h, g.kernel_w) == (3, 3)
            and (g.stride_h, g.stride_w, g.dilation_h, g.dilation_w) == (1, 1, 1, 1)
            and channels_per_group >= MIN_CHANNELS and images >= MIN_IMAGES)


# ------------------------------------------------------------------------- compiled kernels
# Flat C-contiguous arrays with unsigned indices, as in engine/kernels/cpu.py, so LLVM vectorises the
# inner loops; each inner loop reads and writes at most four streams (with sixteen, LLVM's
# aliasing checks gave up and a transform ran 5x slower).

@inline
def _bt(src, s0, s1, s2, s3, dst, d0, step, count):  # pragma: no cover - compiled
    # dst[d0 + k*step + t], k = 0..3, = B^T applied to the four source streams
    s0, s1, s2, s3 = np.uint64(s0), np.uint64(s1), np.uint64(s2), np.uint64(s3)
    d1, d2, d3 = np.uint64(d0 + step), np.uint64(d0 + 2 * step), np.uint64(d0 + 3 * step)
    d0 = np.uint64(d0)
    for t in range(np.uint64(count)):
        x0, x1, x2, x3 = src[s0 + t], src[s1 + t], src[s2 + t], src[s3 + t]
        dst[d0 + t] = x0 - x2
        dst[d1 + t] = x1 + x2
        dst[d2 + t] = x2 - x1
        dst[d3 + t] = x1 - x3


@inline
def _bt_adjoint(src, s0, step, dst, d0, d1, d2, d3, count):  # pragma: no cover - compiled
    # the transpose of _bt: dst streams d0..d3 += B applied to src[s0 + k*step + t]
    s1, s2, s3 = np.uint64(s0 + step), np.uint64(s0 + 2 * step), np.uint64(s0 + 3 * step)
    s0 = np.uint64(s0)
    d0, d1, d2, d3 = np.uint64(d0), np.uint64(d1), np.uint64(d2), np.uint64(d3)
    for t in range(np.uint64(count)):
        o0, o1, o2, o3 = src[s0 + t], src[s1 + t], src[s2 + t], src[s3 + t]
        dst[d0 + t] += o0
        dst[d1 + t] += (o1 - o2) + o3
        dst[d2 + t] += (o1 + o2) - o0
        dst[d3 + t] -= o3


@jit
def _tiles(xt, tmp, v, adjoint, channels, th, tw, n):  # pragma: no cover - compiled
    # xt (C, 2th+2, 2tw+2, n) <-> v (16, C, th, tw, n): B^T d B of every 4x4 tile (stride 2),
    # rows then columns through tmp (4, C, th, 2tw+2, n); the adjoint goes back the same way
    # and sums where the tiles overlap
    row = (2 * tw + 2) * n
    tplane = channels * th * row
    plane = channels * th * tw * n
    if adjoint:
        for t in range(np.uint64(tmp.size)):
            tmp[t] = 0
        for t in range(np.uint64(xt.size)):
            xt[t] = 0
        _tile_columns(tmp, v, True, channels, th, tw, n, row, plane)
    for c in range(channels):
        for i in range(th):
            s = (c * (2 * th + 2) + 2 * i) * row
            d = (c * th + i) * row
            if adjoint:
                _bt_adjoint(tmp, d, tplane, xt, s, s + row, s + 2 * row, s + 3 * row, row)
            else:
                _bt(xt, s, s + row, s + 2 * row, s + 3 * row, tmp, d, tplane, row)
    if not adjoint:
        _tile_columns(tmp, v, False, channels, th, tw, n, row, plane)


@inline
def _tile_columns(tmp, v, adjoint, channels, th, tw, n, row, plane):  # pragma: no cover
    for a in range(4):
        for c in range(channels):
            for i in range(th):
                for j in range(tw):
                    s = ((a * channels + c) * th + i) * row + 2 * j * n
                    d = 4 * a * plane + ((c * th + i) * tw + j) * n
                    if adjoint:
                        _bt_adjoint(v, d, plane, tmp, s, s + n, s + 2 * n, s + 3 * n, n)
                    else:
                        _bt(tmp, s, s + n, s + 2 * n, s + 3 * n, v, d, plane, n)


@inline
def _at(src, s0, step, dst, d0, d1, count):  # pragma: no cover - compiled
    # dst streams d0, d1 = A^T applied to src[s0 + k*step + t], k = 0..3
    s1, s2, s3 = np.uint64(s0 + step), np.uint64(s0 + 2 * step), np.uint64(s0 + 3 * step)
    s0, d0, d1 = np.uint64(s0), np.uint64(d0), np.uint64(d1)
    for t in range(np.uint64(count)):
        x0, x1, x2, x3 = src[s0 + t], src[s1 + t], src[s2 + t], src[s3 + t]
        dst[d0 + t] = x0 + x1 + x2
        dst[d1 + t] = x1 - x2 - x3


@inline
def _at_adjoint(src, s0, s1, dst, d0, step, count):  # pragma: no cover - compiled
    # the transpose of _at: dst[d0 + k*step + t], k = 0..3, = A applied to streams s0, s1
    d1, d2, d3 = np.uint64(d0 + step), np.uint64(d0 + 2 * step), np.uint64(d0 + 3 * step)
    s0, s1, d0 = np.uint64(s0), np.uint64(s1), np.uint64(d0)
    for t in range(np.uint64(count)):
        y0, y1 = src[s0 + t], src[s1 + t]
        dst[d0 + t] = y0
        dst[d1 + t] = y0 + y1
        dst[d2 + t] = y0 - y1
        dst[d3 + t] = -y1


@jit
def _outputs(m, tmp, yt, adjoint, k_, th, tw, n):  # pragma: no cover - compiled
    # m (16, K, th, tw, n) <-> yt (K, 2th, 2tw, n): A^T m A of every tile, columns then rows
    # through tmp (4, K, th, 2tw, n); the adjoint goes back the same way
    row = 2 * tw * n
    tplane = k_ * th * row
    plane = k_ * th * tw * n
    if adjoint:
        for k in range(k_):
            for i in range(th):
                s = (k * 2 * th + 2 * i) * row
                _at_adjoint(yt, s, s + row, tmp, (k * th + i) * row, tplane, row)
    for a in range(4):
        for k in range(k_):
            for i in range(th):
                for j in range(tw):
                    s = 4 * a * plane + ((k * th + i) * tw + j) * n
                    d = ((a * k_ + k) * th + i) * row + 2 * j * n
                    if adjoint:
                        _at_adjoint(tmp, d, d + n, m, s, plane, n)
                    else:
                        _at(m, s, plane, tmp, d, d + n, n)
    if not adjoint:
        for k in range(k_):
            for i in range(th):
                d = (k * 2 * th + 2 * i) * row
                _at(tmp, (k * th + i) * row, tplane, yt, d, d + row, row)


@jit
def _images_last(x, xt, adjoint, n, channels, h, w, hp, wp, ph, pw,
                 bias, biased):  # pragma: no cover
    # x (n, C, h, w) <-> xt (C, hp, wp, n) at offset (ph, pw), zero outside: images go
    # innermost. The loops read (or write) x in order: a stride of C*h*w floats, often a
    # power of two, made the other order 3x slower on cache set conflicts. Writing x, each
    # channel's ``bias`` is added when ``biased``: the sum a pass of its own would make.
    nn = np.uint64(n)
    if not adjoint:
        for c in range(channels):
            for r in range(hp):
                for q in range(wp):
                    if r < ph or r >= ph + h or q < pw or q >= pw + w:
                        d = np.uint64(((c * hp + r) * wp + q) * n)
                        for t in range(nn):
                            xt[d + t] = 0
    for b in range(n):
        for c in range(channels):
            for r in range(h):
                s = np.uint64(((b * channels + c) * h + r) * w)
                d = np.uint64(((c * hp + r + ph) * wp + pw) * n + b)
                if adjoint and biased:
                    bc = bias[c]
                    for q in range(np.uint64(w)):
                        x[s + q] = xt[d + q * nn] + bc
                elif adjoint:
                    for q in range(np.uint64(w)):
                        x[s + q] = xt[d + q * nn]
                else:
                    for q in range(np.uint64(w)):
                        xt[d + q * nn] = x[s + q]


# ------------------------------------------------------------------------------ the algorithm

_NO_BIAS = {np.dtype(t): np.zeros(1, t) for t in (np.float32, np.float64)}


def _bias(bias: np.ndarray | None, dtype: Any) -> tuple[np.ndarray, bool]:
    """``_images_last``'s bias arguments: (the per-channel vector, whether to add it)."""
    return (_NO_BIAS[np.dtype(dtype)], False) if bias is None else (bias.reshape(-1), True)


def filters(w: np.ndarray, group: int) -> np.ndarray:
    """U (group, 16, K/group, C/group) = G w G^T of the (K, C/group, 3, 3) weights."""
    k, cg = w.shape[:2]
    u = (_GG[w.dtype] @ w.reshape(k * cg, 9).T).reshape(16, group, -1, cg)
    return u.transpose(1, 0, 2, 3)


class Plan:
    """One layer's F(2x2, 3x3) convolution: its geometry, run on chunks of images that keep
    the transformed tiles in cache."""

    def __init__(self, geometry: Any, num_output: int, group: int, images: int):
        g = geometry
        self.g, self.group, self.channels, self.num_output = g, group, g.channels, num_output
        self.th, self.tw = (g.out_h + 1) // 2, (g.out_w + 1) // 2
        per_image = 16 * (g.channels + num_output) * self.th * self.tw * 4
        # a multiple of 8 images: the transforms' inner loops then have no scalar remainder
        step = max(MIN_IMAGES, CHUNK_BYTES // per_image // 8 * 8)
        self.chunks = [slice(s, min(s + step, images)) for s in range(0, images, step)]

    def forward(self, x: np.ndarray, w: np.ndarray, y: np.ndarray,
                bias: np.ndarray | None = None) -> None:
        """y (n, K, out_h, out_w) = the convolution of x (n, C, H, W) with w, plus each
        output channel's ``bias`` (added as the tiles go back to images)."""
        u = filters(w, self.group)
        for s in self.chunks:
            v = self._grouped(self._input_tiles(x[s]))
            m = np.empty((16, self.num_output, v.shape[-1]), x.dtype)
            np.matmul(u, v, out=self._grouped(m))
            self._to_images(m, y[s], bias)

    def backward(self, dy: np.ndarray, x: np.ndarray, w: np.ndarray, dw: np.ndarray | None,
                 dx: np.ndarray | None) -> None:
        """dw (K, C/group, 3, 3) += the weight gradient; dx (n, C, H, W) = the bottom's."""
        ut = filters(w, self.group).transpose(0, 1, 3, 2)
        du = 0
        for s in self.chunks:
            dm = self._grouped(self._from_images(dy[s]))
            if dw is not None:
                du = du + np.matmul(dm, self._grouped(self._input_tiles(x[s])).transpose(0, 1, 3, 2))
            if dx is not None:
                dv = np.empty((16, self.channels, dm.shape[-1]), dx.dtype)
                np.matmul(ut, dm, out=self._grouped(dv))
                self._tiles_to_images(dv, dx[s])
        if dw is not None:   # G^T dU G: (group, 16, K/g, C/g) -> (K, C/g, 3, 3)
            k, cg = dw.shape[:2]
            dw += (du.transpose(1, 0, 2, 3).reshape(16, k * cg).T
                   @ _GG[dw.dtype]).reshape(dw.shape)

    def _grouped(self, a: np.ndarray) -> np.ndarray:
        """(16, C, tiles) -> (group, 16, C/group, tiles) view."""
        return a.reshape(16, self.group, -1, a.shape[-1]).transpose(1, 0, 2, 3)

    def _padded(self, n: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
        """The images-last padded input (C, 2th+2, 2tw+2, n) and the transform's scratch."""
        th, tw, c = self.th, self.tw, self.channels
        return (np.empty((c, 2 * th + 2, 2 * tw + 2, n), dtype),
                np.empty(4 * c * th * (2 * tw + 2) * n, dtype))

    def _input_tiles(self, x: np.ndarray) -> np.ndarray:
        """V (16, C, tiles) of the images x (n, C, H, W)."""
        g, th, tw, n, c = self.g, self.th, self.tw, x.shape[0], self.channels
        xt, tmp = self._padded(n, x.dtype)
        _images_last(flat(x), xt.reshape(-1), False, n, c, g.height, g.width, 2 * th + 2,
                     2 * tw + 2, g.pad_h, g.pad_w, *_bias(None, x.dtype))
        v = np.empty((16, c, th * tw * n), x.dtype)
        _tiles(xt.reshape(-1), tmp, v.reshape(-1), False, c, th, tw, n)
        return v

    def _tiles_to_images(self, dv: np.ndarray, dx: np.ndarray) -> None:
        """The adjoint of _input_tiles: dx (n, C, H, W) = the tiles' gradients, summed."""
        g, th, tw, n, c = self.g, self.th, self.tw, dx.shape[0], self.channels
        xt, tmp = self._padded(n, dx.dtype)
        _tiles(xt.reshape(-1), tmp, dv.reshape(-1), True, c, th, tw, n)
        _images_last(flat_out(dx), xt.reshape(-1), True, n, c, g.height, g.width, 2 * th + 2,
                     2 * tw + 2, g.pad_h, g.pad_w, *_bias(None, dx.dtype))

    def _outputs_last(self, n: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
        """The images-last output tiles (K, 2th, 2tw, n) and the transform's scratch."""
        th, tw, k = self.th, self.tw, self.num_output
        return (np.empty((k, 2 * th, 2 * tw, n), dtype),
                np.empty(4 * k * th * 2 * tw * n, dtype))

    def _to_images(self, m: np.ndarray, y: np.ndarray, bias: np.ndarray | None) -> None:
        """y (n, K, out_h, out_w) = A^T m A of the GEMMs' result m (16, K, tiles), plus
        ``bias``."""
        g, th, tw, n, k = self.g, self.th, self.tw, y.shape[0], self.num_output
        yt, tmp = self._outputs_last(n, y.dtype)
        _outputs(m.reshape(-1), tmp, yt.reshape(-1), False, k, th, tw, n)
        _images_last(flat_out(y), yt.reshape(-1), True, n, k, g.out_h, g.out_w, 2 * th, 2 * tw,
                     0, 0, *_bias(bias, y.dtype))

    def _from_images(self, dy: np.ndarray) -> np.ndarray:
        """The adjoint of _to_images: dM (16, K, tiles) of the top's gradient dy."""
        g, th, tw, n, k = self.g, self.th, self.tw, dy.shape[0], self.num_output
        yt, tmp = self._outputs_last(n, dy.dtype)
        _images_last(flat(dy), yt.reshape(-1), False, n, k, g.out_h, g.out_w, 2 * th, 2 * tw,
                     0, 0, *_bias(None, dy.dtype))
        m = np.empty((16, k, th * tw * n), dy.dtype)
        _outputs(m.reshape(-1), tmp, yt.reshape(-1), True, k, th, tw, n)
        return m


def warm(dtype: Any) -> None:
    """Compile, or load from the disk cache, this module's kernels for ``dtype`` arrays: one
    forward and backward of the smallest convolution that runs as F(2x2, 3x3)."""
    from ..kernels.geometry import Geometry

    g = Geometry(channels=MIN_CHANNELS, height=2, width=2, kernel_h=3, kernel_w=3, pad_h=1,
                 pad_w=1, out_h=2, out_w=2)
    x = np.zeros((MIN_IMAGES, g.channels, 2, 2), dtype)
    w = np.zeros((1, g.channels, 3, 3), dtype)
    y = np.empty((MIN_IMAGES, 1, 2, 2), dtype)
    plan = Plan(g, 1, 1, MIN_IMAGES)
    plan.forward(x, w, y)
    plan.backward(y, x, w, np.zeros_like(w), np.empty_like(x))
