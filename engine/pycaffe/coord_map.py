"""``caffe.coord_map``: how the spatial coordinates of one NetSpec top relate to another's.

Each spatial layer maps input coordinates to output ones affinely, per spatial axis:
``out = a * in + b``, written (axis, a, b). Convolution-like layers shrink by their stride
and shift by their padding, Deconvolution does the inverse, point-wise layers are the
identity ``(None, 1, 0)``, Crop shifts by its offset. Walking from two tops back to a common
ancestor and composing the maps gives the map between them; ``crop`` uses it to define the
Crop layer that aligns one top with another (as FCN does).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .net_spec import _PARAM_FIELD, Top, layers as L

PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU",
                       "Log", "LRN", "Exp", "MVN", "Power", "ReLU", "PReLU", "Scale",
                       "Sigmoid", "Split", "TanH", "Threshold"]

Map = tuple[Any, Any, Any]
_IDENTITY: Map = (None, 1, 0)


class UndefinedMapException(Exception):
    """The layer has no coordinate map (it is not spatial, e.g. InnerProduct)."""


class AxisMismatchException(Exception):
    """Two maps act on different axes and cannot be composed."""


def _params(fn: Any) -> dict[str, Any]:
    """The layer's parameters, whether given flat or inside its ``<type>_param`` dict."""
    return fn.params.get(_PARAM_FIELD.get(fn.type_name, ""), fn.params)


def _vec(value: Any) -> np.ndarray:
    return np.array(value, ndmin=1)


def conv_params(fn: Any) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(axis, stride, effective kernel size (dilation applied), pad) of a conv-like layer."""
    p = _params(fn)
    legacy = {"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"} & set(p)
    if legacy:
        raise AssertionError(f"cropping does not support legacy _h/_w params {sorted(legacy)}")
    kernel = _vec(p["kernel_size"])
    return (p.get("axis", 1), _vec(p.get("stride", 1)),
            (kernel - 1) * _vec(p.get("dilation", 1)) + 1, _vec(p.get("pad", 0)))


def crop_params(fn: Any) -> tuple[int, np.ndarray]:
    """(axis, offset) of a Crop layer (defaults: axis 2, offset 0)."""
    p = _params(fn)
    return p.get("axis", 2), _vec(p.get("offset", 0))


def coord_map(fn: Any) -> Map:
    """(axis, a, b) of one layer call: output coordinate = a * input coordinate + b."""
    kind = fn.type_name
    if kind in ("Convolution", "Pooling", "Im2col"):
        axis, stride, kernel, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (kernel - 1) / 2) / stride
    if kind == "Deconvolution":
        axis, stride, kernel, pad = conv_params(fn)
        return axis, stride, (kernel - 1) / 2 - pad
    if kind in PASS_THROUGH_LAYERS:
        return _IDENTITY
    if kind == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset  # the map's axis is the last non-coordinate one
    raise UndefinedMapException(kind)


def compose(base_map: Map, next_map: Map) -> Map:
    """``base_map`` after ``next_map``: scales multiply, the next shift is scaled by the base."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise AxisMismatchException(f"axis {ax1} vs {ax2}")
    return (ax2 if ax1 is None else ax1), a1 * a2, a1 * b2 + b1


def inverse(cmap: Map) -> Map:
    ax, a, b = cmap
    return ax, 1 / a, -b / a


def _mappable_bottoms(top: Top) -> tuple[Top, ...]:
    # Crop's second input only gives the size: coordinates flow through the first alone
    return top.fn.inputs[:1] if top.fn.type_name == "Crop" else top.fn.inputs


def _ancestors(start: Top) -> Any:
    """(top, map from it to ``start``) for ``start`` and every top it derives from through
    layers with a coordinate map, nearest first."""
    maps = {start: _IDENTITY}
    frontier = [start]
    while frontier:
        top = frontier.pop(0)
        yield top, maps[top]
        try:
            step = coord_map(top.fn)
        except UndefinedMapException:
            continue
        for bottom in _mappable_bottoms(top):
            if bottom not in maps:
                maps[bottom] = compose(maps[top], step)
                frontier.append(bottom)


def coord_map_from_to(top_from: Top, top_to: Top) -> Map:
    """The map taking ``top_from``'s coordinates to ``top_to``'s, through their nearest common
    ancestor; a RuntimeError when no chain of spatial layers connects them."""
    from_maps = dict(_ancestors(top_from))
    for top, to_map in _ancestors(top_to):
        if top in from_maps:
            return compose(to_map, inverse(from_maps[top]))
    raise RuntimeError("Could not compute map between tops; are they connected by spatial "
                       "layers?")


def crop(top_from: Top, top_to: Top) -> Top:
    """A Crop layer cutting ``top_from`` to line up with ``top_to``; an AssertionError when
    the scales differ or the offset would be negative or fractional."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    a, b = _vec(a), _vec(b)
    if not (a == 1).all():
        raise AssertionError(f"scale mismatch on crop (a = {a})")
    if not (b <= 0).all():
        raise AssertionError(f"cannot crop negative offset (b = {b})")
    if not (np.round(b) == b).all():
        raise AssertionError(f"cannot crop noninteger offset (b = {b})")
    return L.Crop(top_from, top_to,
                  crop_param=dict(axis=ax + 1, offset=[int(v) for v in -np.round(b)]))
