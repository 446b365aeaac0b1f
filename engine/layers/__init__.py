"""Layers, one module per family; importing this package fills the type registry."""
import importlib as _importlib

from .base import Layer, LayerError, create_layer, layer_class, register, registered_types

# Each family module registers its classes on import; this list is the one place that
# knows which modules exist. The data layers live with the rest of the data code.
for _mod in (".input", ".vision", ".lrn", ".neuron", ".common", ".inner_product", ".loss",
             ".normalization",
             ".python_layer", ".recurrent",
             "engine.data.layers", "engine.data.window", "engine.data.hdf5"):
    _importlib.import_module(_mod, __name__)

__all__ = ["Layer", "LayerError", "create_layer", "layer_class", "register", "registered_types"]
