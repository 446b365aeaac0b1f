"""Caffe's Python layer: ``type: "Python"`` with ``python_param { module layer param_str }``.

The user's class follows pycaffe's contract: it derives from ``caffe.Layer`` (here
engine/pycaffe), and implements ``setup``, ``reshape``, ``forward`` and ``backward(top,
propagate_down, bottom)`` on blobs with ``.data``/``.diff``; it reads ``self.param_str`` and
``self.phase`` and may add learnable blobs with ``self.blobs.add_blob(*shape)``. Those blobs
are this layer's parameters, so the solver updates them and a distributed run synchronises
them like any other. Each process (every worker of a distributed run) imports the module
itself: it must be importable there (on PYTHONPATH or beside the working directory).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..blob import Blob
from .base import Layer, register

TRAIN, TEST = 0, 1  # pycaffe's phase constants (caffe.TRAIN, caffe.TEST)


class BlobVec(list):
    """``self.blobs`` of a Python layer: a list of Blobs with pycaffe's ``add_blob``."""

    def add_blob(self, *shape: int) -> Blob:
        blob = Blob(shape, np.float32)
        self.append(blob)
        return blob


class PyLayer:
    """pycaffe's ``caffe.Layer``: what a user's Python layer derives from."""

    def __init__(self, param: Any = None, phase: int = TRAIN) -> None:
        self.param_str = param.python_param.param_str if param is not None else ""
        self.phase = phase
        self.blobs = BlobVec()

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        pass


@register("Python")
class PythonLayer(Layer):
    """Runs a user's pycaffe layer class inside the engine's layer contract."""

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.python_param
        if not p.module or not p.layer:
            raise self.fail("python_param needs both module and layer")
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.append(str(Path.cwd()))  # pycaffe finds modules beside the working directory
        try:
            module = importlib.import_module(p.module)
        except ImportError as e:
            raise self.fail(f"cannot import python_param.module {p.module!r}: {e}") from None
        cls = getattr(module, p.layer, None)
        if not isinstance(cls, type):
            raise self.fail(f"module {p.module!r} has no class {p.layer!r}")
        impl = cls.__new__(cls)
        PyLayer.__init__(impl, self.param, TRAIN if self.phase == "TRAIN" else TEST)
        if type(impl).__init__ not in (PyLayer.__init__, object.__init__):
            impl.__init__(self.param)  # a class with its own constructor, as pycaffe calls it
        if self.param.blobs:  # weights given in the prototxt (Caffe: the layer's initial blobs)
            from ..caffe_io import blob_to_array
            for b in self.param.blobs:
                arr = blob_to_array(b)
                impl.blobs.add_blob(*arr.shape).data[...] = arr
        self.impl = impl
        self.blobs = impl.blobs  # the same list: what the user adds, the solver learns
        impl.setup(bottom, top)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.impl.reshape(bottom, top)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.impl.forward(bottom, top)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        self.impl.backward(top, list(propagate_down), bottom)
