"""The elastic driver: the rendezvous of an elastic job, in the launcher's process.

It never trains, so losing any worker (rank 0 included) loses no rendezvous; rank 0's log and
snapshots move to the next generation's rank 0. It listens on one ZeroMQ ROUTER socket
(protocol.py: JSON, authenticated with the job key, every field checked), starts a local worker
(or one over ssh) for every slot its listing names (sources.py), and takes workers that join by
hand with its address. It numbers generations: the workers of one form an ordinary job, and
the driver gives each its rank, the table and the commit to start from (membership.py). At a
commit every worker asks whether the membership changes there; the first question fixes the
answer for all.

A worker is known by who it is: its socket's routing id is the nonce its signed JOIN carries
(the driver checks they are one), the same after a reconnect; nothing is keyed by a file
descriptor or the order of connection events. It is lost when a process the driver started
exits (at once), when its routing id is unreachable at ``MISSED_BEATS`` heartbeats in a row
(its connection closed: the kernel closes it when a process dies; a closed connection the
monitor reports is only a hint to send the next heartbeat at once), or when it is silent for
--timeout (a process that hangs, or a machine that vanished without closing its connections).
The survivors are told at once and report the commits they hold, and the next
generation starts from the newest one they all hold. A worker that appears joins at the next
commit; one that leaves (SIGTERM, its manager's notice) makes every worker end the generation
at the same boundary, so nothing is rolled back. Fewer than --min-workers: the job stops,
naming who is missing, after a survivor wrote the last commit to disk as a Caffe snapshot.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.comm.auth import Signer, Verifier
from engine.comm.errors import CommError
from engine.comm.hosts import local_addresses

from ...job_config import JobConfig
from ..hostfile import reserve_ports
from .children import Children
from .events import EventLog
from .generations import BatchFacts, ElasticState, GenState, Worker, WorkerState
from .policy import ElasticSettings
from .protocol import WORKER_KINDS, WORKER_MESSAGE_BYTES, authenticate, encode, parse
from .sources import Slot

__all__ = ["BatchFacts", "Driver", "MISSED_BEATS", "merge_stats"]

_POLL_MS = 50
#: a worker whose routing id is unreachable at this many heartbeats in a row is lost (a closed
#: connection of a live worker comes back at once: its socket reconnects with the same id)
MISSED_BEATS = 3


class Driver:
    """One elastic job's driver: its socket, its worker processes and its loop around the
    job's state machine (generations.py); ``run`` returns when the job finished, else raises
    CommError with the one line that says why it stopped."""

    def __init__(self, config: JobConfig, settings: ElasticSettings, source: Any, key: bytes,
                 facts: BatchFacts, port: int, launch: str = "local",
                 say: Callable[[str], None] | None = None,
                 avoid: frozenset[int] = frozenset()) -> None:
        """``port``: the driver's (0: one drawn from ``port_range``, none of ``avoid``: the
        listed workers' ports, which they bind on this machine too)."""
        from engine import glog

        self.config, self.source = config, source
        self.say = say or glog.info
        self.warn = glog.warning if say is None else say
        self.timeout = config.timeout
        self.hb = max(0.05, min(1.0, self.timeout / 5))
        self.events = EventLog(self.say)
        self._signer, self._verifier = Signer(key), Verifier(key)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, WORKER_MESSAGE_BYTES)
        # a send to a routing id with no connection fails (EHOSTUNREACH) instead of vanishing:
        # how the heartbeats see a closed connection; a reconnect takes its id over
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            if port:
                self._sock.bind(f"tcp://*:{port}")
                self.port = port
            else:
                self.port = self._bind_drawn(avoid)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise CommError(f"elastic driver: cannot bind {f'port {port}' if port else 'a port'}"
                            f": {e}") from None
        self.children = Children(config, key, self.port, launch, local_addresses(), self.say)
        self.state = ElasticState(settings, facts, self.timeout, self.events, self, self.port,
                                  getattr(source, "name", "the listing"))
        self._last_hb = 0.0
        self._signals: list[int] = []
        self._forwarded: set[str] = set()

    def _bind_drawn(self, avoid: frozenset[int]) -> int:
        """Bind a port ``reserve_ports`` draws, none of ``avoid``: bound while the draw still
        holds it (``reserve_ports``' hold lets a ZeroMQ listener beside it), so no other
        process can take it in between."""
        port, held = reserve_ports(1, "0.0.0.0", avoid)
        try:
            self._sock.bind(f"tcp://*:{port}")
        finally:
            for s in held:
                s.close()
        return port

    # the state machine's hooks (generations.Hooks)

    def send(self, w: Worker, kind: str, **fields: Any) -> bool:
        """Send ``w`` a message; False when its routing id has no connection now."""
        return self._send_to(w.ident, kind, **fields)

    def kill(self, w: Worker) -> None:
        self.children.kill(w.slot.key)

    def launched_here(self, slot: Slot) -> bool:
        return self.children.here(slot)

    def newest_snapshot(self) -> str:
        return self.children.newest_snapshot() or self.config.snapshot or "none"

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        handled = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
                   if s]
        previous = {s: signal.signal(s, lambda n, f: self._signals.append(n)) for s in handled}
        try:
            while not self.state.done:
                self._tick()
        except KeyboardInterrupt:
            self.state.failure = (f"interrupted twice: stopped all "
                                  f"{len(self.children.by_slot)} worker processes at once, "
                                  "without a snapshot")
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._shutdown()
        if self.state.failure is not None:
            raise CommError(self.state.failure)

    def _tick(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        ready = dict(poller.poll(_POLL_MS))
        now = time.monotonic()
        while self._monitor.poll(0):  # a connection closed: whose, the next beat finds out
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self._last_hb = 0.0
        if self._sock in ready:
            while self._sock.poll(0):
                self._on_frames(self._sock.recv_multipart(copy=False), now)
        self._reap(now)
        self._watch(now)
        self._take_signals()
        self._refresh(now)
        self.state.advance(now)

    # ------------------------------------------------------------------ sockets
    def _send_to(self, ident: bytes, kind: str, **fields: Any) -> bool:
        try:
            self._sock.send_multipart([ident, *encode(self._signer, kind, **fields)],
                                      zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            if e.errno == zmq.EAGAIN:  # its queue is full: it is there, and slow
                return True
            raise
        return True

    def _on_frames(self, frames: list[Any], now: float) -> None:
        if len(frames) != 3:
            return
        ident = frames[0].bytes
        payload = authenticate(self._verifier, [frames[1].bytes, frames[2].bytes], ident)
        if payload is None:
            return  # not this job's, or a replay: dropped, as the transport drops them
        w = self.state.by_ident(ident)
        try:
            msg = parse(payload, WORKER_KINDS, w.name if w else "a worker")
        except CommError as e:
            self.warn(f"elastic driver: dropped a message: {e}")
            if w is not None:
                self.state.lose(w, f"sent a message the driver cannot use ({e})", now)
            return
        kind = msg["kind"]
        if kind == "join":
            if msg["nonce"].encode() != ident:  # who it says it is must be who it is
                self.warn("elastic driver: dropped a JOIN whose signed nonce is not its "
                          "socket's routing id (a worker of an older Poseidon?)")
                return
            if w is None:
                joined = self.state.join(ident, msg, now)
                if isinstance(joined, str):
                    self._send_to(ident, "refuse", nonce=msg["nonce"], reason=joined)
                else:
                    self.send(joined, "welcome", nonce=msg["nonce"], wid=joined.wid)
            return
        if w is None or w.state == WorkerState.GONE:
            return
        w.last_seen = now
        if kind == "report":
            self.state.report(w, msg, now)
        elif kind == "ask":
            self.state.ask(w, msg, now)
        elif kind == "started":
            self.state.started(w, msg, now, self._forwarded)
        elif kind == "finished":
            self.state.finished(w, msg)
        elif kind == "wrote":
            self.state.wrote(w, msg)

    # ------------------------------------------------------------------ losing workers
    def _reap(self, now: float) -> None:
        """A process the driver started ended: its worker is lost, named by how it ended."""
        for child, rc, reason in self.children.exited():
            key = child.slot.key
            w = next((w for w in self.state.workers.values() if w.slot.key == key
                      and w.active), None)
            if rc == 0 and w is None:
                continue
            if w is not None:
                self.state.lose(w, reason, now)
            elif not any(x.slot.key == key for x in self.state.workers.values()):
                self.events.note(f"the worker started at {key[0]}:{key[1]} {reason} before "
                                 "it joined")
                self.state.charge(child.slot, now)

    def _watch(self, now: float) -> None:
        """Silence beyond --timeout, and the heartbeats, which find a closed connection."""
        for w in list(self.state.workers.values()):
            if w.active and now - w.last_seen > self.timeout:
                self.state.lose(w, f"nothing heard for {self.timeout:g} s (the process hangs, "
                                   "or its machine went)", now)
        if now - self._last_hb >= self.hb:
            self._last_hb = now
            self._reap(now)  # a process that ended is named by its exit, not its connection
            for w in list(self.state.workers.values()):
                if not w.active:
                    continue
                w.unreachable = 0 if self.send(w, "heartbeat") else w.unreachable + 1
                if w.unreachable >= MISSED_BEATS:
                    self.state.lose(w, "its connection to the driver closed (the process "
                                       "ended, or its machine went)", now)

    # ------------------------------------------------------------------ listing, processes
    def _refresh(self, now: float) -> None:
        listing = self.source.poll(self.warn)
        state = self.state
        if listing is not None:
            state.listed = {s.key: s for s in listing}
            for key in list(self.children.by_slot):
                joined = any(w.slot.key == key for w in state.workers.values())
                if key not in state.listed and not joined:
                    self.children.kill(key)  # delisted before it joined
        if state.done or state.stopping is not None:
            return
        for key, slot in state.listed.items():
            busy = key in self.children.by_slot or state.busy(key)
            if not busy and self.children.here(slot) and state.admission.eligible(key, now):
                self.children.start(slot)

    # ------------------------------------------------------------------ signals, the end
    def _take_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            name = signal.Signals(signum).name
            effects = self.config.signal_effects
            action = effects.get("SIGINT" if name == "SIGTERM" else name, "none")
            if action == "none":
                continue
            if action == "stop" and "stop" in self._forwarded:
                raise KeyboardInterrupt
            self._forwarded.add(action)
            g = self.state.gen
            if g is not None and g.state == GenState.RUNNING and len(g.started) == len(g.seats):
                self.state.signal_members(action, self._forwarded)

    def _shutdown(self) -> None:
        for line in self.events.deferred:  # what the job said no generation line after
            self.say(f"Elastic: {line}")
        self.events.deferred = []
        self.say(self.events.summary())
        for w in self.state.workers.values():
            if w.state != WorkerState.GONE:
                try:
                    self.send(w, "exit", reason="the job ended")
                except zmq.ZMQError:
                    pass
        self.children.end(5.0)
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
        self._close_sockets()
        if self.config.stats is not None:
            merge_stats(self.config.stats, self.events.as_dict())

    def _close_sockets(self) -> None:
        self._monitor.close(linger=0)
        self._sock.close(linger=1000)
        self._ctx.term()


def merge_stats(path: str, elastic: dict[str, Any]) -> None:
    """Add the elastic counters to the --stats file the last generation's rank 0 wrote."""
    p = Path(path)
    try:
        stats = json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, ValueError):
        stats = {}
    stats["elastic"] = elastic
    p.write_text(json.dumps(stats, indent=1) + "\n")
