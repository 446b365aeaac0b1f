"""Caffe's weight fillers: initial values for parameter blobs and DummyData tops.

``fill(filler_param, blob)`` writes into ``blob.data`` keeping the blob's dtype and
array module. Random numbers come from Poseidon's one stream (``backend.rng()``) and are
drawn on the host, because a seeded run must give the same weights on CPU and GPU.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from . import backend
from .blob import Blob, building_shapes_only


class FillerError(ValueError):
    """A filler that cannot fill the given blob (unknown type, bad shape, bad bounds)."""


def _store(blob: Blob, values: np.ndarray) -> None:
    xp = backend.get_array_module(blob.data)
    blob.data[...] = xp.asarray(values.reshape(blob.shape), dtype=blob.data.dtype)


def _legacy_dim(blob: Blob, axis: int) -> int:
    """Caffe's LegacyShape: an axis the blob lacks counts as 1 (the channels of a 1-D blob)."""
    return blob.shape[axis] if axis < blob.num_axes() else 1


def _fans(blob: Blob) -> tuple[int, int]:
    """Caffe's fan_in = count / num and fan_out = count / channels (never 0: fill skips
    empty blobs)."""
    return blob.count // _legacy_dim(blob, 0), blob.count // _legacy_dim(blob, 1)


def _variance_n(param: Any, blob: Blob) -> float:
    fan_in, fan_out = _fans(blob)
    norm = param.variance_norm
    if norm == param.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if norm == param.FAN_OUT:
        return float(fan_out)
    return float(fan_in)


def _no_sparse(param: Any) -> None:
    if param.sparse != -1:
        raise FillerError(f"filler '{param.type}' does not support sparse (got {param.sparse})")


def _constant(param: Any, blob: Blob) -> None:
    _no_sparse(param)
    blob.data[...] = param.value


def _uniform(param: Any, blob: Blob) -> None:
    _no_sparse(param)
    if param.min > param.max:
        raise FillerError(f"uniform filler: min {param.min} > max {param.max}")
    _store(blob, backend.rng().uniform(param.min, param.max, blob.count))


def _gaussian(param: Any, blob: Blob) -> None:
    values = backend.rng().normal(param.mean, param.std, blob.count)
    if param.sparse < -1:
        raise FillerError(f"gaussian filler: sparse must be >= -1, got {param.sparse}")
    if param.sparse >= 0:
        # Caffe: each weight survives with probability sparse / num_outputs, so each
        # output keeps on average `sparse` non-zero inputs.
        if not blob.shape:
            raise FillerError("gaussian filler with sparse needs a blob with at least one axis")
        p = min(1.0, param.sparse / blob.shape[0])
        values *= backend.rng().random(blob.count) < p
    _store(blob, values)


def _xavier(param: Any, blob: Blob) -> None:
    _no_sparse(param)
    scale = math.sqrt(3.0 / _variance_n(param, blob))
    _store(blob, backend.rng().uniform(-scale, scale, blob.count))


def _msra(param: Any, blob: Blob) -> None:
    _no_sparse(param)
    std = math.sqrt(2.0 / _variance_n(param, blob))
    _store(blob, backend.rng().normal(0.0, std, blob.count))


def _bilinear(param: Any, blob: Blob) -> None:
    _no_sparse(param)
    shape = blob.shape
    if len(shape) != 4:
        raise FillerError(f"bilinear filler needs a 4-D blob, got shape {shape}")
    height, width = shape[2], shape[3]
    if height != width:
        raise FillerError(f"bilinear filler needs a square kernel, got {height}x{width}")
    # Caffe's upsampling kernel: the same (1-|x/f-c|)(1-|y/f-c|) for every (num, channel).
    f = math.ceil(width / 2.0)
    c = (2 * f - 1 - f % 2) / (2.0 * f)
    ramp = 1.0 - np.abs(np.arange(width) / f - c)
    _store(blob, np.broadcast_to(np.outer(ramp, ramp), shape).copy())


def _positive_unitball(param: Any, blob: Blob) -> None:
    _no_sparse(param)
    values = backend.rng().uniform(0.0, 1.0, blob.count).reshape(_legacy_dim(blob, 0), -1)
    _store(blob, values / values.sum(axis=1, keepdims=True))


_FILLERS: dict[str, Callable[[Any, Blob], None]] = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
    "positive_unitball": _positive_unitball,
}


def fill(filler_param: Any, blob: Blob) -> None:
    """Fill ``blob.data`` as Caffe's filler named by ``filler_param.type`` would."""
    try:
        filler = _FILLERS[filler_param.type]
    except KeyError:
        raise FillerError(f"unknown filler type '{filler_param.type}' "
                          f"(known: {', '.join(sorted(_FILLERS))})") from None
    if blob.count == 0 or building_shapes_only():
        return
    filler(filler_param, blob)


def is_constant(filler_param: Any) -> bool:
    """True when filling twice gives the same values (DummyData refills only otherwise)."""
    return filler_param.type == "constant"
