"""The DWBP syncer: wait-free backprop, scheduling only.

``release(layer)`` is called by ``net.backward`` as soon as a layer's parameter gradients are
complete; it returns at once, so the backward of the layers below goes on while these bytes
travel. When every layer of a unit (one layer, or a fusion bucket) is released, the unit's
scheme takes it on the *progress thread*, which also takes every checked message; schemes run
event-driven there and call ``done`` when a unit's summed gradient is in its diffs, which
applies the solver's ``update_layer`` (the mean is the update's). A *sender thread* moves the
schemes' messages, lowest layer first when several wait (the next forward needs the bottom
layer first); a small message with none waiting goes out from the progress thread itself.
``wait(layer)`` blocks a layer's next forward until its update is applied (BSP, per layer).

At start-up every worker and shard meet (engine/comm/handshake.py): the same net and settings,
rank 0's plan for everyone, the PS chunk table for the shards, READY.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import math
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

from engine import backend, timeline
from engine.pb import poseidon_pb2 as pb

from . import handshake
from .codecs import Codec
from .errors import CommError
from .hosts import HostEntry
from .levels import compose
from .link import Link
from .planner import Plan
from .schemes import SCHEMES, Finished, Scheme
from .chunks import DEFAULT_CHUNK_BYTES
from .stats import CommStats, now
from .topology import Topology
from .transport import (COPY_BELOW_BYTES, SHARD, WORKER, Endpoint, Message, PeerId, header,
                        message_key)
from .units import LayerSlot, ParamSlot, Unit

log = logging.getLogger("poseidon.comm")

#: what a signal asks for, as bits on the wire (Header.request); 'leave': an elastic worker's
#: notice that it goes (every worker ends the generation at the same boundary)
REQUEST_BITS = {"snapshot": pb.REQUEST_SNAPSHOT, "stop": pb.REQUEST_STOP,
                "leave": pb.REQUEST_LEAVE}
_SIGNAL_BITS = pb.REQUEST_SNAPSHOT | pb.REQUEST_STOP | pb.REQUEST_LEAVE

__all__ = ["LayerSlot", "ParamSlot", "Syncer", "open_worker", "REQUEST_BITS"]


def open_worker(rank: int, hosts: Sequence[HostEntry], *, key: bytes, timeout: float = 30.0,
                stats: CommStats | None = None, startup: float | None = None,
                snapshot_hint: Callable[[], str | None] | None = None,
                max_frame_bytes: int | None = None, shards: bool = True) -> Endpoint:
    """Bind worker ``rank``'s socket and connect to every worker (and every shard unless
    ``shards`` is False: a job without PS). No traffic yet."""
    world = len(hosts)
    peers = [(WORKER, r) for r in range(world)] + ([(SHARD, s) for s in range(world)]
                                                    if shards else [])
    return Endpoint((WORKER, rank), hosts, peers, key=key, timeout=timeout, stats=stats,
                    startup=startup, snapshot_hint=snapshot_hint,
                    max_frame_bytes=max_frame_bytes)


class Syncer:
    """The per-layer gradient synchroniser a Solver drives (release / wait / wait_all / close).

    ``planner(link, local_link, engines, crowding, shm_probe) -> Plan`` is rank 0's (the others
    follow the plan it sends): the network link and the link inside a machine (None with one
    worker per machine), the engines every worker joined, the workers per core on rank 0's
    machine, and shm's start-up probe where it ran (``handshake.Planner``); ``link``, when
    given, replaces the network probe.
    Construction runs the start-up barrier.
    """

    def __init__(self, ep: Endpoint, layers: dict[int, LayerSlot],
                 update_layer: Callable[[int], None], *,
                 planner: handshake.Planner | None = None,
                 link: Link | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, priority: bool = True,
                 on_round_done: Callable[[int], None] | None = None,
                 on_plan: Callable[[Plan], None] | None = None, levels: bool = True,
                 engines: Sequence[str] = (), required_engines: Sequence[str] = (),
                 on_gpu: bool = False) -> None:
        """``levels``: reduce inside each machine first when machines run several workers
        (False: every worker a node of its own, as a flat run). ``engines``: the collective
        engines the job allows (rank 0 joins those every worker can run; those of
        ``required_engines`` it must); ``on_gpu``: the gradients are on a GPU."""
        self.ep = ep
        self.rank = ep.me[1]
        self.world = len(ep.hosts)
        self.layers = layers
        self.update_layer = update_layer
        self.on_round_done = on_round_done
        self.chunk_bytes = chunk_bytes
        self.priority = priority
        self.stats = ep.stats
        self.topology = (Topology.of(ep.hosts, self.rank) if levels
                         else Topology.flat(self.world, self.rank))
        self.codec: Codec = Codec()
        self.units: dict[int, Unit] = {}
        self.plan: pb.Plan | None = None
        self._planner = planner
        self._link = link
        self._on_plan = on_plan
        self._schemes: dict[str, Scheme] = {}
        self._engine_names = tuple(engines)
        self._required_engines = tuple(required_engines)
        self._on_gpu = on_gpu
        self.engines: handshake.Engines | None = None
        #: wire tag (Header.scheme) -> the scheme instance that checks and takes it
        self._receivers: dict[str, Scheme] = {}
        self._unit_of: dict[int, Unit] = {}
        self._last_layer = min(layers) if layers else -1  # released last in a backward
        #: the unit released last in a backward carries every signal of its round (its id is
        #: its lowest layer)
        self.signal_unit = self._last_layer
        #: signal bits (SNAPSHOT | STOP) for the messages of the next round this worker sends
        self._request_out = 0
        #: round -> OR of the signal bits in that round's messages, identical on every worker
        self._round_requests: dict[int, int] = {}
        self._requests_taken = 0  # rounds below this one have been handed to the solver
        self._released = {i: 0 for i in layers}
        self._applied = {i: 0 for i in layers}
        self._rounds_done: dict[int, int] = {}
        #: (unit, round) -> [layers released, bits, first release time]
        self._pending: dict[tuple[int, int], list[Any]] = {}
        #: (unit, round) -> (started, released): for the timeout and the overlap counters
        self._outstanding: dict[tuple[int, int], tuple[float, float]] = {}
        self._watched = now()
        #: the counts above; taken directly (Condition's with-statement is a Python call each
        #: way, in every release); ``_cond`` for the threads in ``wait`` (``_sleepers``)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._sleepers = 0
        self._seq = itertools.count()
        self._send_q: queue.PriorityQueue = queue.PriorityQueue()
        #: messages queued for the sender thread and not yet sent (under ``_unsent_lock``)
        self._unsent = 0
        self._unsent_lock = threading.Lock()
        self._events: queue.Queue = queue.Queue()
        ep.checker = self._check
        ep.handler = self._events.put
        ep.on_fatal.append(self._wake)
        self._threads = [threading.Thread(target=self._guard, args=(self._send_loop,),
                                          name="poseidon-send", daemon=True),
                         threading.Thread(target=self._guard, args=(self._progress_loop,),
                                          name="poseidon-progress", daemon=True)]
        for t in self._threads:
            t.start()
        try:
            self._meet()
        except BaseException:
            ep.disarm()
            self._shutdown()
            raise

    # ------------------------------------------------------------------ start-up
    def _meet(self) -> None:
        """The start-up handshake (engine/comm/handshake.py); from its end on, DATA messages
        can be checked."""
        ep = self.ep
        met = handshake.hello(ep, self.layers, self.chunk_bytes, self._fail,
                              handshake.offers(self._engine_names, self._on_gpu))
        self.engines = handshake.join_engines(ep, self._engine_names, self._required_engines,
                                              met.offered, self._fail, self.call_soon)
        for line in self.engines.report():
            log.info(line)
        plan = handshake.agree_plan(ep, self._planner, self._link, self._on_plan,
                                    self.engines.costs, met.crowding, self.engines.shm)
        units = handshake.units_of(plan, self.layers, ep.name, self._fail,
                                   tuple(self.engines.joined))
        self.engines.close(keep_only={u.scheme for u in units.units})
        self.codec = units.codec
        self.plan = plan
        self.units = {u.id: u for u in units.units}
        self._rounds_done = {u.id: 0 for u in units.units}
        for u in units.units:
            for s in u.layers:
                self._unit_of[s.layer] = u
            self.stats.layer_names[u.id] = u.name
        schemes = {name: compose(SCHEMES[name], self, [u for u in units.units
                                                       if u.scheme == name], self.chunk_bytes)
                   for name in sorted({u.scheme for u in units.units})}
        self._receivers = {tag: s for s in schemes.values() for tag in s.tags()}
        self._schemes = schemes
        handshake.ready(ep, plan, schemes.get("ps"), self._fail)

    @property
    def momentum_layers(self) -> list[int]:
        """The layers whose momentum the codec applies (sparse's momentum correction): those of
        the dense units; the solver must not apply it again (``Solver.attach_sync``)."""
        if not self.codec.momentum:
            return []
        return sorted(s.layer for u in self.units.values() if SCHEMES[u.scheme].dense
                      for s in u.layers)

    def _fail(self, reason: str) -> None:
        self.ep.fatal(reason)
        raise CommError(self.ep.error)

    # ------------------------------------------------------------------ the solver's side
    def release(self, layer: int) -> None:
        """Hand layer ``layer``'s fresh gradients on; at once, or a blocking engine's small sum
        (its update applied here)."""
        unit = self._unit_of.get(layer)
        if unit is None:
            return
        if self.ep.error is not None:
            self.raise_if_failed()
        t = now()
        with self._lock:
            rnd = self._released[layer]
            self._released[layer] = rnd + 1
            request = self._request_out
            if layer == self._last_layer:  # sent with (at least) this round's last layer
                self._request_out &= ~request  # not = 0: a signal may have come meanwhile
            bits, first, complete = request, t, True  # a unit of one layer: its one release
            if not unit.alone:
                pend = self._pending.setdefault((unit.id, rnd), [0, 0, t])
                pend[0] += 1
                pend[1] |= request
                _, bits, first = pend
                complete = pend[0] == len(unit.layers)
                if complete:
                    del self._pending[(unit.id, rnd)]
        if complete:
            captured = self._schemes[unit.scheme].capture(unit, rnd, bits)
            if isinstance(captured, Finished):  # summed on this thread: applied here
                # this thread waited on the sum, as it would have in ``wait``
                self.done(unit, rnd, captured, first, now() - t)
            else:
                self._events.put(("start", unit, rnd, bits, captured, first))

    def wait(self, layer: int) -> None:
        """Block until every released round of ``layer`` is applied (call before its forward)."""
        if layer not in self.layers:
            return
        tl = timeline.current
        if self._applied[layer] >= self._released[layer] and self.ep.error is None and \
                not tl.active:  # applied already (the counts only grow): no lock, no clock
            return
        t = now()
        start = tl.now() if tl.active else 0.0
        with self._lock:
            blocked = self._applied[layer] < self._released[layer]
            while self._applied[layer] < self._released[layer]:
                self.raise_if_failed()
                self._sleepers += 1
                self._cond.wait(0.5)
                self._sleepers -= 1
        if self.ep.error is not None:
            self.raise_if_failed()
        if blocked:
            self.stats.add_wait(self._unit_of[layer].id, now() - t)
        if tl.active:
            tl.complete(self.layers[layer].name, "wait", start)

    def wait_all(self) -> None:
        for layer in self.layers:
            self.wait(layer)

    def rounds_applied(self) -> int:
        """Rounds every layer has applied (the iteration counter runs one ahead meanwhile)."""
        with self._lock:
            return min(self._applied.values(), default=0)

    def request(self, action: str) -> None:
        """A signal asked this worker for ``action`` ('snapshot', 'stop' or 'leave'): tell
        every worker through the next round's messages. Called from a signal handler, which
        runs on the training thread: no lock (that thread may hold it), and only that thread
        touches ``_request_out``."""
        self._request_out |= REQUEST_BITS[action]

    def take_agreed(self) -> set[str]:
        """Every action the workers asked for that all of them see now ('snapshot', 'stop',
        'leave'). Called at an iteration boundary, after this worker released round R-1: rounds
        before R-1 are complete on every worker (each of their layers was waited for in the
        last forward), so every worker gets the same answer at the same iteration."""
        with self._lock:
            complete = min(self._released.values(), default=0) - 1
            bits = 0
            for rnd in range(self._requests_taken, complete):
                bits |= self._round_requests.pop(rnd, 0)
            self._requests_taken = max(self._requests_taken, complete)
        return {action for action, bit in REQUEST_BITS.items() if bits & bit}

    def take_request(self) -> str | None:
        """The solver's action at this boundary (``take_agreed``): stop, else snapshot."""
        agreed = self.take_agreed()
        if "stop" in agreed:
            return "stop"
        return "snapshot" if "snapshot" in agreed else None

    def state(self) -> bytes:
        """The plan every worker follows, for a snapshot: a resumed run with the same workers
        follows it again (the same sums in the same order), whatever its own probe measures.
        Without the nonce, which is each job's own."""
        if self.plan is None:
            return b""
        plan = pb.Plan()
        plan.CopyFrom(self.plan)
        plan.ClearField("nonce")
        return plan.SerializeToString(deterministic=True)

    def close(self) -> None:
        """Finish outstanding rounds, check the replicas agree, say BYE, release the sockets."""
        try:
            if self.ep.error is None:
                self.wait_all()
                self.check_replicas()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._send_q.put((math.inf, next(self._seq), None))
        self._events.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for scheme in self._schemes.values():
            scheme.close()
        if self.engines is not None:
            self.engines.close(clean=self.ep.error is None)
        self.stats.extra.update(self.codec.report())
        self.ep.close(say_bye=self.ep.error is None,
                      answered=self.stats.extra.get("replicas_identical", False))

    def check_replicas(self) -> None:
        """Every worker's parameters must be bit-identical (BSP); a difference is fatal."""
        h = hashlib.sha256()
        for li in sorted(self.layers):
            for p in self.layers[li].params:
                h.update(np.ascontiguousarray(backend.to_numpy(p.blob.data)).tobytes())
        mine = h.digest()
        others = [(WORKER, r) for r in range(self.world) if r != self.rank]
        self.ep.broadcast(others, header(pb.CHECK, layout_digest=mine))
        for m in self.ep.wait_for([message_key(pb.CHECK, w) for w in others], "the final check"):
            if m.header.layout_digest != mine:
                self._fail(f"replicas diverged: the parameters of {self.ep.name_of(m.sender)} "
                           f"differ from those of {self.ep.name}")
        self.stats.extra["replicas_identical"] = True
        self.stats.extra["params_sha256"] = mine.hex()

    # ------------------------------------------------------------------ the schemes' host
    def send(self, unit: Unit, peers: Sequence[PeerId], hdr: pb.Header,
             arrays: Sequence[np.ndarray] = ()) -> None:
        """Queue a message for the sender thread, lowest unit first (FIFO within a unit); but a
        small one (copied by the transport: cheap to send) goes out at once from this thread
        when nothing is queued. A hand-off to another thread costs a scheduling delay, which a
        latency-bound round pays at every hop (measured: halving-doubling on the conv net of
        `bench train`, 1 Gbit/s namespaces, 1.13x DDP against 1.05x through the thread)."""
        job = (unit, list(peers), hdr, list(arrays))
        small = sum(a.nbytes for a in job[3]) < COPY_BELOW_BYTES
        with self._unsent_lock:
            inline = small and self._unsent == 0
            if not inline:
                self._unsent += 1
        if inline:
            self._transmit(job)
        else:
            self._send_q.put((unit.priority if self.priority else 0, next(self._seq), job))

    @property
    def collectives(self) -> dict[str, Any]:
        """The collective engines this job joined, by name."""
        return self.engines.joined if self.engines is not None else {}

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the progress thread (from any thread)."""
        self._events.put(fn)

    def done(self, unit: Unit, rnd: int, bits: int, released: float | None = None,
             waited: float = 0.0) -> None:
        """``unit``'s summed gradient of round ``rnd`` is in its diffs: apply (progress thread;
        the training thread for a round its scheme ``Finished`` at release, which says when
        it was ``released``, it was never outstanding, and how long that thread ``waited``)."""
        if released is None:
            _, released = self._outstanding.pop((unit.id, rnd), (0.0, now()))
        apply = not self.codec.watches_rounds or not SCHEMES[unit.scheme].dense or \
            self.codec.after_round(unit.id, bits)
        tl = timeline.current
        start = tl.now() if tl.active else 0.0
        if apply:
            for slot in unit.layers:
                self.update_layer(slot.layer)
        else:  # a wire overflow: every worker skips this update (the bits are the same)
            for p in unit.params:
                p.blob.diff[...] = 0
            log.warning("%s: %s round %d: the fp16 sum overflowed; update skipped, scale now "
                        "%g", self.ep.name, unit.name, rnd, getattr(self.codec, "scale")(unit.id))
        if tl.active:
            tl.complete(f"update {unit.name}", "update", start, {"round": rnd})
        with self._lock:
            request = bits & _SIGNAL_BITS
            if request:
                self._round_requests[rnd] = self._round_requests.get(rnd, 0) | request
            for slot in unit.layers:
                self._applied[slot.layer] += 1
            self._rounds_done[unit.id] += 1
            if self._sleepers:  # (a notify is two Python calls, in every round)
                self._cond.notify_all()
        self.stats.add_round(unit.id, rnd, released, now(), waited)
        if unit.id == self._last_layer and self.on_round_done is not None:  # (the lowest)
            self.on_round_done(rnd)

    # ------------------------------------------------------------------- internals
    def raise_if_failed(self) -> None:
        """On the training thread (a scheme's ``capture`` too): raise the recorded error (the
        process will exit cleanly)."""
        if self.ep.error is not None:
            self.ep.disarm()
            raise CommError(self.ep.error)

    def _wake(self, _reason: str) -> None:
        with self._lock:
            self._cond.notify_all()

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except CommError:
            pass  # already recorded and broadcast by the endpoint
        except Exception as e:
            self.ep.fatal(f"{self.ep.name}: communication thread failed: {type(e).__name__}: {e}")
        finally:
            self._events.put(None)
            self._send_q.put((math.inf, next(self._seq), None))
            self._wake("")

    def _check(self, msg: Message) -> str | None:
        """On the receive thread, before a byte is used: a known unit of the sending scheme,
        in this round or the next, as the scheme's tables say."""
        h = msg.header
        scheme = self._receivers.get(h.scheme)
        unit = self.units.get(h.layer)
        if scheme is None or unit is None or unit.scheme != scheme.name:
            return f"unit {h.layer} is not synchronised by {h.scheme!r} here"
        done = self._rounds_done[unit.id]
        return scheme.check(msg, (done, done + 1))

    def _send_loop(self) -> None:
        ep = self.ep
        while True:
            _, _, job = self._send_q.get()
            if job is None or ep.error is not None:
                return
            self._transmit(job)
            with self._unsent_lock:
                self._unsent -= 1

    def _transmit(self, job: tuple[Unit, list[PeerId], pb.Header, list[np.ndarray]]) -> None:
        unit, peers, hdr, arrays = job
        tl = timeline.current
        start = tl.now()
        self.ep.broadcast(peers, hdr, arrays)
        if tl.active:
            tl.complete(f"send {unit.name}", "send", start,
                        {"round": hdr.round, "scheme": hdr.scheme, "op": hdr.op,
                         "bytes": sum(a.nbytes for a in arrays) * len(peers)})

    def _progress_loop(self) -> None:
        while True:
            try:
                ev = self._events.get(timeout=0.5)
            except queue.Empty:
                self._watchdog()
                continue
            if ev is None or self.ep.error is not None:
                return
            if isinstance(ev, Message):
                self._receivers[ev.header.scheme].receive(ev)
            elif callable(ev):  # a completion posted by another thread (an engine's)
                ev()
            else:
                _, unit, rnd, bits, captured, released = ev
                self._outstanding[(unit.id, rnd)] = (now(), released)
                self._schemes[unit.scheme].start(unit, rnd, bits, captured)
            self._watchdog()

    def _watchdog(self) -> None:
        """A unit whose round has waited longer than the timeout stops the job, naming who
        did not send (or the peer that went silent upstream)."""
        t = now()
        if t - self._watched < 0.5:
            return
        self._watched = t
        for (uid, rnd), (started, _) in list(self._outstanding.items()):
            if t - started > self.ep.timeout:
                unit = self.units[uid]
                self.ep.timed_out(f"the {unit.scheme} messages of {unit.name} round {rnd}",
                                  self._schemes[unit.scheme].missing(unit, rnd))
                return
