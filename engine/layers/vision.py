"""Vision layers: Convolution, Deconvolution, Pooling, Crop, with Caffe's numerics.

Convolution lowers each chunk of the minibatch to columns (``im2col``) and does one GEMM
per group; Deconvolution is the same machinery run backwards (Caffe's weight layout
``(channels_in, num_output / group, kh, kw)``). Two spatial axes are supported.
"""
from __future__ import annotations

from typing import Any, Sequence

from .. import backend, fillers
from ..blob import Blob
from ..pb import caffe_pb2
from . import im2col as K
from .base import Layer, register

_POOL = caffe_pb2.PoolingParameter


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
        self.channel_axis = b0.canonical_axis(p.axis)
        num_spatial = b0.num_axes() - self.channel_axis - 1
        if num_spatial != 2:
            raise self.fail(f"only 2 spatial axes are supported, got {num_spatial} "
                            f"(bottom shape {b0.shape}, axis {p.axis})")
        self.kernel = _spatial_values(self, p, "kernel_size", 0, num_spatial)
        if min(self.kernel) <= 0:
            raise self.fail(f"filter dimensions must be nonzero, got {self.kernel}")
        self.pad = _spatial_values(self, p, "pad", 0, num_spatial)
        self.stride = _spatial_values(self, p, "stride", 1, num_spatial)
        if min(self.stride) <= 0:
            raise self.fail(f"stride dimensions must be nonzero, got {self.stride}")
        self.dilation = _spatial_values(self, p, "dilation", 1, num_spatial)
        if min(self.dilation) <= 0:
            raise self.fail(f"dilation must be positive, got {self.dilation}")
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
            self.geometry = K.Geometry(self.num_output, out_h, out_w, kh, kw, sh, sw, ph, pw,
                                       dh, dw, height, width)
        else:
            out_h = K.conv_out_size(height, kh, ph, sh, dh)
            out_w = K.conv_out_size(width, kw, pw, sw, dw)
            self.geometry = K.Geometry(self.channels, height, width, kh, kw, sh, sw, ph, pw,
                                       dh, dw, out_h, out_w)
        if out_h <= 0 or out_w <= 0:
            raise self.fail(f"output size {out_h}x{out_w} is not positive for input "
                            f"{height}x{width} (kernel {self.kernel}, pad {self.pad}, "
                            f"stride {self.stride}, dilation {self.dilation})")
        self.num = bottom[0].count_range(0, ax)
        for t in top:
            t.reshape((*shape[:ax], self.num_output, out_h, out_w))

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
        g = self.geometry
        per_image = g.col_rows * g.out_h * g.out_w * itemsize
        step = K.chunk_size(xp, self.num, per_image)
        return [slice(s, min(s + step, self.num)) for s in range(0, self.num, step)]

    def _images(self, a: Any, channels: int) -> Any:
        """The blob array as (num, channels, H, W)."""
        return a.reshape(self.num, channels, *a.shape[-2:])

    def _add_bias(self, top: Any) -> None:
        if self.bias_term:
            top += self.blobs[1].data.reshape(1, -1, 1, 1)

    def _bias_gradient(self, top_diff: Any) -> None:
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += top_diff.reshape(self.num, self.num_output, -1).sum(axis=(0, 2))


@register("Convolution", "CONVOLUTION")
class ConvolutionLayer(_BaseConvolution):
    """Caffe's Convolution: im2col + one GEMM per group and chunk."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        g = self.geometry
        xp = backend.get_array_module(bottom[0].data)
        wg = self._grouped_weight()
        for b, t in zip(bottom, top):
            x = self._images(b.data, self.channels)
            y = self._images(t.data, self.num_output)
            for s in self._chunks(xp, x.dtype.itemsize):
                col = K.im2col(x[s], g).reshape(self.group, g.col_rows // self.group, -1)
                out = xp.matmul(wg, col)
                y[s] = self._batch_major(out, s.stop - s.start, (g.out_h, g.out_w))
                self._add_bias(y[s])  # while the chunk is in cache

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        g = self.geometry
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
            dw = self.blobs[0].diff.reshape(wg.shape)
            for s in self._chunks(xp, x.dtype.itemsize):
                if want_w:
                    col = K.im2col(x[s], g).reshape(self.group, g.col_rows // self.group, -1)
                    dw += xp.matmul(self._channel_major(dy[s]), col.transpose(0, 2, 1))
                if down:
                    dcol = xp.matmul(wg.transpose(0, 2, 1), K.grid_operand(dy[s], g, self.group))
                    dx[s] = K.col2im(dcol.reshape(g.col_rows, -1), g, s.stop - s.start)


@register("Deconvolution", "DECONVOLUTION")
class DeconvolutionLayer(_BaseConvolution):
    """Caffe's Deconvolution: the transpose of Convolution (forward is col2im of W^T x)."""

    transposed = True

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        g = self.geometry
        xp = backend.get_array_module(bottom[0].data)
        wg = self._grouped_weight()
        for b, t in zip(bottom, top):
            x = self._images(b.data, self.channels)
            y = self._images(t.data, self.num_output)
            for s in self._chunks(xp, x.dtype.itemsize):
                col = xp.matmul(wg.transpose(0, 2, 1), K.grid_operand(x[s], g, self.group))
                y[s] = K.col2im(col.reshape(g.col_rows, -1), g, s.stop - s.start)
                self._add_bias(y[s])

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        g = self.geometry
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
            dw = self.blobs[0].diff.reshape(wg.shape)
            for s in self._chunks(xp, x.dtype.itemsize):
                col = K.im2col(dy[s], g).reshape(self.group, g.col_rows // self.group, -1)
                if want_w:
                    dw += xp.matmul(self._channel_major(x[s]), col.transpose(0, 2, 1))
                if down:
                    dx[s] = self._batch_major(xp.matmul(wg, col), s.stop - s.start,
                                              (g.out_h, g.out_w))


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
        out_h = K.pool_out_size(h, kh, ph, sh, any_pad)
        out_w = K.pool_out_size(w, kw, pw, sw, any_pad)
        if out_h <= 0 or out_w <= 0:
            raise self.fail(f"kernel {kernel} is larger than the padded input {h}x{w}")
        self.geometry = K.Geometry(c, h, w, kh, kw, sh, sw, ph, pw, 1, 1, out_h, out_w)
        for t in top:
            t.reshape((n, c, out_h, out_w))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        if self.method == _POOL.MAX:
            out, self.argmax = K.max_pool_forward(x, self.geometry)
            if len(top) > 1:
                top[1].data[...] = K.max_pool_mask(self.argmax, self.geometry)
        else:
            out = K.ave_pool_forward(x, self.geometry)
        top[0].data[...] = out

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if self.method == _POOL.MAX:
            K.max_pool_backward(dy, self.argmax, self.geometry, bottom[0].diff)
        else:
            K.ave_pool_backward(dy, self.geometry, bottom[0].diff)


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
