"""Caffe's loss layers of class scores (SoftmaxWithLoss, InfogainLoss, SigmoidCrossEntropyLoss)
and EuclideanLoss, with what every loss shares (the base, label checks, normalization; the
losses of one label or pair per item are label_losses.py, Accuracy accuracy.py), with BVLC
Caffe 1.0's numerics.

A loss layer writes a scalar (shape ``()``) to ``top[0]`` and in backward scales its
gradient by ``top[0].diff``, where the Net has put the layer's loss_weight. Labels arrive
as floats and are truncated to integers as Caffe's ``static_cast<int>`` does.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import backend
from ..blob import Blob
from ..caffe_io import FormatError, read_blobproto
from ..pb import caffe_pb2
from .base import Layer, register
from .axes import softmax

_NORM = caffe_pb2.LossParameter
#: Caffe clamps probabilities at FLT_MIN before the log, in float and double alike
_FLT_MIN = float(np.finfo(np.float32).tiny)
#: the floor of Caffe's kLOG_THRESHOLD losses: the float 1e-20, also in double nets
LOG_THRESHOLD = float(np.float32(1e-20))


def _normalization(loss_param: Any, default: int) -> int:
    """The normalization mode: explicit ``normalization``, else the legacy ``normalize``
    flag (true = VALID, false = BATCH_SIZE), else the layer's default."""
    if loss_param.HasField("normalization"):
        return loss_param.normalization
    if loss_param.HasField("normalize"):
        return _NORM.VALID if loss_param.normalize else _NORM.BATCH_SIZE
    return default


def _normalizer(mode: int, outer: int, inner: int, valid_count: int) -> float:
    """Caffe's get_normalizer; at least 1 so a batch with every label ignored gives 0,
    not NaN."""
    if mode == _NORM.FULL:
        n = outer * inner
    elif mode == _NORM.VALID:
        n = valid_count
    elif mode == _NORM.BATCH_SIZE:
        n = outer
    else:
        n = 1
    return float(max(1, n))


class LossLayer(Layer):
    """Caffe's LossLayer: two bottoms (prediction, target) with the same first dim, a
    scalar top, and no gradient into the labels."""

    is_loss = True
    exact_num_bottoms = 2
    exact_num_tops = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            raise self.fail(f"prediction {bottom[0].shape} and label {bottom[1].shape} "
                            f"must have the same first dimension")
        top[0].reshape(())

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 1

    def _no_label_gradient(self, propagate_down: Sequence[bool]) -> None:
        if len(propagate_down) > 1 and propagate_down[1]:
            raise self.fail("cannot backpropagate to label inputs")


class ClassLabels:
    """Integer labels of shape (outer, inner) for scores of shape (outer, classes, inner),
    with the ignore mask; shared by SoftmaxWithLoss and Accuracy."""

    def __init__(self, layer: Layer, label: Any, outer: int, inner: int, classes: int,
                 ignore_label: int | None):
        xp = backend.get_array_module(label)
        lab = label.reshape(outer, inner).astype(xp.int64)
        self.valid = None if ignore_label is None else lab != ignore_label
        bad = (lab < 0) | (lab >= classes)
        if self.valid is not None:
            bad &= self.valid
            lab = xp.where(self.valid, lab, 0)  # any in-range index; masked out later
        if bool(bad.any()):
            raise layer.fail(f"label value {int(label.reshape(outer, inner)[bad][0])} "
                             f"outside [0, {classes})")
        self.lab = lab
        self.count = outer * inner if self.valid is None else int(self.valid.sum())

    def pick(self, scores: Any) -> Any:
        """scores[i, lab[i, j], j] as an (outer, inner) array."""
        xp = backend.get_array_module(scores)
        return xp.take_along_axis(scores, self.lab[:, None, :], axis=1)[:, 0, :]

    def mask(self, values: Any) -> Any:
        """``values`` (outer, [classes,] inner) with ignored positions set to zero."""
        if self.valid is None:
            return values
        v = self.valid if values.ndim == 2 else self.valid[:, None, :]
        return values * v


def split_at(layer: Layer, blob: Blob, axis: int) -> tuple[int, int, int, int]:
    """(canonical axis, outer, classes, inner) of ``blob`` around ``axis``."""
    try:
        a = blob.canonical_axis(axis)
    except ValueError:
        raise layer.fail(f"axis {axis} out of range for bottom shape {blob.shape}") from None
    return a, blob.count_range(0, a), blob.shape[a], blob.count_range(a + 1)


def check_label_count(layer: Layer, label: Blob, outer: int, inner: int,
                       pred: Blob, axis: int) -> None:
    if label.count != outer * inner:
        raise layer.fail(f"number of labels ({label.count}, shape {label.shape}) must match "
                         f"the number of predictions: prediction shape {pred.shape} with "
                         f"class axis {axis} needs {outer * inner} labels")


@register("SoftmaxWithLoss", "SOFTMAX_LOSS")
class SoftmaxWithLossLayer(LossLayer):
    """Multinomial logistic loss of the softmax of ``bottom[0]`` along softmax_param.axis;
    an optional second top receives the probabilities."""

    exact_num_tops = None
    min_tops = 1
    max_tops = 2

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        self.normalization = _normalization(lp, _NORM.VALID)
        self.axis = self.param.softmax_param.axis
        self.prob: Any = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().reshape(bottom, top)
        self.caxis, self.outer, self.classes, self.inner = split_at(self, bottom[0], self.axis)
        check_label_count(self, bottom[1], self.outer, self.inner, bottom[0], self.axis)
        if len(top) > 1:
            top[1].reshape(bottom[0].shape)

    def _softmax_and_labels(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> Any:
        """Softmax of bottom[0] into ``self.prob`` and the labels into ``self.labels``;
        returns the probabilities as (outer, classes, inner)."""
        if len(top) > 1:
            self.prob = top[1].data  # Caffe's top[1] shares the probabilities
        elif self.prob is None or self.prob.shape != bottom[0].shape:
            # allocated at the first forward, not in reshape: a net built only for its shapes
            # (the simulator) never holds an activation-sized array
            self.prob = backend.get_array_module(bottom[0].data).empty_like(bottom[0].data)
        softmax(bottom[0].data, self.caxis, self.prob)
        self.labels = ClassLabels(self, bottom[1].data, self.outer, self.inner,
                                   self.classes, self.ignore_label)
        return self.prob.reshape(self.outer, self.classes, self.inner)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        prob = self._softmax_and_labels(bottom, top)
        p = self.labels.pick(prob)
        logp = xp.log(xp.maximum(p, p.dtype.type(_FLT_MIN)))
        self.normalizer = _normalizer(self.normalization, self.outer, self.inner,
                                      self.labels.count)
        top[0].data[...] = -self.labels.mask(logp).sum() / self.normalizer

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        self._no_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(bottom[0].diff)
        d = bottom[0].diff.reshape(self.outer, self.classes, self.inner)
        d[...] = self.prob.reshape(d.shape)
        # subtract 1 at each label; the flat indices are distinct, so fancy += is exact
        rows = xp.arange(self.outer)[:, None] * self.classes + self.labels.lab
        flat = rows * self.inner + xp.arange(self.inner)[None, :]
        d.reshape(-1)[flat] -= 1
        if self.labels.valid is not None:
            d *= self.labels.valid[:, None, :]
        d *= top[0].diff / self.normalizer


@register("SigmoidCrossEntropyLoss", "SIGMOID_CROSS_ENTROPY_LOSS")
class SigmoidCrossEntropyLossLayer(LossLayer):
    """Cross-entropy of sigmoid(bottom[0]) against targets in [0, 1] (same count).

    Caffe 1.0 rules: ``ignore_label`` skips targets whose integer value equals it; the
    default normalization is BATCH_SIZE (the first dim), VALID counts non-ignored targets.
    """

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        self.normalization = _normalization(lp, _NORM.BATCH_SIZE)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            raise self.fail(f"inputs must have the same count: {bottom[0].shape} vs "
                            f"{bottom[1].shape}")

    def _valid(self, target: Any) -> Any:
        """Mask of the targets that count, or None when nothing is ignored."""
        if self.ignore_label is None:
            return None
        return target.astype(backend.get_array_module(target).int64) != self.ignore_label

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        x = bottom[0].data
        t = bottom[1].data.reshape(x.shape)
        # log-likelihood written so exp never overflows: x(t - [x>=0]) - log(1 + e^-|x|)
        ll = x * (t - (x >= 0)) - xp.log1p(xp.exp(-xp.abs(x)))
        valid = self._valid(t)
        if valid is not None:
            ll = ll * valid
        count = x.size if valid is None else int(valid.sum())
        self.normalizer = _normalizer(self.normalization, bottom[0].shape[0],
                                      bottom[0].count_range(1), count)
        top[0].data[...] = -ll.sum() / self.normalizer

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        self._no_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(bottom[0].data)
        x = bottom[0].data
        t = bottom[1].data.reshape(x.shape)
        d = bottom[0].diff
        # sigmoid via tanh: no overflow for large |x|
        xp.tanh(x * 0.5, out=d)
        d *= 0.5
        d += 0.5
        d -= t
        valid = self._valid(t)
        if valid is not None:
            d *= valid
        d *= top[0].diff / self.normalizer


@register("EuclideanLoss", "EUCLIDEAN_LOSS")
class EuclideanLossLayer(LossLayer):
    """sum((a - b)²) / (2·N) with N the first dim; gradients flow to both bottoms."""

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().reshape(bottom, top)
        if bottom[0].count_range(1) != bottom[1].count_range(1):
            raise self.fail(f"inputs must have the same dimension: {bottom[0].shape} vs "
                            f"{bottom[1].shape}")

    def allow_force_backward(self, bottom_index: int) -> bool:
        return True

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        self.diff = bottom[0].data - bottom[1].data.reshape(bottom[0].shape)
        flat = self.diff.reshape(-1)
        top[0].data[...] = xp.dot(flat, flat) / bottom[0].shape[0] / 2

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        xp = backend.get_array_module(self.diff)
        num = bottom[0].shape[0]
        for b, down, sign in zip(bottom, propagate_down, (1, -1)):
            if down:
                xp.multiply(self.diff.reshape(b.shape), top[0].diff * sign / num, out=b.diff)


@register("InfogainLoss", "INFOGAIN_LOSS")
class InfogainLossLayer(SoftmaxWithLossLayer):
    """-sum_l H[label, l] log p_l over the softmax p of bottom[0] along
    infogain_loss_param.axis; the K x K matrix H is bottom[2] or the binaryproto
    infogain_loss_param.source. H = identity gives SoftmaxWithLoss (but p is floored at
    kLOG_THRESHOLD, not FLT_MIN). An optional second top receives p."""

    exact_num_bottoms = None
    min_bottoms = 2
    max_bottoms = 3

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        lp = self.param.loss_param
        if lp.HasField("normalize"):
            raise self.fail('loss_param.normalize is deprecated here; use "normalization"')
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        self.normalization = lp.normalization
        ip = self.param.infogain_loss_param
        self.axis = ip.axis
        self.prob = None
        self.stored_h: Any = None
        if len(bottom) < 3:
            if not ip.HasField("source"):
                raise self.fail("the infogain matrix H must be given: infogain_loss_param."
                                "source (a binaryproto) or a third bottom")
            try:
                h = read_blobproto(self.context.resolve(ip.source))
            except FormatError as e:
                raise self.fail(f"cannot read the infogain matrix: {e}") from None
            xp = backend.get_array_module(bottom[0].data)
            self.stored_h = xp.asarray(h, dtype=bottom[0].dtype)

    def _h(self, bottom: Sequence[Blob]) -> Any:
        """H as (classes, classes); a bottom H may change between passes."""
        h = bottom[2].data if len(bottom) > 2 else self.stored_h
        return h.reshape(self.classes, self.classes)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().reshape(bottom, top)
        h = bottom[2].data if len(bottom) > 2 else self.stored_h
        if h.size != self.classes * self.classes:
            raise self.fail(f"infogain matrix H has shape {tuple(h.shape)}: with "
                            f"{self.classes} classes along axis {self.caxis} it must have "
                            f"{self.classes}x{self.classes} elements")

    def allow_force_backward(self, bottom_index: int) -> bool:
        # Caffe allows forcing H's gradient and then aborts in Backward; refusing it here
        # keeps force_backward nets runnable.
        return bottom_index == 0

    def _label_rows(self, h: Any) -> Any:
        """H's row for each position's label, laid out (outer, classes, inner)."""
        return h[self.labels.lab].transpose(0, 2, 1)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        prob = self._softmax_and_labels(bottom, top)
        logp = xp.log(xp.maximum(prob, prob.dtype.type(LOG_THRESHOLD)))
        weighted = self.labels.mask(self._label_rows(self._h(bottom)) * logp)
        self.normalizer = _normalizer(self.normalization, self.outer, self.inner,
                                      self.labels.count)
        top[0].data[...] = -weighted.sum() / self.normalizer

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        self._no_label_gradient(propagate_down)
        if len(propagate_down) > 2 and propagate_down[2]:
            raise self.fail("cannot backpropagate to the infogain matrix input")
        if not propagate_down[0]:
            return
        h = self._h(bottom)
        row_sums = h.sum(axis=1)[self.labels.lab][:, None, :]
        d = bottom[0].diff.reshape(self.outer, self.classes, self.inner)
        d[...] = self.prob.reshape(d.shape) * row_sums - self._label_rows(h)
        if self.labels.valid is not None:
            d *= self.labels.valid[:, None, :]
        d *= top[0].diff / self.normalizer


