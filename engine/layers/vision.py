"""Vision layers: Convolution, Deconvolution, Im2col and Crop, with Caffe's
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
from ..kernels.geometry import Geometry, conv_out_size
from ..pb import caffe_pb2
from . import im2col as K
from . import winograd
from .base import Layer, register

log = logging.getLogger(__name__)
#: layers already said to keep im2col on the GPU (once each, not at every reshape)
_SAID_NO_CUDNN: set[str] = set()

#: Weight gradients with at most this many entries per group are summed image by image
SMALL_WEIGHT_GRADIENT = 2048
#: Convolutions with at most this many column rows per group filter image by image
PER_IMAGE_FILTER_ROWS = 128


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
            per_pixel = top_diff.reshape(self.num * self.num_output, -1)
            ones = backend.ones_like_vector(top_diff, per_pixel.shape[1])
            self.blobs[1].diff += (per_pixel @ ones).reshape(self.num, -1).sum(axis=0)

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
                self.plan.forward(x, self.blobs[0].data, y,
                                  self.blobs[1].data if self.bias_term else None)
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
