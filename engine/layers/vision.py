"""Vision layers: Convolution, Deconvolution, Pooling, SPP, Im2col, Crop, with Caffe's
numerics.

Convolution lowers each chunk of the minibatch to columns (``im2col``) and does one GEMM
per group; Deconvolution is the same machinery run backwards (Caffe's weight layout
``(channels_in, num_output / group, kh, kw)``). Two spatial axes are supported.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from .. import backend, fillers
from ..blob import Blob
from ..kernels import cudnn_conv
from ..kernels.geometry import Geometry, conv_out_size, pool_out_size
from ..pb import caffe_pb2
from . import im2col as K
from . import pool, winograd
from .base import Layer, LayerError, register

log = logging.getLogger(__name__)
#: layers already said to keep im2col on the GPU (once each, not at every reshape)
_SAID_NO_CUDNN: set[str] = set()

_POOL = caffe_pb2.PoolingParameter
#: Weight gradients with at most this many entries per group are summed image by image
SMALL_WEIGHT_GRADIENT = 2048
#: Convolutions with at most this many column rows per group filter image by image
PER_IMAGE_FILTER_ROWS = 128
_SPP = caffe_pb2.SPPParameter


def _spatial_values(layer: Layer, param: Any, name: str, default: int,
                    num_spatial: int) -> tuple[int, int]:
    """(h, w) from the repeated ``name`` or from ``<prefix>_h``/``<prefix>_w``, as Caffe reads them.

    ``kernel_size`` pairs with ``kernel_h``/``kernel_w``; ``dilation`` has no _h/_w form.
    """
    prefix = "kernel" if name == "kernel_size" else name
    has_hw = name != "dilation" and (param.HasField(f"{prefix}_h") or param.HasField(f"{prefix}_w"))
    values = [int(v) for v in getattr(param, name)]
    if has_hw:
        if values:
            raise layer.fail(f"either {name} or {prefix}_h/{prefix}_w should be specified; "
                             "not both")
        return int(getattr(param, f"{prefix}_h")), int(getattr(param, f"{prefix}_w"))
    if not values:
        return default, default
    if len(values) not in (1, num_spatial):
        raise layer.fail(f"{name} must be specified once, or once per spatial dimension "
                         f"(got {len(values)} values for {num_spatial} dimensions)")
    return values[0], values[-1]


_Pair = tuple[int, int]


def _window_params(layer: Layer, param: Any,
                   num_spatial: int) -> tuple[_Pair, _Pair, _Pair, _Pair]:
    """(kernel, pad, stride, dilation), each (h, w), of a ConvolutionParameter, checked."""
    kernel = _spatial_values(layer, param, "kernel_size", 0, num_spatial)
    if min(kernel) <= 0:
        raise layer.fail(f"filter dimensions must be nonzero, got {kernel}")
    pad = _spatial_values(layer, param, "pad", 0, num_spatial)
    stride = _spatial_values(layer, param, "stride", 1, num_spatial)
    if min(stride) <= 0:
        raise layer.fail(f"stride dimensions must be nonzero, got {stride}")
    dilation = _spatial_values(layer, param, "dilation", 1, num_spatial)
    if min(dilation) <= 0:
        raise layer.fail(f"dilation must be positive, got {dilation}")
    return kernel, pad, stride, dilation


def _image_chunks(xp: Any, g: K.Geometry, num: int, itemsize: int) -> list[slice]:
    """Slices of the ``num`` images whose im2col columns make one chunk (``K.chunk_size``)."""
    per_image = g.col_rows * g.out_h * g.out_w * itemsize
    step = K.chunk_size(xp, num, per_image)
    return [slice(s, min(s + step, num)) for s in range(0, num, step)]


def _two_spatial_axes(layer: Layer, bottom: Blob, axis_param: int) -> int:
    """The canonical channel axis, which must be followed by exactly 2 spatial axes."""
    try:
        channel_axis = bottom.canonical_axis(axis_param)
    except ValueError:
        raise layer.fail(f"axis {axis_param} out of range for bottom shape "
                         f"{bottom.shape}") from None
    num_spatial = bottom.num_axes() - channel_axis - 1
    if num_spatial != 2:
        raise layer.fail(f"only 2 spatial axes are supported, got {num_spatial} "
                         f"(bottom shape {bottom.shape}, axis {axis_param})")
    return channel_axis


class _BaseConvolution(Layer):
    """What Convolution and Deconvolution share: parameters, weights, and the GEMMs."""

    min_bottoms = 1
    min_tops = 1
    #: Deconvolution swaps the roles of input and output channels
    transposed = False

    def check_blob_counts(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().check_blob_counts(bottom, top)
        if len(bottom) != len(top):
            raise self.fail(f"needs as many tops as bottoms, got {len(bottom)} and {len(top)}")

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.convolution_param
        b0 = bottom[0]
        self.channel_axis = _two_spatial_axes(self, b0, p.axis)
        self.kernel, self.pad, self.stride, self.dilation = _window_params(self, p, 2)
        self.channels = b0.shape[self.channel_axis]
        self.num_output = int(p.num_output)
        self.group = int(p.group)
        if self.num_output <= 0:
            raise self.fail("num_output must be positive")
        if self.group <= 0 or self.channels % self.group or self.num_output % self.group:
            raise self.fail(f"group {self.group} must divide both the input channels "
                            f"({self.channels}) and num_output ({self.num_output})")
        self.bias_term = bool(p.bias_term)
        xp = backend.get_array_module(b0.data)
        if self.transposed:
            wshape = (self.channels, self.num_output // self.group, *self.kernel)
        else:
            wshape = (self.num_output, self.channels // self.group, *self.kernel)
        weight = Blob(wshape, dtype=b0.dtype, xp=xp, name=f"{self.name}/0")
        fillers.fill(p.weight_filler, weight)
        self.blobs = [weight]
        if self.bias_term:
            bias = Blob((self.num_output,), dtype=b0.dtype, xp=xp, name=f"{self.name}/1")
            fillers.fill(p.bias_filler, bias)
            self.blobs.append(bias)
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        ax = self.channel_axis
        if len(shape) != ax + 3:
            raise self.fail(f"bottom shape {shape} does not have 2 spatial axes after axis {ax}")
        if shape[ax] != self.channels:
            raise self.fail(f"bottom has {shape[ax]} channels, the layer was set up for "
                            f"{self.channels}")
        for b in bottom[1:]:
            if b.shape != shape:
                raise self.fail(f"all bottoms must have the same shape: {b.shape} vs {shape}")
        (kh, kw), (ph, pw) = self.kernel, self.pad
        (sh, sw), (dh, dw) = self.stride, self.dilation
        height, width = shape[ax + 1], shape[ax + 2]
        if self.transposed:
            out_h = sh * (height - 1) + dh * (kh - 1) + 1 - 2 * ph
            out_w = sw * (width - 1) + dw * (kw - 1) + 1 - 2 * pw
            # the columns live on the top: the bottom is the grid of window positions
            self.geometry = Geometry(self.num_output, out_h, out_w, kh, kw, sh, sw, ph, pw,
                                       dh, dw, height, width)
        else:
            out_h = conv_out_size(height, kh, ph, sh, dh)
            out_w = conv_out_size(width, kw, pw, sw, dw)
            self.geometry = Geometry(self.channels, height, width, kh, kw, sh, sw, ph, pw,
                                       dh, dw, out_h, out_w)
        if out_h <= 0 or out_w <= 0:
            raise self.fail(f"output size {out_h}x{out_w} is not positive for input "
                            f"{height}x{width} (kernel {self.kernel}, pad {self.pad}, "
                            f"stride {self.stride}, dilation {self.dilation})")
        self.num = bottom[0].count_range(0, ax)
        for t in top:
            t.reshape((*shape[:ax], self.num_output, out_h, out_w))
        key = (self.geometry, self.num, backend.is_gpu_array(bottom[0].data), bottom[0].dtype)
        if key != getattr(self, "_plan_key", None):  # Caffe reshapes at every forward
            self.plan, self._plan_key = self._fast_plan(bottom[0]), key

    def _fast_plan(self, bottom: Blob) -> Any:
        """Winograd on the CPU, cuDNN on the GPU, unless the layer asks for `engine: CAFFE`
        (im2col + GEMM, Caffe's own order of sums) or neither suits its shape."""
        if self.param.convolution_param.engine == caffe_pb2.ConvolutionParameter.CAFFE:
            return None
        if backend.get_array_module(bottom.data) is np:
            if not self.transposed and winograd.suits(self.geometry, self.channels // self.group,
                                                      self.num):
                return winograd.Plan(self.geometry, self.num_output, self.group, self.num)
            return None
        if not cudnn_conv.suits(bottom.dtype):
            return None
        grid_channels = self.channels if self.transposed else self.num_output
        try:
            return cudnn_conv.Plan(self.geometry, grid_channels, self.group, self.num,
                                   transposed=self.transposed)
        except Exception as e:  # cuDNN has no engine for this shape: im2col still runs it
            if self.name not in _SAID_NO_CUDNN:
                _SAID_NO_CUDNN.add(self.name)
                log.warning("layer '%s': cuDNN cannot run this convolution (%s); it uses "
                            "im2col + GEMM", self.name, str(e).splitlines()[0][:200])
            return None

    # -- shared helpers ---------------------------------------------------------------
    def _grouped_weight(self) -> Any:
        w = self.blobs[0].data
        return w.reshape(self.group, w.shape[0] // self.group, -1)

    def _channel_major(self, a: Any) -> Any:
        """(n, C, h, w) -> (group, C/group, n*h*w), the GEMM operand layout."""
        xp = backend.get_array_module(a)
        n, c = a.shape[:2]
        return xp.ascontiguousarray(a.reshape(n, c, -1).transpose(1, 0, 2)).reshape(
            self.group, c // self.group, -1)

    @staticmethod
    def _batch_major(m: Any, n: int, spatial: tuple[int, int]) -> Any:
        """(group, C/group, n*h*w) -> (n, C, h, w) view."""
        c = m.shape[0] * m.shape[1]
        return m.reshape(c, n, *spatial).transpose(1, 0, 2, 3)

    def _chunks(self, xp: Any, itemsize: int) -> list[slice]:
        return _image_chunks(xp, self.geometry, self.num, itemsize)

    def _images(self, a: Any, channels: int) -> Any:
        """The blob array as (num, channels, H, W)."""
        return a.reshape(self.num, channels, *a.shape[-2:])

    def _add_bias(self, top: Any) -> None:
        if self.bias_term:
            top += self.blobs[1].data.reshape(1, -1, 1, 1)

    def _bias_gradient(self, top_diff: Any) -> None:
        # Caffe's order: a GEMV per image over its pixels, then the images in turn (a
        # reduction over two axes of the blob was 3x slower)
        if self.bias_term and self.param_propagate_down[1]:
            xp = backend.get_array_module(top_diff)
            per_pixel = top_diff.reshape(self.num * self.num_output, -1)
            ones = xp.ones(per_pixel.shape[1], dtype=top_diff.dtype)
            self.blobs[1].diff += xp.matmul(per_pixel, ones).reshape(self.num, -1).sum(axis=0)

    def _weight_gradient(self, dy: Any, col: Any, dw: Any) -> None:
        """dw (group, C/group, rows) += dy (n, C, h, w) times the chunk's columns'
        transpose (group, rows, n*h*w)."""
        xp = backend.get_array_module(dy)
        n = dy.shape[0]
        if dw.shape[1] * dw.shape[2] <= SMALL_WEIGHT_GRADIENT:
            # one small GEMM per image, summed in image order (Caffe's): a single GEMM with
            # a very long inner dimension ran 2.7x slower (LeNet's conv1, 20 x 25 x 36864)
            per_image = col.reshape(col.shape[0], col.shape[1], n, -1).transpose(2, 0, 3, 1)
            dw += xp.matmul(dy.reshape(n, self.group, dw.shape[1], -1), per_image).sum(axis=0)
        else:
            # as dw^T = col dy^T: OpenBLAS ran this orientation 1.02-1.35x faster on the
            # reference nets' convolutions (LeNet's conv2: 0.59 against 0.80 ms a chunk)
            dw += xp.matmul(col, self._channel_major(dy).transpose(0, 2, 1)).transpose(0, 2, 1)

    def _forward_chunk(self, wg: Any, x: Any, y: Any) -> None:
        """y = this layer's linear map of x, for a chunk of images (no bias)."""
        raise NotImplementedError

    def _backward_chunk(self, wg: Any, x: Any, dy: Any, dw: Any | None, dx: Any | None) -> None:
        """For a chunk of images: dw += the weight gradient (when dw is given), dx = the
        bottom's gradient (when dx is given)."""
        raise NotImplementedError

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        wg = self._grouped_weight()
        for b, t in zip(bottom, top):
            x = self._images(b.data, self.channels)
            y = self._images(t.data, self.num_output)
            if self.plan:
                self.plan.forward(x, self.blobs[0].data, y)
                self._add_bias(y)
                continue
            for s in self._chunks(xp, x.dtype.itemsize):
                self._forward_chunk(wg, x[s], y[s])
                self._add_bias(y[s])  # while the chunk is in cache

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        xp = backend.get_array_module(top[0].diff)
        wg = self._grouped_weight()
        want_w = self.param_propagate_down[0]
        for t, down, b in zip(top, propagate_down, bottom):
            dy = self._images(t.diff, self.num_output)
            self._bias_gradient(dy)
            if not (want_w or down):
                continue
            x = self._images(b.data, self.channels)
            dx = self._images(b.diff, self.channels) if down else None
            if self.plan:
                self.plan.backward(dy, x, self.blobs[0].data,
                                   self.blobs[0].diff if want_w else None, dx)
                continue
            dw = self.blobs[0].diff.reshape(wg.shape) if want_w else None
            for s in self._chunks(xp, x.dtype.itemsize):
                self._backward_chunk(wg, x[s], dy[s], dw, None if dx is None else dx[s])


@register("Convolution", "CONVOLUTION")
class ConvolutionLayer(_BaseConvolution):
    """Caffe's Convolution: im2col + one GEMM per group and chunk."""

    def _filter(self, wg: Any, col: Any, y: Any) -> None:
        """y (n, C_out, h, w) = the grouped weights times a chunk's columns."""
        xp = backend.get_array_module(col)
        n = y.shape[0]
        if col.shape[1] <= PER_IMAGE_FILTER_ROWS:
            # one GEMM per image, straight into the top: with few rows the GEMM is cheap
            # and the transposing copy is not (LeNet's conv1 0.32 -> 0.20 ms a chunk)
            per_image = col.reshape(col.shape[0], col.shape[1], n, -1).transpose(2, 0, 1, 3)
            xp.matmul(wg, per_image, out=y.reshape(n, self.group, wg.shape[1], -1))
        else:
            y[...] = self._batch_major(xp.matmul(wg, col), n, y.shape[2:])

    def _forward_chunk(self, wg: Any, x: Any, y: Any) -> None:
        g = self.geometry
        col = K.im2col(x, g).reshape(self.group, g.col_rows // self.group, -1)
        self._filter(wg, col, y)

    def _backward_chunk(self, wg: Any, x: Any, dy: Any, dw: Any | None, dx: Any | None) -> None:
        g = self.geometry
        if dw is not None:
            col = K.im2col(x, g).reshape(self.group, g.col_rows // self.group, -1)
            self._weight_gradient(dy, col, dw)
        if dx is not None:
            xp = backend.get_array_module(dy)
            dcol = xp.matmul(wg.transpose(0, 2, 1), K.grid_operand(dy, g, self.group))
            K.col2im(dcol.reshape(g.col_rows, -1), g, dy.shape[0], out=dx)


@register("Deconvolution", "DECONVOLUTION")
class DeconvolutionLayer(_BaseConvolution):
    """Caffe's Deconvolution: the transpose of Convolution (forward is col2im of W^T x)."""

    transposed = True

    def _forward_chunk(self, wg: Any, x: Any, y: Any) -> None:
        g = self.geometry
        xp = backend.get_array_module(x)
        col = xp.matmul(wg.transpose(0, 2, 1), K.grid_operand(x, g, self.group))
        K.col2im(col.reshape(g.col_rows, -1), g, x.shape[0], out=y)

    def _backward_chunk(self, wg: Any, x: Any, dy: Any, dw: Any | None, dx: Any | None) -> None:
        g = self.geometry
        col = K.im2col(dy, g).reshape(self.group, g.col_rows // self.group, -1)
        if dw is not None:
            self._weight_gradient(x, col, dw)
        if dx is not None:
            xp = backend.get_array_module(dy)
            dx[...] = self._batch_major(xp.matmul(wg, col), dy.shape[0], (g.out_h, g.out_w))


@register("Pooling", "POOLING")
class PoolingLayer(Layer):
    """Caffe's Pooling: MAX (optional mask top) and AVE, with pad, stride and global pooling."""

    exact_num_bottoms = 1
    min_tops = 1

    def check_blob_counts(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        # only MAX pooling has the optional second top (the argmax mask)
        self.max_tops = 2 if self.param.pooling_param.pool == _POOL.MAX else 1
        super().check_blob_counts(bottom, top)

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.pooling_param
        self.method = p.pool
        if self.method == _POOL.STOCHASTIC:
            raise self.fail("STOCHASTIC pooling is not supported (Caffe has no CPU form of it)")
        has = p.HasField
        self.global_pooling = bool(p.global_pooling)
        if self.global_pooling:
            if has("kernel_size") or has("kernel_h") or has("kernel_w"):
                raise self.fail("with global_pooling: true, the filter size cannot be specified")
        else:
            if has("kernel_size") == (has("kernel_h") and has("kernel_w")):
                raise self.fail("filter size is kernel_size OR kernel_h and kernel_w; not both")
            if not (has("kernel_size") or (has("kernel_h") and has("kernel_w"))):
                raise self.fail("for non-square filters both kernel_h and kernel_w are required")
        for name in ("pad", "stride"):
            if not ((not has(name) and has(f"{name}_h") and has(f"{name}_w"))
                    or (not has(f"{name}_h") and not has(f"{name}_w"))):
                raise self.fail(f"{name} is {name} OR {name}_h and {name}_w are required")
        if has("kernel_size"):
            self.kernel = (int(p.kernel_size), int(p.kernel_size))
        else:
            self.kernel = (int(p.kernel_h), int(p.kernel_w))
        self.pad = (int(p.pad_h), int(p.pad_w)) if has("pad_h") else (int(p.pad), int(p.pad))
        self.stride = ((int(p.stride_h), int(p.stride_w)) if has("stride_h")
                       else (int(p.stride), int(p.stride)))
        if self.global_pooling:
            if self.pad != (0, 0) or self.stride != (1, 1):
                raise self.fail("with global_pooling: true, only pad = 0 and stride = 1")
        elif min(self.kernel) <= 0:
            raise self.fail(f"filter dimensions cannot be zero, got {self.kernel}")
        if min(self.stride) <= 0:
            raise self.fail(f"stride must be positive, got {self.stride}")
        if self.pad != (0, 0) and (self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]) \
                and not self.global_pooling:
            raise self.fail(f"pad {self.pad} must be smaller than the kernel {self.kernel}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.fail(f"input must have 4 axes (num, channels, height, width), "
                            f"got shape {shape}")
        n, c, h, w = shape
        kernel = (h, w) if self.global_pooling else self.kernel
        (kh, kw), (ph, pw), (sh, sw) = kernel, self.pad, self.stride
        any_pad = ph != 0 or pw != 0
        out_h = pool_out_size(h, kh, ph, sh, any_pad)
        out_w = pool_out_size(w, kw, pw, sw, any_pad)
        if out_h <= 0 or out_w <= 0:
            raise self.fail(f"kernel {kernel} is larger than the padded input {h}x{w}")
        self.geometry = Geometry(c, h, w, kh, kw, sh, sw, ph, pw, 1, 1, out_h, out_w)
        for t in top:
            t.reshape((n, c, out_h, out_w))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        if self.method == _POOL.MAX:
            out, self.argmax = pool.max_pool_forward(x, self.geometry)
            if len(top) > 1:
                top[1].data[...] = pool.max_pool_mask(self.argmax, self.geometry)
        else:
            out = pool.ave_pool_forward(x, self.geometry)
        top[0].data[...] = out

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if self.method == _POOL.MAX:
            pool.max_pool_backward(dy, self.argmax, self.geometry, bottom[0].diff)
        else:
            pool.ave_pool_backward(dy, self.geometry, bottom[0].diff)


@register("Crop")
class CropLayer(Layer):
    """Caffe's Crop: bottom[0] cut to bottom[1]'s shape from ``axis`` on, at ``offset``."""

    exact_num_bottoms = 2
    exact_num_tops = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.crop_param
        a, b = bottom[0].shape, bottom[1].shape
        if len(a) != len(b):
            raise self.fail(f"bottoms have different numbers of axes: {a} and {b}")
        start = bottom[0].canonical_axis(p.axis)
        offsets = list(p.offset)
        if len(offsets) > 1 and start + len(offsets) != len(a):
            raise self.fail(f"{len(offsets)} offsets given, but {len(a) - start} axes are "
                            f"cropped from axis {start}")
        self.slices = []
        out = []
        for i, size in enumerate(a):
            if i < start:
                self.slices.append(slice(None))
                out.append(size)
                continue
            off = offsets[0] if len(offsets) == 1 else offsets[i - start] if offsets else 0
            if off < 0 or size - off < b[i]:
                raise self.fail(f"the crop for axis {i} is out of bounds: size {b[i]} at "
                                f"offset {off} in {size}")
            self.slices.append(slice(off, off + b[i]))
            out.append(b[i])
        self.slices = tuple(self.slices)
        top[0].reshape(out)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].data[...] = bottom[0].data[self.slices]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            bottom[0].diff[...] = 0
            bottom[0].diff[self.slices] = top[0].diff


@register("SPP")
class SPPLayer(Layer):
    """Caffe's spatial pyramid pooling. Level i pools each plane into 2^i x 2^i bins with a
    Pooling layer (kernel ceil(size / 2^i), stride = kernel, pad (kernel·2^i - size + 1) / 2,
    all under Pooling's own rules); each level's output, flattened per item, is concatenated
    in level order into a (num, total) top. With pyramid_height 1 the top is the single
    level's (num, channels, 1, 1) output, as in Caffe."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.spp_param
        self.pyramid_height = int(p.pyramid_height)
        if self.pyramid_height < 1:
            raise self.fail(f"pyramid_height must be at least 1, got {self.pyramid_height}")
        self.method = {_SPP.MAX: _POOL.MAX, _SPP.AVE: _POOL.AVE,
                       _SPP.STOCHASTIC: _POOL.STOCHASTIC}[p.pool]
        self.levels: list[PoolingLayer] = []
        self.outputs: list[Blob] = []
        self.built_for: tuple[int, int] | None = None
        self.scratch: Blob | None = None  # one level's input gradient, before the sum

    def _pooling_param(self, level: int, height: int, width: int) -> Any:
        bins = 2 ** level
        lp = caffe_pb2.LayerParameter(name=f"{self.name}/level{level}", type="Pooling")
        pp = lp.pooling_param
        pp.pool = self.method
        for axis, size in (("h", height), ("w", width)):
            kernel = -(-size // bins)
            setattr(pp, f"kernel_{axis}", kernel)
            setattr(pp, f"stride_{axis}", kernel)
            # the padding the bins need beyond the image, split with the odd pixel first
            setattr(pp, f"pad_{axis}", (kernel * bins - size + 1) // 2)
        return lp

    def _build(self, bottom: Blob, height: int, width: int) -> None:
        """One Pooling layer per level, for planes of height x width."""
        xp = backend.get_array_module(bottom.data)
        self.levels, self.outputs = [], []
        for i in range(self.pyramid_height):
            level = PoolingLayer(self._pooling_param(i, height, width), self.phase)
            level.context = self.context
            out = Blob((), dtype=bottom.dtype, xp=xp, name=f"{self.name}/level{i}")
            try:
                level.check_blob_counts([bottom], [out])
                level.setup([bottom], [out])
                level.reshape([bottom], [out])
            except LayerError as e:
                raise self.fail(f"pyramid level {i} ({2 ** i}x{2 ** i} bins) cannot pool a "
                                f"{height}x{width} input: {e}") from None
            self.levels.append(level)
            self.outputs.append(out)
        self.built_for = (height, width)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.fail(f"input must have 4 axes (num, channels, height, width), "
                            f"got shape {shape}")
        n, _, height, width = shape
        if height <= 0 or width <= 0:
            raise self.fail(f"input dimensions cannot be zero, got shape {shape}")
        if self.built_for != (height, width):
            self._build(bottom[0], height, width)
        else:
            for level, out in zip(self.levels, self.outputs):
                level.reshape(bottom, [out])
        if self.pyramid_height == 1:
            top[0].reshape(self.outputs[0].shape)
        else:
            top[0].reshape((n, sum(out.count_range(1) for out in self.outputs)))
            if self.scratch is None:
                self.scratch = Blob(shape, dtype=bottom[0].dtype,
                                    xp=backend.get_array_module(bottom[0].data))
            self.scratch.reshape(shape)

    def _segments(self, a: Any) -> list[Any]:
        """Views of the top array (num, total) holding each level's flattened output."""
        flat = a.reshape(a.shape[0], -1)
        bounds = [0]
        for out in self.outputs:
            bounds.append(bounds[-1] + out.count_range(1))
        return [flat[:, lo:hi] for lo, hi in zip(bounds, bounds[1:])]

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for level, out, seg in zip(self.levels, self.outputs, self._segments(top[0].data)):
            level.forward(bottom, [out])
            seg[...] = out.data.reshape(seg.shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        segments = self._segments(top[0].diff)
        for i, (level, out, seg) in enumerate(zip(self.levels, self.outputs, segments)):
            out.diff[...] = seg.reshape(out.shape)
            # the first level writes the bottom's gradient, the others add to it: the
            # bottom feeds every level, as through Caffe's internal Split
            target = bottom[0] if i == 0 else self.scratch
            level.backward([out], [True], [target])
            if i:
                bottom[0].diff += self.scratch.diff


@register("Im2col", "IM2COL")
class Im2colLayer(Layer):
    """Caffe's Im2col: each item's (C, H, W) image becomes its convolution columns, a
    (C·kh·kw, out_h, out_w) blob with rows ordered (c, i, j); the window comes from
    convolution_param (kernel, pad, stride, dilation, axis). Backward is col2im."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.convolution_param
        self.channel_axis = _two_spatial_axes(self, bottom[0], p.axis)
        self.kernel, self.pad, self.stride, self.dilation = _window_params(self, p, 2)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        ax = self.channel_axis
        if len(shape) != ax + 3:
            raise self.fail(f"bottom shape {shape} does not have 2 spatial axes after axis {ax}")
        channels, height, width = shape[ax:]
        (kh, kw), (ph, pw) = self.kernel, self.pad
        (sh, sw), (dh, dw) = self.stride, self.dilation
        out_h = conv_out_size(height, kh, ph, sh, dh)
        out_w = conv_out_size(width, kw, pw, sw, dw)
        if out_h <= 0 or out_w <= 0:
            raise self.fail(f"output size {out_h}x{out_w} is not positive for input "
                            f"{height}x{width} (kernel {self.kernel}, pad {self.pad}, "
                            f"stride {self.stride}, dilation {self.dilation})")
        self.geometry = Geometry(channels, height, width, kh, kw, sh, sw, ph, pw, dh, dw,
                                   out_h, out_w)
        self.num = bottom[0].count_range(0, ax)
        top[0].reshape((*shape[:ax], self.geometry.col_rows, out_h, out_w))

    def _images(self, a: Any, rows: int, h: int, w: int) -> Any:
        return a.reshape(self.num, rows, h, w)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        g = self.geometry
        xp = backend.get_array_module(bottom[0].data)
        x = self._images(bottom[0].data, g.channels, g.height, g.width)
        y = self._images(top[0].data, g.col_rows, g.out_h, g.out_w)
        for s in _image_chunks(xp, g, self.num, x.dtype.itemsize):
            col = K.im2col(x[s], g)
            y[s] = _BaseConvolution._batch_major(col[None], s.stop - s.start, (g.out_h, g.out_w))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        g = self.geometry
        xp = backend.get_array_module(top[0].diff)
        dy = self._images(top[0].diff, g.col_rows, g.out_h, g.out_w)
        dx = self._images(bottom[0].diff, g.channels, g.height, g.width)
        for s in _image_chunks(xp, g, self.num, dy.dtype.itemsize):
            col = K.grid_operand(dy[s], g, 1).reshape(g.col_rows, -1)
            K.col2im(col, g, s.stop - s.start, out=dx[s])
