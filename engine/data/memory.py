"""MemoryData: batches the caller hands the net (pycaffe's ``set_input_arrays``), in order."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..blob import Blob
from ..layers.base import register
from .layers import StreamDataLayer


@register("MemoryData", "MEMORY_DATA")
class MemoryDataLayer(StreamDataLayer):
    """Caffe's MemoryData layer, fed from Python with ``reset(data, labels)`` (pycaffe's
    ``net.set_input_arrays``). Arrays are used as given (no transformation), batches go
    through them in order and wrap around."""

    max_tops = 2

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        mp = self.param.memory_data_param
        self.item_shape = (mp.channels, mp.height, mp.width)
        if min(self.item_shape) <= 0:
            raise self.fail("memory_data_param needs positive channels, height and width")
        self._data: np.ndarray | None = None
        self._labels = np.zeros(0, dtype=np.float32)
        self._init_stream(mp.batch_size, 0, strided=True, prefetch=0)
        self._shape_tops(top, [(self.batch_size, *self.item_shape), (self.batch_size,)])

    def reset(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Use ``data`` (N, C, H, W) and ``labels`` (N,) or (N, 1, 1, 1) from the next batch on."""
        data = np.asarray(data)
        labels = np.asarray(labels).reshape(-1)
        if data.ndim != 4 or data.shape[1:] != self.item_shape:
            raise self.fail(f"data of shape {data.shape} does not match (N, {self.item_shape[0]}, "
                            f"{self.item_shape[1]}, {self.item_shape[2]})")
        if labels.shape[0] != data.shape[0]:
            raise self.fail(f"{data.shape[0]} images but {labels.shape[0]} labels")
        if data.shape[0] == 0 or data.shape[0] % self.batch_size:
            raise self.fail(f"the number of images ({data.shape[0]}) must be a positive multiple "
                            f"of batch_size ({self.batch_size})")
        self._data, self._labels = data, labels.astype(np.float32)
        self.seek(0)

    def _load(self, pos: int) -> tuple[np.ndarray, ...]:
        if self._data is None:
            raise self.fail("no data: call reset(data, labels) first (pycaffe's set_input_arrays)")
        idx = self.record_indices(pos) % self._data.shape[0]
        return self._data[idx], self._labels[idx]
