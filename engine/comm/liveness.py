"""Liveness: who has been heard from and when, heartbeats, and the silent peer named.

Every message a process receives (heartbeats included) marks its sender as heard; a BYE marks
it gone (it will say nothing more, and that is no failure). The heartbeat thread sends each
peer a heartbeat every ``interval`` and declares the first peer silent for ``timeout`` lost;
a peer never heard from at all has the start-up window (``startup``: machines started by
hand take their time) before it did not come to the start-up barrier. The transport
(engine/comm/transport.py) sends the heartbeats and turns a loss into a fatal error.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from .wire import PeerId


class Liveness:
    """The peers of one process, when each was last heard, and which said BYE."""

    def __init__(self, peers: Iterable[PeerId], timeout: float,
                 name_of: Callable[[PeerId], str], startup: float | None = None) -> None:
        self.peers = list(peers)
        self.timeout = float(timeout)
        # the user's window as given, even below --timeout: a quick check that machines came
        self.startup = float(startup if startup is not None else timeout)
        self.name_of = name_of
        self._lock = threading.Lock()
        start = time.monotonic()
        self._last_seen: dict[PeerId, float] = {p: start for p in self.peers}
        self._heard: set[PeerId] = set()
        self._gone: set[PeerId] = set()

    @property
    def interval(self) -> float:
        """Seconds between heartbeats: several per timeout, at most one a second."""
        return max(0.05, min(1.0, self.timeout / 5))

    def heard(self, peer: PeerId) -> None:
        with self._lock:
            self._last_seen[peer] = time.monotonic()
            self._heard.add(peer)

    def said_bye(self, peer: PeerId) -> None:
        with self._lock:
            self._gone.add(peer)

    def gone(self, peer: PeerId) -> bool:
        with self._lock:
            return peer in self._gone

    def all_gone(self, role: str) -> bool:
        with self._lock:
            return all(p in self._gone for p in self.peers if p[0] == role)

    def present(self) -> list[PeerId]:
        """The peers that did not say BYE."""
        with self._lock:
            return [p for p in self.peers if p not in self._gone]

    def silent(self, seconds: float) -> list[PeerId]:
        """Peers (not gone) from which nothing was heard for ``seconds``."""
        now = time.monotonic()
        with self._lock:
            return [p for p in self.peers
                    if p not in self._gone and now - self._last_seen[p] > seconds]

    def overdue(self) -> list[PeerId]:
        """Peers silent beyond their bound: ``timeout`` once heard, ``startup`` before."""
        now = time.monotonic()
        with self._lock:
            return [p for p in self.peers if p not in self._gone and now - self._last_seen[p]
                    > (self.timeout if p in self._heard else self.startup)]

    def never_heard(self, peers: Iterable[PeerId]) -> list[PeerId]:
        """Those of ``peers`` from which nothing has come yet."""
        with self._lock:
            return [p for p in peers if p not in self._heard]

    def lost(self, peer: PeerId) -> str:
        """Why ``peer`` counts as lost, in one line."""
        with self._lock:
            heard = peer in self._heard
        if heard:
            return (f"lost {self.name_of(peer)}: nothing heard for {self.timeout:g} s "
                    "(the process died or hangs)")
        return (f"{self.name_of(peer)} did not come within {self.startup:g} s (start-up "
                "barrier; --startup-timeout)")

    def run(self, stop: threading.Event, beat: Callable[[PeerId], None],
            on_lost: Callable[[str], None]) -> None:
        """The heartbeat thread: ``beat(peer)`` to each peer present every ``interval`` until
        ``stop``; ``on_lost(why)`` for the first peer silent for the timeout."""
        while not stop.wait(self.interval):
            for p in self.present():
                beat(p)
            late = self.overdue()
            if late:
                on_lost(self.lost(late[0]))
                return
