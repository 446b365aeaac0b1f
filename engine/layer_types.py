"""Every layer type, registered: the one module that knows which modules hold layers.

Each family module (engine/layers/<family>.py, and the data layers in engine/data/) registers
its classes with the registry of engine/layers/base.py when it is imported; this module
imports them all, by plain import statements, so the Net and pycaffe see every type Caffe has
and the import graph shows each edge (the layer modules import base.py, never this module).
"""
from __future__ import annotations

from .data import hdf5, image_list, memory, window  # noqa: F401  (they register their types)
from .data import layers as data_layers  # noqa: F401
from .layers import (accuracy, inner_product, label_losses, lrn, loss,  # noqa: F401
                     neuron, normalization, pooling, python_layer, recurrent, reductions,
                     routing, vision)
from .layers import input as input_layers  # noqa: F401
from .layers.base import Layer, LayerError, create_layer, layer_class, register, registered_types

__all__ = ["Layer", "LayerError", "create_layer", "layer_class", "register", "registered_types"]
