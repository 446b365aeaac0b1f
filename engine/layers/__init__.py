"""Layers, one module per family; each registers its classes with base.py's registry when
imported, and engine/layer_types.py imports every family (the data layers' too)."""
from .base import Layer, LayerError, create_layer, layer_class, register, registered_types

__all__ = ["Layer", "LayerError", "create_layer", "layer_class", "register", "registered_types"]
