"""What Caffe does to a NetParameter before it builds a net: NetState filtering (FilterNet,
StateMeetsRule), Split insertion for a blob read more than once (insert_splits.cpp), and the
check that every layer's type is one the engine has, with the nearest name and the line of
the file."""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from .layer_types import registered_types
from .pb import caffe_pb2


class NetError(ValueError):
    """A net that cannot be built; the message names the net file and the layer."""


class UnknownLayerType(NetError):
    """A layer of a type the engine does not have; the message names the file and line."""


# ---------------------------------------------------------------------------------------
# NetState filtering (Caffe's FilterNet / StateMeetsRule)
# ---------------------------------------------------------------------------------------
def state_meets_rule(state: Any, rule: Any) -> bool:
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def filter_net(param: Any, state: Any) -> Any:
    """Copy of ``param`` holding only the layers whose include/exclude rules admit ``state``."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for layer in param.layer:
        if len(layer.include) and len(layer.exclude):
            raise NetError(f"layer '{layer.name}': specify either include rules or exclude "
                           "rules, not both")
        included = len(layer.include) == 0
        if any(state_meets_rule(state, r) for r in layer.exclude):
            included = False
        if any(state_meets_rule(state, r) for r in layer.include):
            included = True
        if included:
            out.layer.add().CopyFrom(layer)
    return out


# ---------------------------------------------------------------------------------------
# Split insertion (Caffe's insert_splits.cpp): one Split layer per top read more than once
# ---------------------------------------------------------------------------------------
def split_blob_name(layer: str, blob: str, top_idx: int, split_idx: int) -> str:
    return f"{blob}_{layer}_{top_idx}_split_{split_idx}"


def insert_splits(param: Any) -> Any:
    last_top: dict[str, tuple[int, int]] = {}
    source_of: dict[tuple[int, int], tuple[int, int]] = {}
    uses: dict[tuple[int, int], int] = {}
    loss_weight: dict[tuple[int, int], float] = {}
    for i, layer in enumerate(param.layer):
        for j, name in enumerate(layer.bottom):
            if name not in last_top:
                raise NetError(f"layer '{layer.name}': unknown bottom blob '{name}' "
                               f"(bottom index {j})")
            src = last_top[name]
            source_of[(i, j)] = src
            uses[src] = uses.get(src, 0) + 1
        for j, name in enumerate(layer.top):
            last_top[name] = (i, j)
        # A top used as a loss counts as one more consumer, as in Caffe.
        for j in range(min(len(layer.loss_weight), len(layer.top))):
            src = last_top[layer.top[j]]
            loss_weight[src] = layer.loss_weight[j]
            if loss_weight[src]:
                uses[src] = uses.get(src, 0) + 1

    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    next_split: dict[tuple[int, int], int] = {}
    for i, layer in enumerate(param.layer):
        new = out.layer.add()
        new.CopyFrom(layer)
        for j, name in enumerate(new.bottom):
            src = source_of[(i, j)]
            if uses.get(src, 0) > 1:
                k = next_split.get(src, 0)
                new.bottom[j] = split_blob_name(param.layer[src[0]].name, name, src[1], k)
                next_split[src] = k + 1
        for j, name in enumerate(new.top):
            count = uses.get((i, j), 0)
            if count <= 1:
                continue
            split = out.layer.add()
            split.name = f"{name}_{layer.name}_{j}_split"
            split.type = "Split"
            split.bottom.append(name)
            weight = loss_weight.get((i, j), 0.0)
            for k in range(count):
                split.top.append(split_blob_name(layer.name, name, j, k))
                if weight:
                    split.loss_weight.append(weight if k == 0 else 0.0)
            if weight:
                del new.loss_weight[:]
                next_split[(i, j)] = next_split.get((i, j), 0) + 1
    return out


def check_layer_types(param: Any, source: str) -> None:
    """Every layer's type is one the engine has; else a NetError at the layer's line in
    ``source`` (when it is a file) with the nearest known type."""
    known = registered_types()
    for lp in param.layer:
        if lp.type in known:
            continue
        by_case = {k.lower(): k for k in known}
        near = difflib.get_close_matches(lp.type.lower(), list(by_case), n=1, cutoff=0.6)
        hint = f" (did you mean '{by_case[near[0]]}'?)" if near else ""
        raise UnknownLayerType(f"{source}{_line_of(source, lp)}: layer '{lp.name}': unknown "
                               f"layer type '{lp.type}'{hint}")


def _line_of(source: str, lp: Any) -> str:
    """":N", the line of ``lp``'s type in the file ``source`` (the nearest to a line naming
    the layer, for a type written more than once), or "" when ``source`` is no file."""
    try:
        lines = Path(source).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return ""
    quoted = lambda field, value: re.compile(rf"\b{field}\s*:\s*[\"']{re.escape(value)}[\"']")
    types = [i for i, line in enumerate(lines) if quoted("type", lp.type).search(line)]
    names = [i for i, line in enumerate(lines) if quoted("name", lp.name).search(line)]
    if not types:
        return ""
    return f":{min(types, key=lambda t: min((abs(t - n) for n in names), default=0)) + 1}"
