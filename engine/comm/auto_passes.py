"""auto's whole-plan passes: after each layer took its cheapest scheme (engine/comm/planner.py),
what per-layer prices cannot see.

- a blocking engine (MPI) carries every layer or none (``spinning_engine_alone``);
- consecutive dense layers share one scheme where a bucket of it costs less than the mix
  (``unify_runs``), and a small layer rides a neighbour's bucket where that halves its time
  (``join_buckets``): fusion priced in.

A pass sees a layer's choice as the planner's ``LayerPlan`` holds it: its facts (``info``),
its scheme and reason, and every scheme's timing for it.
"""
from __future__ import annotations

from typing import Any, Sequence

from .schemes import SCHEMES


def _spins(scheme: str) -> bool:
    """An engine whose calls block, busy-polling until the sum is complete (MPI)."""
    cls = SCHEMES[scheme]
    return cls.engine and cls.backend.blocking  # type: ignore[attr-defined]


def spinning_engine_alone(plans: Sequence[Any], fixed: set[str]) -> None:
    """A blocking engine (MPI) carries every layer of the plan or none. Its calls busy-poll
    until the sum is complete, and beside the other schemes' traffic its sums were slow:
    through 1 Gbit/s (4 workers on 2 cores, the bench's FC-heavy net) one 800-byte MPI
    allreduce a round beside SFB's factors took PS + SFB from 2.21x DDP to 0.93x (Gloo's, which
    sleeps while it waits, 1.84x), and auto's per-layer mix of MPI and SFB ran at 0.46-0.61 of
    PS + SFB's speed in the same runs. The per-layer prices, each engine probed alone, cannot
    see that, so auto compares whole plans: each blocking engine on every layer, against the
    cheapest plan without them (a tie goes to the plan without)."""
    spinning = sorted({p.scheme for p in plans if _spins(p.scheme)})
    if not spinning:
        return
    free = [p for p in plans if p.info.name not in fixed]
    best: dict[str, tuple[float, list[str]]] = {}
    if all(any(not _spins(s) for s in p.timings) for p in free):
        without = [min((s for s in p.timings if not _spins(s)),
                       key=lambda s: p.timings[s].total_s) for p in free]
        best[""] = (sum(p.timings[s].total_s for p, s in zip(free, without)), without)
    kept = {p.scheme for p in plans if p.info.name in fixed}
    for engine in spinning:
        if all(engine in p.timings for p in free) and kept <= {engine}:
            best[engine] = (sum(p.timings[engine].total_s for p in free), [engine] * len(free))
    if not best:
        return
    choice = min(best, key=lambda e: (best[e][0], e != "", e))
    for p, s in zip(free, best[choice][1]):
        if p.scheme != s:
            p.scheme = s
            p.reason = (f"fastest without {', '.join(spinning)} (it busy-waits beside other "
                        "traffic)" if choice == "" else
                        f"{choice} on every layer (it busy-waits beside other traffic)")


def unify_runs(plans: Sequence[Any], marginal: dict[tuple[int, str], float],
               fixed: set[str]) -> None:
    """Consecutive layers (in release order) that chose dense schemes travel in buckets, and
    each bucket pays its latency once: where one of their schemes for the whole run costs no
    more than the mix (its first layer's time plus the others' latency-free times), all take it.
    Two small layers a hair apart in price then share one bucket instead of paying two rounds
    (measured: the conv net on 1 Gbit/s links planned PS + ring, 0.81x DDP; one scheme
    0.96-1.01x)."""
    runs: list[list[Any]] = [[]]
    for p in sorted(plans, key=lambda p: -p.info.layer):
        if SCHEMES[p.scheme].dense and p.info.name not in fixed:
            runs[-1].append(p)
        elif runs[-1]:
            runs.append([])

    def cost(run: list[Any], schemes: list[str]) -> float:
        total, prev = 0.0, None
        for p, s in zip(run, schemes):
            total += marginal[(p.info.layer, s)] if s == prev else p.timings[s].total_s
            prev = s
        return total

    for run in runs:
        present = sorted({p.scheme for p in run})
        if len(present) < 2:
            continue
        options = [d for d in present if all((p.info.layer, d) in marginal for p in run)]
        best = min(options, key=lambda d: cost(run, [d] * len(run)), default=None)
        if best is not None and cost(run, [best] * len(run)) <= cost(run, [p.scheme for p in run]):
            for p in run:
                if p.scheme != best:
                    p.scheme, p.reason = best, f"one {best} bucket with its neighbours"


#: a layer joins a neighbour's bucket only where that at least halves its time: riding a bucket
#: is not free (the bucket's first layer waits for the others), and a plan must not flip
#: between two runs of a job on the noise of the link probe (a resumed run must follow the
#: same sums, bit for bit)
JOIN_GAIN = 0.5


def join_buckets(plans: Sequence[Any], marginal: dict[tuple[int, str], float],
                 fixed: set[str]) -> None:
    """Fusion included: a layer beside a layer of a dense scheme can ride in its bucket for
    that scheme's time without latency; where that is well below the layer's own best time, it
    joins (a small layer next to a large one: one message instead of two). Swept in release
    order, then back, so that the first layer released can join the bucket after it."""
    order = sorted(plans, key=lambda p: -p.info.layer)
    for sweep in (order, order[::-1]):
        for prev, p in zip(sweep, sweep[1:]):
            d = prev.scheme
            joined = marginal.get((p.info.layer, d))
            if p.info.name in fixed or d == p.scheme or joined is None:
                continue
            if joined < JOIN_GAIN * p.timings[p.scheme].total_s:
                p.scheme, p.reason = d, f"fastest in {prev.info.name}'s bucket"
