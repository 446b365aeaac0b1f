"""Collective engines (Gloo, MPI, NCCL) as schemes: what the three backends' schemes share.

A cluster that already runs a collective engine tuned for its fabric (MPI on InfiniBand, NCCL
on NVLink, Gloo on Ethernet) can sum a dense unit's gradients there instead of on Poseidon's
own transport. The engine layer (engine/comm/engines.py) joins a backend to the job and issues
its ops in the one order every worker shares; this module makes a scheme of it:

- **One order.** Round by round, each round's units in release order (backward completes them
  so on every worker, as DDP issues its buckets), the signals last: each op gets its number.
- **At release.** Host gradients are gathered and their sum issued at release, on the
  training thread; a GPU's are staged to the host (or, NCCL's, gathered on the device) and
  issued from the progress thread once ready (``sum_vector``).
- **Completion.** Each completion is posted into the syncer's progress loop
  (``Host.call_soon``), where the sum goes into the diffs and the update is applied exactly
  as every other scheme's.
- **Signals.** The other schemes OR each worker's request bits (snapshot, stop, leave) into
  their messages. An engine sums numbers, so the unit released last in a backward (the
  syncer's ``signal_unit``: every signal of a round reaches it) carries one value per bit
  behind its gradients (a large one, or a device's: in a small allreduce of their own, last in
  the round): summed, a value above zero is the OR, the same on every worker.

Every worker ends each round with identical bits: each backend pins an algorithm that hands
every worker the same sum (a ring's reduce-scatter sums each segment once), and the syncer's
replica check covers the engines as every scheme. The engines authenticate nothing: the plan,
the signals and the elastic control stay on Poseidon's authenticated wire.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb

from ..cost import Device, LayerTiming, cost_ring
from ..engines import Backend, Collective, EngineError, probed_timing
from ..errors import CommError
from ..transport import WORKER, Message, PeerId
from ..units import Unit, in_place, is_view, lies_at, scatter_sum
from .base import DenseScheme, Finished

#: the request bits a signal unit carries, one value each behind its gradients
SIGNAL_BITS = (pb.REQUEST_SNAPSHOT, pb.REQUEST_STOP, pb.REQUEST_OVERFLOW, pb.REQUEST_LEAVE)
_SIGNAL_MASK = sum(SIGNAL_BITS)
_NO_SIGNALS = [0.0] * len(SIGNAL_BITS)


def signal_rows(dtype: Any) -> dict[int, memoryview]:
    """Each set of raised bits as the values written behind the gradients, in their dtype: a
    memoryview's copy and read are single C calls, where NumPy's conversion of a list and its
    ufuncs run through machinery that costs tens of microseconds once it is cold (a round's
    start, after backward or a pause), which a small allreduce's round pays in full."""
    return {key: memoryview(np.array([1.0 if key & b else 0.0 for b in SIGNAL_BITS], dtype))
            for key in range(_SIGNAL_MASK + 1) if not key & ~_SIGNAL_MASK}


#: a signal unit whose diffs cannot be placed in the vector that carries the signals behind
#: them (a diff something else holds, a GPU's), and this large, sends its signals in an
#: allreduce of their own: copying it in would cost more than that small allreduce. Any other
#: carries them behind at no cost: a second op per round cost Gloo a concurrent allreduce and
#: MPI a serial one.
SIGNALS_APART_BYTES = 256 << 10


class _Issued:
    """A unit's round issued at release: its completions (from an engine's thread) and its
    finish (attached on the progress thread); whichever comes last runs the finish on the
    progress thread. (The round's last unit is summed and applied on the training thread,
    without one.)"""
    __slots__ = ("host", "began", "placed", "vec", "flags", "_lock", "_left", "_finish")

    def __init__(self, host: Any, began: float, placed: bool) -> None:
        self.host, self.began, self.placed = host, began, placed
        self.vec: Any = None
        self.flags: Any = None
        self._lock = threading.Lock()
        self._left = 0
        self._finish: Callable[[], None] | None = None

    def completed(self) -> None:
        """One of the round's ops is complete (any thread)."""
        with self._lock:
            self._left += 1
            ready = self._finish is not None and self._left == self._ops()
        if ready:
            self.host.call_soon(self._finish)

    def attach(self, finish: Callable[[], None]) -> None:
        """The progress thread's finish; run at once when every op is complete already."""
        with self._lock:
            self._finish = finish
            ready = self._left == self._ops()
        if ready:
            finish()

    def complete(self) -> bool:
        """Every op of the round completed (a blocking engine ran them on this thread)."""
        with self._lock:
            return self._left == self._ops()

    def _ops(self) -> int:
        return 1 if self.flags is None else 2


class CollectiveScheme(DenseScheme):
    """A dense scheme whose sums a collective engine makes (one class per backend)."""

    backend: ClassVar[type[Backend]]
    engine = True
    #: an engine sums over every worker itself, inside machines and across them
    leveled = False
    #: an elastic job can rebuild it for each generation's workers
    elastic: ClassVar[bool] = True
    #: a bucket costs the engine's steps, whatever its size, and the engine pipelines a large
    #: one itself (DDP's buckets are 25 MB): --fusion-ms bounds a bucket, not --fusion-mb
    fusion_capped = False

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int,
                 groups: Sequence[tuple[int, ...]] | None = None, mine: int = 0) -> None:
        self.signal_unit = host.signal_unit if any(u.id == host.signal_unit for u in units) \
            else None
        super().__init__(host, units, chunk_bytes, groups, mine)  # the diffs placed
        if self.host.codec.name != "fp32":
            raise EngineError(f"{self.name} sums float32 gradients on the engine: it has no "
                              f"{self.host.codec.name} wire")
        self.collective: Collective = host.collectives[self.name]
        self._abort = host.raise_if_failed  # (bound once: a round's wait is given it)
        # release order: backward completes the highest unit first, on every worker alike
        ordered = sorted(self.units, reverse=True)
        self._position = {uid: k for k, uid in enumerate(ordered)}
        self._ops_per_round = len(ordered)
        #: the signals travel in an allreduce of their own, last in each round, where
        #: copying the signal unit into a longer vector would cost more
        self._signals_apart = False
        if self.signal_unit is not None:
            u = self.units[self.signal_unit]
            dtype = np.dtype(u.params[0].blob.diff.dtype)
            buf = self._buffers.get(u.id)
            # copied into a vector each round (a GPU's staged one, a diff something else
            # holds): a large one sends its signals apart rather than copy itself
            copied = buf is None or (is_view(u) and not in_place(u, buf))
            if self.backend.on_device or (copied and
                                          u.count * dtype.itemsize >= SIGNALS_APART_BYTES):
                self._signals_apart = True
                self._ops_per_round += 1
                self._buffers.pop(u.id, None)
            elif buf is None:  # a GPU's, staged: copied in behind
                self._buffers[u.id] = np.empty(u.count + len(SIGNAL_BITS), dtype)
        for u in self.units.values():  # a ring's bytes each way (cost_ring: both ways)
            nbytes = u.count * np.dtype(u.params[0].blob.diff.dtype).itemsize
            host.ep.stats.count_allreduce(u.id, self.name, int(cost_ring(nbytes, host.world) / 2))
        #: where the signal values lie behind a host signal unit's gradients
        self._signal_tail: memoryview | None = None
        if self.signal_unit is not None and not self._signals_apart:
            vec = self._buffers[self.signal_unit]
            self._signal_tail = memoryview(vec[-len(SIGNAL_BITS):])
            self._signal_rows = signal_rows(vec.dtype)

    def _behind(self, unit: Unit) -> int:
        # the signal values, behind a host signal unit's gradients
        return len(SIGNAL_BITS) if unit.id == self.signal_unit and not self.backend.on_device \
            else 0

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int) -> LayerTiming:
        """On ``link``, the engine's probed link (a ring's alpha and beta)."""
        return probed_timing(cls.name, info, world, link, device)

    def capture(self, unit: Unit, rnd: int, bits: int) -> Any:
        """On the training thread at release: host gradients are gathered and their sum is
        issued now, in the one order (release order is that order); a GPU's are staged for
        the host first and issued from the progress thread (``start``). The round's last
        unit (the signal unit: backward is over, and the next forward needs it first) is
        waited for and applied here, without a hand-off to the progress thread and back."""
        placed_at = self._placed.get(unit.id)  # (``_placed_vector``, a call fewer a round)
        vec = placed_at.vector() if placed_at is not None else None
        placed = vec is not None  # summed in place: nothing to scatter
        if not placed:
            staged = super().capture(unit, rnd, bits)
            if staged is not None:
                return staged
            vec = self._gathered(unit)
        # (a clock read a round, for the bench's spans alone)
        began = time.perf_counter() if self.spans is not None else 0.0
        if unit.id == self.signal_unit:
            vec, flags = self._issue(unit, rnd, vec, bits, None, True)
            return Finished(self._summed(unit, began, vec, flags, placed))
        issued = _Issued(self.host, began, placed)
        issued.vec, issued.flags = self._issue(unit, rnd, vec, bits, issued.completed)
        if issued.complete():  # summed on this thread: the syncer applies it here too
            return Finished(self._summed(unit, began, issued.vec, issued.flags, placed))
        return issued

    def start(self, unit: Unit, rnd: int, bits: int, captured: Any) -> None:
        if not isinstance(captured, _Issued):  # staged from a GPU: issued from here
            super().start(unit, rnd, bits, captured)
            return
        captured.attach(lambda: self.host.done(unit, rnd, self._summed(
            unit, captured.began, captured.vec, captured.flags, captured.placed)))

    def _summed(self, unit: Unit, began: float, vec: Any, flags: Any, placed: bool) -> int:
        """The summed round into the unit's diffs (``placed``: summed in them); the signal
        bits every worker raised."""
        if self.spans is not None:
            self.spans.append((began, time.perf_counter()))
        agreed = self._agreed(unit, vec, flags)
        if not placed:
            scatter_sum(unit, vec)
        return agreed

    def sum_vector(self, unit: Unit, rnd: int, phase: int, vec: Any, bits: int,
                   on_done: Callable[[Any, int], None]) -> None:
        """A unit's vector from the progress thread (staged from a GPU, or NCCL's)."""
        box: list[Any] = []
        waiting = [0]

        def summed() -> None:  # on the progress thread, once per op
            waiting[0] -= 1
            if not waiting[0]:
                on_done(box[0], self._agreed(unit, box[0], box[1]))

        def post() -> None:
            self.host.call_soon(summed)

        waiting[0] = 1 + (unit.id == self.signal_unit and self._signals_apart)
        box.extend(self._issue(unit, rnd, vec, bits, post))

    def _issue(self, unit: Unit, rnd: int, vec: Any, bits: int,
               done: Callable[[], None] | None, here: bool = False) -> tuple[Any, Any]:
        """Submit a unit's round (and, for the signal unit, its signals); ``done()`` once per
        op submitted (``here``: they are summed on this thread, in their turn, and ``done``
        may be None). (the vector summed, the signal vector or None)."""
        flags = None
        if unit.id == self.signal_unit:
            if self._signal_tail is None:
                flags = self.signal_vector([1.0 if bits & b else 0.0 for b in SIGNAL_BITS])
            else:
                buf = self._buffers[unit.id]
                if vec is not buf and not lies_at(vec, buf):  # a diff held elsewhere, staged
                    buf[:unit.count] = vec[:unit.count]
                self._signal_tail[:] = self._signal_rows[bits & _SIGNAL_MASK]
                vec = buf
        first = rnd * self._ops_per_round
        self._submit(first + self._position[unit.id], vec, f"{unit.name} round {rnd}", done,
                     here)
        if flags is not None:
            self._submit(first + self._ops_per_round - 1, flags, f"the signals of round {rnd}",
                         done, here)
        return vec, flags

    def _submit(self, seq: int, vec: Any, what: str, done: Callable[[], None] | None,
                here: bool) -> None:
        """One op to the engine: summed on this thread in its turn (``here``), or submitted
        with its completion."""
        if here:
            self.collective.sum_here(seq, vec, what, self._abort)
        else:
            assert done is not None
            self.collective.submit(seq, vec, done, what)

    def _agreed(self, unit: Unit, vec: Any, flags: Any) -> int:
        """The signal bits every worker raised this round (the signal unit's; 0 else)."""
        if unit.id != self.signal_unit:
            return 0
        got = self.on_host(flags).tolist() if flags is not None else self._signal_tail.tolist()
        if got == _NO_SIGNALS:
            return 0
        return sum(b for b, f in zip(SIGNAL_BITS, got) if f > 0)

    def signal_vector(self, values: list[float]) -> Any:
        """A round's signal values as the engine sums them (a fresh vector: the last one may
        still be in flight)."""
        return np.array(values, np.float32)

    def on_host(self, summed: Any) -> Any:
        """Summed signal values, readable on the host."""
        return summed

    # nothing comes over Poseidon's wire for an engine's units
    def check(self, msg: Message, expected_rounds: tuple[int, int]) -> str | None:
        return f"unit {msg.header.layer}: {self.name} sends nothing over Poseidon's wire"

    def receive(self, msg: Message) -> None:
        raise CommError(f"{self.name}: unexpected message for unit {msg.header.layer}")

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        # the engine does not say whose part is late: every other worker is a suspect
        return [(WORKER, r) for r in range(self.host.world) if r != self.host.rank]
