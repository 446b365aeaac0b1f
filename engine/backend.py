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


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def use_gpu(device: int, math: str = "fast") -> None:
    """Select GPU ``device`` for new arrays, its convolutions and matrix products computed as
    ``math`` says (engine/kernels/cudnn_conv.py's ``MATHS``: fast, strict or tf32); raises a
    clear error when there is no GPU."""
    global _device
    from .kernels import cudnn_conv
    cudnn_conv.set_math(math)  # a bad mode is refused before any GPU is touched
    if not cupy_available():
        raise RuntimeError(f"--gpu {device}: CuPy with a CUDA GPU is not available on this machine "
                           "(pip install -e '.[gpu]' in Poseidon's checkout)")
    _cupy.cuda.Device(device).use()
    _device = device
    _set_matmul_tf32(math == "tf32")


def _set_matmul_tf32(allowed: bool) -> None:
    """cuBLAS's float32 products on TF32 tensor cores or not (CuPy's CUPY_TF32, set for this
    process whatever the environment said: only --gpu-math tf32 allows them)."""
    from cupy._core import _routines_linalg as linalg  # type: ignore
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if allowed
                            else linalg.COMPUTE_TYPE_DEFAULT)


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
    from .kernels import cudnn_conv  # the convolutions' library decides most GPU times
    return (f"{name}, CUDA runtime {_cupy.cuda.runtime.runtimeGetVersion()}, "
            f"CuPy {_cupy.__version__}, {cudnn_conv.version()}, math {cudnn_conv.math_mode()}")


def gpu_math_line() -> str:
    """The log's line on how the GPU computes (--gpu-math)."""
    from .kernels import cudnn_conv
    mode = cudnn_conv.math_mode()
    return f"GPU math: {mode} ({cudnn_conv.MATH_LINES[mode]})"


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


_ONES: dict[tuple[str, str, int, str], Any] = {}


def ones_like_vector(like: Any, n: int) -> Any:
    """n ones on ``like``'s device, of its dtype, made once: the vector a sum as a GEMV
    (Caffe's multipliers) multiplies by."""
    key = (type(like).__module__, str(getattr(like, "device", "cpu")), n, str(like.dtype))
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = get_array_module(like).ones(n, dtype=like.dtype)
    return ones


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
