"""Shared-memory allreduce for the workers of one machine (as NCCL and Horovod do inside a node).

Workers on one machine need not copy gradients through sockets: through the kernel, each byte is
copied twice and costs CPU on both ends, which is what bounds local workers that share cores.
Here the machine's workers share one memory segment; per unit and phase it holds a slot for each
worker's vector and one for the sum. A round:

1. worker r copies its vector into slot r and tells the unit's summers (WRITTEN);
2. once every slot is written, summer j adds part j of all slots, in rank order, into part j of
   the sum and tells every worker (SUMMED);
3. once every part is summed, each worker reads the sum (the solver's update takes the mean).

A large unit is cut into P parts, one per worker (a reduce-scatter and an all-gather through
memory: a worker writes its vector, reads 1/P of every slot, writes 1/P of the sum and reads the
whole sum; with the plain codecs its gradients are gathered straight into its slot); a unit
below ``PARALLEL_BYTES`` is summed by one worker (rotating with the unit), so that its round
costs 2(P-1) signals instead of 2P(P-1). Every part is summed once and read by all, so replicas are
bit-identical. The signals are header-only ZeroMQ messages, authenticated and checked like every
other; only the arrays go through memory. No socket carries a gradient byte, so the byte
counters of an shm unit stay at zero.

No slot needs a second buffer (BSP): a worker writes slot r of round k+1 after its forward of
k+1, so after applying round k, so after every summer read round k's slots and after it read round
k's sum; and summer j writes round k+1's sum only once every worker wrote round k+1, so once every
worker has read round k's sum.

The segment: a file in /dev/shm named by the plan's nonce (rank 0 draws it per job; it travels in
the authenticated PLAN), created by rank 0 with O_EXCL and mode 0600, its memory reserved up
front (posix_fallocate: a full /dev/shm is an error at start-up, never a SIGBUS mid-run). The other
workers open it at their first round (after the start-up barrier, so it exists), and rank 0
unlinks it once its first round is complete (every worker has opened it by then) or at close,
whichever comes first: a job killed after its first round leaves nothing behind (one killed
before it leaves a file named poseidon-<nonce>). A process
that can open an 0600 file of the job's user can also ptrace its workers, so the segment's
contents are not authenticated beyond that.
"""
from __future__ import annotations

import errno
import mmap
import os
import time
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from engine.pb import poseidon_pb2 as pb

from ..cost import Device, LayerTiming
from ..engines import PROBE_LARGE_BYTES, PROBE_REPEATS, PROBE_SMALL_BYTES, ring_link
from ..errors import CommError
from ..link import Link
from ..transport import WORKER, Message, PeerId, header, message_key
from ..units import Unit, split
from ..wire import PROBE_SHM, arrays_are
from .base import DenseScheme

#: where the segment lives (a tmpfs on Linux); without it shm is not offered
SHM_DIR = "/dev/shm"


def segment_path(nonce: bytes) -> str:
    """The segment of the job whose plan carries ``nonce``."""
    return os.path.join(SHM_DIR, f"poseidon-{bytes(nonce).hex()}")


def map_segment(path: str, nbytes: int, create: bool, where: str) -> mmap.mmap:
    """The segment at ``path``, of ``nbytes``: created (O_EXCL, 0600, its memory reserved up
    front) or opened; one that cannot be made is removed again, and every failure is one
    CommError naming ``where``."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        hint = (" (do the workers listed as one machine share its /dev/shm? else list them "
                "as machines of their own, or give --comm ring)") if not create else ""
        raise CommError(f"{where}: cannot {'create' if create else 'open'} it: "
                        f"{e.strerror}{hint}") from None
    try:
        if create:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                why = "no room" if e.errno == errno.ENOSPC else e.strerror
                raise CommError(f"{where}: {why} for {nbytes / 1e6:.1f} MB (every worker's "
                                "gradients and their sum); make /dev/shm larger or give "
                                "--comm ring") from None
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise CommError(f"{where}: {size} bytes, expected {nbytes} (another job's "
                            "segment, or a different plan)")
        return mmap.mmap(fd, nbytes)
    except BaseException:
        if create:
            unlink_quietly(path)
        raise
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sum_part(slots: np.ndarray, total: np.ndarray, offset: int, count: int) -> None:
    """Part [offset, offset + count) of ``total``: every worker's slot (a row) added in rank
    order, so that the sum is the same whoever forms it."""
    part = total[offset:offset + count]
    np.add(slots[0, offset:offset + count], slots[1, offset:offset + count], out=part)
    for r in range(2, len(slots)):
        part += slots[r, offset:offset + count]


WRITTEN, SUMMED = 0, 1


def open_probe(nonce: bytes, world: int, create: bool, where: str) -> mmap.mmap:
    """The segment of the start-up probe (``probe``): a slot of its larger size for each of
    ``world`` workers and one for the sum, named by ``nonce`` (rank 0 creates it)."""
    return map_segment(segment_path(nonce), (world + 1) * PROBE_LARGE_BYTES, create,
                       f"{where}: the shm probe's shared memory")


def probe(ep: Any, seg: mmap.mmap, hand_off: Callable[[Callable[[], None]], None]) -> Link:
    """Every worker of the machine at once, through ``seg`` (``open_probe``): rounds of this
    scheme, a small vector's (one summer) and a 4 MB one's (every worker sums a part), the
    fastest of a few of each, as a ring's link (``engines.ring_link``), as the collective
    engines are probed beside it. A round takes a real one's path: this thread writes its
    slot, ``hand_off`` runs the signals and the sum on the syncer's progress thread (as
    ``start``) and returns once they are done, with the sum read out. Through the transport
    and those threads a 4 KB round took 0.7 ms (2 workers) to 1.4 ms (4 on 2 cores), where the
    cost model's two signals came to 0.3; 4 MB, 6.6 ms against the model's 2.5 and MPI's 5.4."""
    world, rank = len(ep.hosts), ep.me[1]
    others = [(WORKER, r) for r in range(world) if r != rank]
    count = PROBE_LARGE_BYTES // 4
    slots = np.ndarray((world, count), np.float32, seg)
    total = np.ndarray((count,), np.float32, seg, world * count * 4)
    mine, out = np.ones(count, np.float32), np.empty(count, np.float32)
    rnd, best = 0, []
    for nbytes, repeats in zip((PROBE_SMALL_BYTES, PROBE_LARGE_BYTES), PROBE_REPEATS):
        n = nbytes // 4
        summers = list(range(world)) if nbytes >= PARALLEL_BYTES else [0]
        parts = split(n, len(summers))
        to_summers = [(WORKER, s) for s in summers if s != rank]

        def summed(rnd: int) -> None:
            _step(ep, to_summers, rnd, WRITTEN)
            if rank in summers:
                _wait(ep, others, rnd, WRITTEN)
                sum_part(slots, total, *parts[summers.index(rank)])
                _step(ep, others, rnd, SUMMED)
            _wait(ep, to_summers, rnd, SUMMED)
            out[:n] = total[:n]

        times = []
        for _ in range(repeats + 1):  # the first touches the pages
            t = time.perf_counter()
            slots[rank, :n] = mine[:n]
            hand_off(partial(summed, rnd))
            times.append(time.perf_counter() - t)
            rnd += 1
        best.append(min(times[1:]))
    return ring_link(world, PROBE_SMALL_BYTES, best[0], PROBE_LARGE_BYTES, best[1],
                     f"shm probe: {PROBE_SMALL_BYTES >> 10} KB in {best[0] * 1e6:.0f} us, "
                     f"{PROBE_LARGE_BYTES >> 20} MB in {best[1] * 1e3:.2f} ms, {world} workers")


def _step(ep: Any, to: Sequence[PeerId], rnd: int, step: int) -> None:
    hdr = header(pb.PROBE, op=PROBE_SHM, round=rnd, layer=1 + step)  # layer 0: link echoes
    for peer in to:
        ep.send(peer, hdr, [])


def _wait(ep: Any, of: Sequence[PeerId], rnd: int, step: int) -> None:
    ep.wait_for([message_key(pb.PROBE, peer, rnd, 1 + step) for peer in of],
                f"the shm probe's {('WRITTEN', 'SUMMED')[step]} of round {rnd}")
#: units at least this large are summed by all P workers, each a part; smaller by one
PARALLEL_BYTES = 1 << 18
_ALIGN = 64  # every region starts on a cache line


class _Region:
    """One (unit, phase) vector: every worker's slot, the sum, and who sums which part."""
    __slots__ = ("offset", "count", "summers", "parts")

    def __init__(self, offset: int, count: int, summers: list[int]) -> None:
        self.offset, self.count, self.summers = offset, count, summers
        self.parts = split(count, len(summers))


class _Op:
    __slots__ = ("bits", "on_done", "written", "summed", "did_sum")

    def __init__(self, bits: int, on_done: Any) -> None:
        self.bits, self.on_done = bits, on_done
        self.written: set[int] = set()
        self.summed: set[int] = set()
        self.did_sum = False


class Shm(DenseScheme):
    name = "shm"
    one_machine = True
    fusion_capped = False
    #: gathered straight into this worker's shared slot
    places_diffs = False

    def __init__(self, host: Any, units: Sequence[Unit], chunk_bytes: int,
                 groups: Sequence[tuple[int, ...]] | None = None, mine: int = 0) -> None:
        super().__init__(host, units, chunk_bytes, groups, mine)
        if groups is not None and len(groups) > 1:
            raise CommError("shm synchronises the workers of one machine: it has no levels")
        self.world = host.world
        self.rank = host.rank
        self.peers: list[PeerId] = [(WORKER, r) for r in range(self.world) if r != self.rank]
        if len(host.plan.nonce) < 16:
            raise CommError("shm: the plan carries no nonce to name the shared memory by")
        # a job's gradients share one dtype (the net's)
        self.dtype = np.dtype(units[0].params[0].blob.diff.dtype if units else "<f4")
        self._regions: dict[tuple[int, int], _Region] = {}
        offset = 0
        for u in units:
            for phase, count in sorted(host.codec.vectors(u.count).items()):
                many = count * self.dtype.itemsize >= PARALLEL_BYTES
                summers = list(range(self.world)) if many else [u.id % self.world]
                self._regions[(u.id, phase)] = _Region(offset, count, summers)
                offset += -(-(self.world + 1) * count * self.dtype.itemsize // _ALIGN) * _ALIGN
        self.nbytes = max(offset, _ALIGN)
        self.path = segment_path(host.plan.nonce)
        self._creator = self.rank == 0
        self._linked = False
        self._map: mmap.mmap | None = None
        self._views: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._ops: dict[tuple[int, int, int], _Op] = {}
        self._early: dict[tuple[int, int, int], list[Message]] = {}
        if self._creator:
            self._open(create=True)

    @classmethod
    def available(cls) -> bool:
        return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int) -> LayerTiming:
        nbytes = info.params * info.itemsize
        # copy in, read every slot's part and write the sum's, read the sum out
        copies = (2.0 + (world + 1) / world) * nbytes / device.add_bytes_per_s
        update = device.update_s(nbytes)
        signal = link.alpha_s
        # WRITTEN to the summers, SUMMED from them: every worker sums a part of a large unit,
        # one worker a small one's
        many = nbytes >= PARALLEL_BYTES
        messages = 4.0 * (world - 1) / (1 if many else world)
        return LayerTiming(info.name, cls.name, 0.0, 0.0, signal, signal, signal, 0.0,
                           copies + (0.0 if device.update_on_device else update), update,
                           messages=messages)

    # ---------------------------------------------------------------------------- memory
    def _open(self, create: bool) -> None:
        self._map = map_segment(self.path, self.nbytes, create,
                                f"{self.host.ep.name}: shared memory {self.path}")
        self._linked = self._linked or create

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            unlink_quietly(self.path)

    def _region_views(self, key: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(every worker's slot as rows, the sum) of a (unit, phase)."""
        views = self._views.get(key)
        if views is None:
            if self._map is None:
                self._open(create=False)
            reg = self._regions[key]
            slots = np.ndarray((self.world, reg.count), self.dtype, self._map, reg.offset)
            total = np.ndarray((reg.count,), self.dtype, self._map,
                               reg.offset + self.world * reg.count * self.dtype.itemsize)
            views = self._views[key] = (slots, total)
        return views

    def close(self) -> None:
        super().close()
        self._unlink()
        self._views.clear()
        self._buffers.clear()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view; the mapping goes with the process
                pass
            self._map = None

    # ---------------------------------------------------------------------------- rounds
    def start(self, unit: Unit, rnd: int, bits: int, captured: Any) -> None:
        # the gathered gradients go straight into this worker's slot (then the sum too), when
        # the codec sums the gradients as they are
        if self.host.codec.sums_as_given and unit.id not in self._buffers:
            key = min(k for k in self._regions if k[0] == unit.id)
            self._buffers[unit.id] = self._region_views(key)[0][self.rank]
        super().start(unit, rnd, bits, captured)

    def sum_vector(self, unit: Unit, rnd: int, phase: int, vec: np.ndarray, bits: int,
                   on_done: Any) -> None:
        slots, _ = self._region_views((unit.id, phase))
        mine = slots[self.rank]
        if vec.dtype != mine.dtype or vec.shape != mine.shape:
            raise CommError(f"shm: unit {unit.name} phase {phase} sums {vec.dtype}{vec.shape}, "
                            f"its slot holds {mine.dtype}{mine.shape}")
        if not np.shares_memory(vec, mine):
            mine[...] = vec
        op = _Op(bits, on_done)
        key = (unit.id, rnd, phase)
        self._ops[key] = op
        op.written.add(self.rank)
        summers = [s for s in self._regions[(unit.id, phase)].summers if s != self.rank]
        self.host.send(unit, [(WORKER, s) for s in summers],
                       self.header(unit, rnd, WRITTEN, bits, phase=phase))
        for msg in self._early.pop(key, []):
            self._step(op, msg)
        self._advance(unit, rnd, phase, op)

    def receive(self, msg: Message) -> None:
        self.deliver(self._ops, self._early, msg, self._step)

    def _step(self, op: _Op, msg: Message) -> None:
        h = msg.header
        sender = msg.sender[1]
        got = op.written if h.op == WRITTEN else op.summed
        if sender in got:
            raise RuntimeError(f"shm: a second {('WRITTEN', 'SUMMED')[h.op]} of unit {h.layer} "
                               f"round {h.round} from worker {sender}")
        got.add(sender)
        op.bits |= h.request
        self._advance(self.units[h.layer], h.round, h.phase, op)

    def _advance(self, unit: Unit, rnd: int, phase: int, op: _Op) -> None:
        if self._ops.get((unit.id, rnd, phase)) is not op:
            return  # done already (an early message completed it)
        reg = self._regions[(unit.id, phase)]
        slots, total = self._region_views((unit.id, phase))
        if not op.did_sum and self.rank in reg.summers and len(op.written) == self.world:
            o, n = reg.parts[reg.summers.index(self.rank)]
            sum_part(slots, total, o, n)
            op.did_sum = True
            op.summed.add(self.rank)
            self.host.send(unit, self.peers, self.header(unit, rnd, SUMMED, op.bits, phase=phase))
        if len(op.summed) == len(reg.summers):
            del self._ops[(unit.id, rnd, phase)]
            if self._creator:
                self._unlink()  # every worker has opened the segment: it wrote its slot
            op.on_done(total, op.bits)

    # ---------------------------------------------------------------------------- checks
    def check(self, msg: Message, rounds: tuple[int, int]) -> str | None:
        h = msg.header
        sender = msg.sender[1]
        if msg.sender[0] != WORKER or sender == self.rank or not 0 <= sender < self.world:
            return f"unit {h.layer}: shm signal from {msg.sender}, not a peer worker"
        if h.round not in rounds:
            return f"unit {h.layer}: round {h.round}, expected {rounds[0]}"
        reg = self._regions.get((h.layer, h.phase))
        if reg is None or h.op not in (WRITTEN, SUMMED):
            return f"unit {h.layer}: no shm step {h.op} of phase {h.phase}"
        if h.op == WRITTEN and self.rank not in reg.summers:
            return f"unit {h.layer}: WRITTEN from worker {sender}, but this worker sums no part"
        if h.op == SUMMED and sender not in reg.summers:
            return f"unit {h.layer}: SUMMED from worker {sender}, which sums no part"
        return arrays_are(msg, [])

    def missing(self, unit: Unit, rnd: int) -> list[PeerId]:
        out: set[PeerId] = set()
        for (uid, r, phase), op in self._ops.items():
            if uid == unit.id and r == rnd:
                reg = self._regions[(uid, phase)]
                if self.rank in reg.summers and not op.did_sum:
                    out |= {(WORKER, w) for w in range(self.world) if w not in op.written}
                else:
                    out |= {(WORKER, s) for s in reg.summers if s not in op.summed}
        return sorted(out)
