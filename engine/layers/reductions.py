"""Layers that combine values: Eltwise (product, sum, max of their bottoms), Softmax, ArgMax
and Reduction. Each computes what BVLC Caffe 1.0 computes, with one array code path for NumPy
and CuPy (``xp``).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .. import backend
from ..blob import Blob
from .axes import canonical_axis, softmax
from .base import Layer, register


@register("Eltwise", "ELTWISE")
class EltwiseLayer(Layer):
    """Element-wise PROD, SUM (with per-bottom ``coeff``) or MAX of same-shaped bottoms."""

    min_bottoms = 2
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.eltwise_param
        self.op = p.operation
        self.coeffs = list(p.coeff) or [1.0] * len(bottom)
        if p.coeff and self.op != p.SUM:
            raise self.fail("eltwise_param.coeff is only allowed with operation SUM")
        if len(self.coeffs) != len(bottom):
            raise self.fail(f"{len(p.coeff)} coeff(s) for {len(bottom)} bottoms; "
                            f"give one per bottom")
        self.stable_prod_grad = p.stable_prod_grad
        self.max_idx: Any = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != bottom[0].shape:
                raise self.fail(f"bottom {i} has shape {b.shape}, bottom 0 has "
                                f"{bottom[0].shape}; all must match")
        top[0].reshape(bottom[0].shape)
        if self.op == self.param.eltwise_param.MAX:
            xp = backend.get_array_module(bottom[0].data)
            if self.max_idx is None or self.max_idx.shape != bottom[0].shape:
                self.max_idx = xp.zeros(bottom[0].shape, dtype=xp.int32)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        p = self.param.eltwise_param
        out = top[0].data
        if self.op == p.PROD:
            xp.multiply(bottom[0].data, bottom[1].data, out=out)
            for b in bottom[2:]:
                out *= b.data
        elif self.op == p.SUM:
            xp.multiply(bottom[0].data, self.coeffs[0], out=out)
            for b, c in zip(bottom[1:], self.coeffs[1:]):
                out += b.data if c == 1.0 else b.data * c
        else:
            # Caffe's tie rule: bottom 1 wins a tie with bottom 0, later bottoms never do
            a, b = bottom[0].data, bottom[1].data
            self.max_idx[...] = xp.where(a > b, 0, 1)
            xp.maximum(a, b, out=out)
            for i, blob in enumerate(bottom[2:], 2):
                better = blob.data > out
                self.max_idx[better] = i
                xp.maximum(out, blob.data, out=out)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        xp = backend.get_array_module(top[0].diff)
        p = self.param.eltwise_param
        dy = top[0].diff
        for i, (b, down) in enumerate(zip(bottom, propagate_down)):
            if not down:
                continue
            if self.op == p.PROD:
                if self.stable_prod_grad:
                    others = [o.data for j, o in enumerate(bottom) if j != i]
                    xp.multiply(others[0], dy, out=b.diff)
                    for o in others[1:]:
                        b.diff *= o
                else:
                    xp.divide(top[0].data, b.data, out=b.diff)
                    b.diff *= dy
            elif self.op == p.SUM:
                xp.multiply(dy, self.coeffs[i], out=b.diff)
            else:
                xp.multiply(dy, self.max_idx == i, out=b.diff)

@register("Softmax", "SOFTMAX")
class SoftmaxLayer(Layer):
    """Softmax along ``softmax_param.axis`` (in place allowed)."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.axis = canonical_axis(self, bottom[0], self.param.softmax_param.axis)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        softmax(bottom[0].data, self.axis, top[0].data)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(top[0].diff)
        y, dy = top[0].data, top[0].diff
        dot = (dy * y).sum(axis=self.axis, keepdims=True)
        xp.subtract(dy, dot, out=bottom[0].diff)
        bottom[0].diff *= y

@register("ArgMax", "ARGMAX")
class ArgMaxLayer(Layer):
    """Indices (and with ``out_max_val`` the values) of the ``top_k`` largest entries.

    Without ``axis`` each item's values are flattened and the top is (N, 1 or 2, top_k);
    with ``axis`` the top is the bottom with that dim replaced by top_k, holding the
    indices, or the values when ``out_max_val``. Order follows Caffe's sort on
    (value, index) pairs: equal values rank the higher index first.
    """

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.argmax_param
        self.out_max_val = p.out_max_val
        self.top_k = p.top_k
        self.axis = canonical_axis(self, bottom[0], p.axis) if p.HasField("axis") else None
        if self.top_k < 1:
            raise self.fail("argmax_param.top_k must be at least 1")
        span = bottom[0].shape[self.axis] if self.axis is not None else bottom[0].count_range(1)
        if self.top_k > span:
            raise self.fail(f"top_k {self.top_k} exceeds the {span} values it ranks "
                            f"(bottom shape {bottom[0].shape})")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        s = bottom[0].shape
        if self.axis is not None:
            shape = s[:self.axis] + (self.top_k,) + s[self.axis + 1:]
        else:
            # Caffe keeps at least 3 axes and pads the rest with 1s
            shape = (s[0], 2 if self.out_max_val else 1, self.top_k) + (1,) * (len(s) - 3)
        top[0].reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        x = bottom[0].data
        rows = (xp.moveaxis(x, self.axis, -1) if self.axis is not None
                else x.reshape(x.shape[0], -1))
        dim = rows.shape[-1]
        # a stable sort of the reversed row puts the higher index first among equals
        order = xp.argsort(-rows[..., ::-1], axis=-1, kind="stable")[..., :self.top_k]
        idx = dim - 1 - order
        if self.axis is not None:
            out = xp.take_along_axis(rows, idx, axis=-1) if self.out_max_val else idx
            top[0].data[...] = xp.moveaxis(out, -1, self.axis)
            return
        t = top[0].data.reshape(x.shape[0], -1, self.top_k)
        t[:, 0, :] = idx
        if self.out_max_val:
            t[:, 1, :] = xp.take_along_axis(rows, idx, axis=-1)

@register("Reduction")
class ReductionLayer(Layer):
    """One number per index of the dims before ``axis``, reducing all the dims from ``axis``
    on: SUM, ASUM (sum of |x|), SUMSQ (sum of x^2) or MEAN, times ``coeff``. The top's shape
    is the bottom's dims before ``axis``: a scalar for the default axis 0."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.reduction_param
        self.op = p.operation
        if self.op not in (p.SUM, p.ASUM, p.SUMSQ, p.MEAN):
            raise self.fail(f"unknown reduction_param.operation {self.op}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.reduction_param
        axis = canonical_axis(self, bottom[0], p.axis)
        self.num, self.dim = bottom[0].count_range(0, axis), bottom[0].count_range(axis)
        top[0].reshape(bottom[0].shape[:axis])
        self.coeff = float(p.coeff)
        if self.op == p.MEAN:
            # C++ float division: an empty mean is coeff * 0 / 0, NaN, not an exception
            self.coeff = self.coeff / self.dim if self.dim else math.inf

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        p = self.param.reduction_param
        x = bottom[0].data.reshape(self.num, self.dim)
        y = top[0].data.reshape(self.num)
        if self.op == p.ASUM:
            x = xp.abs(x)
        elif self.op == p.SUMSQ:
            x = x * x
        x.sum(axis=1, out=y)
        if self.coeff != 1:
            y *= y.dtype.type(self.coeff)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(top[0].diff)
        p = self.param.reduction_param
        scale = top[0].diff.reshape(self.num, 1) * top[0].dtype.type(self.coeff)
        x = bottom[0].data.reshape(self.num, self.dim)
        dx = bottom[0].diff.reshape(self.num, self.dim)
        if self.op == p.ASUM:
            xp.multiply(xp.sign(x), scale, out=dx)
        elif self.op == p.SUMSQ:
            xp.multiply(x, 2 * scale, out=dx)
        else:
            dx[...] = scale
