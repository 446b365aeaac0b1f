"""The network link model: sending b bytes takes alpha + beta * b seconds.

``alpha`` is the per-message latency and ``beta`` the inverse bandwidth, as in the cost models
of the Poseidon and S-SGD DAG papers. A link is given on the command line as a bandwidth and a
latency, or read from the JSON that `poseidon bench comm` writes after fitting both
(``poseidon-link`` version 1; ``unfair`` and ``overhead_s`` optional)::

    {"format": "poseidon-link", "version": 1, "alpha_s": 8.1e-05,
     "beta_s_per_byte": 8.3e-10, "source": "poseidon bench comm, loopback, 2026-11-23"}

Many TCP flows through one side of a link do not share it fairly, and a round that needs all
of them (a PS shard's sum needs every push of its chunk; a worker, every sum) ends with the
slowest: ``unfair`` prices that (``slowdown``). ``overhead_s`` is LogP's o, the CPU a message
costs each end, which the planner prices where workers outnumber cores.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.jsonfile import read_json

FORMAT = "poseidon-link"
VERSION = 1

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([kKmMgGtT]?)(GbE|bit|bps|b|B)?(?:/s)?\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


#: The emulated cluster's links (engine/perf/netns.py, 2026-11-25): every host sending 3.2 MB
#: to every other at once over open TCP connections, 4 rounds, the slowest flow into a host
#: ended 0.99-1.02x its fair time with 1 flow per side, 1.15-1.29x with 3 (P = 4) and
#: 1.16-1.30x with 7 (P = 8, 200 Mbit/s; 1.20-1.29x at 83 Mbit/s), the fastest at 0.4-0.6x:
#: medians 1.20 at 3 flows and 1.22-1.26 at 7, which unfair = 0.26-0.30 fits. A PS round is
#: less synchronised than that all-to-all (its chunks differ in size and start as backward
#: releases them): its rows in bench cluster fit 0.2 at 10 GbE. 0.25 is between.
UNFAIR_MEASURED = 0.25


class LinkError(ValueError):
    """A link that cannot be used; the message says which value and why."""


@dataclass(frozen=True)
class Link:
    alpha_s: float
    beta_s_per_byte: float
    source: str = ""
    #: 0: flows sharing a side share it fairly; else see ``slowdown``
    unfair: float = 0.0
    #: how many of a node's peers are on one host (flat workers of a machine): flows between
    #: the same two hosts take the same path and share it fairly
    peers_per_host: float = 1.0
    #: LogP's overhead: the CPU seconds a message's send or its receipt costs the process at
    #: that end (Poseidon's transport: its threads, the signing, the library), where probed.
    #: A machine with more workers than cores takes it from their compute (``plan_layers``)
    overhead_s: float = 0.0

    def slowdown(self, peers: float) -> float:
        """How many times its fair share of the time the slowest flow through one side takes
        when a node talks to ``peers`` peers at once (PS and SFB: P-1; ring and hd: 1):
        flows from n different hosts share it unfairly, ``1 + unfair * (1 - 1/n)`` (measured:
        UNFAIR_MEASURED); flows between the same two hosts fairly (two levels: a machine's
        owners all talk to the same other machines)."""
        n = peers / self.peers_per_host
        return 1.0 + self.unfair * (1.0 - 1.0 / n) if n > 1 else 1.0

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` as one message (0 bytes cost nothing)."""
        return self.alpha_s + self.beta_s_per_byte * nbytes if nbytes > 0 else 0.0

    @property
    def bits_per_s(self) -> float:
        return 8.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    @classmethod
    def from_bandwidth(cls, bits_per_s: float, latency_s: float = 0.0, source: str = "",
                       unfair: float = 0.0) -> "Link":
        if not bits_per_s > 0:
            raise LinkError(f"bandwidth must be positive, got {bits_per_s!r} bit/s")
        if not latency_s >= 0:
            raise LinkError(f"latency must be non-negative, got {latency_s!r} s")
        return cls(latency_s, 8.0 / bits_per_s, source, unfair)

    def scaled(self, time_scale: float) -> "Link":
        """The link as seen when every time is stretched by ``time_scale`` (replayed compute)."""
        return replace(self, alpha_s=self.alpha_s * time_scale,
                       beta_s_per_byte=self.beta_s_per_byte * time_scale,
                       source=f"{self.source} x{time_scale:g}")

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "alpha_s": self.alpha_s,
                "beta_s_per_byte": self.beta_s_per_byte, "bandwidth_bits_per_s": self.bits_per_s,
                "unfair": self.unfair, "overhead_s": self.overhead_s, "source": self.source}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")


def parse_bandwidth(text: str) -> float:
    """'10gbit', '10G', '10GbE', '1e9', '100mbit' -> bits per second ('B' alone means bytes)."""
    m = _RATE.match(str(text))
    if not m:
        raise LinkError(f"bandwidth {text!r}: expected a number with an optional unit, "
                        "e.g. 10gbit, 100mbit, 1.25GB/s")
    value, prefix, unit = float(m.group(1)), m.group(2).lower(), m.group(3) or ""
    if unit == "GbE":  # 10GbE: Ethernet's name for 10 Gbit/s
        prefix, unit = "g", "bit"
    bits = value * _SCALE[prefix] * (8 if unit == "B" else 1)
    if not bits > 0:
        raise LinkError(f"bandwidth {text!r} must be positive")
    return bits


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*(s|ms|us|µs|ns)?\s*$")
_DURATION_SCALE = {"s": 1.0, "": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: str) -> float:
    """'50us', '0.2ms', '1e-4' (seconds) -> seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise LinkError(f"latency {text!r}: expected a number with an optional unit, e.g. 50us, "
                        "0.2ms")
    return float(m.group(1)) * _DURATION_SCALE[m.group(2) or ""]


def load_link(path: str | Path) -> Link:
    p = Path(path)
    d = read_json(p, "link", LinkError)
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise LinkError(f"{p}: not a {FORMAT} file")
    if d.get("version") != VERSION:
        raise LinkError(f"{p}: {FORMAT} version {d.get('version')!r}; this Poseidon reads {VERSION}")
    try:
        alpha, beta = float(d["alpha_s"]), float(d["beta_s_per_byte"])
        unfair = float(d.get("unfair", 0.0))
        overhead = float(d.get("overhead_s", 0.0))
    except (KeyError, TypeError, ValueError):
        raise LinkError(f"{p}: needs numeric alpha_s and beta_s_per_byte (and unfair and "
                        "overhead_s, if given)") from None
    for name, value in (("alpha_s", alpha), ("unfair", unfair), ("overhead_s", overhead)):
        if not value >= 0:
            raise LinkError(f"{p}: {name} must be >= 0, got {value!r}")
    if not beta > 0:
        raise LinkError(f"{p}: beta_s_per_byte must be > 0, got {beta!r}")
    return Link(alpha, beta, str(d.get("source", str(p))), unfair, overhead_s=overhead)


def parse_link(text: str) -> Link:
    """``--link``: a poseidon-link JSON file, or BANDWIDTH[@LATENCY] ('10gbit@50us', '1gbit')."""
    if Path(text).is_file():
        return load_link(text)
    bandwidth, _, latency = str(text).partition("@")
    return Link.from_bandwidth(parse_bandwidth(bandwidth), parse_duration(latency or "0"),
                               f"given: {text}")
