"""Collective engines (Gloo, MPI, NCCL) as schemes: the layer the three backends share.

A cluster that already runs a collective engine tuned for its fabric (MPI on InfiniBand, NCCL
on NVLink, Gloo on Ethernet) can sum a dense unit's gradients there instead of on Poseidon's
own transport. A backend (``Backend``: gloo.py, mpi.py and nccl.py beside this module) knows one
library's allreduce; this module gives every backend the same life in a job:

- **Set-up** (engine/comm/handshake.py ``join_engines``): rank 0 makes the engine's rendezvous
  (a TCP store, an NCCL id) and sends it in the authenticated ENGINE message; every worker
  joins (``Collective``), and all run the start-up probe (``probe``): a small and a 4 MB
  allreduce on the engine itself, fitted as a ring's alpha and beta, which is what the
  planner prices the engine's layers with.
- **One order.** A collective engine matches operations by the order they are issued, so
  every worker must issue the same ones in the same order. The *engine thread* issues a
  scheme's allreduces strictly in (round, unit) order, units in release order (the order
  backward completes them, the same on every worker: DDP issues its buckets so), never in the
  order they happen to be ready; a unit that is ready early waits for its turn.
- **Completion.** A *wait thread* waits for each issued allreduce in turn and posts its
  completion into the syncer's progress loop (``Host.call_soon``), where the unit's mean is
  applied exactly as every other scheme's is.
- **Signals.** The other schemes OR each worker's request bits (snapshot, stop, leave) into
  their messages. An engine sums numbers, so the unit that ends a backward (the syncer's
  ``signal_unit``: every signal of a round is in its release) carries one extra value per bit
  behind its gradients (a large one, or a device's: in a small allreduce of their own, last in
  the round): summed, a value above zero is the OR.

Every worker ends each round with identical bits: each backend pins an algorithm that hands
every worker the same sum (a ring's reduce-scatter sums each segment once), and the syncer's
replica check covers the engines as every scheme. The engines authenticate nothing: the plan,
the signals and the elastic control stay on Poseidon's authenticated wire.
"""
from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from engine import timeline
from engine.pb import poseidon_pb2 as pb

from ..cost import Device, LayerTiming
from ..errors import CommError
from ..link import Link
from ..transport import WORKER, Message, PeerId
from ..units import Unit, gather, is_view, scatter_mean
from .base import DenseScheme

#: the request bits a signal unit carries, one value each behind its gradients
SIGNAL_BITS = (pb.REQUEST_SNAPSHOT, pb.REQUEST_STOP, pb.REQUEST_OVERFLOW, pb.REQUEST_LEAVE)
#: the start-up probe: a small and a 4 MB allreduce, the fastest of several of each
PROBE_SMALL_BYTES = 4 << 10
PROBE_LARGE_BYTES = 4 << 20
PROBE_REPEATS = (8, 3)
#: no engine moves a byte faster than memory (1 / 100 GB/s)
MIN_BETA = 1e-11
#: a signal unit this large sends its signals in an allreduce of their own: copying it into a
#: vector with room for them behind would cost more than that small allreduce
SIGNALS_APART_BYTES = 256 << 10


class EngineError(CommError):
    """An engine that cannot run here, or failed; the message names it and why."""


@dataclass(frozen=True)
class EngineCost:
    """An engine as the planner prices it and a plan records it: its library's version, the
    algorithm pinned, and the start-up probe as a ring's link (alpha per step, beta per byte)."""
    name: str
    version: str
    algorithm: str
    link: Link

    def to_pb(self) -> pb.EngineSpec:
        return pb.EngineSpec(name=self.name, version=self.version, algorithm=self.algorithm,
                             alpha_s=self.link.alpha_s,
                             beta_s_per_byte=self.link.beta_s_per_byte)

    @classmethod
    def from_pb(cls, spec: pb.EngineSpec, source: str) -> "EngineCost":
        return cls(spec.name, spec.version, spec.algorithm,
                   Link(spec.alpha_s, max(spec.beta_s_per_byte, MIN_BETA), source))


class Backend(ABC):
    """One library's allreduce, joined to one job. The constructor (the join), ``start`` and
    ``close`` run on the engine thread; a completion is reported by ``then``."""

    #: the scheme's name, on the command line and in plans
    name: ClassVar[str]
    #: what to install for it, for the line that says it is missing
    install: ClassVar[str]
    #: it sums device (GPU) vectors in place (NCCL); else host vectors
    on_device: ClassVar[bool] = False
    #: ``start`` returns only once the sum is complete (MPI's blocking collectives): ops are
    #: issued from the engine thread; else from whichever thread submits the op in turn
    blocking: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def missing(cls, on_gpu: bool) -> str:
        """Why this process cannot run the engine ("" where it can). Cheap to call twice."""

    @classmethod
    @abstractmethod
    def version(cls) -> str:
        """The library's version, as plans record it."""

    @classmethod
    @abstractmethod
    def algorithm(cls) -> str:
        """The reduction algorithm pinned, so that a rerun sums in the same order."""

    @classmethod
    def setup(cls, address: str, world: int, timeout: float) -> tuple[bytes, Any]:
        """Rank 0: the rendezvous every worker joins with (sent in the authenticated ENGINE
        message), and what rank 0 must keep alive while the job runs (a store's server)."""
        return b"", None

    @abstractmethod
    def __init__(self, setup: bytes, rank: int, world: int, address: str,
                 timeout: float) -> None:
        """Join the engine (every worker at once; blocks until all have)."""

    @abstractmethod
    def start(self, vec: Any) -> Any:
        """Issue the in-place allreduce (sum) of ``vec``; a handle for ``then`` (a blocking
        engine returns once the sum is complete)."""

    @abstractmethod
    def then(self, handle: Any, done: Callable[[BaseException | None], None]) -> bool:
        """Arrange ``done(error or None)`` for when ``handle`` completes, on any thread, and
        say True; or False: the collective's wait thread calls ``finish`` and then ``done``."""

    def finish(self, handle: Any) -> None:
        """Block until ``handle`` completes (for ``then``'s False)."""

    def close(self) -> None:
        """Leave the engine (the job's end)."""

    @classmethod
    def thread_context(cls) -> Callable[[], None]:
        """Called on the thread that joins; what each engine thread runs first (a GPU
        engine's threads work on the worker's device)."""
        return lambda: None

    @classmethod
    def abandon(cls) -> None:
        """A collective of this process failed or was left unfinished (it may never
        complete)."""


_STOP = object()


class Collective:
    """A backend joined to one job: its engine thread (the join, the probe, the leave, and a
    blocking engine's ops), the ops issued strictly in sequence order, and, for an engine
    that cannot call back, a wait thread that waits for each issued op in turn. Completions
    go to each op's ``done``, on whichever thread saw them."""

    def __init__(self, backend: type[Backend], setup: bytes, rank: int, world: int,
                 address: str, timeout: float, on_error: Callable[[str], None]) -> None:
        self.backend_class = backend
        self.name = backend.name
        self.world = world
        self.timeout = timeout
        self._on_error = on_error
        self._calls: queue.Queue = queue.Queue()
        self._issued: queue.Queue = queue.Queue()
        #: the sequence number issued next, and ops that came before their turn
        self._next = 0
        self._early: dict[int, tuple[Any, Callable[[], None], str]] = {}
        self._order = threading.Lock()
        self._closed = False
        self.failed: str | None = None
        enter = backend.thread_context()
        self._threads = [threading.Thread(target=self._engine_loop, args=(enter,),
                                          name=f"poseidon-{self.name}", daemon=True),
                         threading.Thread(target=self._wait_loop, args=(enter,),
                                          name=f"poseidon-{self.name}-wait", daemon=True)]
        for t in self._threads:
            t.start()
        self.backend: Backend = self.call(
            lambda: backend(setup, rank, world, address, timeout),
            f"joining {self.name} (every worker joins at once)")

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the engine thread (a library that wants its calls on one thread gets
        them there) and return its result; an EngineError after the job's timeout."""
        box: dict[str, Any] = {}
        done = threading.Event()
        self._calls.put(("call", fn, box, done))
        if not done.wait(self.timeout + 5):
            raise EngineError(f"{self.name}: {what} took longer than {self.timeout:g} s")
        if "error" in box:
            raise EngineError(f"{self.name}: {what} failed: {_first_line(box['error'])}")
        return box["value"]

    def submit(self, seq: int, vec: Any, done: Callable[[], None], what: str) -> None:
        """Allreduce ``vec`` in place as operation ``seq`` of the job's one order (0, 1, 2,
        ...); ``done()`` once complete (on an engine's thread). A blocking engine's ops go
        to the engine thread; another's are issued here when it is their turn (a thread
        hand-off at every release costs a scheduling delay where the cores are busy with
        backward), else by the op before them."""
        if self.backend_class.blocking:
            self._calls.put(("op", seq, vec, done, what))
            return
        with self._order:
            self._take(seq, vec, done, what)

    def _take(self, seq: int, vec: Any, done: Callable[[], None], what: str) -> None:
        """Hold op ``seq``, then issue every op whose turn it is (under ``_order``)."""
        self._early[seq] = (vec, done, what)
        while self._next in self._early and self.failed is None:
            self._issue(*self._early.pop(self._next))

    def _issue(self, vec: Any, on_done: Callable[[], None], what: str) -> None:
        self._next += 1
        tl = timeline.current
        if tl.active:  # the allreduce on the engine thread, from its issue to its end
            began, inner = tl.now(), on_done

            def on_done() -> None:
                tl.complete(f"{self.name} {what}", "allreduce", began)
                inner()
        try:
            handle = self.backend.start(vec)
            if not self.backend.then(handle, self._completion(on_done, what)):
                self._issued.put((handle, on_done, what))
        except Exception as e:
            self._fail(what, e)

    def _engine_loop(self, enter: Callable[[], None]) -> None:
        enter()
        while True:
            item = self._calls.get()
            if item is _STOP:
                self._issued.put(_STOP)
                return
            if item[0] == "call":
                _, fn, box, done = item
                try:
                    box["value"] = fn()
                except Exception as e:  # handed to the caller, which names the engine
                    box["error"] = e
                done.set()
                continue
            self._take(*item[1:])

    def _completion(self, on_done: Callable[[], None],
                    what: str) -> Callable[[BaseException | None], None]:
        def done(error: BaseException | None) -> None:
            if error is not None:
                self._fail(what, error)
            elif self.failed is None:
                on_done()
        return done

    def _wait_loop(self, enter: Callable[[], None]) -> None:
        enter()
        while True:
            item = self._issued.get()
            if item is _STOP:
                return
            handle, on_done, what = item
            if self.failed is not None:
                continue
            try:
                self.backend.finish(handle)
            except Exception as e:
                self._fail(what, e)
                continue
            on_done()

    def _fail(self, what: str, e: BaseException) -> None:
        if self.failed is None:
            self.failed = f"the {self.name} allreduce of {what} failed: {_first_line(e)}"
            if self._closed:  # a job that ended already (its peers left): nobody to tell
                return
            try:
                self._on_error(self.failed)
            except Exception:  # noqa: BLE001 - an engine's thread must not die of the report
                pass

    def close(self, clean: bool = True) -> None:
        """Leave the engine once every issued allreduce is done (on the engine thread, after
        them). Not ``clean`` (the job failed): a collective may never complete, and a thread
        blocked in one is left behind (a daemon)."""
        self._closed = True
        left = False
        if self.failed is None and clean:
            try:
                self.call(self.backend.close, "leaving")
                left = True
            except EngineError:
                pass
        if not left:
            self.backend_class.abandon()
        self._calls.put(_STOP)
        for t in self._threads:
            t.join(timeout=2)


class _Issued:
    """A unit's round issued at release: its completions (from an engine's thread) and its
    finish (attached on the progress thread); whichever comes last runs the finish on the
    progress thread."""
    __slots__ = ("host", "began", "vec", "flags", "_lock", "_left", "_finish")

    def __init__(self, host: Any, began: float) -> None:
        self.host, self.began = host, began
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

    def _ops(self) -> int:
        return 1 if self.flags is None else 2


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:400]


def probe(collective: Collective) -> Link:
    """Every worker at once: the fastest of a few small and a few 4 MB allreduces on the
    engine, as a ring's link (``ring_time`` of either size is what was measured)."""
    world = collective.world
    backend = collective.backend

    def run() -> tuple[float, float]:
        best = []
        for nbytes, repeats in zip((PROBE_SMALL_BYTES, PROBE_LARGE_BYTES), PROBE_REPEATS):
            vec = _probe_vector(backend, nbytes)
            times = []
            for _ in range(repeats + 1):  # the first warms the engine's connections up
                t = time.perf_counter()
                _complete(backend, backend.start(vec))
                times.append(time.perf_counter() - t)
            best.append(min(times[1:]))
        return best[0], best[1]

    small, large = collective.call(run, "the start-up probe")
    return ring_link(world, PROBE_SMALL_BYTES, small, PROBE_LARGE_BYTES, large,
                     f"{collective.name} probe: {PROBE_SMALL_BYTES >> 10} KB in "
                     f"{small * 1e6:.0f} us, {PROBE_LARGE_BYTES >> 20} MB in "
                     f"{large * 1e3:.2f} ms, {world} workers")


def _complete(backend: Backend, handle: Any) -> None:
    """Wait here for ``handle`` (on the engine thread, at start-up)."""
    seen = threading.Event()
    box: list[BaseException | None] = []

    def done(error: BaseException | None) -> None:
        box.append(error)
        seen.set()
    if not backend.then(handle, done):
        backend.finish(handle)
        return
    seen.wait()
    if box[0] is not None:
        raise box[0]


def _probe_vector(backend: Backend, nbytes: int) -> Any:
    if backend.on_device:
        import cupy
        return cupy.zeros(nbytes // 4, np.float32)
    return np.zeros(nbytes // 4, np.float32)


def ring_link(world: int, small_bytes: int, small_s: float, large_bytes: int, large_s: float,
              source: str) -> Link:
    """The link whose ring allreduce takes the two measured times: 2(P-1) steps of alpha, and
    2(P-1)/P of the bytes at beta each way."""
    steps = 2 * max(world - 1, 1)
    frac = steps / max(world, 1)
    beta = max((large_s - small_s) / (frac * (large_bytes - small_bytes)), MIN_BETA)
    alpha = max((small_s - frac * small_bytes * beta) / steps, 0.0)
    return Link(alpha, beta, source)


def ring_time(link: Link, world: int, nbytes: float) -> float:
    """An engine's allreduce of ``nbytes`` on ``world`` workers, on its probed link."""
    steps = 2 * max(world - 1, 1)
    return steps * link.alpha_s + steps / max(world, 1) * nbytes * link.beta_s_per_byte


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
        super().__init__(host, units, chunk_bytes, groups, mine)
        if self.host.codec.name != "fp32":
            raise EngineError(f"{self.name} sums float32 gradients on the engine: it has no "
                              f"{self.host.codec.name} wire")
        self.collective: Collective = host.collectives[self.name]
        # release order: backward completes the highest unit first, on every worker alike
        ordered = sorted(self.units, reverse=True)
        self._position = {uid: k for k, uid in enumerate(ordered)}
        self._ops_per_round = len(ordered)
        self.signal_unit = host.signal_unit if host.signal_unit in self.units else None
        #: the signals travel in an allreduce of their own, last in each round, where
        #: copying the signal unit into a longer vector would cost more
        self._signals_apart = False
        if self.signal_unit is not None:
            u = self.units[self.signal_unit]
            dtype = np.dtype(u.params[0].blob.diff.dtype)
            if self.backend.on_device or u.count * dtype.itemsize >= SIGNALS_APART_BYTES:
                self._signals_apart = True
                self._ops_per_round += 1
            else:  # gathered straight into the vector that carries the bits behind it
                self._buffers[u.id] = np.empty(u.count + len(SIGNAL_BITS), dtype)

    @classmethod
    def timing(cls, info: Any, world: int, link: Any, device: Device, chunk_bytes: int,
               wire_itemsize: int) -> LayerTiming:
        """On ``link``, the engine's probed link (a ring's alpha and beta)."""
        nbytes = info.params * info.itemsize
        moved = 2 * (world - 1) / world * nbytes
        span = ring_time(link, world, nbytes)
        update = device.update_s(nbytes)
        return LayerTiming(info.name, cls.name, moved, moved, span, span, 0.0, 0.0,
                           0.0 if device.update_on_device else update, update)

    def capture(self, unit: Unit, rnd: int, bits: int) -> Any:
        """On the training thread at release: host gradients are gathered and their sum is
        issued now, in the one order (release order is that order); a GPU's are staged for
        the host first and issued from the progress thread (``start``)."""
        staged = super().capture(unit, rnd, bits)
        if staged is not None:
            return staged
        if unit.id not in self._buffers and not is_view(unit):
            self._buffers[unit.id] = np.empty(unit.count,
                                              np.dtype(unit.params[0].blob.diff.dtype))
        vec = gather(unit, self._buffers.get(unit.id))
        issued = _Issued(self.host, time.perf_counter())
        issued.vec, issued.flags = self._issue(unit, rnd, vec, bits, issued.completed)
        return issued

    def start(self, unit: Unit, rnd: int, bits: int, captured: Any) -> None:
        if not isinstance(captured, _Issued):  # staged from a GPU: issued from here
            super().start(unit, rnd, bits, captured)
            return
        world, spans = self.host.world, self.spans

        def finish() -> None:  # on the progress thread
            if spans is not None:
                spans.append(time.perf_counter() - captured.began)
            vec = captured.vec
            agreed = self._agreed(unit, vec, captured.flags)
            scatter_mean(unit, vec, world, vec)
            self.host.done(unit, rnd, agreed)

        captured.attach(finish)

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
               done: Callable[[], None]) -> tuple[Any, Any]:
        """Submit a unit's round (and, for the signal unit, its signals); ``done()`` once per
        op submitted. (the vector summed, the signal vector or None)."""
        flags = None
        if unit.id == self.signal_unit:
            values = [1.0 if bits & b else 0.0 for b in SIGNAL_BITS]
            if self._signals_apart:
                flags = self.signal_vector(values)
            else:
                buf = self._buffers[unit.id]
                if not np.shares_memory(buf, vec):  # a view or a staged vector: copied in
                    buf[:unit.count] = vec[:unit.count]
                buf[unit.count:] = values
                vec = buf
        first = rnd * self._ops_per_round
        moved = int(2 * (self.host.world - 1) / self.host.world * unit.count
                    * vec.dtype.itemsize)
        stats = self.host.ep.stats
        stats.add_bytes(unit.id, self.name, True, moved, True)
        stats.add_bytes(unit.id, self.name, False, moved, True)
        self.collective.submit(first + self._position[unit.id], vec, done,
                               f"{unit.name} round {rnd}")
        if flags is not None:
            self.collective.submit(first + self._ops_per_round - 1, flags, done,
                                   f"the signals of round {rnd}")
        return vec, flags

    def _agreed(self, unit: Unit, vec: Any, flags: Any) -> int:
        """The signal bits every worker raised this round (the signal unit's; 0 else)."""
        if unit.id != self.signal_unit:
            return 0
        got = self.on_host(flags if flags is not None else vec[unit.count:])
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
