"""The collective engines' shared layer: a library's allreduce joined to a job, its threads,
and the one order every worker issues its operations in (below the schemes that use it,
engine/comm/schemes/collective.py, and its backends gloo.py, mpi.py and nccl.py).

- **Backend**: one library's allreduce (join, start, completion, leave), its version and the
  algorithm it pins so that a rerun sums in the same order.
- **Collective**: a backend joined to one job. A collective engine matches operations by the
  order they are issued, so every worker must issue the same ones in the same order: each op
  has a number in the job's one order, and an op that comes before its turn waits for the
  ones before it. A blocking engine's ops (MPI) are issued by the collective's *engine
  thread*, which also joins, probes and leaves (a small op whose turn it is, while that
  thread is idle, by the thread that submits it: ``Backend.inline_bytes``); another's by
  whichever thread submits an op in its turn (a hand-off at every release costs a
  scheduling delay where backward keeps the cores busy). Completions are reported by the
  engine's own thread (Gloo's future, MPI's engine thread) or, for an engine that cannot
  call back (NCCL's stream event), by a wait thread that waits for each op in turn; an op
  its submitter waits for anyway (the round's last) is waited for on that thread.
- **probe**: at start-up, every worker at once, a 4 KB and a 4 MB allreduce on the engine,
  fitted as a ring's alpha and beta (``EngineCost``): what the planner prices the engine's
  layers with and the plan records.
"""
from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from engine import timeline
from engine.pb import poseidon_pb2 as pb

from .cost import LayerTiming
from .errors import CommError
from .link import Link

#: the start-up probe: a small and a 4 MB allreduce, the fastest of several of each
PROBE_SMALL_BYTES = 4 << 10
PROBE_LARGE_BYTES = 4 << 20
PROBE_REPEATS = (8, 3)
#: no engine moves a byte faster than memory (1 / 100 GB/s)
MIN_BETA = 1e-11

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
    #: a blocking engine's op of at most this many bytes is issued by the thread that submits
    #: it, when it is its turn and the engine thread is idle: a small sum blocks backward for
    #: less than the hand-off to the engine thread and back would cost (0: never)
    inline_bytes: ClassVar[int] = 0

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
        """Block until ``handle`` completes, raising its error: for ``then``'s False, and for
        an op its submitter waits for anyway (the round's last). A blocking engine's ops are
        complete when ``start`` returns, and need none."""
        if not self.blocking:
            raise NotImplementedError(f"{self.name}: the backend cannot be waited for")

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
        #: set when an op is issued while ``sum_here`` waits for its turn (``_waiting``: a
        #: plain flag, read in every issue where the Event's own is a call)
        self._advanced = threading.Event()
        self._waiting = False
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
        ...); ``done()`` once complete (on an engine's thread, or on this one). A blocking
        engine's op goes to the engine thread, but a small one is summed here when it is its
        turn and that thread is idle; another engine's is issued here when it is its turn (a
        thread hand-off at every release costs a scheduling delay where the cores are busy
        with backward), else by the op before it."""
        if self.backend_class.blocking:
            if vec.nbytes <= self.backend_class.inline_bytes and self._order.acquire(False):
                try:  # its turn: every op before it is issued, and so complete
                    if self._next == seq:
                        self._take(seq, vec, done, what)
                        return
                finally:
                    self._order.release()
            self._calls.put(("op", seq, vec, done, what))
            return
        with self._order:
            self._take(seq, vec, done, what)

    def sum_here(self, seq: int, vec: Any, what: str,
                 abort: Callable[[], None] | None = None) -> None:
        """Allreduce ``vec`` in place as operation ``seq``, issued on this thread in its turn
        and waited for here (the round's last: its caller waits for it anyway), on any
        engine: complete when this returns. Its turn comes when the thread that issues the
        op before it says so (a blocking engine's op before it is complete by then, as it is
        when that thread lets go of the order). Each wait is bounded: by the job's timeout,
        and by ``abort`` (which raises the job's error); a failure of the engine raises
        here."""
        deadline = 0.0  # set once it has to wait (a clock read costs the round a call)
        mine = None
        while True:
            if self._next == seq or self.failed is not None:
                # (a timed acquire costs the round twice an untimed one's call)
                if self._order.acquire(False) or self._order.acquire(timeout=0.5):
                    try:
                        if self._next == seq or self.failed is not None:
                            mine = self._take(seq, vec, None, what, True)
                            break
                    finally:
                        self._order.release()
                    continue
            else:
                self._advanced.clear()  # then looked at again: an issue between is seen
                self._waiting = True
                if self._next != seq and self.failed is None:
                    self._advanced.wait(0.5)
            if abort is not None:
                abort()
            if not deadline:
                deadline = time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                raise EngineError(f"{self.name}: {what} waited {self.timeout:g} s for the "
                                  "allreduces before it")
        if mine is not None:  # waited for after the order's lock: others' ops go on meanwhile
            handle, on_done = mine
            try:  # the engine's completion wakes only this thread, as the bare call's does
                if not self.backend_class.blocking:  # a blocking engine's op is complete
                    self.backend.finish(handle)
            except Exception as e:
                self._fail(what, e)
            if self.failed is None and on_done is not None:  # (the timeline's)
                on_done()
        if self.failed is not None:
            if abort is not None:
                abort()  # the job's error, where the engine's failure made one
            raise CommError(self.failed)

    def _take(self, seq: int, vec: Any, done: Callable[[], None] | None, what: str,
              here: bool = False) -> tuple[Any, Callable[[], None]] | None:
        """Op ``seq`` held until its turn; in its turn, issued, and then every held op whose
        turn follows (under ``_order``: no op is held in its turn). With ``here``, op ``seq``,
        if issued now, is left for this thread to wait for: (its handle, its completion)."""
        if self._next != seq:
            self._early[seq] = (vec, done, what)
            return None
        mine = None
        while self.failed is None:
            waited = here and self._next == seq
            issued = self._issue(vec, done, what, waited)
            if waited:
                mine = issued
            op = self._early.pop(self._next, None) if self._early else None
            if op is None:
                break
            vec, done, what = op
        return mine

    def _issue(self, vec: Any, on_done: Callable[[], None] | None, what: str,
               waited: bool = False) -> tuple[Any, Callable[[], None]] | None:
        """Issue one op; with ``waited``, return (its handle, its completion) for the thread
        that waits for it rather than arrange its report."""
        self._next += 1
        if self._waiting:  # (the set costs a lock)
            self._waiting = False
            self._advanced.set()
        tl = timeline.current
        if tl.active:  # the allreduce on the engine thread, from its issue to its end
            began, inner = tl.now(), on_done

            def on_done() -> None:
                tl.complete(f"{self.name} {what}", "allreduce", began)
                if inner is not None:
                    inner()
        try:
            handle = self.backend.start(vec)
            if waited:
                return handle, on_done
            if not self.backend.then(handle, self._completion(on_done, what)):
                self._issued.put((handle, on_done, what))
        except Exception as e:
            self._fail(what, e)
        return None

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
            with self._order:  # a small op may be summed on the thread that submits it
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


def probed_timing(scheme: str, info: Any, world: int, link: Link, device: Any) -> LayerTiming:
    """A layer's round on a scheme whose whole round was probed at start-up (``link``, a
    ring's: ``ring_link``), every worker at once on the machine's cores: its time as measured,
    the crowding included, so no message of Poseidon's transport is priced on top."""
    nbytes = info.params * info.itemsize
    moved = 2 * (world - 1) / world * nbytes
    span = ring_time(link, world, nbytes)
    update = device.update_s(nbytes)
    return LayerTiming(info.name, scheme, moved, moved, span, span, 0.0, 0.0,
                       0.0 if device.update_on_device else update, update)
