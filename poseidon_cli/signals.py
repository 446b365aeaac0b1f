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
def signal_requests(solver: Any, effects: dict[str, str] | None = None, *,
                    then_ignore: bool = False) -> Iterator[None]:
    """While inside, each signal of ``effects`` ('stop', 'snapshot' or 'none') asks ``solver``
    for its action; the previous handlers come back on the way out. ``then_ignore``: after a
    run that ended well they are ignored instead, as a launcher's worker wants: its run is
    over and the process ends by itself, and the launcher may pass on the manager's stop
    late, after the stop every worker agreed on (a worker killed by it then fails a job
    that stopped as asked). A run that fails restores them all the same."""
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
    ended_well = False
    try:
        yield
        ended_well = True
    finally:
        for sig, h in previous.items():
            signal.signal(sig, signal.SIG_IGN if ended_well and then_ignore else h)
