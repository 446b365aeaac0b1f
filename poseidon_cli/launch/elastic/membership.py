"""Forming a generation: which commit it starts from, who is in it, in which rank order.

The commit: every worker keeps its two newest commits. When a worker is lost, the survivors may
hold different newest commits, but never more than one commit apart: a worker takes the commit
of iteration c + K only after it applied iteration c + K - 1's update, which needs every
worker's gradient of that iteration, so every worker had passed iteration c (and committed it)
by then. The newest commit all survivors hold is therefore their smallest newest one, and
every survivor still holds it.

The order: the survivors first, in their old rank order (the new rank 0 is a survivor: it
holds the commit and hands it to the workers that join), then the workers that join, in the
order they came. Machines are numbered by their lowest rank, as in any host table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.comm.errors import CommError
from engine.comm.hosts import HostEntry

from ..rendezvous import table_of_reports


@dataclass(frozen=True)
class Seat:
    """A worker as a generation sees it."""
    wid: int
    host: str
    port: int
    machine: str
    #: the commits it holds (iterations); empty for a worker that joins
    commits: tuple[int, ...] = ()


def common_commit(survivors: Sequence[Seat], changes: Sequence[str] = ()) -> int | None:
    """The newest commit every survivor holds; None when there is none (no survivor).
    ``changes`` (the losses that left these survivors) go into the error: they are its cause."""
    if not survivors:
        return None
    held = set(survivors[0].commits)
    for s in survivors[1:]:
        held &= set(s.commits)
    if not held:
        raise CommError("; ".join([
            "elastic: the survivors hold no commit in common ("
            + "; ".join(f"{s.host}:{s.port} holds {list(s.commits)}" for s in survivors) + ")",
            *changes]))
    return max(held)


def table_of(seats: Sequence[Seat]) -> list[HostEntry]:
    """The host table of a generation whose ranks are ``seats``' order."""
    return table_of_reports([{"rank": r, "host": s.host, "port": s.port, "machine": s.machine,
                              "local_rank": None, "local_size": None}
                             for r, s in enumerate(seats)], "elastic driver")
