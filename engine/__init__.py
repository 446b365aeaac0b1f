"""Poseidon's compute engine: Caffe formats, layers, nets, solvers, data and the communicator.

``engine.Net`` is the pycaffe-style entry point (``engine.net.Net``), loaded on first use so
that importing a small part of the engine does not build the layer registry.
"""
from typing import Any

from . import glog as _glog  # noqa: F401  (every engine logger writes glog lines from the start)


def __getattr__(name: str) -> Any:
    if name == "Net":
        from .net import Net
        return Net
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
