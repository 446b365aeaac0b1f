"""``caffe.Classifier``: a deploy net that classifies H x W x K images.

Images are resized to ``image_dims``, cropped to the net's input (the centre, or with
``oversample`` the four corners, the centre and their mirrors, whose predictions are
averaged), preprocessed by a ``caffe.io.Transformer`` and run in batches.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import io as caffe_io
from .net import Net
from .preprocess import configured_transformer


class Classifier(Net):
    """``Classifier(model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
    raw_scale=None, channel_swap=None)``: a TEST-phase net with its input's Transformer."""

    def __init__(self, model_file: str, pretrained_file: str,
                 image_dims: Sequence[int] | None = None, mean: np.ndarray | None = None,
                 input_scale: float | None = None, raw_scale: float | None = None,
                 channel_swap: Sequence[int] | None = None):
        super().__init__(model_file, 1, weights=pretrained_file)  # caffe.TEST
        self.transformer = configured_transformer(self, mean, input_scale, raw_scale,
                                                  channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].data.shape[2:])
        self.image_dims = self.crop_dims if image_dims is None or not len(image_dims) \
            else np.asarray(image_dims)

    def predict(self, inputs: Sequence[np.ndarray], oversample: bool = True) -> Any:
        """N x classes probabilities for N images (H x W x K arrays)."""
        h, w = (int(d) for d in self.image_dims)
        resized = np.stack([caffe_io.resize_image(im, (h, w)) for im in inputs])
        if oversample:
            crops = caffe_io.oversample(resized, self.crop_dims)
        else:
            ch, cw = (int(d) for d in self.crop_dims)
            y, x = int(h / 2.0 - ch / 2.0), int(w / 2.0 - cw / 2.0)
            crops = resized[:, y:y + ch, x:x + cw]
        in_ = self.inputs[0]
        batch = np.stack([self.transformer.preprocess(in_, c) for c in crops])
        predictions = self.forward_all(**{in_: batch})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape(len(predictions) // 10, 10, -1).mean(axis=1)
        return predictions
