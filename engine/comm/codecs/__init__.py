"""Wire codecs (one per module): what a dense scheme's round sums and how it looks on the wire.

- ``fp32`` (base.py): the gradients as they are;
- ``fp16`` (fp16.py): half the bytes, overflow detected and skipped everywhere;
- ``sparse`` (sparse.py): only the chunks with the largest L1 norm, the rest kept as a residual.

``--wire`` picks the value encoding (fp32, fp16); ``--sparse`` picks the sparse codec, which
sends float32 values.
"""
from __future__ import annotations

from typing import Any

from .base import Codec
from .fp16 import Fp16Codec
from .sparse import SparseCodec

CODECS: dict[str, type[Codec]] = {"fp32": Codec, "fp16": Fp16Codec, "sparse": SparseCodec}
#: the value encodings --wire offers
WIRES = ("fp32", "fp16")

__all__ = ["CODECS", "WIRES", "Codec", "Fp16Codec", "SparseCodec", "make_codec"]


def make_codec(name: str, plan: Any = None) -> Codec:
    """The codec ``name``; ``plan`` (a poseidon.Plan) carries its settings."""
    if name not in CODECS:
        raise ValueError(f"unknown wire codec {name!r} (known: {', '.join(CODECS)})")
    return CODECS[name].from_plan(plan)
