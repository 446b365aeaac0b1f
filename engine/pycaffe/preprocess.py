"""The input Transformer a Classifier or Detector sets up from its constructor's options."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .io import Transformer


def configured_transformer(net: Any, mean: np.ndarray | None, input_scale: float | None,
                           raw_scale: float | None, channel_swap: Sequence[int] | None
                           ) -> Transformer:
    """A Transformer for the net's first input: H x W x K images -> K x H x W, then the
    options that are given."""
    in_ = net.inputs[0]
    t = Transformer({in_: net.blobs[in_].data.shape})
    t.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        t.set_mean(in_, mean)
    if input_scale is not None:
        t.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        t.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        t.set_channel_swap(in_, channel_swap)
    return t
