"""``import caffe``: the pycaffe names a script or a Python layer needs, backed by the engine.

Installed under the import name ``caffe`` (pyproject maps it here, no top-level folder). So
far: ``Layer`` (the base of Python layers), ``TRAIN``/``TEST``, ``Net`` with pycaffe's
signatures, the mode and seed functions, ``layer_type_list`` and ``has_nccl``. A real BVLC
pycaffe installed in the same environment wins whichever was installed last; keep them in
separate virtualenvs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import backend
from engine.layers import layer_class, registered_types
from engine.layers.python_layer import TEST, TRAIN, PyLayer as Layer

__all__ = ["Layer", "TRAIN", "TEST", "Net", "set_mode_cpu", "set_mode_gpu", "set_device",
           "set_random_seed", "layer_type_list", "has_nccl"]

_PHASES = {TRAIN: "TRAIN", TEST: "TEST"}


def Net(network_file: str | Path, *args: Any, weights: str | None = None,
        phase: int | None = None) -> Any:
    """pycaffe's ``Net(file, phase)``, ``Net(file, weights, phase)`` and keyword forms."""
    from engine.net import Net as EngineNet

    if len(args) == 2:
        weights, phase = args
    elif len(args) == 1:
        phase = args[0]
    elif args:
        raise TypeError("Net(network_file, [weights,] phase)")
    if phase not in _PHASES:
        raise ValueError(f"phase must be caffe.TRAIN or caffe.TEST, got {phase!r}")
    return EngineNet(str(network_file), phase=_PHASES[phase],
                     weights=str(weights) if weights is not None else None)


def set_mode_cpu() -> None:
    backend.use_cpu()


def set_mode_gpu() -> None:
    backend.use_gpu(_device[0])


_device = [0]


def set_device(device_id: int) -> None:
    _device[0] = int(device_id)


def set_random_seed(seed: int) -> None:
    backend.seed(int(seed))


def layer_type_list() -> list[str]:
    """The registered layer types by their current names (the V1 enum aliases left out)."""
    return sorted({layer_class(t).type for t in registered_types()})


def has_nccl() -> bool:
    return False  # no NCCL here: the CPU engine, and GPU runs synchronise over ZeroMQ
