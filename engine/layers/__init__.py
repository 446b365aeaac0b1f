"""Layers, one module per family; importing this package fills the type registry."""
from .base import Layer, LayerError, create_layer, layer_class, register, registered_types

# Each family module registers its classes on import. Keep this list the only place
# that needs to know which modules exist.
import importlib as _importlib

for _mod in ("input", "vision", "lrn", "neuron", "common", "loss", "normalization"):
    try:
        _importlib.import_module(f"{__name__}.{_mod}")
    except ModuleNotFoundError as _e:  # a family not written yet
        if _e.name != f"{__name__}.{_mod}":
            raise
# The data layers live with the rest of the data code (LMDB, transformer, prefetch).
_importlib.import_module("engine.data.layers")

__all__ = ["Layer", "LayerError", "create_layer", "layer_class", "register", "registered_types"]
