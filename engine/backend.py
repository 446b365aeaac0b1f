"""The array module: NumPy on the CPU, CuPy when a GPU is chosen.

Layers never import numpy or cupy directly for math on blobs; they ask
``get_array_module(array)`` (Chainer's ``xp`` idiom) so one code path serves both.
"""
from __future__ import annotations

from typing import Any

import numpy as np

try:  # CuPy is an optional extra; its absence is the normal CPU case.
    import cupy as _cupy  # type: ignore
except Exception:  # pragma: no cover - depends on the machine
    _cupy = None

_device: int | None = None


def _tune_allocator() -> None:
    """Keep freed multi-MB buffers in the heap instead of returning them to the kernel.

    Every layer makes large temporaries each iteration; with glibc's defaults each one is a
    fresh mmap whose pages fault in again (LeNet fwd+bwd 42 -> 25 ms measured). Equivalent to
    MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_/MALLOC_TOP_PAD_; a no-op off glibc.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 256 << 20)
    libc.mallopt(m_trim_threshold, 256 << 20)
    libc.mallopt(m_top_pad, 64 << 20)


_tune_allocator()


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def use_gpu(device: int) -> None:
    """Select GPU ``device`` for new arrays; raises a clear error when there is none."""
    global _device
    if not cupy_available():
        raise RuntimeError(f"--gpu {device}: CuPy with a CUDA GPU is not available on this machine "
                           "(pip install 'poseidon[gpu]')")
    _cupy.cuda.Device(device).use()
    _device = device


def use_cpu() -> None:
    global _device
    _device = None


def xp_default() -> Any:
    """The array module new blobs are made with."""
    return _cupy if _device is not None else np


def get_array_module(*arrays: Any) -> Any:
    """numpy or cupy, whichever the arrays belong to."""
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return np


def to_numpy(a: Any) -> np.ndarray:
    """Host copy of an array from either module."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy.asnumpy(a)
    return np.asarray(a)


def is_gpu_array(a: Any) -> bool:
    return _cupy is not None and isinstance(a, _cupy.ndarray)


_rng = np.random.default_rng(1701)


def seed(n: int | None) -> None:
    """Seed Poseidon's one random stream (the solver's random_seed); None = from entropy."""
    global _rng
    _rng = np.random.default_rng(None if n is None or n < 0 else n)


def rng() -> np.random.Generator:
    """The random stream fillers, dropout, shuffles and random crops draw from."""
    return _rng
