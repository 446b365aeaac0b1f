"""Child processes' error lines, reported once by their parent.

A failure reaches every process of a run (ABORT carries the reason), so every worker and shard
would print the same `poseidon: error:` line, and a launcher would add its own "worker 1 exited
with code 1" on top. The parent reads each child's stderr instead: other lines pass through at
once, error lines are held back, and the parent reports the first of them as the run's error.
A shard's error also reaches its worker this way while the run goes on (``on_error``), so a
shard that cannot bind its port stops the run at once instead of after the whole timeout.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from typing import Callable

PREFIX = "poseidon: error: "
#: rank 0's log line for each snapshot it writes (engine/solver.py)
SNAPSHOT_LINE = re.compile(r"Snapshotting solver state to .* file (\S+)\s*$")


class ErrorRelay:
    """Reads the stderr of the processes handed to ``watch`` (started with stderr=PIPE)."""

    def __init__(self, on_error: Callable[[str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._errors: list[str] = []
        self._readers: dict[int, threading.Thread] = {}
        self.on_error = on_error
        #: the newest snapshot a child said it wrote (a hint for a run that fails later)
        self.last_snapshot: str | None = None

    def watch(self, proc: subprocess.Popen) -> None:
        t = threading.Thread(target=self._read, args=(proc,), name=f"relay-{proc.pid}",
                             daemon=True)
        self._readers[proc.pid] = t
        t.start()

    def first_error(self, proc: subprocess.Popen | None = None, wait_s: float = 2.0) -> str | None:
        """The first error line any child printed (without the prefix); waits up to ``wait_s``
        for ``proc``'s stderr to be read to its end, since it may just have exited."""
        if proc is not None and proc.pid in self._readers:
            self._readers[proc.pid].join(wait_s)
        with self._lock:
            return self._errors[0] if self._errors else None

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace")
            if line.startswith(PREFIX):
                reason = line[len(PREFIX):].strip()
                with self._lock:
                    if reason not in self._errors:
                        self._errors.append(reason)
                if self.on_error is not None:
                    self.on_error(reason)
                continue
            if (m := SNAPSHOT_LINE.search(line)) is not None:
                self.last_snapshot = m.group(1)
            sys.stderr.write(line)
            sys.stderr.flush()
        proc.stderr.close()
