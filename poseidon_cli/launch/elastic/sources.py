"""Where an elastic job's workers are listed, read again while it runs.

A hosts file (re-read when it changes), a discovery command (run every few seconds; it prints
the hosts it sees now, in the hosts-file format, as Horovod's --host-discovery-script), or a
fixed list (-n N). Each gives the *slots* the job may use now: one worker each, at an address
and port, on a machine. A listing that cannot be read (a file caught half-written, a command
that fails) is named once in the log and the previous listing stays.
"""
from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from engine.comm.hosts import HostEntry, HostsError

from ..hostfile import check_resolvable, parse_hosts_text

#: where a worker that joined with the driver's address was "listed"
BY_HAND = "joined by hand"
#: a discovery command that runs longer than this is stopped and named
DISCOVERY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Slot:
    """One worker a listing asks for."""
    host: str
    port: int
    #: what tells machines apart: the listing's line (several lines may name one address: an
    #: emulated cluster), or the machine a worker that joined by hand reports
    machine: str
    #: the worker's index among its machine's (--gpus pins local worker i to the i-th GPU)
    local: int
    where: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.port)



def slots_of(entries: Sequence[HostEntry]) -> list[Slot]:
    """A host table's workers as slots; the workers of one line are one machine."""
    return [Slot(e.host, e.port, f"{e.host}:{e.port - 2 * e.local_rank}", e.local_rank,
                 e.where) for e in entries]


def parse_listing(text: str, name: str) -> list[Slot]:
    """A listing in the hosts-file format (HostsError naming ``name`` and the line)."""
    if not text.strip():
        return []  # a discovery command that sees no host now
    entries = parse_hosts_text(text, name)
    check_resolvable(entries)
    return slots_of(entries)


class Fixed:
    """-n N, or no listing at all (workers join by hand): what it says, once."""

    def __init__(self, slots: list[Slot], name: str) -> None:
        self.name = name
        self._slots: list[Slot] | None = slots

    def poll(self, warn: Callable[[str], None]) -> list[Slot] | None:
        slots, self._slots = self._slots, None
        return slots


class HostsFile:
    """A hosts file, read again whenever its modification time or size changes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.name = str(path)
        self._seen: tuple[int, int] | None = None

    def poll(self, warn: Callable[[str], None]) -> list[Slot] | None:
        try:
            st = self.path.stat()
        except OSError as e:
            stamp = (-1, -1)
            if stamp != self._seen:
                self._seen = stamp
                warn(f"hosts file {self.path}: {e.strerror}: keeping the workers listed before")
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            return parse_listing(self.path.read_text(), self.name)
        except (HostsError, OSError) as e:
            warn(f"{e}: keeping the workers listed before")
            return None


class Discovery:
    """A command printing the hosts it sees now, run every ``interval`` seconds on a thread of
    its own (a slow cloud API must not hold up the driver)."""

    def __init__(self, command: str, interval: float) -> None:
        self.command = command
        self.name = f"--host-discovery {command!r}"
        self.interval = interval
        self._lock = threading.Lock()
        self._result: tuple[list[Slot] | None, str | None] | None = None
        self._last: list[Slot] | None = None
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="poseidon-discovery",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            result: tuple[list[Slot] | None, str | None]
            try:
                done = subprocess.run(["sh", "-c", self.command], capture_output=True,
                                      text=True, timeout=DISCOVERY_TIMEOUT_S,
                                      env={**os.environ})
                if done.returncode != 0:
                    tail = done.stderr.strip().splitlines()[-1:] or [""]
                    result = (None, f"{self.name} exited with code {done.returncode}"
                                    f"{': ' + tail[0][:200] if tail[0] else ''}")
                else:
                    result = (parse_listing(done.stdout, self.name), None)
            except subprocess.TimeoutExpired:
                result = (None, f"{self.name} ran longer than {DISCOVERY_TIMEOUT_S:g} s")
            except (HostsError, OSError) as e:
                result = (None, str(e))
            with self._lock:
                self._result = result
            if self._stop.wait(self.interval):
                return

    def poll(self, warn: Callable[[str], None]) -> list[Slot] | None:
        with self._lock:
            result, self._result = self._result, None
        if result is None:
            return None
        slots, error = result
        if error is not None:
            if error != self._last_error:  # said once, not every few seconds
                warn(f"{error}: keeping the workers listed before")
            self._last_error = error
            return None
        self._last_error = None
        if slots == self._last:
            return None
        self._last = slots
        return slots

    def close(self) -> None:
        self._stop.set()
