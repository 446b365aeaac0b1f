"""``import caffe``: BVLC pycaffe's package, backed by the engine.

Installed under the import name ``caffe`` (pyproject maps it here, no top-level folder). It
offers what pycaffe's ``caffe/__init__.py`` does: ``Net`` and the six solvers with
``get_solver`` (net.py, solver.py), ``Layer`` for Python layers, ``TRAIN``/``TEST``, the mode,
device, seed and logging functions, ``layer_type_list``, ``has_nccl``, ``Classifier``,
``Detector``, ``io``, ``proto`` (``caffe.proto.caffe_pb2`` after a bare ``import caffe``, as
BVLC's allows), and ``net_spec``'s ``layers``/``params``/``NetSpec``/``to_proto``;
``caffe.draw`` and ``caffe.coord_map`` import as submodules.

A real BVLC pycaffe and this package both answer to ``import caffe``: whichever comes first
on ``sys.path`` wins. Keep them in separate virtualenvs (README, "For pycaffe users").
"""
from __future__ import annotations

import time

from engine import backend, glog
from engine.allocator import tune_allocator
from engine.layer_types import layer_class, registered_types
from engine.layers.python_layer import TEST, TRAIN, PyLayer as Layer

from . import io, proto  # noqa: F401  (proto: caffe.proto.caffe_pb2 after `import caffe`)
from .classifier import Classifier
from .detector import Detector
from .net import Net
from .net_spec import NetSpec, layers, params, to_proto
from .solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,
                     RMSPropSolver, SGDSolver, get_solver)

tune_allocator()  # a pycaffe script is a training process too (engine/allocator.py)

__version__ = "1.0.0"  # the Caffe release whose Python interface this follows

__all__ = ["Layer", "TRAIN", "TEST", "Net", "SGDSolver", "NesterovSolver", "AdaGradSolver",
           "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver", "NCCL", "Timer",
           "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed", "layer_type_list",
           "has_nccl", "init_log", "log", "solver_count", "set_solver_count", "solver_rank",
           "set_solver_rank", "set_multiprocess", "Classifier", "Detector", "io", "layers",
           "params", "NetSpec", "to_proto"]

_device = [0]
_solver = {"count": 1, "rank": 0, "multiprocess": False}


def set_mode_cpu() -> None:
    backend.use_cpu()


def set_mode_gpu() -> None:
    backend.use_gpu(_device[0])


def set_device(device_id: int) -> None:
    _device[0] = int(device_id)


def set_random_seed(seed: int) -> None:
    backend.seed(int(seed))


def layer_type_list() -> list[str]:
    """The registered layer types by their current names (the V1 enum aliases left out)."""
    return sorted({layer_class(t).type for t in registered_types()})


def has_nccl() -> bool:
    return False  # no NCCL here: the CPU engine, and GPU runs synchronise over ZeroMQ


class NCCL:
    """pycaffe's NCCL handle; never usable here (``has_nccl()`` is False): Poseidon's
    distributed runs go through ``poseidon train --hosts``/``-n``."""

    def __init__(self, *args: object) -> None:
        raise RuntimeError("this caffe has no NCCL (caffe.has_nccl() is False); train on "
                           "several GPUs or machines with `poseidon train -n N` or --hosts")

    @staticmethod
    def new_uid() -> bytes:
        raise RuntimeError("this caffe has no NCCL (caffe.has_nccl() is False)")


class Timer:
    """pycaffe's Timer: ``start()``, ``stop()``, ``ms`` (wall-clock milliseconds)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._elapsed = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self._elapsed = (time.perf_counter() - self._start) * 1000.0
            self._start = None

    @property
    def ms(self) -> float:
        return self._elapsed


def init_log(level: int = 0, stderr: bool = True) -> None:
    """Accepted for pycaffe scripts; the engine logs Caffe-style lines to stderr already."""


def log(message: str) -> None:
    glog.info(message)


# Caffe's multi-GPU bookkeeping, kept for scripts that set it; Poseidon's workers are processes
def solver_count() -> int:
    return _solver["count"]


def set_solver_count(count: int) -> None:
    _solver["count"] = int(count)


def solver_rank() -> int:
    return _solver["rank"]


def set_solver_rank(rank: int) -> None:
    _solver["rank"] = int(rank)


def set_multiprocess(multiprocess: bool) -> None:
    _solver["multiprocess"] = bool(multiprocess)
