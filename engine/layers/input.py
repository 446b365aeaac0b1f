"""Input layers with no source: Input (blobs the caller fills) and DummyData (filler output)."""
from __future__ import annotations

from typing import Any, Sequence

from .. import fillers
from ..blob import Blob
from ..pb import caffe_pb2
from .base import Layer, register


def _pick(values: Sequence[Any], i: int) -> Any:
    """Caffe's one-for-all-or-one-per-top rule for repeated fields."""
    return values[0] if len(values) == 1 else values[i]


@register("Input")
class InputLayer(Layer):
    """Tops shaped from input_param.shape; the caller writes their data before forward."""

    exact_num_bottoms = 0
    min_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shapes = self.param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.fail(f"input_param has {len(shapes)} shapes for {len(top)} tops "
                            "(give one shape, or one per top)")
        for i, blob in enumerate(top):
            if shapes:
                blob.reshape(tuple(_pick(shapes, i).dim))

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Tops keep whatever shape the caller gave them."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """The data is already there."""


@register("DummyData", "DUMMY_DATA")
class DummyDataLayer(Layer):
    """Tops filled by data_filler: constant fillers once at setup, the others every forward."""

    exact_num_bottoms = 0
    min_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.dummy_data_param
        n = len(top)
        if len(p.data_filler) not in (0, 1, n):
            raise self.fail(f"has {len(p.data_filler)} data_filler for {n} tops "
                            "(give none, one, or one per top)")
        if p.data_filler:
            self.fillers = [_pick(p.data_filler, i) for i in range(n)]
        else:
            self.fillers = [caffe_pb2.FillerParameter(type="constant", value=0.0)] * n
        for i, blob in enumerate(top):
            blob.reshape(self._shape(p, i, n))
            if fillers.is_constant(self.fillers[i]):
                fillers.fill(self.fillers[i], blob)
        # Constant tops never change, so only the random ones are refilled each forward.
        self.refill = [not fillers.is_constant(f) for f in self.fillers]

    def _shape(self, p: Any, i: int, n: int) -> tuple[int, ...]:
        legacy = (p.num, p.channels, p.height, p.width)
        if any(legacy):
            if p.shape:
                raise self.fail("give either shape or num/channels/height/width, not both")
            for field, values in zip(("num", "channels", "height", "width"), legacy):
                if len(values) not in (1, n):
                    raise self.fail(f"dummy_data_param.{field} has {len(values)} values for "
                                    f"{n} tops (give one, or one per top)")
            return tuple(int(_pick(values, i)) for values in legacy)
        if len(p.shape) not in (1, n):
            raise self.fail(f"dummy_data_param has {len(p.shape)} shapes for {n} tops "
                            "(give one, or one per top)")
        return tuple(_pick(p.shape, i).dim)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Shapes are fixed at setup."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for filler, refill, blob in zip(self.fillers, self.refill, top):
            if refill:
                fillers.fill(filler, blob)
