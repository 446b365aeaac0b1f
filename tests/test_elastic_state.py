"""The elastic job's state machine alone (poseidon_cli/launch/elastic/generations.py): no
socket, no process; its hooks record what the driver would send and kill."""
from __future__ import annotations

import dataclasses
from typing import Any

from poseidon_cli.launch.elastic.events import EventLog
from poseidon_cli.launch.elastic.generations import (BatchFacts, ElasticState, GenState, Worker,
                                                     WorkerState)
from poseidon_cli.launch.elastic.policy import ElasticSettings
from poseidon_cli.launch.elastic.sources import Slot


class Hooks:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict[str, Any]]] = []
        self.killed: list[int] = []

    def send(self, w: Worker, kind: str, **fields: Any) -> bool:
        self.sent.append((w.wid, kind, fields))
        return True

    def kill(self, w: Worker) -> None:
        self.killed.append(w.wid)

    def launched_here(self, slot: Slot) -> bool:
        return True

    def newest_snapshot(self) -> str:
        return "none"

    def of(self, kind: str) -> list[tuple[int, dict[str, Any]]]:
        return [(wid, f) for wid, k, f in self.sent if k == kind]


def state_of(workers: int, min_workers: int = 2) -> tuple[ElasticState, Hooks, list[Worker]]:
    hooks = Hooks()
    lines: list[str] = []
    s = ElasticState(ElasticSettings(min_workers, None, 5, "none", None, 600.0, 3),
                     BatchFacts(8, 1), 30.0, EventLog(lines.append), hooks, 9000, "hosts.txt")
    s.listed = {("127.0.0.1", 1000 + 2 * i): Slot("127.0.0.1", 1000 + 2 * i, "m", i,
                                                   "hosts.txt:1") for i in range(workers)}
    joined = []
    for i, key in enumerate(s.listed):
        w = s.join(f"w{i}".encode(), {"host": key[0], "port": key[1], "machine": "m",
                                      "pid": 100 + i}, 0.0)
        assert isinstance(w, Worker)
        s.report(w, {"gen": 0, "status": "new", "commits": [], "iter": 0, "reason": ""}, 0.0)
        joined.append(w)
    return s, hooks, joined


def test_the_first_generation_takes_every_listed_worker_in_listing_order():
    s, hooks, ws = state_of(3)
    s.advance(1.0)
    assert s.gen is not None and s.gen.number == 1 and s.gen.state == GenState.RUNNING
    assert [(wid, f["rank"], f["source"]) for wid, f in hooks.of("assign")] == \
        [(0, 0, "start"), (1, 1, "start"), (2, 2, "start")]
    assert all(w.state == WorkerState.MEMBER for w in ws)


def test_a_lost_member_fails_the_generation_and_the_next_goes_on_from_the_common_commit():
    s, hooks, ws = state_of(3)
    s.advance(1.0)
    s.lose(ws[1], "killed by signal 9", 2.0)
    assert s.gen.state == GenState.FAILED and hooks.killed == [1]
    assert sorted(wid for wid, _ in hooks.of("abort")) == [0, 2]
    for w, commits in ((ws[0], [5, 10]), (ws[2], [10])):
        s.report(w, {"gen": 1, "status": "failed", "commits": commits, "iter": 12,
                     "reason": "aborted"}, 3.0)
    s.advance(3.0)
    assert s.gen.number == 2 and s.gen.start == 10 and len(s.gen.seats) == 2
    assert [f["rank"] for _, f in hooks.of("assign")[-2:]] == [0, 1]
    # what the generation's line will say, once its workers have met
    assert s.events.changes == ["lost worker 1 (127.0.0.1:1002): killed by signal 9"]
    assert s.events.causes == s.events.changes


def test_a_loss_seen_after_the_failure_it_caused_is_the_cause_named():
    """kill -9 breaks the survivors' collective; one may report that before the victim's
    exit is seen: the line names the kill, not the broken connection."""
    s, hooks, ws = state_of(3)
    s.advance(1.0)
    s.report(ws[2], {"gen": 1, "status": "failed", "commits": [10], "iter": 12,
                     "reason": "worker 2: gloo: Connection reset by peer"}, 2.0)
    s.lose(ws[1], "killed by signal 9", 2.1)
    assert s.events.causes == ["lost worker 1 (127.0.0.1:1002): killed by signal 9"]


def test_the_first_question_at_a_commit_fixes_the_answer_for_all():
    s, hooks, ws = state_of(2)
    s.advance(1.0)
    late = s.join(b"w9", {"host": "10.0.0.9", "port": 2000, "machine": "n", "pid": 9}, 1.5)
    assert isinstance(late, Worker)
    s.report(late, {"gen": 0, "status": "new", "commits": [], "iter": 0, "reason": ""}, 1.5)
    for w in ws:
        s.ask(w, {"gen": 1, "iter": 5}, 2.0)
    answers = [f["answer"] for _, f in hooks.of("decision")]
    assert answers == ["regroup", "regroup"] and s.gen.state == GenState.ENDING


def test_a_worker_already_in_the_job_is_refused_naming_it():
    s, _, ws = state_of(2)
    again = s.join(b"x", {"host": "127.0.0.1", "port": 1000, "machine": "m", "pid": 7}, 1.0)
    assert again == ("elastic driver at port 9000: a worker at 127.0.0.1:1000 is already in "
                     "this job")


def test_a_first_generation_that_fails_before_any_commit_starts_again_naming_why():
    """A member fails while the others join an engine (a wait bounded by the timeout that
    may begin just after the end): they report late but in the window, hold no commit, and
    the job starts again from its files; the failure is the cause the next line names."""
    s, hooks, ws = state_of(3)
    s.advance(1.0)
    why = "worker 2 (127.0.0.1:1004): gloo: joining gloo failed: Connection reset by peer"
    s.report(ws[2], {"gen": 1, "status": "failed", "commits": [], "iter": 0, "reason": why},
             2.0)
    assert s.gen.state == GenState.FAILED
    s.advance(2.0 + 31.0)  # past the timeout, within the window: still waiting
    assert s.gen.number == 1 and all(w.state == WorkerState.MEMBER for w in ws)
    for w in ws[:2]:
        s.report(w, {"gen": 1, "status": "failed", "commits": [], "iter": 0,
                     "reason": "aborted"}, 34.0)
    s.advance(34.0)
    assert s.gen.number == 2 and s.gen.from_start and len(s.gen.seats) == 3
    assert [f["source"] for _, f in hooks.of("assign")[-3:]] == ["start"] * 3
    assert s.events.causes == [f"generation failed: {why}"]


def test_a_member_that_beats_but_never_reports_is_lost_after_the_window():
    s, hooks, ws = state_of(3)
    s.advance(1.0)
    s.report(ws[2], {"gen": 1, "status": "failed", "commits": [5], "iter": 7,
                     "reason": "worker 2: boom"}, 2.0)
    for w in ws[:1]:
        s.report(w, {"gen": 1, "status": "failed", "commits": [5], "iter": 7,
                     "reason": "aborted"}, 3.0)
    s.advance(2.0 + 2 * 30.0 - 0.5)
    assert s.gen.number == 1 and ws[1].state == WorkerState.MEMBER
    s.advance(2.0 + 2 * 30.0 + 0.5)
    assert ws[1].state == WorkerState.GONE and s.gen.number == 2 and s.gen.start == 5
    assert s.events.causes == ["generation failed: worker 2: boom",
                               "lost worker 1 (127.0.0.1:1002): did not report within 60 s "
                               "after generation 1 ended"]


def test_a_failure_after_a_commit_goes_on_from_it_not_from_the_start():
    s, hooks, ws = state_of(2)
    s.advance(1.0)
    s.report(ws[0], {"gen": 1, "status": "failed", "commits": [], "iter": 0,
                     "reason": "worker 0: boom"}, 2.0)
    s.report(ws[1], {"gen": 1, "status": "failed", "commits": [0], "iter": 3,
                     "reason": "aborted"}, 2.0)
    s.advance(3.0)
    assert s.done and "no commit in common" in s.failure and "worker 0: boom" in s.failure


def fail_as_they_meet(s: ElasticState, ws: list[Worker], now: float, why: str) -> None:
    """Every member of the current generation reports it failed before any commit."""
    for w in ws:
        s.report(w, {"gen": s.gen.number, "status": "failed", "commits": [], "iter": 0,
                     "reason": why}, now)
    s.advance(now)


def test_starting_again_from_the_start_is_bounded_by_max_failures():
    """A job whose workers fail every time they meet starts again at most --max-failures (3)
    times, then stops naming the failure."""
    s, hooks, ws = state_of(2)
    s.advance(1.0)
    for attempt in range(4):
        number = s.gen.number
        fail_as_they_meet(s, ws, 2.0 + attempt, "worker 0: gloo: joining gloo failed: boom")
        if attempt < 3:
            assert s.gen.number == number + 1 and s.gen.from_start and not s.done
    assert s.done and s.restarts == 3
    assert "no commit in common" in s.failure and "joining gloo failed: boom" in s.failure


def test_max_failures_0_starts_again_without_limit():
    s, hooks, ws = state_of(2)
    s.settings = dataclasses.replace(s.settings, max_failures=0)
    s.advance(1.0)
    for attempt in range(5):
        number = s.gen.number
        fail_as_they_meet(s, ws, 2.0 + attempt, "boom")
        assert s.gen.number == number + 1 and not s.done
