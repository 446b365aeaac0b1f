"""Timing the stages a message passes through the transport (`poseidon bench comm --stages`).

An endpoint with a clock marks, per message round, when a send was called ("call"), its
header serialised ("serialised") and its first piece tagged ("tagged", then handed to
ZeroMQ); and on the receiving side when ZeroMQ handed it over ("received"), when it
verified ("verified"), when it passed its checks ("checked"), when it was handed to its
handler or mailbox ("handed"), and when a waiting thread woke with it ("woken"). The clock is monotonic and
shared by every process of a machine, so two processes' marks can be merged.
"""
from __future__ import annotations

import time


class StageClock:
    """Marks ``(round, stage, ns)``; the receive thread holds its marks until the header
    names the round."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, str, int]] = []
        self._held: list[tuple[str, int]] = []

    def mark(self, rnd: int, stage: str) -> None:
        self.marks.append((rnd, stage, time.perf_counter_ns()))

    def hold(self, stage: str, first: bool = False) -> None:
        """A mark whose round is not known yet; ``first`` forgets what an earlier message
        (one dropped, or a piece) left held."""
        if first:
            self._held.clear()
        self._held.append((stage, time.perf_counter_ns()))

    def release(self, rnd: int) -> None:
        self.marks.extend((rnd, stage, t) for stage, t in self._held)
        self._held.clear()
