"""Communication counters: bytes per layer and scheme, time waiting on the network, overlap.

Bytes are array-payload bytes (headers are a few dozen bytes and not counted, so the counters
can be compared with the cost model's float counts); messages are counted beside them. Each
transfer is counted twice over: ``net`` when it crosses the node boundary (a worker and its own
shard are one node), and in the ``all`` totals whatever the peer. Time counters come from the syncer: for every layer and
round, when its gradients were released and when the update was applied, and how long the
training thread blocked in ``wait`` (or in ``release``, for a round summed on that thread).
"""
from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any


#: how many rounds ``add_round`` logs before it takes them into the counters
LOG_BATCH = 64


class CommStats:
    """Thread-safe counters shared by the transport (bytes) and the syncer (times)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (layer, scheme) -> [sent_net, recv_net, sent_all, recv_all, messages sent, received]
        self._bytes: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0] * 6)
        #: (layer, scheme) -> the bytes an engine's allreduce moves each way every round
        self._per_round: dict[tuple[int, str], int] = {}
        self._wait: dict[int, float] = defaultdict(float)
        #: round -> (layer, released, applied) of the rounds not yet folded into the totals
        self._intervals: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
        #: the folded rounds: how many, their communication and its part hidden, and the
        #: round below which every round is folded
        self._folded = [0, 0.0, 0.0]
        self._folded_below = 0
        self._rounds: dict[int, int] = defaultdict(int)  # layer -> completed rounds
        #: (layer, round, released, applied, waited) of the rounds not yet counted
        self._log: deque[tuple[int, int, float, float, float]] = deque()
        self.layer_names: dict[int, str] = {}
        #: run facts (rank, plan, ...) written alongside the counters
        self.extra: dict[str, Any] = {}

    def add_bytes(self, layer: int, scheme: str, sent: bool, nbytes: int, network: bool) -> None:
        """One message's array bytes (a latency-bound scheme is judged by its message count)."""
        with self._lock:
            row = self._bytes[(layer, scheme)]
            row[2 if sent else 3] += nbytes
            row[4 if sent else 5] += 1
            if network:
                row[0 if sent else 1] += nbytes

    def count_allreduce(self, layer: int, scheme: str, nbytes: int) -> None:
        """A collective engine sums ``layer``'s vector every round, moving ``nbytes`` each way
        per worker across the network (what a ring moves): one message each way a round,
        counted from the rounds ``add_round`` notes (a small allreduce's round pays for each
        operation of its own bookkeeping)."""
        with self._lock:
            self._per_round[(layer, scheme)] = nbytes

    def add_wait(self, layer: int, seconds: float) -> None:
        with self._lock:
            self._wait[layer] += seconds

    def add_round(self, layer: int, rnd: int, released: float, applied: float,
                  waited: float = 0.0) -> None:
        """A worker finished round ``rnd`` of ``layer`` (released -> update applied), and the
        training thread ``waited`` that long for it (a round summed at its release). Logged
        (a deque's append needs no lock) and taken into the counters LOG_BATCH at a time: a
        small allreduce's round pays for each operation of its own bookkeeping."""
        log = self._log
        log.append((layer, rnd, released, applied, waited))
        if len(log) >= LOG_BATCH:
            with self._lock:
                self._take_log()

    def _take_log(self) -> None:
        """The logged rounds into the counters (under the lock). A layer's round R is released
        after its forward, which waited for every layer's round R-1: rounds before R-1 are
        complete, and folding them keeps a long run's counters (and each display's summary)
        as small as its first rounds'. Folded two further back, for a margin. (Every round
        of a small allreduce passes here: a round of one unit is folded without its list.)"""
        log, intervals, rounds, wait = self._log, self._intervals, self._rounds, self._wait
        folded, below = self._folded, self._folded_below
        top = -1
        for _ in range(len(log)):
            layer, rnd, released, applied, waited = log.popleft()
            if waited:
                wait[layer] += waited
            if rnd >= below:
                intervals[rnd].append((layer, released, applied))
            elif applied > released:  # a round already folded: its interval alone
                folded[1] += applied - released
            if rounds[layer] <= rnd:
                rounds[layer] = rnd + 1
            if rnd > top:
                top = rnd
        if top - 2 > below:
            self._folded_below = below = top - 2
            for r in [r for r in intervals if r < below]:
                ivs = intervals.pop(r)
                folded[0] += 1
                if len(ivs) == 1:  # _overlap's first case, without its call
                    _, released, applied = ivs[0]
                    if applied > released:
                        folded[1] += applied - released
                else:
                    c, h = _overlap(ivs)
                    folded[1] += c
                    folded[2] += h

    def note_round(self, layer: int, rnd: int) -> None:
        """Round ``rnd`` of ``layer`` took place (per-iteration averages divide by the count)."""
        with self._lock:
            if self._rounds[layer] <= rnd:
                self._rounds[layer] = rnd + 1

    def summary(self) -> dict[str, Any]:
        """Per-layer bytes per round (network and all), wait seconds, and the hidden fraction."""
        with self._lock:
            self._take_log()
            layers = []
            rows = {key: list(row) for key, row in self._bytes.items()}
            for key, nbytes in self._per_round.items():  # one message each way a round
                done = self._rounds.get(key[0], 0)
                row = rows.setdefault(key, [0] * 6)
                rows[key] = [v + done * n for v, n in zip(row, (nbytes,) * 4 + (1, 1))]
            for (layer, scheme), (sn, rn, sa, ra, ms, mr) in sorted(rows.items()):
                n = max(self._rounds.get(layer, 0), 1)
                layers.append({"layer": layer, "name": self.layer_names.get(layer, str(layer)),
                               "scheme": scheme, "rounds": self._rounds.get(layer, 0),
                               "net_sent_per_iter": sn / n, "net_recv_per_iter": rn / n,
                               "all_sent_per_iter": sa / n, "all_recv_per_iter": ra / n,
                               "messages_sent_per_iter": ms / n,
                               "messages_recv_per_iter": mr / n})
            rounds, comm, hidden = self._folded
            for ivs in self._intervals.values():
                c, h = _overlap(ivs)
                comm += c
                hidden += h
            rounds += len(self._intervals)
            iters = max(rounds, 1)
            return {**self.extra, "layers": layers,
                    "wait_s_per_iter": sum(self._wait.values()) / iters,
                    # every unit, one that never had to wait too
                    "wait_s_by_layer": {str(k): self._wait.get(k, 0.0) / iters
                                        for k in sorted(set(self._wait) | set(self.layer_names))},
                    "comm_s_per_iter": comm / iters,
                    "hidden_fraction": hidden / comm if comm > 0 else 0.0,
                    "iterations": rounds}

    def format_lines(self) -> list[str]:
        s = self.summary()
        lines = [f"comm: wait {s['wait_s_per_iter'] * 1e3:.1f} ms/iter, comm {s['comm_s_per_iter'] * 1e3:.1f}"
                 f" ms/iter, {100 * s['hidden_fraction']:.0f}% hidden behind backward"]
        for row in s["layers"]:
            lines.append(f"comm: {row['name']:>12} {row['scheme']:>3}: this worker sent "
                         f"{row['all_sent_per_iter'] / 1e6:.3f} MB, received {row['all_recv_per_iter'] / 1e6:.3f}"
                         f" MB per iter ({(row['net_sent_per_iter'] + row['net_recv_per_iter']) / 1e6:.3f}"
                         " MB across the network)")
        return lines

    def write_json(self, path: str | Path) -> None:
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.summary(), indent=1))
        tmp.replace(p)


def _overlap(intervals: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(length of the union of comm intervals, part of it inside the backward window).

    The backward window of a round runs from its first release to its last: communication
    after the last release is what the next iteration has to wait for.
    """
    if len(intervals) < 2:  # none hidden: a round's one interval starts at its last release
        return (max(intervals[0][2] - intervals[0][1], 0.0), 0.0) if intervals else (0.0, 0.0)
    spans = sorted([(a, b) for _, a, b in intervals])  # by release
    hi = spans[-1][0]
    total = hidden = 0.0
    end = -float("inf")
    for a, b in spans:
        if a < end:
            a = end
        if b <= a:
            continue
        total += b - a
        if a < hi:  # and a is past the first release: the spans are in release order
            hidden += (b if b < hi else hi) - a
        end = b
    return total, hidden


#: the counters' clock (the function itself: a wrapper is one more call in every round)
now = time.perf_counter
