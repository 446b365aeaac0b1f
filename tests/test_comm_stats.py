"""The communication counters over a long run: each round's overlap folded into totals once the
round is complete, so a run's millionth display costs what its first did."""
from __future__ import annotations

import random

import pytest

from engine.comm.stats import LOG_BATCH, CommStats, _overlap


def _rounds(n: int, layers: int = 3, seed: int = 0) -> list[tuple[int, int, float, float]]:
    """(layer, round, released, applied): backward releases the top layer first; each sum
    ends a while later, some after the next release (overlapping) and some after backward."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for rnd in range(n):
        for layer in reversed(range(layers)):
            t += rng.uniform(0.1, 1.0)
            out.append((layer, rnd, t, t + rng.uniform(0.05, 2.0)))
        t += rng.uniform(0.5, 1.5)  # the forward
    return out


def _expected(events: list[tuple[int, int, float, float]]) -> tuple[int, float, float]:
    by_round: dict[int, list[tuple[int, float, float]]] = {}
    for layer, rnd, a, b in events:
        by_round.setdefault(rnd, []).append((layer, a, b))
    comm = hidden = 0.0
    for ivs in by_round.values():
        c, h = _overlap(ivs)
        comm, hidden = comm + c, hidden + h
    return len(by_round), comm, hidden


def test_a_long_runs_counters_hold_a_few_rounds_and_sum_every_round() -> None:
    events = _rounds(3000)
    stats = CommStats()
    kept = logged = 0
    for layer, rnd, a, b in events:
        stats.add_round(layer, rnd, a, b)
        kept, logged = max(kept, len(stats._intervals)), max(logged, len(stats._log))
    rounds, comm, hidden = _expected(events)
    s = stats.summary()
    # the rounds not yet known complete and one batch of rounds logged, not the run's 3,000
    assert kept <= 4 and logged < LOG_BATCH
    assert s["iterations"] == rounds == 3000
    assert s["comm_s_per_iter"] == pytest.approx(comm / rounds, rel=1e-12)
    assert s["hidden_fraction"] == pytest.approx(hidden / comm, rel=1e-12)
    assert 0.0 < s["hidden_fraction"] < 1.0  # the set-up overlaps backward, not wholly


def test_a_round_reported_late_is_counted_once() -> None:
    """A layer's round may be reported after its next ones (the applying thread is late): its
    interval still counts, and no iteration is counted twice."""
    events = _rounds(50)
    late = [e for e in events if e[1] == 10 and e[0] == 0]
    stats = CommStats()
    for e in events:
        if e not in late:
            stats.add_round(e[0], e[1], e[2], e[3])
    for layer, rnd, a, b in late:
        stats.add_round(layer, rnd, a, b)
    s = stats.summary()
    assert s["iterations"] == 50
    assert s["comm_s_per_iter"] * 50 >= _expected([e for e in events if e not in late])[1]


def test_an_engines_bytes_are_counted_from_its_rounds_beside_the_wires_messages() -> None:
    """A collective engine says once what its allreduce moves a round; every round it
    completes counts those bytes and one message each way, and a layer's own messages on
    Poseidon's wire are added beside them."""
    stats = CommStats()
    stats.count_allreduce(4, "mpi", 3000)
    stats.add_bytes(1, "ps", True, 10, True)
    for rnd in range(5):
        stats.add_round(4, rnd, float(rnd), rnd + 0.5)
        stats.add_round(1, rnd, float(rnd), rnd + 0.5)
    rows = {row["scheme"]: row for row in stats.summary()["layers"]}
    assert rows["mpi"]["rounds"] == 5
    for key in ("net_sent_per_iter", "net_recv_per_iter", "all_sent_per_iter",
                "all_recv_per_iter"):
        assert rows["mpi"][key] == 3000
    assert rows["mpi"]["messages_sent_per_iter"] == rows["mpi"]["messages_recv_per_iter"] == 1
    assert rows["ps"]["all_sent_per_iter"] == 2 and rows["ps"]["all_recv_per_iter"] == 0
    stats.add_round(4, 5, 5.0, 5.5)  # a sixth round: counted, the per-round figure holds
    rows = {row["scheme"]: row for row in stats.summary()["layers"]}
    assert rows["mpi"]["rounds"] == 6 and rows["mpi"]["all_sent_per_iter"] == 3000
