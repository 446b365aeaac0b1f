"""Normalization layers: BatchNorm, MVN, and the per-channel affine pair Scale and Bias.

As in Caffe, BatchNorm only normalizes (its three blobs are running statistics, never
learned); the learned gamma/beta live in a following Scale layer with ``bias_term``.
Scale and Bias broadcast a parameter of shape ``bottom.shape[axis:axis+num_axes]`` over
the bottom, viewed as (outer, dim, inner).
"""
from __future__ import annotations

from typing import Any, Sequence

from .. import backend, fillers
from ..blob import Blob
from .base import Layer, register
from .axes import legacy_shape


@register("BatchNorm")
class BatchNormLayer(Layer):
    """Caffe's BatchNorm: blobs are (mean sum, variance sum, scale factor)."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.batch_norm_param
        self.moving_average_fraction = float(p.moving_average_fraction)
        self.use_global_stats = (bool(p.use_global_stats) if p.HasField("use_global_stats")
                                 else self.phase == "TEST")
        self.eps = float(p.eps)
        self.channels = 1 if bottom[0].num_axes() == 1 else bottom[0].shape[1]
        # As Caffe's LayerSetUp: the statistics get lr_mult 0 (added to the layer's own
        # LayerParameter, so the Net and a saved prototxt see it); a learning rate is an error.
        for i in range(3):
            if i == len(self.param.param):
                self.param.param.add(lr_mult=0.0)
            elif self.param.param[i].lr_mult != 0:
                raise self.fail(f"param {i} has lr_mult {self.param.param[i].lr_mult}: batch "
                                "normalization statistics cannot be learned (use a Scale layer)")
        xp = backend.get_array_module(bottom[0].data)
        dtype = bottom[0].dtype
        self.blobs = [Blob((self.channels,), dtype=dtype, xp=xp, name=f"{self.name}/0"),
                      Blob((self.channels,), dtype=dtype, xp=xp, name=f"{self.name}/1"),
                      Blob((1,), dtype=dtype, xp=xp, name=f"{self.name}/2")]
        # Running statistics are updated by forward, never by gradients.
        self.param_propagate_down = [False, False, False]
        self._x_norm: Any = None
        self._std: Any = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[0].num_axes() > 1 and bottom[0].shape[1] != self.channels:
            raise self.fail(f"bottom has {bottom[0].shape[1]} channels, expected {self.channels}")
        top[0].reshape(bottom[0].shape)

    def _view(self, a: Any) -> Any:
        return a.reshape(a.shape[0], self.channels, -1)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        x3 = self._view(bottom[0].data)
        dtype = x3.dtype
        if self.use_global_stats:
            stored = float(self.blobs[2].data.reshape(-1)[0])
            factor = 0.0 if stored == 0 else 1.0 / stored
            mean = self.blobs[0].data * dtype.type(factor)
            var = self.blobs[1].data * dtype.type(factor)
            centered = x3 - mean.reshape(1, -1, 1)
        else:
            m = bottom[0].count // self.channels
            mean = _reduce_outer_inner(x3) / dtype.type(m)
            centered = x3 - mean.reshape(1, -1, 1)
            var = _reduce_outer_inner(centered, centered) / dtype.type(m)
            maf = dtype.type(self.moving_average_fraction)
            correction = dtype.type(m / (m - 1) if m > 1 else 1)
            self.blobs[2].data *= maf
            self.blobs[2].data += 1
            self.blobs[0].data *= maf
            self.blobs[0].data += mean
            self.blobs[1].data *= maf
            self.blobs[1].data += correction * var
        self._std = xp.sqrt(var + dtype.type(self.eps)).reshape(1, -1, 1)
        y3 = self._view(top[0].data)
        xp.divide(centered, self._std, out=y3)
        # Kept because a later in-place layer (usually Scale) overwrites the top.
        if self._x_norm is None or self._x_norm.shape != y3.shape or self._x_norm.dtype != dtype:
            self._x_norm = y3.copy()
        else:
            self._x_norm[...] = y3

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(top[0].diff)
        dy3 = self._view(top[0].diff)
        dx3 = self._view(bottom[0].diff)
        if self.use_global_stats:
            xp.divide(dy3, self._std, out=dx3)
            return
        # dx = (dy - mean(dy) - mean(dy * y) * y) / std, means over all axes but channels.
        y3 = self._x_norm
        n = dy3.dtype.type(dy3.shape[0] * dy3.shape[2])
        mean_dyy = (_reduce_outer_inner(dy3, y3) / n).reshape(1, -1, 1)
        mean_dy = (_reduce_outer_inner(dy3) / n).reshape(1, -1, 1)
        grad = dy3 - mean_dy - mean_dyy * y3
        xp.divide(grad, self._std, out=dx3)


@register("MVN")
class MVNLayer(Layer):
    """Caffe's MVN: subtract the mean of each (item, channel) plane, or of each whole item
    with ``across_channels``; with ``normalize_variance`` also divide by (std + eps), the
    std being the biased one. As in Caffe the top is 4-D (num, channels, height, width)
    whatever the bottom's (at most 4) axes."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.mvn_param
        self.normalize_variance = bool(p.normalize_variance)
        self.across_channels = bool(p.across_channels)
        self.eps = float(p.eps)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = legacy_shape(self, bottom[0])
        top[0].reshape(shape)
        self.rows = shape[0] if self.across_channels else shape[0] * shape[1]

    def _rows(self, a: Any) -> Any:
        """The array as (rows, dim): one row per normalized group."""
        return a.reshape(self.rows, -1)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        x = self._rows(bottom[0].data)
        y = self._rows(top[0].data)
        xp.subtract(x, x.mean(axis=1, keepdims=True), out=y)
        if self.normalize_variance:
            var = xp.einsum("ij,ij->i", y, y)[:, None] / y.dtype.type(y.shape[1])
            self.std = xp.sqrt(var)
            self.std += y.dtype.type(self.eps)
            y /= self.std

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(top[0].diff)
        dy = self._rows(top[0].diff)
        dx = self._rows(bottom[0].diff)
        if not self.normalize_variance:
            xp.subtract(dy, dy.mean(axis=1, keepdims=True), out=dx)
            return
        # Caffe's formula, read from the top's data as Caffe does (so an in-place layer
        # after MVN changes it): (dy - mean(dy) - y * mean(dy * y)) / (std + eps). It
        # treats eps as 0 inside the derivative of the std.
        y = self._rows(top[0].data)
        dyy = xp.einsum("ij,ij->i", dy, y)[:, None]
        grad = dy - (y * dyy + dy.sum(axis=1, keepdims=True)) / dy.dtype.type(dy.shape[1])
        xp.divide(grad, self.std, out=dx)


def _param_shape(layer: Layer, bottom: Blob, axis_param: int, num_axes: int) -> tuple[int, ...]:
    """Shape of a learned Scale/Bias parameter: bottom.shape[axis:axis+num_axes]."""
    axis = bottom.canonical_axis(axis_param)
    if num_axes < -1:
        raise layer.fail(f"num_axes must be non-negative, or -1 for all remaining axes; "
                         f"got {num_axes}")
    end = bottom.num_axes() if num_axes == -1 else axis + num_axes
    if end > bottom.num_axes():
        raise layer.fail(f"axis {axis} + num_axes {num_axes} exceeds the bottom's "
                         f"{bottom.num_axes()} axes (shape {bottom.shape})")
    return bottom.shape[axis:end]


def _broadcast_dims(layer: Layer, bottom: Blob, operand: Blob,
                    axis_param: int) -> tuple[int, int, int]:
    """(outer, dim, inner) of the bottom for an operand spanning axes from ``axis``."""
    axis = 0 if operand.num_axes() == 0 else bottom.canonical_axis(axis_param)
    n = operand.num_axes()
    if bottom.num_axes() < axis + n or bottom.shape[axis:axis + n] != operand.shape:
        raise layer.fail(f"operand of shape {operand.shape} does not match bottom shape "
                         f"{bottom.shape} starting at axis {axis}")
    return bottom.count_range(0, axis), operand.count, bottom.count_range(axis + n)


def _make_param(layer: Layer, bottom: Blob, shape: tuple[int, ...], filler_param: Any,
                index: int) -> Blob:
    blob = Blob(shape, dtype=bottom.dtype, xp=backend.get_array_module(bottom.data),
                name=f"{layer.name}/{index}")
    fillers.fill(filler_param, blob)
    return blob


def _reduce_outer_inner(a3: Any, b3: Any | None = None) -> Any:
    """Per-channel sums of a3 (outer, dim, inner), or of a3 * b3, over outer and inner, in
    Caffe's order: a GEMV over each (outer, channel) row, then one over the outer index. Both
    are BLAS products, which a GPU runs at its memory's speed; CuPy's reduction over two
    axes at once gives each channel one thread block (ResNet-50's first BatchNorm: 64 blocks
    reading 100 MB)."""
    outer, dim, inner = a3.shape
    if b3 is not None:
        a3 = a3 * b3
    rows = a3.reshape(outer * dim, inner) @ backend.ones_like_vector(a3, inner)
    return backend.ones_like_vector(a3, outer) @ rows.reshape(outer, dim)


@register("Bias")
class BiasLayer(Layer):
    """top = bottom[0] + bias, the bias learned (one bottom) or given as bottom[1]."""

    min_bottoms = 1
    max_bottoms = 2
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.bias_param
        if len(bottom) == 1:
            shape = _param_shape(self, bottom[0], p.axis, p.num_axes)
            self.blobs = [_make_param(self, bottom[0], shape, p.filler, 0)]
        self.param_propagate_down = [True] * len(self.blobs)

    def _bias(self, bottom: Sequence[Blob]) -> Blob:
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.dims = _broadcast_dims(self, bottom[0], self._bias(bottom),
                                    self.param.bias_param.axis)
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        outer, dim, inner = self.dims
        bias = self._bias(bottom).data.reshape(1, dim, 1)
        xp.add(bottom[0].data.reshape(outer, dim, inner), bias,
               out=top[0].data.reshape(outer, dim, inner))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        xp = backend.get_array_module(top[0].diff)
        if propagate_down[0] and bottom[0] is not top[0]:
            xp.copyto(bottom[0].diff, top[0].diff)
        learned = len(bottom) == 1
        if (learned and self.param_propagate_down[0]) or (not learned and propagate_down[1]):
            outer, dim, inner = self.dims
            grad = _reduce_outer_inner(top[0].diff.reshape(outer, dim, inner))
            bias = self._bias(bottom)
            if learned:  # parameter gradients accumulate; bottom gradients overwrite
                bias.diff += grad.reshape(bias.shape)
            else:
                bias.diff[...] = grad.reshape(bias.shape)


@register("Scale")
class ScaleLayer(Layer):
    """top = bottom[0] * scale (+ bias): scale learned (one bottom) or bottom[1]."""

    min_bottoms = 1
    max_bottoms = 2
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.scale_param
        self.blobs = []
        if len(bottom) == 1:
            shape = _param_shape(self, bottom[0], p.axis, p.num_axes)
            if p.HasField("filler"):
                filler = p.filler
            else:  # Caffe's default makes a fresh Scale the identity
                filler = type(p.filler)(type="constant", value=1.0)
            self.blobs.append(_make_param(self, bottom[0], shape, filler, 0))
            bias_shape = shape
        else:
            bias_shape = bottom[1].shape
        self.bias_term = bool(p.bias_term)
        if self.bias_term:
            self.blobs.append(_make_param(self, bottom[0], bias_shape, p.bias_filler,
                                          len(self.blobs)))
        self.param_propagate_down = [True] * len(self.blobs)
        self._input_copy: Any = None

    def _scale(self, bottom: Sequence[Blob]) -> Blob:
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        axis = self.param.scale_param.axis
        self.dims = _broadcast_dims(self, bottom[0], self._scale(bottom), axis)
        if self.bias_term:
            _broadcast_dims(self, bottom[0], self.blobs[-1], axis)
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        outer, dim, inner = self.dims
        x = bottom[0].data
        if top[0] is bottom[0]:
            # The scale's gradient needs the input, which the in-place forward overwrites.
            if self._input_copy is None or self._input_copy.shape != x.shape \
                    or self._input_copy.dtype != x.dtype:
                self._input_copy = x.copy()
            else:
                self._input_copy[...] = x
        y3 = top[0].data.reshape(outer, dim, inner)
        xp.multiply(x.reshape(outer, dim, inner), self._scale(bottom).data.reshape(1, dim, 1),
                    out=y3)
        if self.bias_term:
            y3 += self.blobs[-1].data.reshape(1, dim, 1)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        xp = backend.get_array_module(top[0].diff)
        outer, dim, inner = self.dims
        dy3 = top[0].diff.reshape(outer, dim, inner)
        if self.bias_term and self.param_propagate_down[-1]:
            bias = self.blobs[-1]
            bias.diff += _reduce_outer_inner(dy3).reshape(bias.shape)
        learned = len(bottom) == 1
        scale = self._scale(bottom)
        if (learned and self.param_propagate_down[0]) or (not learned and propagate_down[1]):
            x = self._input_copy if top[0] is bottom[0] else bottom[0].data
            grad = _reduce_outer_inner(dy3, x.reshape(outer, dim, inner)).reshape(scale.shape)
            if learned:  # parameter gradients accumulate; bottom gradients overwrite
                scale.diff += grad
            else:
                scale.diff[...] = grad
        if propagate_down[0]:
            xp.multiply(dy3, scale.data.reshape(1, dim, 1),
                        out=bottom[0].diff.reshape(outer, dim, inner))
