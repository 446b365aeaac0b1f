"""The network link model: sending b bytes takes alpha + beta * b seconds.

``alpha`` is the per-message latency and ``beta`` the inverse bandwidth, as in the cost models
of the Poseidon and S-SGD DAG papers. A link is given on the command line as a bandwidth and a
latency, or read from the JSON that `poseidon bench comm` writes after fitting both
(``poseidon-link`` version 1)::

    {"format": "poseidon-link", "version": 1, "alpha_s": 8.1e-05,
     "beta_s_per_byte": 8.3e-10, "source": "poseidon bench comm, loopback, 2026-11-23"}
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.jsonfile import read_json

FORMAT = "poseidon-link"
VERSION = 1

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([kKmMgGtT]?)(GbE|bit|bps|b|B)?(?:/s)?\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class LinkError(ValueError):
    """A link that cannot be used; the message says which value and why."""


@dataclass(frozen=True)
class Link:
    alpha_s: float
    beta_s_per_byte: float
    source: str = ""

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` as one message (0 bytes cost nothing)."""
        return self.alpha_s + self.beta_s_per_byte * nbytes if nbytes > 0 else 0.0

    @property
    def bits_per_s(self) -> float:
        return 8.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    @classmethod
    def from_bandwidth(cls, bits_per_s: float, latency_s: float = 0.0, source: str = "") -> "Link":
        if not bits_per_s > 0:
            raise LinkError(f"bandwidth must be positive, got {bits_per_s!r} bit/s")
        if not latency_s >= 0:
            raise LinkError(f"latency must be non-negative, got {latency_s!r} s")
        return cls(latency_s, 8.0 / bits_per_s, source)

    def scaled(self, time_scale: float) -> "Link":
        """The link as seen when every time is stretched by ``time_scale`` (replayed compute)."""
        return Link(self.alpha_s * time_scale, self.beta_s_per_byte * time_scale,
                    f"{self.source} x{time_scale:g}")

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "alpha_s": self.alpha_s,
                "beta_s_per_byte": self.beta_s_per_byte, "bandwidth_bits_per_s": self.bits_per_s,
                "source": self.source}

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
    except (KeyError, TypeError, ValueError):
        raise LinkError(f"{p}: needs numeric alpha_s and beta_s_per_byte") from None
    if not (alpha >= 0 and beta > 0):
        raise LinkError(f"{p}: alpha_s must be >= 0 and beta_s_per_byte > 0")
    return Link(alpha, beta, str(d.get("source", str(p))))


def parse_link(text: str) -> Link:
    """``--link``: a poseidon-link JSON file, or BANDWIDTH[@LATENCY] ('10gbit@50us', '1gbit')."""
    if Path(text).is_file():
        return load_link(text)
    bandwidth, _, latency = str(text).partition("@")
    return Link.from_bandwidth(parse_bandwidth(bandwidth), parse_duration(latency or "0"),
                               f"given: {text}")
