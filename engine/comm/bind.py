"""The adapter between a Net and the communicator: which arrays each layer synchronises.

engine.comm never imports a layer class and never reads a layer's protobuf. It looks at a
built Net: the learnable parameters each layer owns, and whether a layer declares the
sufficient-factor contract (engine/factors.py: ``factor_spec()``, K rows, M inputs, N outputs
and the orientation of the weight; ``sufficient_factors()`` after a backward;
``defer_weight_gradient``, which spares the layer's own weight-gradient GEMM when SFB rebuilds
it; ``rebuild_gradient``, the rebuild).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from engine.factors import FactorSpec, SufficientFactors

from .cost import LayerInfo
from .units import LayerSlot, ParamSlot


def describe_net(net: Any) -> tuple[dict[int, LayerSlot], list[LayerInfo]]:
    """Per layer that owns learnable parameters: its sync slots and what the planner needs."""
    owned: dict[int, list[int]] = {}
    for i, li in enumerate(net.param_layer_index):
        owned.setdefault(li, []).append(i)
    # a blob used by several layers gets gradient from all of them: no factor shortcut then
    uses: dict[int, int] = {}
    for blobs in net.params.values():
        for b in blobs:
            uses[id(b)] = uses.get(id(b), 0) + 1
    slots: dict[int, LayerSlot] = {}
    infos: list[LayerInfo] = []
    for li in sorted(owned):
        layer = net.layers[li]
        idx = owned[li]
        blobs = [net.learnable_params[i] for i in idx]
        spec = _factor_spec(net, li, layer, blobs, uses)
        shape = (spec.k, spec.m, spec.n) if spec is not None else None
        params = [ParamSlot(i, net.param_names[i], blob) for i, blob in zip(idx, blobs)]
        slots[li] = LayerSlot(li, net.layer_names[li], params)
        if spec is not None:
            slots[li].factors = layer.sufficient_factors
            slots[li].factor_shape = shape
            slots[li].defer_weight_gradient = _deferrer(layer)
            slots[li].rebuild = layer.rebuild_gradient
        infos.append(LayerInfo(li, net.layer_names[li], [tuple(b.shape) for b in blobs], shape,
                               int(np.dtype(blobs[0].dtype).itemsize)))
    return slots, infos


def _deferrer(layer: SufficientFactors) -> Any:
    def defer(on: bool) -> None:
        layer.defer_weight_gradient = on
    return defer


def _factor_spec(net: Any, li: int, layer: Any, blobs: list[Any],
                 uses: dict[int, int]) -> FactorSpec | None:
    """The layer's factor spec when its gradients can be rebuilt from sufficient factors: it
    declares the contract, owns its one or two blobs alone, and computes their gradients."""
    if not isinstance(layer, SufficientFactors) or not 1 <= len(blobs) <= 2:
        return None
    if any(uses.get(id(b), 0) != 1 for b in blobs):
        return None
    if not all(layer.param_propagate_down) or not net.layer_need_backward[li]:
        return None
    return layer.factor_spec()
