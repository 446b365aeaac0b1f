"""The elastic driver: the rendezvous of an elastic job, in the launcher's process.

It never trains, so losing any worker (rank 0 included) loses no rendezvous; rank 0's log and
snapshots move to the next generation's rank 0. It listens on one ZeroMQ ROUTER socket
(protocol.py: JSON, authenticated with the job key, every field checked), starts a local worker
(or one over ssh) for every slot its listing names (sources.py), and takes workers that join by
hand with its address. It numbers generations: the workers of one form an ordinary job, and
the driver gives each its rank, the table and the commit to start from (membership.py). At a
commit every worker asks whether the membership changes there; the first question fixes the
answer for all. A worker is lost when its process exits, its connection closes (the kernel
closes it when a process dies: seen at once), or it is silent for --timeout (a machine that
vanished); the survivors are told at once and report the commits they hold, and the next
generation starts from the newest one they all hold. A worker that appears joins at the next
commit; one that leaves (SIGTERM, its manager's notice) makes every worker end the generation
at the same boundary, so nothing is rolled back. Fewer than --min-workers: the job stops,
naming who is missing, after a survivor wrote the last commit to disk as a Caffe snapshot.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.comm.auth import KEY_ENV, Signer, Verifier, key_hex
from engine.comm.errors import CommError
from engine.comm.hosts import HostEntry, is_local_host, local_addresses

from ..config import JobConfig
from ..relay import ErrorRelay
from .events import EventLog
from .membership import Seat, common_commit, table_of
from .policy import Admission, ElasticSettings, lr_scale, usable
from .protocol import WORKER_KINDS, WORKER_MESSAGE_BYTES, authenticate, encode, parse
from .sources import BY_HAND, Slot

_POLL_MS = 50


@dataclass(frozen=True)
class BatchFacts:
    """The solver's batch per worker and pass, and its iter_size: what the batch rule needs."""
    batch: int
    iter_size: int


@dataclass
class Worker:
    """A worker process that joined."""
    wid: int
    slot: Slot
    pid: int
    ident: bytes
    conn: tuple[int, int] | None
    joined_at: float
    last_seen: float
    #: idle (joined, in no generation), member (of the current one), done, gone
    state: str = "idle"
    #: its newest report since the generation it was in ended (None: none yet)
    report: dict[str, Any] | None = None
    rank: int | None = None

    @property
    def name(self) -> str:
        at = f"{self.slot.host}:{self.slot.port}"
        return f"worker {self.rank} ({at})" if self.rank is not None else f"worker at {at}"


@dataclass
class Generation:
    number: int
    seats: list[Seat]
    start: int
    batch: str
    reached: int
    formed_at: float
    #: running, ending (a regroup or a leave: every worker ends at one boundary), failed
    state: str = "running"
    decisions: dict[int, str] = field(default_factory=dict)
    ended_at: float | None = None
    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    plan: str = "?"


@dataclass
class Child:
    proc: subprocess.Popen
    relay: ErrorRelay
    slot: Slot


def member_command() -> list[str]:
    """The command of a worker the driver starts; its settings come on standard input."""
    return [sys.executable, "-m", "poseidon_cli.launch.elastic.member"]


def exit_reason(rc: int, reported: str | None) -> str:
    how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    return f"{how} ({reported})" if reported else how


class Driver:
    """One elastic job's driver; ``run`` returns when the job finished, else raises CommError
    with the one line that says why it stopped."""

    def __init__(self, config: JobConfig, settings: ElasticSettings, source: Any, key: bytes,
                 facts: BatchFacts, port: int, launch: str = "local",
                 say: Callable[[str], None] | None = None) -> None:
        from engine import glog

        self.config, self.settings, self.source = config, settings, source
        self.key, self.facts, self.launch = key, facts, launch
        self.say = say or glog.info
        self.warn = glog.warning if say is None else say
        self.timeout = config.timeout
        self.hb = max(0.05, min(1.0, self.timeout / 5))
        self.admission = Admission(settings.backoff_s, settings.max_failures)
        self.events = EventLog(self.say)
        self.workers: dict[int, Worker] = {}
        self.children: dict[tuple[str, int], Child] = {}
        self.listed: dict[tuple[str, int], Slot] = {}
        self.gen: Generation | None = None
        self.first_images: int | None = None
        self._next_wid = 0
        self._epoch: dict[int, int] = {}
        self._signer, self._verifier = Signer(key), Verifier(key)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, WORKER_MESSAGE_BYTES)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED |
                                                      zmq.EVENT_DISCONNECTED)
        try:
            if port:
                self._sock.bind(f"tcp://*:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port("tcp://*", 20000, 32000)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise CommError(f"elastic driver: cannot bind port {port}: {e}") from None
        self.t0 = time.monotonic()
        self._last_hb = 0.0
        self._waiting_since: float | None = None
        self._stopping: dict[str, Any] | None = None
        self._signals: list[int] = []
        self._forwarded: set[str] = set()
        self.failure: str | None = None
        self.done = False

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        handled = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
                   if s]
        previous = {s: signal.signal(s, lambda n, f: self._signals.append(n)) for s in handled}
        try:
            while not self.done:
                self._tick()
        except KeyboardInterrupt:
            self.failure = (f"interrupted twice: stopped all {len(self.children)} worker "
                            "processes at once, without a snapshot")
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._shutdown()
        if self.failure is not None:
            raise CommError(self.failure)

    def _tick(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        ready = dict(poller.poll(_POLL_MS))
        now = time.monotonic()
        # connection events first: a JOIN on a reused descriptor comes after its ACCEPTED
        while self._monitor.poll(0):
            self._on_monitor(recv_monitor_message(self._monitor), now)
        if self._sock in ready:
            while self._sock.poll(0):
                self._on_frames(self._sock.recv_multipart(copy=False), now)
        self._reap(now)
        self._watch_silence(now)
        self._take_signals()
        self._refresh(now)
        self._advance(now)

    # ------------------------------------------------------------------ sockets
    def send(self, w: Worker, kind: str, **fields: Any) -> None:
        self._sock.send_multipart([w.ident, *encode(self._signer, kind, **fields)])

    def _on_monitor(self, event: dict[str, Any], now: float) -> None:
        fd = int(event["value"])
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._epoch[fd] = self._epoch.get(fd, 0) + 1
            return
        for w in self.workers.values():
            if w.conn == (fd, self._epoch.get(fd, 0)) and w.state not in ("gone", "done"):
                child = self.children.get(w.slot.key)
                if child is not None:  # the kernel closed it: the process is dying; say how
                    try:
                        child.proc.wait(0.5)
                    except subprocess.TimeoutExpired:
                        pass
                    if child.proc.poll() is not None:
                        self._reap(now)
                        return
                self.lose(w, "its connection to the driver closed (the process ended, or its "
                             "machine went)", now)

    def _on_frames(self, frames: list[Any], now: float) -> None:
        if len(frames) != 3:
            return
        ident = frames[0].bytes
        fd = frames[1].get(zmq.SRCFD)
        payload = authenticate(self._verifier, [frames[1].bytes, frames[2].bytes], ident)
        if payload is None:
            return  # not this job's, or a replay: dropped, as the transport drops them
        w = next((w for w in self.workers.values() if w.ident == ident), None)
        try:
            msg = parse(payload, WORKER_KINDS, w.name if w else "a worker")
        except CommError as e:
            self.warn(f"elastic driver: dropped a message: {e}")
            if w is not None:
                self.lose(w, f"sent a message the driver cannot use ({e})", now)
            return
        if msg["kind"] == "join":
            self._on_join(ident, (fd, self._epoch.get(fd, 0)), msg, now)
            return
        if w is None or w.state == "gone":
            return
        w.last_seen = now
        handler = getattr(self, f"_on_{msg['kind']}")
        handler(w, msg, now)

    # ------------------------------------------------------------------ messages
    def _on_join(self, ident: bytes, conn: tuple[int, int], msg: dict[str, Any],
                 now: float) -> None:
        key = (msg["host"], msg["port"])
        # a machine is its name at its address: emulated hosts share the name, not the address
        slot = self.listed.get(key) or Slot(msg["host"], msg["port"],
                                            f"{msg['machine']}@{msg['host']}", 0, BY_HAND)

        def refuse(reason: str) -> None:
            self._sock.send_multipart([ident, *encode(self._signer, "refuse",
                                                      nonce=msg["nonce"], reason=reason)])

        if self.admission.excluded(slot.key):
            refuse(f"elastic driver at port {self.port}: the worker at {key[0]}:{key[1]} is "
                   "excluded from this job (it failed again and again right after joining)")
            return
        if any(w.slot.key == key and w.state not in ("gone", "done")
               for w in self.workers.values()):
            refuse(f"elastic driver at port {self.port}: a worker at {key[0]}:{key[1]} is "
                   "already in this job")
            return
        w = Worker(self._next_wid, slot, msg["pid"], ident, conn, now, now)
        self._next_wid += 1
        self.workers[w.wid] = w
        self.send(w, "welcome", nonce=msg["nonce"], wid=w.wid)

    def _on_heartbeat(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        pass

    def _on_report(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        g = self.gen
        w.report = msg
        status = msg["status"]
        if status == "new" and g is not None:
            self.say(f"Elastic: the worker at {w.slot.host}:{w.slot.port} is ready (pid "
                     f"{w.pid}): it joins at the next commit")
        member = g is not None and msg["gen"] == g.number and w.state == "member"
        if status == "left":  # gracefully: its slot is not charged with a failure
            w.state = "gone"
            self.admission.left(w.slot.key, now)
            self.events.left(w.name, msg["reason"] or "SIGTERM", now)
            self.send(w, "exit", reason="left")
        if not member or status == "new":
            return
        assert g is not None
        if status == "failed" and g.state != "failed":
            self.fail_generation(msg["reason"] or f"{w.name} failed", now)
        elif g.state == "running":
            g.state, g.ended_at = "ending", now
            self.events.since = self.events.since or now

    def _on_ask(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        g, it = self.gen, msg["iter"]
        if g is None or msg["gen"] != g.number or g.state == "failed" or w.state != "member":
            # the abort message it was (or is being) sent says why
            self.send(w, "decision", gen=msg["gen"], iter=it, answer="abort")
            return
        if it > g.start:
            self.admission.progressed(w.slot.key)
        answer = g.decisions.get(it)
        if answer is None:
            answer = "regroup" if self._change_pending(g) else "continue"
            g.decisions[it] = answer
            if answer == "regroup" and g.state == "running":
                g.state, g.ended_at = "ending", now
                self.events.since = self.events.since or now
        self.send(w, "decision", gen=g.number, iter=it, answer=answer)

    def _on_started(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        g = self.gen
        if g is None or msg["gen"] != g.number:
            return
        g.started.add(w.wid)
        if w.rank == 0:
            g.plan = msg["plan"] or g.plan
        if len(g.started) == len(g.seats):
            self.events.generation(g.number, len(g.seats), g.start, g.reached, now, g.batch,
                                   g.plan)
            if "stop" in self._forwarded or "snapshot" in self._forwarded:
                for action in sorted(self._forwarded):
                    self._signal_members(action)

    def _on_finished(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        g = self.gen
        if g is not None and msg["gen"] == g.number:
            g.finished.add(w.wid)
            w.state = "done"

    def _on_wrote(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        if self._stopping is None or self._stopping["writer"] != w.wid:
            return
        line = self._stopping["line"]
        path = msg["path"]
        self.failure = (f"{line}; the last commit (iteration {self._stopping['commit']}) is "
                        f"written to {path}: resume from it with --snapshot {path}" if path else
                        f"{line}; writing the last commit (iteration "
                        f"{self._stopping['commit']}) failed: {msg['reason']}")
        self.done = True

    # ------------------------------------------------------------------ losing workers
    def lose(self, w: Worker, reason: str, now: float) -> None:
        """``w`` is gone: stop its process, charge its slot, fail its generation."""
        if w.state in ("gone", "done"):
            return
        w.state = "gone"
        child = self.children.get(w.slot.key)
        if child is not None and child.proc.poll() is None:
            _kill(child.proc)
        self.events.lost(w.name, reason, now)
        self._charge(w.slot, now)
        g = self.gen
        if g is not None and any(s.wid == w.wid for s in g.seats) and g.state != "failed":
            self.fail_generation(f"{w.name} {reason}", now)

    def _charge(self, slot: Slot, now: float) -> None:
        if self.done or self._stopping is not None:
            return
        failures, wait = self.admission.failed(slot.key, now)
        at = f"{slot.host}:{slot.port}"
        if wait is None:
            self.events.note(f"worker at {at} excluded: it failed {failures} times in a row "
                             "before the job could commit with it", excluded=True)
        elif failures > 1:
            self.events.note(f"worker at {at} failed {failures} times in a row before the job "
                             f"could commit with it: it may join again in {wait:g} s (back-off, "
                             "doubling)")
        elif slot.key in self.listed and self.launch_here(slot):
            self.events.note(f"worker at {at} may start again in {wait:g} s (back-off)")

    def fail_generation(self, reason: str, now: float) -> None:
        g = self.gen
        assert g is not None
        g.state, g.ended_at = "failed", g.ended_at or now
        self.events.since = self.events.since or now
        for s in g.seats:
            w = self.workers[s.wid]
            if w.state == "member":
                self.send(w, "abort", gen=g.number, reason=reason[:2000])

    def _reap(self, now: float) -> None:
        for key, child in list(self.children.items()):
            rc = child.proc.poll()
            if rc is None:
                continue
            _kill(child.proc)  # what is left of its process group: its shard
            del self.children[key]
            w = next((w for w in self.workers.values() if w.slot.key == key
                      and w.state not in ("gone", "done")), None)
            if rc == 0 and w is None:
                continue
            reason = exit_reason(rc, child.relay.first_error(child.proc, wait_s=0.5))
            if w is not None:
                self.lose(w, reason, now)
            elif not any(x.slot.key == key for x in self.workers.values()):
                self.events.note(f"the worker started at {key[0]}:{key[1]} {reason} before "
                                 "it joined")
                self._charge(child.slot, now)

    def _watch_silence(self, now: float) -> None:
        for w in list(self.workers.values()):
            if w.state not in ("gone", "done") and now - w.last_seen > self.timeout:
                self.lose(w, f"nothing heard for {self.timeout:g} s (the process hangs, or "
                             "its machine went)", now)
        if now - self._last_hb >= self.hb:
            self._last_hb = now
            for w in self.workers.values():
                if w.state not in ("gone", "done"):
                    self.send(w, "heartbeat")

    # ------------------------------------------------------------------ listing, processes
    def launch_here(self, slot: Slot) -> bool:
        return is_local_host(slot.host, self._local) or self.launch == "ssh"

    def _refresh(self, now: float) -> None:
        if not hasattr(self, "_local"):
            self._local = local_addresses()
        listing = self.source.poll(self.warn)
        if listing is not None:
            self.listed = {s.key: s for s in listing}
            for key, child in list(self.children.items()):
                joined = any(w.slot.key == key for w in self.workers.values())
                if key not in self.listed and not joined:
                    _kill(child.proc)  # delisted before it joined
        if self.done or self._stopping is not None:
            return
        for key, slot in self.listed.items():
            busy = key in self.children or any(w.slot.key == key and w.state != "gone"
                                               for w in self.workers.values())
            if not busy and self.launch_here(slot) and self.admission.eligible(slot.key,
                                                                              now):
                self._start(slot)

    def _start(self, slot: Slot) -> None:
        from ..launcher import ssh_command

        gpus = self.config.gpus
        gpu = gpus[slot.local % len(gpus)] if gpus else None
        here = is_local_host(slot.host, self._local)
        driver_host = "127.0.0.1" if here else own_host(slot.host, self.port)
        settings = json.dumps({"config": self.config.to_json(), "driver":
                               f"{driver_host}:{self.port}", "host": slot.host,
                               "port": slot.port, "machine": slot.machine, "gpu": gpu})
        plain = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        if here:
            cmd, env, stdin = member_command(), {**plain, KEY_ENV: key_hex(self.key)}, \
                settings + "\n"
        else:
            entry = HostEntry(0, slot.host, slot.port, 0, 0, 1, slot.where)
            cmd, env = ssh_command(entry, member_command()), plain
            stdin = key_hex(self.key) + "\n" + settings + "\n"
        proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE,
                                stdin=subprocess.PIPE, env=env)
        relay = ErrorRelay()
        relay.watch(proc)
        assert proc.stdin is not None
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died at once: _reap says how
            pass
        self.children[slot.key] = Child(proc, relay, slot)
        self.say(f"Elastic: started the worker at {slot.host}:{slot.port} ({slot.where}; pid "
                 f"{proc.pid})")

    # ------------------------------------------------------------------ generations
    def _member_workers(self, g: Generation) -> list[Worker]:
        return [self.workers[s.wid] for s in g.seats]

    def _change_pending(self, g: Generation) -> bool:
        """Would the next generation differ from ``g``: a worker waits to join (and the
        batch rule takes it), or a member's slot is no longer listed."""
        members = self._member_workers(g)
        if any(self._delisted(w) for w in members):
            return True
        joiners = self._joiners(time.monotonic())
        if not joiners:
            return False
        cap = self.settings.max_workers or len(members) + len(joiners)
        choice = usable(min(cap, len(members) + len(joiners)), self.settings.min_workers,
                        self.facts.batch, self.settings.global_batch, self.facts.iter_size)
        return not isinstance(choice, str) and choice[0] != len(members)

    def _delisted(self, w: Worker) -> bool:
        return w.slot.where != BY_HAND and w.slot.key not in self.listed

    def _joiners(self, now: float) -> list[Worker]:
        """Workers free to join, in the listing's order, then those that joined by hand in
        the order they came."""
        order = {key: i for i, key in enumerate(self.listed)}
        return sorted((w for w in self.workers.values()
                       if w.state == "idle" and w.report is not None and not self._delisted(w)
                       and self.admission.eligible(w.slot.key, now)),
                      key=lambda w: (order.get(w.slot.key, len(order)), w.joined_at))

    def _advance(self, now: float) -> None:
        g = self.gen
        if self._stopping is not None:
            if now > self._stopping["deadline"]:
                self.failure = (f"{self._stopping['line']}; the last commit (iteration "
                                f"{self._stopping['commit']}) could not be written: its "
                                f"writer did not answer within {self._stopping['wait']:g} s")
                self.done = True
            return
        if g is not None and g.state == "running":
            members = self._member_workers(g)
            if g.finished and all(w.wid in g.finished or w.state == "gone" for w in members) \
                    and all(w.state != "member" for w in members):
                self.done = True
            return
        if g is not None:
            waiting = [w for w in self._member_workers(g) if w.state == "member"
                       and (w.report is None or w.report["gen"] != g.number)]
            if waiting:
                if now - (g.ended_at or now) < self.timeout:
                    return
                for w in waiting:
                    self.lose(w, f"did not report within {self.timeout:g} s after generation "
                                 f"{g.number} ended", now)
        self._form(now)

    def _form(self, now: float) -> None:
        g = self.gen
        s = self.settings
        survivors = [w for w in (self._member_workers(g) if g else [])
                     if w.state == "member" and not self._delisted(w)]
        for w in (self._member_workers(g) if g else []):
            if w.state == "member" and self._delisted(w):
                w.state = "gone"
                self.events.left(w.name, f"no longer listed in {self.source.name}", now)
                self.send(w, "exit", reason="no longer listed")
        seats = [Seat(w.wid, w.slot.host, w.slot.port, w.slot.machine,
                      tuple(w.report["commits"]) if w.report else ()) for w in survivors]
        if g is not None and not seats:
            self.failure = (f"elastic: every worker of generation {g.number} is gone ("
                            + "; ".join(self.events.changes or ["none left"])
                            + f"): nothing of the job's state is left in memory; the newest "
                            f"snapshot on disk: {self._newest_snapshot()}")
            self.done = True
            return
        try:
            commit = common_commit(seats, self.events.changes) if seats else None
        except CommError as e:
            self.failure, self.done = str(e), True
            return
        joiners = self._joiners(now)
        candidates = seats + [Seat(w.wid, w.slot.host, w.slot.port, w.slot.machine)
                              for w in joiners]
        cap = min(s.max_workers or len(candidates), len(candidates))
        choice = usable(cap, s.min_workers, self.facts.batch, s.global_batch,
                        self.facts.iter_size)
        if g is None:  # the first generation waits for every worker listed (or --max-workers)
            expected = min(s.max_workers or 10 ** 9,
                           len(self.listed) or s.max_workers or s.min_workers)
            if len(candidates) < expected and now - self.t0 < self.timeout:
                return
        if isinstance(choice, str):
            self._waiting_since = self._waiting_since or now
            if now - self._waiting_since < self.timeout:
                return
            self._give_up(choice, seats, commit, now)
            return
        self._waiting_since = None
        workers, iter_size = choice
        chosen = candidates[:workers]
        self._assign(chosen, commit, iter_size, now)

    def _give_up(self, why: str, seats: list[Seat], commit: int | None, now: float) -> None:
        missing = "; ".join(self.events.changes) or "no worker came"
        line = f"elastic: {why} ({missing})"
        if commit is None:
            self.failure = f"{line}; the newest snapshot on disk: {self._newest_snapshot()}"
            self.done = True
            return
        writer = self.workers[seats[0].wid]
        wait = 2 * self.timeout + 60.0  # a solver is built and the snapshot written
        self._stopping = {"line": line, "writer": writer.wid, "commit": commit,
                          "deadline": now + wait, "wait": wait}
        self.send(writer, "write", commit=commit)

    def _assign(self, chosen: list[Seat], commit: int | None, iter_size: int,
                now: float) -> None:
        g = self.gen
        number = g.number + 1 if g else 1
        entries = table_of(chosen)
        images = len(chosen) * self.facts.batch * iter_size
        if self.first_images is None:
            self.first_images = images
        scale = lr_scale(self.settings.lr, images, self.first_images)
        reached = max([w.report["iter"] for w in self._member_workers(g)
                       if w.report and w.report["gen"] == g.number] or [0]) if g else 0
        batch = (f"global batch {len(chosen)} x {self.facts.batch}"
                 + (f" x iter_size {iter_size}" if iter_size > 1 else "") + f" = {images}"
                 + (f", base_lr x {scale:.4g} (--elastic-lr linear)" if scale != 1 else ""))
        start = commit if commit is not None else 0
        self.gen = Generation(number, chosen, start, batch, reached, now)
        rows = [{"host": e.host, "port": e.port, "machine": e.machine,
                 "local_rank": e.local_rank} for e in entries]
        sources = ["start" if commit is None else "memory" if seat.commits else "peer"
                   for seat in chosen]
        joiners = [r for r, source in enumerate(sources) if source == "peer"]
        for rank, (seat, source) in enumerate(zip(chosen, sources)):
            w = self.workers[seat.wid]
            if w.state == "idle" and number > 1:
                self.events.came(f"worker at {w.slot.host}:{w.slot.port} ({w.slot.where})",
                                 now)
            w.state, w.report, w.rank = "member", None, rank
            self.admission.joined(w.slot.key)
            self.send(w, "assign", gen=number, rank=rank, hosts=rows, commit=start,
                      source=source, joiners=joiners, iter_size=iter_size, lr_scale=scale,
                      commit_every=self.settings.commit_every)

    def _newest_snapshot(self) -> str:
        found = [c.relay.last_snapshot for c in self.children.values() if c.relay.last_snapshot]
        return found[-1] if found else (self.config.snapshot or "none")

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
            g = self.gen
            if g is not None and g.state == "running" and len(g.started) == len(g.seats):
                self._signal_members(action)

    def _signal_members(self, action: str) -> None:
        g = self.gen
        assert g is not None
        for w in self._member_workers(g):
            if w.state == "member":
                self.send(w, "signal", action=action)
        if action == "snapshot":
            self._forwarded.discard("snapshot")

    def _shutdown(self) -> None:
        for w in self.workers.values():
            if w.state not in ("gone",):
                try:
                    self.send(w, "exit", reason="the job ended")
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5.0
        for child in self.children.values():
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill(child.proc)
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


def own_host(peer: str, port: int) -> str:
    """This machine's address on the route to ``peer``."""
    from ..rendezvous import own_address
    return own_address(peer, port)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
