"""`--timeline trace.json`: Chrome trace events of a run, viewable in Perfetto (ui.perfetto.dev)
or chrome://tracing.

Each process records complete events ("X": name, category, start, duration) per thread:
every layer's forward and backward and the wait before a forward on the training thread; each
send on the sender thread; the wait for sums or factors, SFB's rebuild and the solver update
on the reducer thread; a shard's additions and the send of each sum on its summing threads
(its receiver thread with --shard-threads 0); and one "iteration" event around each
iteration. Events of one thread nest: a thread records an event when it ends, and only around
work that thread does.

Timestamps are microseconds of the wall clock (time.time_ns), so the parts of the processes of
one machine line up exactly, and those of different machines as well as their clocks agree
(NTP: typically within a millisecond). Each process writes its part beside the output file
(``<out>.parts/``); rank 0 waits a bounded time for the parts of the processes on its machine,
merges them into one file, written atomically, and removes them. A remote rank's part stays in
its own ``<out>.parts/`` folder when the file system is not shared.

With no timeline the recorder is ``NOOP``: the hot paths test one attribute.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


def now_us() -> float:
    return time.time_ns() / 1000.0


class Timeline:
    """The events of one process."""

    active = True

    def __init__(self, out: str | Path, process: str, part: str) -> None:
        self.out = Path(out)
        self.part = part
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0,
             "args": {"name": process}}]
        self._named: set[int] = set()

    def now(self) -> float:
        return now_us()

    def complete(self, name: str, cat: str, start_us: float, args: dict[str, Any] | None = None
                 ) -> None:
        """An event from ``start_us`` (from ``now()``) to now, on the calling thread."""
        end = now_us()
        tid = threading.get_native_id()
        event = {"ph": "X", "name": name, "cat": cat, "pid": self.pid, "tid": tid,
                 "ts": start_us, "dur": max(end - start_us, 0.0)}
        if args:
            event["args"] = args
        with self._lock:
            if tid not in self._named:
                self._named.add(tid)
                self._events.append({"ph": "M", "name": "thread_name", "pid": self.pid,
                                     "tid": tid, "args": {"name": threading.current_thread().name}})
            self._events.append(event)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def save_part(self) -> Path:
        """Write this process's events to ``<out>.parts/<part>.json`` (atomically)."""
        folder = parts_dir(self.out)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.part}.json"
        _write_atomically(path, {"traceEvents": self.events()})
        return path


class _NoTimeline:
    active = False

    def now(self) -> float:
        return 0.0

    def complete(self, name: str, cat: str, start_us: float,
                 args: dict[str, Any] | None = None) -> None:
        pass


NOOP = _NoTimeline()
#: the process's recorder; engine code reads ``timeline.current`` at each event
current: Timeline | _NoTimeline = NOOP


def start(out: str | Path, process: str, part: str) -> Timeline:
    global current
    current = Timeline(out, process, part)
    return current


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def merge(out: str | Path, expected: int, wait_s: float = 10.0) -> int:
    """Merge ``expected`` parts (waiting up to ``wait_s`` for late ones) into ``out``; returns
    how many were merged. The merged file says which parts were missing, if any."""
    out = Path(out)
    folder = parts_dir(out)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(list(folder.glob("*.json"))) < expected:
        time.sleep(0.1)
    parts = sorted(folder.glob("*.json"))
    events: list[dict[str, Any]] = []
    for p in parts:
        events.extend(json.loads(p.read_text())["traceEvents"])
    _write_atomically(out, {"traceEvents": events, "displayTimeUnit": "ms",
                            "metadata": {"parts": [p.stem for p in parts],
                                         "expected_parts": expected,
                                         "clock": "wall clock, microseconds since the epoch"}})
    for p in parts:
        p.unlink()
    try:
        folder.rmdir()
    except OSError:
        pass
    return len(parts)


def _write_atomically(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def check_nesting(events: list[dict[str, Any]]) -> None:
    """Raise ValueError unless each thread's complete events nest (no partial overlaps)."""
    by_thread: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(
                (e["ts"], e["ts"] + e["dur"], e["name"]))
    for key, spans in by_thread.items():
        stack: list[tuple[float, float, str]] = []
        for s in sorted(spans, key=lambda t: (t[0], -t[1])):
            while stack and stack[-1][1] <= s[0] + 1e-3:
                stack.pop()
            if stack and s[1] > stack[-1][1] + 1e-3:
                raise ValueError(f"thread {key}: {s[2]} [{s[0]}, {s[1]}] overlaps "
                                 f"{stack[-1][2]} [{stack[-1][0]}, {stack[-1][1]}]")
            stack.append(s)
