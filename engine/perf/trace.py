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

A trace of a distributed run may also carry what was measured of its communication, so that
the DAG recurrence can be checked without the link model: ``workers`` (how many there were),
per layer with parameters ``comm_ms`` (how long its communication held the network, from
its start to its summed gradient being there, as Horovod's timeline records an allreduce; a
fused group's time on the first layer released, 0 on the others) and optionally
``iteration_ms``, the measured steady-state iteration, to compare with.
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
    #: measured communication (a distributed run's trace), None when not measured
    comm_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON row: comm_ms only when it was measured."""
        return {k: v for k, v in vars(self).items() if v is not None or k != "comm_ms"}


@dataclass
class Trace:
    net: str
    batch: int | None
    layers: list[LayerTime]
    device: str = ""
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: the run's worker count when the layers carry measured communication
    workers: int | None = None
    #: the run's measured steady-state iteration, to compare the recurrence with
    iteration_ms: float | None = None

    @property
    def has_comm(self) -> bool:
        return any(l.comm_ms is not None for l in self.layers)

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
        def times(x: float | None) -> float | None:
            return None if x is None else x * factor

        return Trace(self.net, self.batch,
                     [LayerTime(l.name, l.type, l.forward_ms * factor, l.backward_ms * factor,
                                times(l.comm_ms)) for l in self.layers],
                     self.device, f"{self.source} x{factor:g}", self.extra, self.workers,
                     times(self.iteration_ms))

    def as_dict(self) -> dict[str, Any]:
        measured = {k: v for k, v in (("workers", self.workers),
                                      ("iteration_ms", self.iteration_ms)) if v is not None}
        return {"format": FORMAT, "version": VERSION, "net": self.net, "batch": self.batch,
                "device": self.device, "source": self.source, **measured,
                "layers": [l.as_dict() for l in self.layers], **self.extra}

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
            comm = row.get("comm_ms")
            lt = LayerTime(str(row["name"]), str(row.get("type", "")),
                           float(row["forward_ms"]), float(row["backward_ms"]),
                           None if comm is None else float(comm))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"{where}: layers[{i}]: needs name, forward_ms and backward_ms "
                             f"(and comm_ms a number if given) ({type(e).__name__}: {e})") from None
        if not (lt.forward_ms >= 0 and lt.backward_ms >= 0 and (
                lt.comm_ms is None or lt.comm_ms >= 0)):  # also rejects NaN
            raise TraceError(f"{where}: layers[{i}] ({lt.name}): negative or NaN time")
        layers.append(lt)
    batch = d.get("batch")
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        raise TraceError(f"{where}: batch must be a positive integer, got {batch!r}")
    workers, iteration = d.get("workers"), d.get("iteration_ms")
    if any(l.comm_ms is not None for l in layers) and (
            not isinstance(workers, int) or isinstance(workers, bool) or workers < 2):
        raise TraceError(f"{where}: layers carry comm_ms, so 'workers' must say how many "
                         f"workers the run had (2 or more), got {workers!r}")
    if iteration is not None and not (isinstance(iteration, (int, float)) and iteration > 0):
        raise TraceError(f"{where}: iteration_ms must be a positive number, got {iteration!r}")
    source = str(d.get("source") or ("poseidon time --json" if fmt is None else ""))
    known = {"format", "version", "net", "batch", "device", "source", "layers", "workers",
             "iteration_ms"}
    extra = {k: v for k, v in d.items() if k not in known and fmt == FORMAT}
    return Trace(str(d.get("net", "")), batch, layers, str(d.get("device", "")), source, extra,
                 workers, None if iteration is None else float(iteration))


def load_trace(path: str | Path) -> Trace:
    return trace_from_dict(read_json(path, "trace", TraceError), str(path))
