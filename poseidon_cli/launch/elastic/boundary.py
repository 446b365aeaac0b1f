"""A generation's iteration boundaries: commits, the driver's answer, leaving.

``ElasticSync`` is the GradientSync the Solver drives in an elastic run: the generation's
Syncer, plus what happens at each iteration boundary (``take_request``, which the Solver calls
at every boundary, where every worker sees the same agreed signals):

* every ``commit_every`` iterations each worker commits (the Solver's state copied in memory,
  after every update in flight is applied) and asks the driver whether the membership changes
  there; the driver gives every worker of the generation the same answer. On "regroup" every
  worker ends the generation at that boundary: nothing is rolled back.
* a worker told to leave (SIGTERM: its manager's notice) raises the LEAVE bit in its next
  round's messages; once all see it, all commit at that same boundary and end the
  generation, so the next starts from there and nothing is rolled back.

A worker keeps its two newest commits (``Commits``): when a worker is lost, the survivors go on
from the newest commit they all hold, which is at most one commit back (membership.py).
"""
from __future__ import annotations

from typing import Any

from engine.snapshots import Commit

from .protocol import COMMITS_HELD


class Commits:
    """The newest commits this worker holds, by iteration, all of one timeline (from the
    commit its generation started from on)."""

    def __init__(self) -> None:
        self._held: dict[int, Commit] = {}

    def add(self, commit: Commit) -> None:
        for it in [it for it, c in self._held.items() if c is commit]:
            del self._held[it]  # a spare overwritten: it holds another iteration now
        self._held[commit.iter] = commit
        for it in sorted(self._held)[:-COMMITS_HELD]:
            del self._held[it]

    def restart(self, commit: Commit) -> None:
        """A generation starts from ``commit``: what this worker held beyond it was trained
        in a generation that failed, and must never be gone on from."""
        self._held = {commit.iter: commit}

    def spare(self) -> Commit | None:
        """The commit the next one may overwrite: the older of two. When a worker commits
        c + K, every worker has committed c (membership.py), so nobody goes back before c."""
        return self._held[min(self._held)] if len(self._held) == COMMITS_HELD else None

    def get(self, iteration: int) -> Commit:
        return self._held[iteration]

    def iterations(self) -> list[int]:
        return sorted(self._held)

    def newest(self) -> Commit | None:
        return self._held[max(self._held)] if self._held else None


class ElasticSync:
    """The Syncer of one generation with the elastic boundary (see the module docstring).
    ``ended``: why the generation ended here ('regroup' or 'leave'), once it has."""

    def __init__(self, inner: Any, solver: Any, commits: Commits, client: Any, gen: int,
                 start: int, commit_every: int) -> None:
        self.inner, self.solver, self.commits, self.client = inner, solver, commits, client
        self.gen, self.start, self.commit_every = gen, start, commit_every
        self.ended: str | None = None
        self._boundary = start  # the generation starts with its commit in hand

    # the Syncer's own work
    def release(self, layer: int) -> None:
        self.inner.release(layer)

    def wait(self, layer: int) -> None:
        self.inner.wait(layer)

    def wait_all(self) -> None:
        self.inner.wait_all()

    def request(self, action: str) -> None:
        self.inner.request(action)

    def state(self) -> bytes:
        return self.inner.state()

    def close(self) -> None:
        self.inner.close()

    @property
    def momentum_layers(self) -> list[int]:
        return self.inner.momentum_layers

    def iterations_done(self) -> int:
        """The iteration this worker reached: every update before it applied. A worker whose
        generation fails while iteration i's updates are in flight has its counter at i + 1
        but completed only i (a lost peer may have sent the update to it and not to others)."""
        return self.start + self.inner.rounds_applied()

    def take_request(self) -> str | None:
        """The Solver's action at this boundary: 'stop' (the job's), 'end' (the generation
        ends here: a regroup or a leave), 'snapshot', or None."""
        agreed = self.inner.take_agreed()
        if "stop" in agreed:
            return "stop"
        snapshot = "snapshot" if "snapshot" in agreed else None
        it = self.solver.iter
        if it == self._boundary or it >= self.solver.param.max_iter:
            return snapshot  # asked again while testing; or the job is done here anyway
        self._boundary = it
        leave = "leave" in agreed
        due = it % self.commit_every == 0
        if not (leave or due):
            return snapshot
        self.commits.add(self.solver.commit(into=self.commits.spare()))
        if leave:
            self.ended = "leave"
        elif self.client.ask(self.gen, it) == "regroup":
            self.ended = "regroup"
        if self.ended is None:
            return snapshot
        if snapshot:
            self.solver.snapshot()
        return "end"
