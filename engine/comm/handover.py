"""Handing a commit to a worker that joins an elastic job, over the generation's endpoint.

A worker that joins has no state; the new generation's rank 0 (a survivor, which holds the
commit the generation starts from) sends it the commit's arrays in STATE messages, pieces of at
most ``chunk_bytes``, each one array frame. The receiver cuts its own arrays (its own net's
blobs and its solver's history) into the same pieces and waits for exactly those: each piece is
checked against its own array (dtype, length, offset) before a byte of it is used, and the
commit's iteration, learning-rate step and data positions against what it expects. Nothing
comes from disk, and a piece of another generation cannot pass the generation's key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engine import backend
from engine.pb import poseidon_pb2 as pb

from .errors import CommError
from .transport import WORKER, Endpoint, PeerId, header, message_key

#: the sender of every piece: the new generation's rank 0
SOURCE: PeerId = (WORKER, 0)


@dataclass(frozen=True)
class Piece:
    """One STATE message: ``count`` values of array ``array`` from ``offset``."""
    array: int
    offset: int
    count: int


def pieces(arrays: Sequence[Any], chunk_bytes: int) -> list[Piece]:
    """The pieces both sides cut ``arrays`` into: every array in order, at most ``chunk_bytes``
    (and at least one value) a piece; an empty array is one empty piece."""
    out = []
    for i, a in enumerate(arrays):
        per = max(1, chunk_bytes // a.dtype.itemsize)
        size = int(a.size)
        out += [Piece(i, o, min(per, size - o)) for o in range(0, size, per)] or [Piece(i, 0, 0)]
    return out


def send_commit(ep: Endpoint, peers: Sequence[PeerId], arrays: Sequence[Any], iteration: int,
                current_step: int, data_positions: Sequence[int], chunk_bytes: int) -> None:
    """Rank 0: send the commit of ``iteration`` (``arrays``, in commit order) to ``peers``."""
    if not peers:
        return
    flat = [backend.to_numpy(a).reshape(-1) for a in arrays]
    for k, p in enumerate(pieces(flat, chunk_bytes)):
        info = pb.CommitPiece(iter=iteration, current_step=current_step, array=p.array,
                              offset=p.offset)
        if k == 0:
            info.data_position.extend(int(d) for d in data_positions)
        ep.broadcast(peers, header(pb.STATE, round=iteration, layer=p.array, chunk=k,
                                   commit=info),
                     [flat[p.array][p.offset:p.offset + p.count]])


@dataclass
class Received:
    """What a joining worker got: host copies of every array (commit order), and the solver's
    counters."""
    arrays: list[np.ndarray]
    current_step: int
    data_positions: list[int]


def receive_commit(ep: Endpoint, templates: Sequence[Any], iteration: int,
                   data_layers: int, chunk_bytes: int) -> Received:
    """A joining worker: wait (bounded by the endpoint's timeout) for rank 0's commit of
    ``iteration``, checking every piece against ``templates`` (this worker's own arrays, in
    commit order) and the data positions against its ``data_layers``."""
    cut = pieces(templates, chunk_bytes)
    keys = [message_key(pb.STATE, SOURCE, iteration, p.array, 0, k) for k, p in enumerate(cut)]
    got = ep.wait_for(keys, f"the commit of iteration {iteration}")
    out = [np.empty(int(t.size), dtype=t.dtype) for t in templates]
    first = got[0].header.commit
    for k, (p, m) in enumerate(zip(cut, got)):
        info, where = m.header.commit, f"{ep.name_of(m.sender)}'s commit piece {k}"
        want = templates[p.array].dtype
        arr = m.arrays[0] if len(m.arrays) == 1 else None
        if (arr is None or arr.dtype != want or arr.shape != (p.count,) or info.iter != iteration
                or info.array != p.array or info.offset != p.offset):
            raise CommError(f"{where} does not fit {ep.name}'s net: array {info.array} offset "
                            f"{info.offset} of commit {info.iter} as "
                            f"{'?' if arr is None else f'{arr.dtype}{arr.shape}'}, expected "
                            f"array {p.array} offset {p.offset} of commit {iteration} as "
                            f"{want}({p.count},)")
        out[p.array][p.offset:p.offset + p.count] = arr
    if len(first.data_position) != data_layers:
        raise CommError(f"{ep.name_of(SOURCE)}'s commit has {len(first.data_position)} data "
                        f"positions, {ep.name}'s net has {data_layers} data layers")
    return Received([o.reshape(t.shape) for o, t in zip(out, templates)],
                    int(first.current_step), [int(d) for d in first.data_position])
