"""Layer-time traces: per-layer forward and backward times of one net at one batch size.

The simulator predicts from them and the emulated cluster replays them. One versioned JSON
format, ``poseidon-layer-trace`` version 1::

    {"format": "poseidon-layer-trace", "version": 1,
     "net": "VGG_ILSVRC_19_layers", "batch": 32,
     "device": "NVIDIA H100 80GB", "source": "poseidon time --gpu 0 --json, 2026-11-23",
     "layers": [{"name": "conv1_1", "type": "Convolution",
                 "forward_ms": 1.25, "backward_ms": 2.5}, ...]}

``layers`` is in the net's order (bottom first); times are milliseconds per iteration for
``batch`` images on one worker. ``poseidon time --json`` output (keys net, iterations,
layers[name, type, forward_ms, backward_ms]) is read as a trace too: its batch is taken from
the net when given, and its source is recorded as such.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.jsonfile import read_json

FORMAT = "poseidon-layer-trace"
VERSION = 1


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class LayerTime:
    name: str
    type: str
    forward_ms: float
    backward_ms: float


@dataclass
class Trace:
    net: str
    batch: int | None
    layers: list[LayerTime]
    device: str = ""
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def forward_ms(self) -> float:
        return sum(l.forward_ms for l in self.layers)

    @property
    def backward_ms(self) -> float:
        return sum(l.backward_ms for l in self.layers)

    def by_name(self) -> dict[str, LayerTime]:
        return {l.name: l for l in self.layers}

    def scaled(self, factor: float) -> "Trace":
        """Every time multiplied by ``factor`` (replay's --time-scale, a faster device...)."""
        return Trace(self.net, self.batch,
                     [LayerTime(l.name, l.type, l.forward_ms * factor, l.backward_ms * factor)
                      for l in self.layers], self.device, f"{self.source} x{factor:g}", self.extra)

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "net": self.net, "batch": self.batch,
                "device": self.device, "source": self.source,
                "layers": [vars(l) for l in self.layers], **self.extra}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")


def trace_from_dict(d: Any, where: str = "trace") -> Trace:
    """A Trace from a parsed v1 trace or a `poseidon time --json` report; checks every field."""
    if not isinstance(d, dict):
        raise TraceError(f"{where}: not a JSON object")
    fmt = d.get("format")
    if fmt is not None and fmt != FORMAT:
        raise TraceError(f"{where}: format {fmt!r}, expected {FORMAT!r}")
    if fmt == FORMAT and d.get("version") != VERSION:
        raise TraceError(f"{where}: {FORMAT} version {d.get('version')!r}; this Poseidon reads "
                         f"version {VERSION}")
    rows = d.get("layers")
    if not isinstance(rows, list) or not rows:
        raise TraceError(f"{where}: no 'layers' list")
    layers = []
    for i, row in enumerate(rows):
        try:
            lt = LayerTime(str(row["name"]), str(row.get("type", "")),
                           float(row["forward_ms"]), float(row["backward_ms"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{where}: layers[{i}]: needs name, forward_ms and backward_ms "
                             f"({type(e).__name__}: {e})") from None
        if not (lt.forward_ms >= 0 and lt.backward_ms >= 0):  # also rejects NaN
            raise TraceError(f"{where}: layers[{i}] ({lt.name}): negative or NaN time")
        layers.append(lt)
    batch = d.get("batch")
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        raise TraceError(f"{where}: batch must be a positive integer, got {batch!r}")
    source = str(d.get("source") or ("poseidon time --json" if fmt is None else ""))
    known = {"format", "version", "net", "batch", "device", "source", "layers"}
    extra = {k: v for k, v in d.items() if k not in known and fmt == FORMAT}
    return Trace(str(d.get("net", "")), batch, layers, str(d.get("device", "")), source, extra)


def load_trace(path: str | Path) -> Trace:
    return trace_from_dict(read_json(path, "trace", TraceError), str(path))
