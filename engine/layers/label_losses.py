"""Losses of one label or one pair per item: Hinge (L1 and L2), MultinomialLogistic (of given
probabilities) and Contrastive (pairs, similar or not), with Caffe's numerics and its
legacy (N, C, H, W) shape rules."""
from __future__ import annotations

from typing import Any, Sequence

from .. import backend
from ..blob import Blob
from .axes import legacy_shape
from .base import register
from ..pb import caffe_pb2
from .loss import LOG_THRESHOLD, ClassLabels, LossLayer


class _OneLabelPerItem(LossLayer):
    """A loss on bottom[0] seen as (num, dim) with one class label per item: Caffe's
    HingeLoss and MultinomialLogisticLoss."""

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().reshape(bottom, top)
        legacy_shape(self, bottom[0])
        # Caffe reads label[i] for item i; any other label layout would pair items with
        # the wrong labels, so it is refused (MultinomialLogisticLoss checks this too).
        if legacy_shape(self, bottom[1])[1:] != (1, 1, 1):
            raise self.fail(f"label shape {bottom[1].shape} must be (num, 1, 1, 1): one label "
                            f"per item")
        self.num, self.dim = bottom[0].shape[0], bottom[0].count_range(1)

    def _items(self, a: Any) -> Any:
        return a.reshape(self.num, self.dim)

    def _label_index(self, bottom: Sequence[Blob]) -> tuple[Any, Any]:
        """(rows, labels): fancy indices of each item's label score in ``_items``."""
        xp = backend.get_array_module(bottom[1].data)
        lab = ClassLabels(self, bottom[1].data, self.num, 1, self.dim, None).lab[:, 0]
        return xp.arange(self.num), lab


@register("HingeLoss", "HINGE_LOSS")
class HingeLossLayer(_OneLabelPerItem):
    """One-vs-all hinge loss: with t = -1 except t = +1 at the label,
    L1: sum max(0, 1 - t·x) / num, L2: sum max(0, 1 - t·x)² / num."""

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.squared = self.param.hinge_loss_param.norm == caffe_pb2.HingeLossParameter.L2

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        self.index = self._label_index(bottom)
        m = self._items(bottom[0].data).copy()
        m[self.index] *= -1
        m += 1
        xp.maximum(m, 0, out=m)
        self.margins = m
        flat = m.reshape(-1)
        total = xp.dot(flat, flat) if self.squared else flat.sum()
        top[0].data[...] = total / self.num

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        self._no_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(self.margins)
        d = self._items(bottom[0].diff)
        if self.squared:
            xp.multiply(self.margins, top[0].diff * 2 / self.num, out=d)
        else:  # Caffe's sign(0) is 0: a satisfied margin gives no gradient
            xp.sign(self.margins, out=d)
            d *= top[0].diff / self.num
        d[self.index] *= -1


@register("MultinomialLogisticLoss", "MULTINOMIAL_LOGISTIC_LOSS")
class MultinomialLogisticLossLayer(_OneLabelPerItem):
    """-sum log p[label] / num for probabilities p given directly as bottom[0] (no softmax),
    each floored at Caffe's kLOG_THRESHOLD."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        self.index = self._label_index(bottom)
        p = self._items(bottom[0].data)[self.index]
        self.picked = xp.maximum(p, p.dtype.type(LOG_THRESHOLD))
        top[0].data[...] = -xp.log(self.picked).sum() / self.num

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        self._no_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        d = self._items(bottom[0].diff)
        d[...] = 0
        d[self.index] = (-top[0].diff / self.num) / self.picked


@register("ContrastiveLoss", "CONTRASTIVE_LOSS")
class ContrastiveLossLayer(LossLayer):
    """Hadsell et al.'s contrastive loss of feature pairs (a, b) with similarity y:
    sum over items of y·d² + (1 - y)·max(margin - d, 0)², over 2·num, d = ||a - b||;
    legacy_version uses max(margin - d², 0) for dissimilar pairs. y is bottom[2]; only a
    and b take gradients."""

    exact_num_bottoms = 3

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.contrastive_loss_param
        self.margin = float(p.margin)
        self.legacy = bool(p.legacy_version)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().reshape(bottom, top)
        a, b, y = (legacy_shape(self, blob) for blob in bottom)
        if a[1:] != b[1:] or a[2:] != (1, 1):
            raise self.fail(f"the feature bottoms must both be (num, channels, 1, 1) with the "
                            f"same channels, got {bottom[0].shape} and {bottom[1].shape}")
        if y != (a[0], 1, 1, 1):
            raise self.fail(f"the similarity bottom must be ({a[0]}, 1, 1, 1): one label per "
                            f"pair, got shape {bottom[2].shape}")
        self.num, self.channels = a[0], a[1]

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 2

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        margin = bottom[0].dtype.type(self.margin)
        self.diff = (bottom[0].data.reshape(self.num, self.channels)
                     - bottom[1].data.reshape(self.num, self.channels))
        self.dist_sq = xp.einsum("ij,ij->i", self.diff, self.diff)
        # static_cast<int>: a similarity of 0.5 counts as dissimilar
        self.similar = bottom[2].data.reshape(-1).astype(xp.int64) != 0
        if self.legacy:
            apart = xp.maximum(margin - self.dist_sq, 0)
        else:
            apart = xp.maximum(margin - xp.sqrt(self.dist_sq), 0) ** 2
        per_pair = xp.where(self.similar, self.dist_sq, apart)
        top[0].data[...] = per_pair.sum() / self.num / 2

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if len(propagate_down) > 2 and propagate_down[2]:
            raise self.fail("cannot backpropagate to the similarity input")
        if not (propagate_down[0] or propagate_down[1]):
            return
        xp = backend.get_array_module(self.diff)
        dt = self.diff.dtype.type
        margin = dt(self.margin)
        if self.legacy:
            slack = margin - self.dist_sq
            pull = xp.full_like(slack, -1)
        else:
            dist = xp.sqrt(self.dist_sq)
            slack = margin - dist
            # Caffe's 1e-4 keeps identical features from dividing by zero; it also makes
            # this gradient differ from the loss's exact one by that relative amount.
            pull = -slack / (dist + dt(1e-4))
        coeff = xp.where(self.similar, dt(1), xp.where(slack > 0, pull, dt(0)))
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                alpha = sign * top[0].diff / self.num
                xp.multiply(self.diff, (coeff * alpha)[:, None],
                            out=bottom[i].diff.reshape(self.num, self.channels))
