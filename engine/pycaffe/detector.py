"""``caffe.Detector``: classify windows of images (R-CNN style), optionally with context.

Each window (ymin, xmin, ymax, xmax) is cut from its image, warped to the net's input and
classified. With ``context_pad`` the box is enlarged so that a border of that many input pixels
shows the surroundings, as R-CNN's feature extraction does; what lies outside the image is
filled with the mean.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from . import io as caffe_io
from .net import Net
from .preprocess import configured_transformer


class Detector(Net):
    """``Detector(model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
    channel_swap=None, context_pad=None)``."""

    def __init__(self, model_file: str, pretrained_file: str, mean: np.ndarray | None = None,
                 input_scale: float | None = None, raw_scale: float | None = None,
                 channel_swap: Sequence[int] | None = None, context_pad: int | None = None):
        super().__init__(model_file, 1, weights=pretrained_file)  # caffe.TEST
        self.transformer = configured_transformer(self, mean, input_scale, raw_scale,
                                                  channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows: Iterable[tuple[str, Sequence[Any]]]
                       ) -> list[dict[str, Any]]:
        """[{'window', 'prediction', 'filename'}] for every window of every image."""
        images_windows = list(images_windows)
        in_ = self.inputs[0]
        crops = []
        for filename, windows in images_windows:
            image = caffe_io.load_image(filename)
            crops += [self.crop(image, np.asarray(w)) for w in windows]
        batch = np.stack([self.transformer.preprocess(in_, c) for c in crops])
        predictions = iter(self.forward_all(**{in_: batch})[self.outputs[0]])
        return [{"window": w, "prediction": next(predictions), "filename": filename}
                for filename, windows in images_windows for w in windows]

    def detect_selective_search(self, image_fnames: Sequence[str]) -> list[dict[str, Any]]:
        """Windows proposed by selective search (the selective_search_ijcv_with_python module,
        which runs MATLAB)."""
        import os

        import selective_search_ijcv_with_python as selective_search
        image_fnames = [os.path.abspath(f) for f in image_fnames]
        windows = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows))

    def crop(self, im: np.ndarray, window: np.ndarray) -> np.ndarray:
        """The window's pixels; with context_pad, the enlarged box warped to the input size
        and padded with the mean where it leaves the image."""
        ymin, xmin, ymax, xmax = (int(v) for v in window[:4])
        if not self.context_pad:
            return im[ymin:ymax, xmin:xmax]
        size = self.blobs[self.inputs[0]].width  # a square input
        scale = size / (1.0 * size - 2 * self.context_pad)
        half = np.array([(ymax - ymin + 1) / 2.0, (xmax - xmin + 1) / 2.0])
        centre = np.array([ymin, xmin]) + half
        box = np.round(np.concatenate([centre - scale * half, centre + scale * half]))
        full = box[2:] - box[:2] + 1
        cell = size / full  # input pixels per image pixel, (y, x)
        pad = np.round(np.maximum(0, -box[:2]) * cell).astype(int)
        h, w = im.shape[:2]
        box = np.clip(box, 0, [h, w, h, w])
        clipped = box[2:] - box[:2] + 1
        extent = np.minimum(np.round(clipped * cell).astype(int), size - pad)
        y0, x0, y1, x1 = box.astype(int)
        context = caffe_io.resize_image(im[y0:y1, x0:x1], extent)
        out = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
        out[pad[0]:pad[0] + extent[0], pad[1]:pad[1] + extent[1]] = context
        return out

    def configure_crop(self, context_pad: int | None) -> None:
        """The crop size (the input in image layout) and, for context, the mean in image
        space (before the transformer's channel swap and raw scale)."""
        in_ = self.inputs[0]
        t = self.transformer
        to_image = np.argsort(t.transpose[in_])
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[to_image]
        self.context_pad = context_pad
        if not context_pad:
            return
        mean = t.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
            return
        crop_mean = mean.copy().transpose(to_image)
        if in_ in t.channel_swap:
            crop_mean = crop_mean[:, :, np.argsort(t.channel_swap[in_])]
        if in_ in t.raw_scale:
            crop_mean = crop_mean / t.raw_scale[in_]
        self.crop_mean = crop_mean
