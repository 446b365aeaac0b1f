"""Blob: a named pair of arrays (data and diff) with Caffe's shape helpers.

Every allocation is checked first against the memory this machine has (RAM available plus
free swap): a net that cannot fit fails with one line naming the blob and the bytes, before
anything is allocated, instead of a MemoryError traceback or a machine swapping to death.

Inside ``shapes_only()`` a blob holds no memory at all: each array is a single value seen under
the blob's shape (every stride 0), so a net is built, set up and reshaped for its shapes and
parameter sizes (the simulator's needs) at any batch, whatever the machine's memory.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator, Sequence

import numpy as np

from . import backend


class BlobTooLarge(ValueError):
    """A blob (or a net) needs more memory than the machine has."""


def meminfo_bytes(*names: str) -> int | None:
    """The sum of /proc/meminfo's fields ``names``, in bytes (Linux); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().splitlines())
        return sum(int(fields[k].split()[0]) * 1024 for k in names)
    except (OSError, KeyError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def available_bytes() -> int | None:
    """MemAvailable + SwapFree (Linux), read once per process; None where unknown."""
    return meminfo_bytes("MemAvailable", "SwapFree")


def fmt_bytes(n: int) -> str:
    for unit, size in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def check_fits(what: str, nbytes: int) -> None:
    """Raise BlobTooLarge when ``nbytes`` more would not fit in this machine's memory."""
    limit = available_bytes()
    if limit is not None and nbytes > limit:
        raise BlobTooLarge(f"{what} needs {fmt_bytes(nbytes)}, more than the "
                           f"{fmt_bytes(limit)} of memory this machine has available "
                           "(RAM + swap)")


_shapes_only = False


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Blobs made or reshaped inside hold no memory and fillers write nothing: for tools that
    need only shapes (the simulator); never while training (every value of a blob is one)."""
    global _shapes_only
    before, _shapes_only = _shapes_only, True
    try:
        yield
    finally:
        _shapes_only = before


def building_shapes_only() -> bool:
    """True inside ``shapes_only()``."""
    return _shapes_only


def _zeros(shape: tuple[int, ...], dtype: Any, xp: Any) -> Any:
    if _shapes_only:  # one value under the whole shape: writes land on it, nothing is backed
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape))
    return xp.zeros(shape, dtype=dtype)


def _checked_shape(name: str, shape: Sequence[int], dtype: Any, xp: Any) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"blob {name!r}: negative dimension in shape {shape}")
    if xp is np and not _shapes_only:  # a GPU's memory is CuPy's to report
        n = math.prod(shape)  # Python ints: no wrap-around
        check_fits(f"blob {name!r} of shape {shape} (data and diff)",
                   2 * n * np.dtype(dtype).itemsize)
    return shape


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
        self.data = _zeros(_checked_shape(name, shape, dtype, xp), dtype, xp)
        self.diff = _zeros(self.data.shape, dtype, xp)  # zeros_like writes every page; zeros need not

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

    def legacy_shape(self, index: int) -> int:
        """Caffe's LegacyShape: a dimension of the old 4-D view (1 past the blob's axes)."""
        if self.data.ndim > 4:
            raise ValueError(f"blob {self.name!r} of shape {self.shape} has more than 4 axes: "
                             "num/channels/height/width do not apply")
        n = self.data.ndim
        return self.shape[index] if -n <= index < n else 1

    # pycaffe's (and Caffe's) names for the 4-D view: blob.num, blob.channels, ...
    num = property(lambda self: self.legacy_shape(0))
    channels = property(lambda self: self.legacy_shape(1))
    height = property(lambda self: self.legacy_shape(2))
    width = property(lambda self: self.legacy_shape(3))

    def canonical_axis(self, axis: int) -> int:
        """Caffe's CanonicalAxisIndex: negative axes count from the end."""
        n = self.data.ndim
        if not -n <= axis < max(n, 1):
            raise ValueError(f"axis {axis} out of range for blob {self.name!r} of shape {self.shape}")
        return axis + n if axis < 0 else axis

    def count_range(self, start: int, end: int | None = None) -> int:
        """Product of dims [start, end)."""
        return math.prod(self.shape[start:end])

    def reshape(self, *dims: int | Sequence[int]) -> None:
        """``reshape((2, 3))``, or pycaffe's ``reshape(2, 3)``; ``reshape()`` makes a scalar."""
        shape = tuple(int(s) for s in (dims[0] if len(dims) == 1 and not isinstance(
            dims[0], (int, np.integer)) else dims))  # type: ignore[union-attr]
        if shape == self.shape:
            return
        xp = backend.get_array_module(self.data)
        shape = _checked_shape(self.name, shape, self.data.dtype, xp)
        n = math.prod(shape)
        if n == self.data.size and not _shapes_only:
            self.data = self.data.reshape(shape)
            self.diff = self.diff.reshape(shape)
        else:
            self.data = _zeros(shape, self.data.dtype, xp)
            self.diff = _zeros(shape, self.data.dtype, xp)

    def reshape_like(self, other: "Blob") -> None:
        self.reshape(other.shape)

    def share_data(self, other: "Blob") -> None:
        self.data = other.data

    def share_diff(self, other: "Blob") -> None:
        self.diff = other.diff

    def __repr__(self) -> str:
        return f"Blob({self.name!r}, shape={self.shape}, dtype={self.data.dtype})"
