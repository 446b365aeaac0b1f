"""What an elastic job says about its membership: one log line per event, and the counters.

A generation is formed after one or more changes (a worker lost, one that left, one that came);
once every worker of the new generation has its state and has met the others, one line says
who left or came and why, the commit the job went on from, the iterations lost, the seconds it
took and the new generation's batch and plan. Back-off and exclusion of a flapping worker are
lines of their own. ``--stats`` gets the counts and every event (``as_dict``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class EventLog:
    say: Callable[[str], None]
    #: the changes since the last generation formed, and when the first was seen
    changes: list[str] = field(default_factory=list)
    since: float | None = None
    counts: dict[str, int] = field(default_factory=lambda: {
        "generations": 0, "joined": 0, "left": 0, "lost": 0, "excluded": 0,
        "iterations_lost": 0})
    recoveries_s: list[float] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    #: the first failure a member of the ending generation reported
    failure: str = ""
    #: how many of the changes are losses that another event caused
    consequences: int = 0
    #: notes that came while a change was pending: said after the line that names the change
    deferred: list[str] = field(default_factory=list)

    def _change(self, kind: str, line: str, now: float) -> None:
        self.counts[kind] += 1
        self.changes.append(line)
        if self.since is None:
            self.since = now

    def lost(self, who: str, why: str, now: float, consequence: bool = False) -> None:
        """``consequence``: lost because the generation had ended and it did not report,
        which some other event caused."""
        if consequence:
            self.consequences += 1
        self._change("lost", f"lost {who}: {why}", now)

    def left(self, who: str, why: str, now: float) -> None:
        self._change("left", f"{who} left ({why})", now)

    def came(self, who: str, now: float) -> None:
        self._change("joined", f"{who} came", now)

    def failed(self, why: str, now: float) -> None:
        """A member failed and reported why (it stays a survivor; no change is counted). A
        loss explains such a failure (the survivors' collectives break when a worker is
        killed, and may report before its exit is seen), so the first reason is named only
        where every change is a consequence: a generation that failed by itself."""
        self.failure = self.failure or f"generation failed: {why}"
        if self.since is None:
            self.since = now

    @property
    def causes(self) -> list[str]:
        """Why the current generation ends: its changes, the failure a member reported
        first where no change but consequences explains it."""
        if self.consequences < len(self.changes) or not self.failure:
            return self.changes
        return [self.failure, *self.changes]

    def note(self, line: str, excluded: bool = False, after_change: bool = False) -> None:
        """A line of its own (a worker backing off, or excluded); ``after_change``: it
        follows a change the next generation's line will name, and is said after that."""
        if excluded:
            self.counts["excluded"] += 1
        self.events.append({"event": line})
        if after_change:
            self.deferred.append(line)
            return
        self.say(f"Elastic: {line}")

    def _formed(self) -> None:
        """A generation formed: what led to it is said; the notes that waited follow."""
        self.changes, self.since, self.failure, self.consequences = [], None, "", 0
        for line in self.deferred:
            self.say(f"Elastic: {line}")
        self.deferred = []

    def generation(self, number: int, workers: int, start: int, reached: int, now: float,
                   batch: str, plan: str) -> None:
        """Generation ``number`` of ``workers`` trains, from ``start`` (the commit); the
        iteration the job had ``reached`` before it."""
        self.counts["generations"] += 1
        lost = max(0, reached - start)
        if number == 1:
            self.say(f"Elastic generation 1: {workers} workers from iteration {start}; {batch}; "
                     f"plan: {plan}")
            self._formed()
            return
        seconds = now - (self.since if self.since is not None else now)
        self.counts["iterations_lost"] += lost
        self.recoveries_s.append(seconds)
        redo = (f"iterations {start}..{reached - 1} done again: {lost} lost" if lost else
                "nothing lost")
        what = "; ".join(self.causes) or "the generation ended"
        line = (f"{what}. Generation {number}: {workers} workers from commit {start} ({redo}), "
                f"in {seconds:.2f} s; {batch}; plan: {plan}")
        self.events.append({"generation": number, "workers": workers, "commit": start,
                            "iterations_lost": lost, "recovery_s": round(seconds, 3),
                            "changes": self.causes})
        self.say(f"Elastic: {line}")
        self._formed()

    def summary(self) -> str:
        """The job's membership in one line, for its end."""
        c = self.counts
        took = (", recoveries took " + ", ".join(f"{s:.1f}" for s in self.recoveries_s) + " s"
                if self.recoveries_s else "")
        return (f"Elastic: the job ends after {c['generations']} generation"
                f"{'' if c['generations'] == 1 else 's'}: {c['lost']} lost, {c['joined']} "
                f"joined, {c['left']} left, {c['excluded']} excluded; {c['iterations_lost']} "
                f"iterations done again{took}")

    def as_dict(self) -> dict[str, Any]:
        return {**self.counts, "recovery_s": [round(s, 3) for s in self.recoveries_s],
                "events": self.events}
