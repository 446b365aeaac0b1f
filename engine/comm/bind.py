"""The adapter between a Net and the communicator: which arrays each layer synchronises.

engine.comm never imports a layer class. This module looks at a built Net duck-typed: the
learnable parameters each layer owns, and whether a layer hands out sufficient factors
(``hasattr(layer, "sufficient_factors")``, the InnerProduct contract: u = top diff K x N,
v = bottom data K x M; weight gradient uᵀ·v, or vᵀ·u with ``transpose: true``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .planner import LayerInfo
from .ps import PSParam
from .syncer import LayerSlot, ParamSlot


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
        shape = _factor_shape(net, li, layer, blobs, uses)
        transpose = shape is not None and bool(layer.param.inner_product_param.transpose)
        params = []
        for i, blob in zip(idx, blobs):
            j = int(net.param_names[i].rsplit("/", 1)[1])
            role = "other"
            if shape is not None:
                role = ("weight_t" if transpose else "weight") if j == 0 else "bias"
            params.append(ParamSlot(i, net.param_names[i], blob, role))
        slots[li] = LayerSlot(li, net.layer_names[li], params,
                              layer.sufficient_factors if shape is not None else None, shape)
        infos.append(LayerInfo(li, net.layer_names[li], [tuple(b.shape) for b in blobs], shape,
                               int(np.dtype(blobs[0].dtype).itemsize)))
    return slots, infos


def _factor_shape(net: Any, li: int, layer: Any, blobs: list[Any],
                  uses: dict[int, int]) -> tuple[int, int, int] | None:
    """(K, M, N) when layer ``li``'s gradients can be rebuilt from its sufficient factors."""
    if not hasattr(layer, "sufficient_factors") or not 1 <= len(blobs) <= 2:
        return None
    if any(uses.get(id(b), 0) != 1 for b in blobs):
        return None
    if not all(getattr(layer, "param_propagate_down", [True] * len(blobs))):
        return None
    if hasattr(net, "layer_need_backward") and not net.layer_need_backward[li]:
        return None
    w = blobs[0].shape
    if len(w) != 2:
        return None
    m, n = (w[0], w[1]) if layer.param.inner_product_param.transpose else (w[1], w[0])
    count = net.bottom_vecs[li][0].count
    if count % m:
        return None
    return count // m, m, n


def ps_params(slots: dict[int, LayerSlot], schemes: dict[int, str]) -> list[PSParam]:
    """The parameters the PS carries (every layer not synchronised by SFB)."""
    return [PSParam(p.index, li, int(p.blob.diff.size), np.dtype(p.blob.diff.dtype).str)
            for li, slot in sorted(slots.items()) if schemes[li] == "ps" for p in slot.params]
