"""What every synchronisation scheme is: the host it runs in and its interface.

A scheme synchronises *units* (engine/comm/units.py). The syncer (engine/comm/syncer.py)
schedules units; a scheme moves one unit's round and turns the local gradients into their sum
over every worker (the solver's update divides, in the pass it makes anyway):

- ``capture`` runs on the training thread at release (copy what the next forward overwrites);
  a scheme that completed the round there (a blocking engine's small sum) says so with
  ``Finished``, and the syncer applies the update on that thread, without a hand-off;
- ``start`` runs on the progress thread once the local gradients are final;
- ``check`` validates a received message on the receive thread, before any byte is used;
- ``receive`` takes a checked message on the progress thread;
- when the summed gradient is in the unit's diffs the scheme calls ``host.done``.

Every scheme runs event-driven on the progress thread: nothing blocks waiting for one unit, so
units may complete in any order (priority) without deadlock, and a slow peer holds up only the
units that need it. ``timing`` prices one layer for the planner and the DAG model alike.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb

from ..cost import Device, LayerTiming
from ..staging import Staged, Staging
from ..units import (LayerSlot, Placed, Unit, gather, is_view, placed_vector, scatter_sum,
                     split)

if TYPE_CHECKING:
    from ..codecs import Codec
    from ..topology import Topology
    from ..transport import Endpoint, Message, PeerId

class Host(Protocol):
    """What the syncer offers a scheme."""
    ep: "Endpoint"
    rank: int
    world: int
    codec: "Codec"
    topology: "Topology"
    plan: pb.Plan  # rank 0's plan, every worker's alike (its nonce names what schemes create)

    #: the collective engines this job joined, by name (schemes/collective.py)
    collectives: dict[str, Any]
    #: the unit whose release ends a backward: it carries every signal of its round
    signal_unit: int

    def send(self, unit: Unit, peers: Sequence["PeerId"], hdr: pb.Header,
             arrays: Sequence[np.ndarray] = ()) -> None:
        """Queue a DATA message of ``unit`` for the sender thread (by the unit's priority)."""

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the progress thread (from any thread)."""

    def done(self, unit: Unit, rnd: int, bits: int) -> None:
        """The summed gradient of ``unit``'s round ``rnd`` is in its diffs: apply the update."""

    def raise_if_failed(self) -> None:
        """On the training thread: raise the job's error, once it has one (CommError)."""


class Finished(int):
    """``capture``'s answer for a round it completed on the training thread: the sum is in
    the unit's diffs, and its value is the signal bits every worker raised in it (an int
    subclass: made without a call of Python's, in every such round)."""
    __slots__ = ()


class Scheme(ABC):
    """One way of turning every worker's local gradients of a unit into their sum."""

    #: the name on the wire, in plans and on the command line
    name: ClassVar[str]
    #: sums dense vectors: fusion buckets and wire codecs apply to it
    dense: ClassVar[bool] = True
    #: only for the workers of one machine (shared memory); never planned across machines
    one_machine: ClassVar[bool] = False
    #: a fusion bucket of it is capped by --fusion-mb (bytes on a wire pipeline better in
    #: pieces); False: by --fusion-ms only (a bucket costs its messages, whatever its size)
    fusion_capped: ClassVar[bool] = True
    #: a collective engine's (schemes/collective.py): its traffic is not authenticated, and
    #: the planner prices it from the engine's start-up probe
    engine: ClassVar[bool] = False
    #: with several workers per machine, it runs in two levels (engine/comm/levels.py)
    leveled: ClassVar[bool] = True

    def __init__(self, host: Host, units: Sequence[Unit], chunk_bytes: int,
                 groups: Sequence[tuple[int, ...]] | None = None, mine: int = 0) -> None:
        """``groups``: the worker groups that each sum one part of every unit's vector (a
        two-level run's network groups; default: one group of every worker, one part), and
        ``mine``: the group (and part) this worker takes part in."""
        self.host = host
        self.units = {u.id: u for u in units}
        self.chunk_bytes = chunk_bytes
        self.groups = [tuple(g) for g in groups] if groups else [tuple(range(host.world))]
        self.mine = mine
        self.group = self.groups[mine]
        self.size = len(self.group)
        self.index = self.group.index(host.rank)

    def sizes(self, unit: Unit, part: int) -> dict[int, int]:
        """phase -> the length of part ``part`` of each vector the unit sums per round."""
        return {phase: split(n, len(self.groups))[part][1]
                for phase, n in self.host.codec.vectors(unit.count).items()}

    def tags(self) -> list[str]:
        """The wire tags (Header.scheme) whose messages this scheme checks and receives."""
        return [self.name]

    @classmethod
    def applies(cls, layer: LayerSlot | Any) -> bool:
        """Whether this scheme can synchronise ``layer`` (a LayerSlot or a planner LayerInfo)."""
        return True

    @classmethod
    def available(cls) -> bool:
        """Whether this machine can run the scheme at all (what it needs is there)."""
        return True

    @classmethod
    def machine_share(cls, workers: int, slots: int) -> float:
        """Flat workers, ``slots`` to a machine: how many of a machine's workers' bytes, at
        once, each worker's bytes on the machine's one link stand for (1: a link of its own).
        By default a node talks with all its P-1 peers (SFB's factors; PS's pushes to the other
        shards and its shard's sums to the other workers), of which P-k are on other machines,
        for each of the machine's k workers at once."""
        if slots <= 1:
            return 1.0
        return slots * (workers - slots) / (workers - 1)

    @classmethod
    @abstractmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device,
               chunk_bytes: int, wire_itemsize: int) -> LayerTiming:
        """The cost of synchronising one layer (a planner LayerInfo) among ``world`` workers."""

    def capture(self, unit: Unit, rnd: int, bits: int) -> Any:
        """On the training thread at release of round ``rnd`` (this worker's signal
        ``bits``): what must be copied before the next forward."""
        return None

    @abstractmethod
    def start(self, unit: Unit, rnd: int, bits: int, captured: Any) -> None:
        """The local gradients of ``unit`` for round ``rnd`` are final (progress thread)."""

    @abstractmethod
    def check(self, msg: "Message", expected_rounds: tuple[int, int]) -> str | None:
        """Why ``msg`` is not a message this worker expects (receive thread), or None."""

    @abstractmethod
    def receive(self, msg: "Message") -> None:
        """A checked message (progress thread)."""

    @abstractmethod
    def missing(self, unit: Unit, rnd: int) -> list["PeerId"]:
        """The peers whose messages for ``unit``'s round ``rnd`` have not come (for errors)."""

    def largest_frame(self) -> int:
        """The largest array frame this scheme sends or receives, in bytes (ZMQ_MAXMSGSIZE)."""
        return 0

    def close(self) -> None:
        """Release what the scheme holds outside the process (the syncer's shutdown, on every
        path)."""

    def header(self, unit: Unit, rnd: int, op: int, bits: int, **fields: Any) -> pb.Header:
        return pb.Header(kind=pb.DATA, scheme=self.name, layer=unit.id, round=rnd, op=op,
                         request=bits, **fields)


class DenseScheme(Scheme):
    """A scheme that sums dense vectors: the unit's gradients are gathered into one vector,
    the codec decides what is summed (``sum_vector``, the scheme's own), and the sum is
    scattered back into the diffs."""

    dense = True
    #: a host unit of several diffs is summed in a vector of the scheme's where those diffs
    #: live (``placed_vector``: backward accumulates into it, so gathering copies nothing); a
    #: scheme that gathers into memory of its own (shm's shared slots) says False
    places_diffs: ClassVar[bool] = True

    def __init__(self, host: Host, units: Sequence[Unit], chunk_bytes: int,
                 groups: Sequence[tuple[int, ...]] | None = None, mine: int = 0) -> None:
        super().__init__(host, units, chunk_bytes, groups, mine)
        self._buffers: dict[int, np.ndarray] = {}
        self._staging = Staging()
        #: when a list: each round's (start, end) on the clock of ``time.perf_counter``,
        #: from the gathered vector to its sum (`poseidon bench comm --allreduce` sets it)
        self.spans: list[tuple[float, float]] | None = None
        for u in self.units.values():
            behind = self._behind(u)
            if self.places_diffs and (behind or not is_view(u)) and \
                    all(isinstance(p.blob.diff, np.ndarray) for p in u.params):
                self._buffers[u.id] = placed_vector(u, behind)
        #: the host units whose vector their diffs are views of
        self._placed = {uid: placed for uid, u in self.units.items()
                        if (placed := Placed.of(u, self._buffers.get(uid))) is not None}

    def _behind(self, unit: Unit) -> int:
        """How many values the scheme carries behind the unit's gradients in its vector."""
        return 0

    def close(self) -> None:
        # the placements hold the diffs, and a next generation's ``place_diffs`` would take
        # them for diffs that something else holds (it counts their references)
        self._placed.clear()

    def _host_vector(self, unit: Unit) -> np.ndarray:
        """The unit's host gradients as one vector: the one its diffs are views of, or
        ``_gathered``."""
        vec = self._placed_vector(unit)
        return vec if vec is not None else self._gathered(unit)

    def _gathered(self, unit: Unit) -> np.ndarray:
        """The unit's host gradients gathered into a buffer the unit keeps across rounds (its
        diff itself when it is one contiguous diff)."""
        if unit.id not in self._buffers and not is_view(unit):
            self._buffers[unit.id] = np.empty(unit.count, np.dtype(unit.params[0].blob.diff.dtype))
        return gather(unit, self._buffers.get(unit.id))

    def _placed_vector(self, unit: Unit) -> np.ndarray | None:
        """The vector the unit's diffs are views of, while they are (``Placed``); else None."""
        placed = self._placed.get(unit.id)
        return placed.vector() if placed is not None else None

    def capture(self, unit: Unit, rnd: int, bits: int) -> Staged | None:
        # a GPU's gradients start for the host now, beside the backward of the layers below
        return self._staging.begin(unit)

    def start(self, unit: Unit, rnd: int, bits: int, captured: Staged | None) -> None:
        if captured is not None:
            vec = captured.wait()
        else:
            vec = self._host_vector(unit)
        spans = self.spans
        began = time.perf_counter() if spans is not None else 0.0

        def finish(total: np.ndarray, bits: int) -> None:
            if spans is not None:
                spans.append((began, time.perf_counter()))
            # the sum into the diffs (a scheme's sends of ``vec``, maybe a diff, are all
            # received once the sum is complete, while ``total`` may still be on its way to a
            # peer: zero-copy); a staged one goes back on the copy stream
            if captured is None or not self._staging.scatter(unit, total, vec):
                scatter_sum(unit, total)
            self.host.done(unit, rnd, bits)

        self.host.codec.reduce(unit, rnd, vec, bits, self.sum_vector, finish)

    def deliver(self, ops: dict, early: dict, msg: "Message",
                step: Callable[[Any, "Message"], None]) -> None:
        """``step(op, msg)`` when this worker has started the message's round (``ops`` keyed by
        unit, round and phase), else hold the message in ``early`` until it has: a peer can be
        ahead of this worker's backward."""
        h = msg.header
        key = (h.layer, h.round, h.phase)
        op = ops.get(key)
        if op is None:
            early.setdefault(key, []).append(msg)
            return
        step(op, msg)

    @abstractmethod
    def sum_vector(self, unit: Unit, rnd: int, phase: int, vec: np.ndarray, bits: int,
                   on_done: Callable[[np.ndarray, int], None]) -> None:
        """Sum ``vec`` over the workers (event-driven); then ``on_done(total, bits)`` with the
        ORed bits of every worker. ``total`` may be ``vec`` itself.

        Sends are zero-copy: a scheme must not change an array it sent until the peer has it.
        When ``on_done`` runs, every send of ``vec`` must have been received (the sum needed
        it), so the caller may overwrite ``vec``; ``total`` may still be in flight."""
