"""ImageData: Caffe's data layer over a list of image files and labels (``source``), read and
decoded in order (or shuffled each epoch), transformed as the Data layer's records are."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .. import backend
from ..blob import Blob
from ..layers.base import register
from .datum import load_image
from .imageset import ListEntry, read_image_list
from .layers import _ImageStreamLayer, _Record


@register("ImageData", "IMAGE_DATA")
class ImageDataLayer(_ImageStreamLayer):
    """Caffe's ImageData layer: a list file of ``<path> <label>`` lines, images read from disk.

    Images are read like cv::imread (BGR, or grey when ``is_color: false``) and resized with
    OpenCV's bilinear rule when new_height/new_width are set. ``shuffle`` reorders the list
    every pass (a permutation per pass, drawn from the layer's seed and the pass number).
    """

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        ip = self.param.image_data_param
        if (ip.new_height > 0) != (ip.new_width > 0):
            raise self.fail("new_height and new_width must be set together")
        if not ip.source:
            raise self.fail("image_data_param.source is not set")
        self.source = self.context.resolve(ip.source)
        self.lines = self._read_list(self.source)
        self._init_transformer()
        self._shuffle_seed = self._draw_seed() if ip.shuffle else 0
        self._perm: tuple[int, np.ndarray] = (-1, np.arange(0))
        skip = int(backend.rng().integers(ip.rand_skip)) if ip.rand_skip else 0
        # Caffe's prefetching layers all take their queue depth from data_param.prefetch
        self._init_stream(ip.batch_size, skip, strided=True,
                          prefetch=self.param.data_param.prefetch)
        self._setup_image_tops(top)

    def _read_list(self, path: Path) -> list[ListEntry]:
        with self._named_errors():
            return read_image_list(path)

    def _fetch(self, k: int) -> _Record:
        epoch, j = divmod(k, len(self.lines))
        if self._shuffle_seed:
            # one tuple, replaced whole: the consumer's thread may read it too (_following)
            cached_epoch, perm = self._perm
            if cached_epoch != epoch:
                perm = np.random.default_rng([self._shuffle_seed, epoch]).permutation(
                    len(self.lines))
                self._perm = (epoch, perm)
            j = int(perm[j])
        entry = self.lines[j]
        return _Record(k, j, entry, entry.label)

    def _decode(self, record: _Record) -> tuple[np.ndarray, int]:
        ip = self.param.image_data_param
        # Caffe concatenates root_folder and the listed name as strings
        path = self.context.resolve(ip.root_folder + record.key.name)
        return load_image(path, ip.is_color, ip.new_height, ip.new_width), record.value

    def _following(self, record: _Record) -> _Record:
        return self._fetch(record.stream + 1)

    def _describe(self, record: _Record) -> str:
        return (f"image {record.key.name} ({self.source}:{record.key.line}, stream position "
                f"{record.stream})")

    def _source_size(self) -> int:
        return len(self.lines)
