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


_allocator_tuned = False


def tune_allocator() -> None:
    """Keep freed multi-MB buffers in the heap instead of returning them to the kernel.

    Every layer makes large temporaries each iteration, and libzmq's I/O thread allocates each
    received message; with glibc's defaults each one is a fresh mmap whose pages fault in again
    (LeNet fwd+bwd 42 -> 25 ms measured; a 64 MB message stream on loopback ran at 0.37 of a
    raw TCP stream, 0.88 with this). A raised mmap threshold is not enough: a thread's own
    arena is at most 64 MB, so anything larger is mmapped anyway. Hence one arena (the brk
    heap, shared by every thread) and no mmap at all. Must run before other threads allocate;
    idempotent; a no-op off glibc. Equivalent to MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_ MALLOC_TOP_PAD_.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_max, m_arena_max = -1, -2, -4, -8
    libc.mallopt(m_arena_max, 1)
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_top_pad, 64 << 20)


tune_allocator()


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


def device_name() -> str:
    """What computes new arrays, with the library versions a timing depends on."""
    if _device is None:
        import platform
        cpu = platform.processor() or platform.machine()
        return f"CPU {cpu}, NumPy {np.__version__}"
    props = _cupy.cuda.runtime.getDeviceProperties(_device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    try:
        from cupy.cuda import cudnn
        dnn = f", cuDNN {cudnn.getVersion()}"
    except Exception:  # CuPy without its cuDNN bindings
        dnn = ", no cuDNN"
    return (f"{name}, CUDA runtime {_cupy.cuda.runtime.runtimeGetVersion()}, "
            f"CuPy {_cupy.__version__}{dnn}")


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


#: the seed of a solver whose random_seed is -1 (Caffe takes entropy; a fixed one keeps the
#: replicas of a distributed run identical and every run repeatable)
DEFAULT_SEED = 1701
_rng = np.random.default_rng(DEFAULT_SEED)


def seed(n: int | None) -> None:
    """Seed Poseidon's one random stream (the solver's random_seed); None = from entropy."""
    global _rng
    _rng = np.random.default_rng(None if n is None or n < 0 else n)


def seed_iteration(root: int, rank: int, iteration: int) -> None:
    """Draw what one training iteration draws (dropout masks...) from a stream of (root, rank,
    iteration) alone: a run resumed at any iteration, from any snapshot, draws exactly what
    the uninterrupted run drew, and no random state needs saving."""
    global _rng
    _rng = np.random.default_rng([root, rank, iteration])


def rng() -> np.random.Generator:
    """The random stream fillers, dropout, shuffles and random crops draw from."""
    return _rng
