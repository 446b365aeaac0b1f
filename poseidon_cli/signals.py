"""Signals as Caffe's `caffe train` reads them: each asks the solver for an action.

Caffe's -sigint_effect (default stop) and -sighup_effect (default snapshot); SIGTERM, what SLURM
and Kubernetes send before they kill, follows -sigint_effect. The action happens at the next
iteration boundary (``Solver.request``); on a distributed run the request rides on the next
round's messages, so every worker acts at the same iteration. A second stop signal
interrupts at once.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

#: Caffe's defaults (-sigint_effect stop, -sighup_effect snapshot), and SIGTERM as SIGINT
DEFAULT_EFFECTS = {"SIGINT": "stop", "SIGHUP": "snapshot", "SIGTERM": "stop"}


@contextlib.contextmanager
def signal_requests(solver: Any, effects: dict[str, str] | None = None) -> Iterator[None]:
    """While inside, each signal of ``effects`` ('stop', 'snapshot' or 'none') asks ``solver``
    for its action; the previous handlers come back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    effects = {**DEFAULT_EFFECTS, **(effects or {})}
    stops: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        action = effects[signal.Signals(signum).name]
        if action == "none":
            return
        if action == "stop":
            if stops:
                raise KeyboardInterrupt  # asked twice: stop now
            stops.append(signum)
        solver.request(action)

    previous = {}
    for name in effects:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
