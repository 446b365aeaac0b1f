"""The elastic driver's rules: who may join, and what the batch and learning rate become.

Flapping: a worker that fails before the job could commit with it (it joined, and died again
before the generation's first commit) made the job roll back for nothing. Each failure makes
its slot wait before it may join again, twice as long after each failure in a row without
progress, and after ``max_failures`` such failures it is excluded for the rest of the job. A
failure after the job committed with the worker starts the count again at one.

The batch: every worker keeps its net's batch B, so P workers train with global batch P·B
(iter_size i: P·B·i). With ``--global-batch G`` the global batch stays G: a generation of P
workers runs iter_size G / (P·B), and a membership where that is not whole is refused, naming
why. ``--elastic-lr linear`` scales the learning rate with the global batch against the first
generation's (Goyal et al.'s linear scaling rule); ``none`` keeps the solver's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


@dataclass(frozen=True)
class ElasticSettings:
    """The driver's rules, as --elastic's options set them (start.py declares them)."""
    min_workers: int
    max_workers: int | None
    commit_every: int
    lr: str
    global_batch: int | None
    backoff_s: float
    max_failures: int


@dataclass
class _Record:
    failures: int = 0  # in a row, without progress in between
    progressed: bool = False
    until: float = 0.0
    excluded: bool = False


@dataclass
class Admission:
    """Back-off and exclusion per slot (a worker's host and port)."""
    backoff_s: float
    max_failures: int
    _records: dict[Hashable, _Record] = field(default_factory=dict)

    def joined(self, key: Hashable) -> None:
        """``key``'s worker is in a generation again: it has made no progress there yet."""
        self._records.setdefault(key, _Record()).progressed = False

    def progressed(self, key: Hashable) -> None:
        """The job committed with ``key``'s worker."""
        self._records.setdefault(key, _Record()).progressed = True

    def failed(self, key: Hashable, now: float) -> tuple[int, float | None]:
        """``key``'s worker failed: (its failures in a row, seconds it must wait before it may
        join again; None: excluded)."""
        r = self._records.setdefault(key, _Record())
        r.failures = 1 if r.progressed else r.failures + 1
        r.progressed = False
        if r.failures >= self.max_failures and self.max_failures > 0:
            r.excluded = True
            return r.failures, None
        wait = self.backoff_s * 2 ** (r.failures - 1)
        r.until = now + wait
        return r.failures, wait

    def left(self, key: Hashable, now: float) -> float:
        """``key``'s worker left (its manager's notice): it is not a failure, but its machine
        is going; it is not started again for ``backoff_s``."""
        r = self._records.setdefault(key, _Record())
        r.until = now + self.backoff_s
        return self.backoff_s

    def excluded(self, key: Hashable) -> bool:
        r = self._records.get(key)
        return r is not None and r.excluded

    def eligible(self, key: Hashable, now: float) -> bool:
        r = self._records.get(key)
        return r is None or (not r.excluded and now >= r.until)


def iter_size_for(workers: int, batch: int, global_batch: int | None,
                  solver_iter_size: int) -> int | str:
    """The iter_size a generation of ``workers`` runs, or why that membership is refused."""
    if global_batch is None:
        return solver_iter_size
    if global_batch % (workers * batch):
        fits = [p for p in range(1, global_batch // batch + 1) if global_batch % (p * batch) == 0]
        return (f"--global-batch {global_batch} with a batch of {batch} per worker needs "
                f"{global_batch} / ({workers} x {batch}) to be whole (it is for "
                f"{', '.join(map(str, fits[:12]))} workers)")
    return global_batch // (workers * batch)


def usable(available: int, min_workers: int, batch: int, global_batch: int | None,
           solver_iter_size: int) -> tuple[int, int] | str:
    """(workers, iter_size) of the largest membership of at most ``available`` workers and at
    least ``min_workers`` that the batch rule allows; or why there is none."""
    why = (f"{available} worker{'' if available == 1 else 's'} can train, fewer than "
           f"--min-workers {min_workers}")
    for p in range(available, min_workers - 1, -1):
        size = iter_size_for(p, batch, global_batch, solver_iter_size)
        if isinstance(size, int):
            return p, size
        why = size
    return why


def lr_scale(mode: str, images: int, first_images: int) -> float:
    """The factor on base_lr for a generation training ``images`` per iteration, when the first
    trained ``first_images`` (linear: their ratio; none: 1)."""
    return images / first_images if mode == "linear" else 1.0
