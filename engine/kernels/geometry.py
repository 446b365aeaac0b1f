"""The shape of one windowed operation (a convolution's im2col, a pooling) on a batch of image
planes, and Caffe's output-size rules: what the window kernels on the CPU and the GPU and the
vision layers share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: the types of MAX pooling's argmax record on the CPU, narrowest first (``index_dtype``)
INDEX_DTYPES = (np.int8, np.int16, np.int32)


@dataclass(frozen=True)
class Geometry:
    """Shape of one windowed operation on a (n, channels, height, width) image batch.

    ``out_h`` x ``out_w`` is the grid of window positions (a convolution's output, or a
    pooling output computed with Caffe's ceil-and-clip rule by the caller).
    """

    channels: int
    height: int
    width: int
    kernel_h: int
    kernel_w: int
    stride_h: int = 1
    stride_w: int = 1
    pad_h: int = 0
    pad_w: int = 0
    dilation_h: int = 1
    dilation_w: int = 1
    out_h: int = 0
    out_w: int = 0

    @property
    def col_rows(self) -> int:
        return self.channels * self.kernel_h * self.kernel_w

    @property
    def window(self) -> int:
        return self.kernel_h * self.kernel_w


def conv_out_size(size: int, kernel: int, pad: int, stride: int, dilation: int) -> int:
    """Caffe's convolution output size (floor)."""
    extent = dilation * (kernel - 1) + 1
    return (size + 2 * pad - extent) // stride + 1


def pool_out_size(size: int, kernel: int, pad: int, stride: int, any_pad: bool) -> int:
    """Caffe's pooling output size: ceil, then drop a last window that starts in the padding.

    ``any_pad`` is whether either spatial pad is non-zero: Caffe clips both axes then.
    """
    out = -(-(size + 2 * pad - kernel) // stride) + 1
    if any_pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def index_dtype(window: int) -> Any:
    """The narrowest of INDEX_DTYPES for a window of ``window`` offsets: the argmax record MAX
    pooling keeps for its backward pass is read once per output, so narrow is fast."""
    return next((t for t in INDEX_DTYPES if window <= np.iinfo(t).max), INDEX_DTYPES[-1])
