"""Blob: a named pair of arrays (data and diff) with Caffe's shape helpers."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import backend


class Blob:
    """Caffe's Blob: ``data`` holds values, ``diff`` holds gradients, both of one shape.

    Arrays are (re)allocated lazily by ``reshape``; a reshape to the same element
    count keeps the existing memory, as Caffe does.
    """

    __slots__ = ("data", "diff", "name")

    def __init__(self, shape: Sequence[int] = (), dtype: Any = np.float32, xp: Any = None,
                 name: str = ""):
        xp = xp if xp is not None else backend.xp_default()
        self.name = name
        self.data = xp.zeros(tuple(int(s) for s in shape), dtype=dtype)
        self.diff = xp.zeros(self.data.shape, dtype=dtype)  # zeros_like writes every page; zeros need not

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def count(self) -> int:
        return int(self.data.size)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    def num_axes(self) -> int:
        return self.data.ndim

    def canonical_axis(self, axis: int) -> int:
        """Caffe's CanonicalAxisIndex: negative axes count from the end."""
        n = self.data.ndim
        if not -n <= axis < max(n, 1):
            raise ValueError(f"axis {axis} out of range for blob {self.name!r} of shape {self.shape}")
        return axis + n if axis < 0 else axis

    def count_range(self, start: int, end: int | None = None) -> int:
        """Product of dims [start, end)."""
        dims = self.shape[start:end]
        return int(np.prod(dims, dtype=np.int64)) if dims else 1

    def reshape(self, shape: Sequence[int]) -> None:
        shape = tuple(int(s) for s in shape)
        if shape == self.shape:
            return
        if any(s < 0 for s in shape):
            raise ValueError(f"blob {self.name!r}: negative dimension in shape {shape}")
        xp = backend.get_array_module(self.data)
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if n == self.data.size:
            self.data = self.data.reshape(shape)
            self.diff = self.diff.reshape(shape)
        else:
            self.data = xp.zeros(shape, dtype=self.data.dtype)
            self.diff = xp.zeros(shape, dtype=self.data.dtype)

    def reshape_like(self, other: "Blob") -> None:
        self.reshape(other.shape)

    def share_data(self, other: "Blob") -> None:
        self.data = other.data

    def share_diff(self, other: "Blob") -> None:
        self.diff = other.diff

    def __repr__(self) -> str:
        return f"Blob({self.name!r}, shape={self.shape}, dtype={self.data.dtype})"
