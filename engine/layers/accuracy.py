"""Accuracy: the fraction of items whose label is among the top_k scores (ignore_label skipped;
a second top gives the accuracy of each class), with Caffe's tie rule. A metric, not a loss:
it has no backward."""
from __future__ import annotations

from typing import Sequence

from .. import backend
from ..blob import Blob
from .base import Layer, register
from .loss import ClassLabels, check_label_count, split_at


@register("Accuracy", "ACCURACY")
class AccuracyLayer(Layer):
    """Top-k classification accuracy over non-ignored labels; an optional second top holds
    the accuracy per class.

    Ranking is Caffe 1.0's: a partial sort on (score, class index) pairs, so a class whose
    score equals the true class's score outranks it when its index is higher. The label is
    counted correct when fewer than top_k classes outrank it.
    """

    exact_num_bottoms = 2
    min_tops = 1
    max_tops = 2

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        ap = self.param.accuracy_param
        self.top_k = ap.top_k
        self.axis = ap.axis
        self.ignore_label = ap.ignore_label if ap.HasField("ignore_label") else None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        _, self.outer, self.classes, self.inner = split_at(self, bottom[0], self.axis)
        if self.top_k > self.classes:
            raise self.fail(f"top_k {self.top_k} exceeds the number of classes {self.classes}")
        check_label_count(self, bottom[1], self.outer, self.inner, bottom[0], self.axis)
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((self.classes,))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        scores = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        labels = ClassLabels(self, bottom[1].data, self.outer, self.inner, self.classes,
                              self.ignore_label)
        true = labels.pick(scores)[:, None, :]
        lab = labels.lab[:, None, :]
        cls = xp.arange(self.classes)[None, :, None]
        outranks = (scores > true) | ((scores == true) & (cls > lab))
        correct = labels.mask(outranks.sum(axis=1) < self.top_k)
        # no valid label at all gives 0 (Caffe 1.0 divides 0 by 0; later Caffe gives 0)
        top[0].data[...] = correct.sum() / max(labels.count, 1)
        if len(top) > 1:
            flat_lab = labels.lab.reshape(-1)
            seen = labels.mask(xp.ones(labels.lab.shape, dtype=top[1].data.dtype))
            nums = xp.bincount(flat_lab, weights=seen.reshape(-1), minlength=self.classes)
            hits = xp.bincount(flat_lab, weights=correct.reshape(-1).astype(nums.dtype),
                               minlength=self.classes)
            top[1].data[...] = hits / xp.maximum(nums, 1)
