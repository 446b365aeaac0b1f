"""LRN (local response normalization), Caffe's two regions, with Caffe's exact formulas.

ACROSS_CHANNELS: ``scale = k + alpha/size * sum(x^2 over the size channels centred on c)``
(zero padded), ``top = x * scale^-beta``; the backward pass is Caffe's:
``dx = dy * scale^-beta - 2*alpha*beta/size * x * sum(dy * top / scale over the window)``.

WITHIN_CHANNEL: Caffe composes Split, Power, AVE Pooling (size x size, pad (size-1)/2,
stride 1, so the divisor is always size^2), Power and Eltwise PROD:
``top = x * (1 + alpha/size^2 * boxsum(x^2))^-beta`` (k is not used). This module computes
the same result and its exact gradient directly.

Both forms are array-module generic (whole-array slices and adds), so they run unchanged
on CuPy; they are the reference for ACROSS_CHANNELS's compiled CPU form (``compiled``).
"""
from __future__ import annotations

from typing import Any, Sequence

from .. import backend
from ..blob import Blob
from ..pb import caffe_pb2
from ..kernels import cpu as compiled
from .base import Layer, register

_LRN = caffe_pb2.LRNParameter


def _neg_power(s: Any, beta: float) -> Any:
    """s ** -beta; the common betas go through sqrt, several times faster than pow."""
    xp = backend.get_array_module(s)
    if beta == 0.75:
        r = xp.sqrt(s)
        r *= xp.sqrt(r)  # s^0.75
        return xp.reciprocal(r, out=r)
    if beta == 0.5:
        r = xp.sqrt(s)
        return xp.reciprocal(r, out=r)
    if beta == 1.0:
        return xp.reciprocal(s)
    return xp.power(s, s.dtype.type(-beta))


def _window_sum(a: Any, axis: int, size: int) -> Any:
    """Sum of ``size`` consecutive entries centred on each index along ``axis``, zero padded."""
    xp = backend.get_array_module(a)
    pre = (size - 1) // 2
    n = a.shape[axis]
    pad_shape = list(a.shape)
    pad_shape[axis] = n + size - 1
    padded = xp.zeros(pad_shape, dtype=a.dtype)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(pre, pre + n)
    padded[tuple(idx)] = a
    idx[axis] = slice(0, n)
    out = padded[tuple(idx)].copy()
    for k in range(1, size):
        idx[axis] = slice(k, k + n)
        out += padded[tuple(idx)]
    return out


@register("LRN")
class LRNLayer(Layer):
    """Caffe's LRN layer (AlexNet's norm1/norm2)."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.lrn_param
        self.size = int(p.local_size)
        if self.size % 2 != 1:
            raise self.fail(f"LRN only supports odd values for local_size, got {self.size}")
        self.alpha, self.beta, self.k = float(p.alpha), float(p.beta), float(p.k)
        self.region = p.norm_region
        if self.region not in (_LRN.ACROSS_CHANNELS, _LRN.WITHIN_CHANNEL):
            raise self.fail(f"unknown norm_region {self.region}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[0].num_axes() != 4:
            raise self.fail(f"input must have 4 axes (num, channels, height, width), "
                            f"got shape {bottom[0].shape}")
        top[0].reshape(bottom[0].shape)

    def _compiled(self, x: Any) -> bool:
        """Whether the compiled CPU form serves (it computes ACROSS_CHANNELS)."""
        return (self.region == _LRN.ACROSS_CHANNELS and not backend.is_gpu_array(x)
                and compiled.lrn_supports(self.beta))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        if self._compiled(x):
            y, self.scale, self.factor = compiled.lrn_forward(x, self.size, self.alpha,
                                                              self.beta, self.k)
            top[0].data[...] = y
            return
        dt = x.dtype.type
        sq = x * x
        if self.region == _LRN.ACROSS_CHANNELS:
            scale = _window_sum(sq, 1, self.size)
            scale *= dt(self.alpha / self.size)
            scale += dt(self.k)
        else:
            scale = _window_sum(_window_sum(sq, 2, self.size), 3, self.size)
            scale *= dt(self.alpha / (self.size * self.size))
            scale += dt(1)
        self.scale = scale
        self.factor = _neg_power(scale, self.beta)  # scale^-beta, reused by backward
        top[0].data[...] = x * self.factor

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        x, y, dy = bottom[0].data, top[0].data, top[0].diff
        if self._compiled(x):
            compiled.lrn_backward(x, y, dy, self.scale, self.factor, self.size,
                                  2 * self.alpha * self.beta / self.size, bottom[0].diff)
            return
        dt = x.dtype.type
        ratio = dy * y
        ratio /= self.scale
        if self.region == _LRN.ACROSS_CHANNELS:
            acc = _window_sum(ratio, 1, self.size)
            coeff = 2 * self.alpha * self.beta / self.size
        else:
            # d top / d x through the box sum: the box is symmetric, so its adjoint is itself
            acc = _window_sum(_window_sum(ratio, 2, self.size), 3, self.size)
            coeff = 2 * self.alpha * self.beta / (self.size * self.size)
        acc *= x
        acc *= dt(coeff)
        dx = dy * self.factor
        dx -= acc
        bottom[0].diff[...] = dx
