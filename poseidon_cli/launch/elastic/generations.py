"""The elastic job's state machine: its workers, its generations, and every decision the driver
takes, without a socket or a process (testable alone: tests/test_elastic_rules.py).

A worker is ``IDLE`` once it joined, a ``MEMBER`` of the current generation once assigned,
``DONE`` when the job finished with it, ``GONE`` when lost or left. A generation is
``RUNNING``, then ``ENDING`` (a regroup or a leave: every worker ends at one boundary) or
``FAILED`` (a worker lost: every member is told at once). When no generation runs, the next is
formed from the survivors and the workers waiting to join (policy.py's batch rule), starting
from the newest commit every survivor holds (membership.py). Below --min-workers the job stops,
after a survivor wrote the last commit as a Caffe snapshot.

What touches the world goes through the ``Hooks`` the driver gives: a message to a worker, the
kill of a process the driver started, which slots it starts here, the newest snapshot.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.comm.errors import CommError

from .events import EventLog
from .membership import Seat, common_commit, table_of
from .policy import Admission, ElasticSettings, lr_scale, usable
from .sources import BY_HAND, Slot


class WorkerState(enum.Enum):
    IDLE = "idle"      # joined, in no generation
    MEMBER = "member"  # of the current generation
    DONE = "done"      # the job finished with it
    GONE = "gone"      # lost, or left


class GenState(enum.Enum):
    RUNNING = "running"
    ENDING = "ending"  # a regroup or a leave: every worker ends at one boundary
    FAILED = "failed"  # a worker lost: what was done since the commit is dropped


#: a worker that is still part of the job
ACTIVE = (WorkerState.IDLE, WorkerState.MEMBER)


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
    #: its socket's routing id: the nonce its signed JOIN carried
    ident: bytes
    joined_at: float
    last_seen: float
    #: heartbeats in a row at which its routing id was unreachable
    unreachable: int = 0
    state: WorkerState = WorkerState.IDLE
    #: its newest report since the generation it was in ended (None: none yet)
    report: dict[str, Any] | None = None
    rank: int | None = None

    @property
    def name(self) -> str:
        at = f"{self.slot.host}:{self.slot.port}"
        return f"worker {self.rank} ({at})" if self.rank is not None else f"worker at {at}"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


@dataclass
class Generation:
    number: int
    seats: list[Seat]
    start: int
    batch: str
    reached: int
    formed_at: float
    state: GenState = GenState.RUNNING
    decisions: dict[int, str] = field(default_factory=dict)
    ended_at: float | None = None
    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    plan: str = "?"
    #: it started from the job's start (its files), not from a commit
    from_start: bool = False


class Hooks(Protocol):
    """What the state machine asks of the driver."""

    def send(self, w: Worker, kind: str, **fields: Any) -> bool:
        """Send ``w`` a message; False where its connection is gone."""

    def kill(self, w: Worker) -> None:
        """Stop ``w``'s process, where the driver started it."""

    def launched_here(self, slot: Slot) -> bool:
        """Whether the driver starts the worker of ``slot`` itself."""

    def newest_snapshot(self) -> str:
        """The newest snapshot on disk, as the workers' logs named it."""


class ElasticState:
    """One elastic job's workers and generations, and the driver's decisions."""

    def __init__(self, settings: ElasticSettings, facts: BatchFacts, timeout: float,
                 events: EventLog, hooks: Hooks, port: int, source_name: str) -> None:
        self.settings, self.facts, self.timeout = settings, facts, timeout
        #: how long a member whose heartbeats still come may take to report after its
        #: generation ended: it may be inside a wait bounded by the timeout that began just
        #: after the end (a Collective's join: a worker failed while the others joined), and
        #: only then unwinds; one that is silent is lost by its heartbeats, not by this
        self.report_window = 2 * timeout
        #: generations started again from the job's start, having failed before any commit
        self.restarts = 0
        self.events, self.hooks, self.port = events, hooks, port
        self.source_name = source_name
        self.admission = Admission(settings.backoff_s, settings.max_failures)
        self.workers: dict[int, Worker] = {}
        #: the slots the listing names now (the driver refreshes it)
        self.listed: dict[tuple[str, int], Slot] = {}
        self.gen: Generation | None = None
        self.first_images: int | None = None
        self._next_wid = 0
        self.t0 = time.monotonic()
        self._waiting_since: float | None = None
        self.stopping: dict[str, Any] | None = None
        self.failure: str | None = None
        self.done = False

    def by_ident(self, ident: bytes) -> Worker | None:
        return next((w for w in self.workers.values() if w.ident == ident), None)

    def busy(self, key: tuple[str, int]) -> bool:
        """A worker of slot ``key`` is in the job (not gone)."""
        return any(w.slot.key == key and w.state != WorkerState.GONE
                   for w in self.workers.values())

    # ------------------------------------------------------------------ messages
    def join(self, ident: bytes, msg: dict[str, Any], now: float) -> Worker | str:
        """A JOIN: the new worker, or why it is refused."""
        key = (msg["host"], msg["port"])
        # a machine is its name at its address: emulated hosts share the name, not the address
        slot = self.listed.get(key) or Slot(msg["host"], msg["port"],
                                            f"{msg['machine']}@{msg['host']}", 0, BY_HAND)
        if self.admission.excluded(slot.key):
            return (f"elastic driver at port {self.port}: the worker at {key[0]}:{key[1]} is "
                    "excluded from this job (it failed again and again right after joining)")
        if any(w.slot.key == key and w.active for w in self.workers.values()):
            return (f"elastic driver at port {self.port}: a worker at {key[0]}:{key[1]} is "
                    "already in this job")
        w = Worker(self._next_wid, slot, msg["pid"], ident, now, now)
        self._next_wid += 1
        self.workers[w.wid] = w
        return w

    def report(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        g = self.gen
        w.report = msg
        status = msg["status"]
        if status == "new" and g is not None:
            self.events.say(f"Elastic: the worker at {w.slot.host}:{w.slot.port} is ready (pid "
                            f"{w.pid}): it joins at the next commit")
        member = g is not None and msg["gen"] == g.number and w.state == WorkerState.MEMBER
        if status == "left":  # gracefully: its slot is not charged with a failure
            w.state = WorkerState.GONE
            self.admission.left(w.slot.key, now)
            self.events.left(w.name, msg["reason"] or "SIGTERM", now)
            self.hooks.send(w, "exit", reason="left")
        if not member or status == "new":
            return
        assert g is not None
        if status == "failed" and g.state != GenState.FAILED:
            reason = msg["reason"] or f"{w.name} failed"
            self.events.failed(reason, now)
            self.fail_generation(reason, now)
        elif g.state == GenState.RUNNING:
            g.state, g.ended_at = GenState.ENDING, now
            self.events.since = self.events.since or now

    def ask(self, w: Worker, msg: dict[str, Any], now: float) -> None:
        g, it = self.gen, msg["iter"]
        if g is None or msg["gen"] != g.number or g.state == GenState.FAILED \
                or w.state != WorkerState.MEMBER:
            # the abort message it was (or is being) sent says why
            self.hooks.send(w, "decision", gen=msg["gen"], iter=it, answer="abort")
            return
        if it > g.start:
            self.admission.progressed(w.slot.key)
        answer = g.decisions.get(it)
        if answer is None:
            answer = "regroup" if self.change_pending(g) else "continue"
            g.decisions[it] = answer
            if answer == "regroup" and g.state == GenState.RUNNING:
                g.state, g.ended_at = GenState.ENDING, now
                self.events.since = self.events.since or now
        self.hooks.send(w, "decision", gen=g.number, iter=it, answer=answer)

    def started(self, w: Worker, msg: dict[str, Any], now: float,
                forwarded: set[str]) -> None:
        """``w`` met its generation's peers; when all have, the generation's line, and the
        signals ``forwarded`` before it could take them."""
        g = self.gen
        if g is None or msg["gen"] != g.number:
            return
        g.started.add(w.wid)
        if w.rank == 0:
            g.plan = msg["plan"] or g.plan
        if len(g.started) == len(g.seats):
            self.events.generation(g.number, len(g.seats), g.start, g.reached, now, g.batch,
                                   g.plan)
            if "stop" in forwarded or "snapshot" in forwarded:
                for action in sorted(forwarded):
                    self.signal_members(action, forwarded)

    def finished(self, w: Worker, msg: dict[str, Any]) -> None:
        g = self.gen
        if g is not None and msg["gen"] == g.number:
            g.finished.add(w.wid)
            w.state = WorkerState.DONE

    def wrote(self, w: Worker, msg: dict[str, Any]) -> None:
        if self.stopping is None or self.stopping["writer"] != w.wid:
            return
        line = self.stopping["line"]
        path = msg["path"]
        self.failure = (f"{line}; the last commit (iteration {self.stopping['commit']}) is "
                        f"written to {path}: resume from it with --snapshot {path}" if path else
                        f"{line}; writing the last commit (iteration "
                        f"{self.stopping['commit']}) failed: {msg['reason']}")
        self.done = True

    def signal_members(self, action: str, forwarded: set[str]) -> None:
        g = self.gen
        assert g is not None
        for w in self.member_workers(g):
            if w.state == WorkerState.MEMBER:
                self.hooks.send(w, "signal", action=action)
        if action == "snapshot":
            forwarded.discard("snapshot")

    # ------------------------------------------------------------------ losing workers
    def lose(self, w: Worker, reason: str, now: float, consequence: bool = False) -> None:
        """``w`` is gone: stop its process, charge its slot, fail its generation.
        ``consequence``: another event ended the generation first (events.py)."""
        if not w.active:
            return
        w.state = WorkerState.GONE
        self.hooks.kill(w)
        self.events.lost(w.name, reason, now, consequence=consequence)
        g = self.gen
        member = g is not None and any(s.wid == w.wid for s in g.seats)
        self.charge(w.slot, now, after_change=member)
        if member and g.state != GenState.FAILED:
            self.fail_generation(f"{w.name} {reason}", now)

    def charge(self, slot: Slot, now: float, after_change: bool = False) -> None:
        """A failure of ``slot``'s worker: back it off, or exclude it after too many (said
        after the next generation's line when ``after_change``: that line names the loss)."""
        if self.done or self.stopping is not None:
            return
        failures, wait = self.admission.failed(slot.key, now)
        at = f"{slot.host}:{slot.port}"
        if wait is None:
            self.events.note(f"worker at {at} excluded: it failed {failures} times in a row "
                             "before the job could commit with it", excluded=True,
                             after_change=after_change)
        elif failures > 1:
            self.events.note(f"worker at {at} failed {failures} times in a row before the job "
                             f"could commit with it: it may join again in {wait:g} s (back-off, "
                             "doubling)", after_change=after_change)
        elif slot.key in self.listed and self.hooks.launched_here(slot):
            self.events.note(f"worker at {at} may start again in {wait:g} s (back-off)",
                             after_change=after_change)

    def fail_generation(self, reason: str, now: float) -> None:
        g = self.gen
        assert g is not None
        g.state, g.ended_at = GenState.FAILED, g.ended_at or now
        self.events.since = self.events.since or now
        for s in g.seats:
            w = self.workers[s.wid]
            if w.state == WorkerState.MEMBER:
                self.hooks.send(w, "abort", gen=g.number, reason=reason[:2000])

    # ------------------------------------------------------------------ generations
    def member_workers(self, g: Generation) -> list[Worker]:
        return [self.workers[s.wid] for s in g.seats]

    def change_pending(self, g: Generation) -> bool:
        """Would the next generation differ from ``g``: a worker waits to join (and the
        batch rule takes it), or a member's slot is no longer listed."""
        members = self.member_workers(g)
        if any(self.delisted(w) for w in members):
            return True
        joiners = self.joiners(time.monotonic())
        if not joiners:
            return False
        cap = self.settings.max_workers or len(members) + len(joiners)
        choice = usable(min(cap, len(members) + len(joiners)), self.settings.min_workers,
                        self.facts.batch, self.settings.global_batch, self.facts.iter_size)
        return not isinstance(choice, str) and choice[0] != len(members)

    def delisted(self, w: Worker) -> bool:
        return w.slot.where != BY_HAND and w.slot.key not in self.listed

    def joiners(self, now: float) -> list[Worker]:
        """Workers free to join, in the listing's order, then those that joined by hand in
        the order they came."""
        order = {key: i for i, key in enumerate(self.listed)}
        return sorted((w for w in self.workers.values()
                       if w.state == WorkerState.IDLE and w.report is not None
                       and not self.delisted(w) and self.admission.eligible(w.slot.key, now)),
                      key=lambda w: (order.get(w.slot.key, len(order)), w.joined_at))

    def advance(self, now: float) -> None:
        """Whatever is due now: the end of the job, a member that did not report, the next
        generation."""
        g = self.gen
        if self.stopping is not None:
            if now > self.stopping["deadline"]:
                self.failure = (f"{self.stopping['line']}; the last commit (iteration "
                                f"{self.stopping['commit']}) could not be written: its "
                                f"writer did not answer within {self.stopping['wait']:g} s")
                self.done = True
            return
        if g is not None and g.state == GenState.RUNNING:
            members = self.member_workers(g)
            if g.finished and all(w.wid in g.finished or w.state == WorkerState.GONE
                                  for w in members) \
                    and all(w.state != WorkerState.MEMBER for w in members):
                self.done = True
            return
        if g is not None:
            waiting = [w for w in self.member_workers(g) if w.state == WorkerState.MEMBER
                       and (w.report is None or w.report["gen"] != g.number)]
            if waiting:
                if now - (g.ended_at or now) < self.report_window:
                    return
                for w in waiting:
                    self.lose(w, f"did not report within {self.report_window:g} s after "
                                 f"generation {g.number} ended", now, consequence=True)
        self.form(now)

    def form(self, now: float) -> None:
        g = self.gen
        s = self.settings
        survivors = [w for w in (self.member_workers(g) if g else [])
                     if w.state == WorkerState.MEMBER and not self.delisted(w)]
        for w in (self.member_workers(g) if g else []):
            if w.state == WorkerState.MEMBER and self.delisted(w):
                w.state = WorkerState.GONE
                self.events.left(w.name, f"no longer listed in {self.source_name}", now)
                self.hooks.send(w, "exit", reason="no longer listed")
        seats = [Seat(w.wid, w.slot.host, w.slot.port, w.slot.machine,
                      tuple(w.report["commits"]) if w.report else ()) for w in survivors]
        if g is not None and not seats:
            self.failure = (f"elastic: every worker of generation {g.number} is gone ("
                            + "; ".join(self.events.causes or ["none left"])
                            + f"): nothing of the job's state is left in memory; the newest "
                            f"snapshot on disk: {self.hooks.newest_snapshot()}")
            self.done = True
            return
        try:
            commit = common_commit(seats, self.events.causes) if seats else None
        except CommError as e:
            limit = self.settings.max_failures
            if g is not None and g.from_start and not any(seat.commits for seat in seats) \
                    and (limit == 0 or self.restarts < limit):
                # it failed before any worker held a commit: nothing was trained, so the
                # survivors start again from the job's start (its files are still there), as
                # often as a worker may fail in a row before it is excluded (0: no limit)
                self.restarts += 1
                commit = None
            else:
                self.failure, self.done = str(e), True
                return
        joiners = self.joiners(now)
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
            self.give_up(choice, seats, commit, now)
            return
        self._waiting_since = None
        workers, iter_size = choice
        self.assign(candidates[:workers], commit, iter_size, now)

    def give_up(self, why: str, seats: list[Seat], commit: int | None, now: float) -> None:
        missing = "; ".join(self.events.causes) or "no worker came"
        line = f"elastic: {why} ({missing})"
        if commit is None:
            self.failure = f"{line}; the newest snapshot on disk: {self.hooks.newest_snapshot()}"
            self.done = True
            return
        writer = self.workers[seats[0].wid]
        wait = 2 * self.timeout + 60.0  # a solver is built and the snapshot written
        self.stopping = {"line": line, "writer": writer.wid, "commit": commit,
                         "deadline": now + wait, "wait": wait}
        self.hooks.send(writer, "write", commit=commit)

    def assign(self, chosen: list[Seat], commit: int | None, iter_size: int,
               now: float) -> None:
        g = self.gen
        number = g.number + 1 if g else 1
        entries = table_of(chosen)
        images = len(chosen) * self.facts.batch * iter_size
        if self.first_images is None:
            self.first_images = images
        scale = lr_scale(self.settings.lr, images, self.first_images)
        reached = max([w.report["iter"] for w in self.member_workers(g)
                       if w.report and w.report["gen"] == g.number] or [0]) if g else 0
        batch = (f"global batch {len(chosen)} x {self.facts.batch}"
                 + (f" x iter_size {iter_size}" if iter_size > 1 else "") + f" = {images}"
                 + (f", base_lr x {scale:.4g} (--elastic-lr linear)" if scale != 1 else ""))
        start = commit if commit is not None else 0
        self.gen = Generation(number, chosen, start, batch, reached, now,
                              from_start=commit is None)
        rows = [{"host": e.host, "port": e.port, "machine": e.machine,
                 "local_rank": e.local_rank} for e in entries]
        sources = ["start" if commit is None else "memory" if seat.commits else "peer"
                   for seat in chosen]
        joiners = [r for r, source in enumerate(sources) if source == "peer"]
        for rank, (seat, source) in enumerate(zip(chosen, sources)):
            w = self.workers[seat.wid]
            if w.state == WorkerState.IDLE and number > 1:
                self.events.came(f"worker at {w.slot.host}:{w.slot.port} ({w.slot.where})",
                                 now)
            w.state, w.report, w.rank = WorkerState.MEMBER, None, rank
            self.admission.joined(w.slot.key)
            self.hooks.send(w, "assign", gen=number, rank=rank, hosts=rows, commit=start,
                            source=source, joiners=joiners, iter_size=iter_size,
                            lr_scale=scale, commit_every=self.settings.commit_every)
