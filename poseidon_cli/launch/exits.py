"""A process's forced exit: after a fatal communication error, it ends within a grace period
even if its training thread is busy in a long compute and cannot take the error.

The endpoint (engine/comm/transport.py) calls ``arm`` when its communication fails and
``disarm`` when the training thread has the error in hand and will exit by itself; the
engine never ends a process. A worker and its PS shard use it; an elastic worker does not (a
failed generation must not end the process: the next generation follows).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any

#: after a fatal error, a process still busy computing is stopped this many seconds later
EXIT_GRACE_S = 2.0


class ForcedExit:
    """Ends the process ``grace`` seconds after a fatal error unless disarmed first."""

    def __init__(self, grace: float = EXIT_GRACE_S) -> None:
        self.grace = grace
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._disarmed = False

    def attach(self, ep: Any) -> "ForcedExit":
        """Arm on ``ep``'s fatal error, disarm when its owner takes the error."""
        ep.on_fatal.append(self.arm)
        ep.on_disarm.append(self.disarm)
        return self

    def arm(self, reason: str) -> None:
        with self._lock:
            if self._timer is None and not self._disarmed:
                self._timer = threading.Timer(self.grace, _hard_exit, (reason,))
                self._timer.daemon = True
                self._timer.start()

    def disarm(self) -> None:
        with self._lock:
            self._disarmed = True
            if self._timer is not None:
                self._timer.cancel()


def _hard_exit(reason: str) -> None:
    sys.stderr.write(f"poseidon: error: {reason}\n")
    sys.stderr.flush()
    os._exit(1)
