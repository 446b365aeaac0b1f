"""Caffe's layer contract and the registry that maps Caffe type strings to layer classes.

A layer is one class: ``setup`` checks its parameters and makes its parameter blobs,
``reshape`` sizes its tops, ``forward`` writes ``top[i].data``, ``backward`` writes
``bottom[i].diff`` (overwriting) where ``propagate_down[i]`` and *adds* parameter
gradients into ``self.blobs[j].diff`` where ``self.param_propagate_down[j]`` (Caffe
accumulates parameter gradients; the solver clears them once per iteration, which is
what makes ``iter_size`` work).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..blob import Blob
from ..context import RunContext


class LayerError(ValueError):
    """A problem with one layer's definition or inputs; the message names the layer."""


class Layer:
    """Base of every layer. Subclasses override the four contract methods."""

    #: Caffe type string(s) the class answers to; set by ``@register``.
    type: str = ""
    #: bottom/top count checks (None = no check), as Caffe's ExactNumBottomBlobs etc.
    exact_num_bottoms: int | None = None
    min_bottoms: int | None = None
    max_bottoms: int | None = None
    exact_num_tops: int | None = None
    min_tops: int | None = None
    max_tops: int | None = None
    #: a loss layer's first top gets loss_weight 1 unless the prototxt says otherwise
    is_loss: bool = False

    def __init__(self, param: Any, phase: str = "TRAIN"):
        self.param = param  # caffe_pb2.LayerParameter
        self.name: str = param.name
        self.phase = phase
        self.blobs: list[Blob] = []
        self.param_propagate_down: list[bool] = []
        self.context = RunContext()  # the Net sets the run's own before setup

    # -- the contract ------------------------------------------------------------
    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Check parameters against the bottoms and create ``self.blobs``."""

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        raise NotImplementedError

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        raise NotImplementedError

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        """Default: a layer with nothing to propagate (data layers, Accuracy, ...)."""

    def allow_force_backward(self, bottom_index: int) -> bool:
        """False for inputs that can never take a gradient (a loss layer's labels)."""
        return True

    # -- helpers for subclasses ------------------------------------------------------
    def fail(self, message: str) -> "LayerError":
        """An error that names this layer; ``raise self.fail("...")``."""
        return LayerError(f"layer '{self.name}' ({self.type}): {message}")

    def check_blob_counts(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        def check(kind: str, n: int, exact: int | None, lo: int | None, hi: int | None) -> None:
            if exact is not None and n != exact:
                raise self.fail(f"takes exactly {exact} {kind} blob(s), got {n}")
            if lo is not None and n < lo:
                raise self.fail(f"takes at least {lo} {kind} blob(s), got {n}")
            if hi is not None and n > hi:
                raise self.fail(f"takes at most {hi} {kind} blob(s), got {n}")
        check("bottom", len(bottom), self.exact_num_bottoms, self.min_bottoms, self.max_bottoms)
        check("top", len(top), self.exact_num_tops, self.min_tops, self.max_tops)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self.name}'>"


_REGISTRY: dict[str, type[Layer]] = {}


def register(*type_names: str) -> Callable[[type[Layer]], type[Layer]]:
    """Class decorator: ``@register("Convolution", "CONVOLUTION")``."""
    def deco(cls: type[Layer]) -> type[Layer]:
        cls.type = type_names[0]
        for name in type_names:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise RuntimeError(f"layer type {name!r} registered twice")
            _REGISTRY[name] = cls
        return cls
    return deco


def layer_class(type_name: str, layer_name: str = "?") -> type[Layer]:
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise LayerError(f"layer '{layer_name}': unknown layer type '{type_name}'") from None


def create_layer(param: Any, phase: str = "TRAIN") -> Layer:
    """Instantiate the layer class registered for ``param.type``."""
    return layer_class(param.type, param.name)(param, phase)


def registered_types() -> list[str]:
    return sorted(_REGISTRY)
