"""`poseidon bench elastic`: what a lost machine costs, elastic against stop-and-resume.

In the emulated cluster (engine/perf/netns.py) P hosts each run one real worker (compute
replayed from a trace, links shaped), and one more host runs the elastic driver. Mid-run the
victim's host is taken away: every process in its namespace is killed at once, as when a spot
machine is reclaimed. Two ways to carry on, alternating, each ``repeats`` times:

* elastic: `poseidon train --elastic --min-workers P-1` (each worker joined the driver with
  --rendezvous, as srun or a pod starts them). The survivors go on from the newest commit.
* by hand: the same job as an ordinary run (--hosts, --rank per host) that snapshots every K
  iterations. The survivors stop once they notice (--timeout); then, with no human delay,
  P-1 workers are started again from the newest snapshot (--snapshot).

Measured from the kill, in wall seconds (process start-up, imports and the handshake are real
and not scaled; only the replayed compute and the links are): ``resumed``, until the new
rank 0 trains again (the first iteration it logs); ``regained``, until it logs the iteration
the job had reached when the machine went (the lost iterations done again); and the iterations
lost. The goal: regained <= 5 s plus one commit interval (K iterations at the measured pace).
"""
from __future__ import annotations

import datetime as dt
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from engine.comm.auth import KEY_ENV, key_hex, new_key, write_key_file
from engine.perf.netns import EmulatedCluster

from .cluster import BenchError, bench_solver

PORT = 29500
DRIVER_PORT = 29400
_LINE = re.compile(r"^I(\d{4}) (\d{2}:\d{2}:\d{2}\.\d{6}) .*\] Iteration (\d+) \(", re.M)
_EVENT = re.compile(r"Generation 2: \d+ workers from commit (\d+)")


@dataclass
class Recovery:
    way: str            # "elastic" or "by hand"
    workers: int
    killed_at: int      # the iteration the job had reached (rank 0's newest line)
    resumed_from: int   # the commit, or the snapshot
    lost: int           # iterations done again
    resumed_s: float    # kill -> the new rank 0's first iteration
    regained_s: float   # kill -> the iteration the job had reached, again
    iteration_s: float  # the pace before the kill (wall seconds per iteration)


def iteration_lines(log: str) -> list[tuple[float, int]]:
    """(epoch seconds, iteration) of each of rank 0's 'Iteration N (' lines, in order."""
    year = dt.date.today().year
    out = []
    for m in _LINE.finditer(log):
        day = dt.datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
        out.append((day.timestamp(), int(m.group(3))))
    return out


def _wait(what: str, ready: Callable[[], bool], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not ready():
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {limit:g} s")
        time.sleep(0.02)


def _wait_regained(run: "Run", log: str, t_kill: float, start: int, reached: int,
                   limit: float) -> tuple[float, float]:
    """(when ``log`` showed training again from iteration ``start`` after the kill, when it
    showed ``reached`` again). The first iteration of the new run is logged once; the old run
    may have logged that iteration too, just after the kill: the later line is the new run's."""
    found: list[tuple[float, float]] = []

    def regained() -> bool:
        lines = iteration_lines(run.text(log))
        starts = [ts for ts, it in lines if ts > t_kill and it == start]
        done = [ts for ts, it in lines if starts and ts >= starts[-1] and it >= reached]
        if done:
            found.append((starts[-1], done[0]))
        return bool(done)

    _wait(f"iteration {reached} again", regained, limit)
    return found[-1]


class Run:
    """One job in a fresh emulated cluster: P worker hosts and one more (the driver's)."""

    def __init__(self, cluster: EmulatedCluster, out: Path, solver: Path, train: list[str],
                 env: dict[str, str]) -> None:
        self.cluster, self.out, self.solver, self.train, self.env = cluster, out, solver, train, env
        self.logs: dict[str, Path] = {}

    def start(self, host: int, name: str, args: list[str]) -> subprocess.Popen:
        log = self.out / f"{name}.log"
        self.logs[name] = log
        cmd = [sys.executable, "-m", "poseidon_cli.main", "train", "--solver", str(self.solver),
               *self.train, *args]
        with log.open("w") as f:
            return self.cluster.run(host, cmd, stdout=subprocess.DEVNULL, stderr=f,
                                    cwd=os.getcwd(), env=self.env)

    def text(self, name: str) -> str:
        return self.logs[name].read_text()

    def take_away(self, host: int) -> float:
        """Kill every process on ``host`` at once (a reclaimed machine); when."""
        from engine.perf.netns import _kill_in_namespace
        t = time.time()
        _kill_in_namespace(self.cluster.namespaces[host])
        return t


def _rank0_log(run: Run, names: list[str]) -> str | None:
    """The worker whose log has iteration lines (rank 0 of the first generation), once one
    has."""
    return next((name for name in names if _LINE.search(run.text(name))), None)


def elastic(run: Run, workers: int, victim: int, kill_at: int, commit_every: int,
            limit: float) -> Recovery:
    key = run.out / "job.key"
    write_key_file(key, force=True)
    driver_host = workers
    common = ["--elastic", "--key-file", str(key), "--commit-every", str(commit_every)]
    run.start(driver_host, "driver", [*common, "--min-workers", str(workers - 1),
                                              "--max-workers", str(workers),
                                              "--rendezvous-port", str(DRIVER_PORT)])
    address = run.cluster.addresses[driver_host]
    names = [f"w{h}" for h in range(workers)]
    for h in range(workers):
        run.start(h, names[h], [*common, "--rendezvous", f"{address}:{DRIVER_PORT}"])
    _wait("elastic generation 1", lambda: "Elastic generation 1" in run.text("driver"), limit)
    _wait(f"iteration {kill_at}", lambda: (rank0 := _rank0_log(run, names)) is not None and any(
        it >= kill_at for _, it in iteration_lines(run.text(rank0))), limit)
    rank0 = _rank0_log(run, names)
    assert rank0 is not None
    # rank 0 of generation 1 is the first worker to join, not host 0: take another machine
    hosts_by_log = {n: h for h, n in enumerate(names)}
    others = [h for h in range(workers) if h != hosts_by_log[rank0]]
    t_kill = run.take_away(others[(victim - 1) % len(others)])
    before = iteration_lines(run.text(rank0))
    reached = max(it for _, it in before)
    _wait("the next generation", lambda: _EVENT.search(run.text("driver")) is not None, limit)
    commit = int(_EVENT.search(run.text("driver")).group(1))  # type: ignore[union-attr]
    got = _wait_regained(run, rank0, t_kill, commit, reached, limit)
    return Recovery("elastic", workers, reached, commit, reached + 1 - commit,
                    got[0] - t_kill, got[1] - t_kill, _pace(before))


def by_hand(run: Run, workers: int, victim: int, kill_at: int, commit_every: int,
            limit: float) -> Recovery:
    hosts = run.out / "hosts.txt"
    hosts.write_text("".join(f"{a}:{PORT}\n" for a in run.cluster.addresses[:workers]))
    procs = [run.start(h, f"w{h}", ["--hosts", str(hosts), "--rank", str(h)])
             for h in range(workers)]
    _wait(f"iteration {kill_at}", lambda: any(
        it >= kill_at for _, it in iteration_lines(run.text("w0"))), limit)
    t_kill = run.take_away(victim)
    before = iteration_lines(run.text("w0"))
    reached = max(it for _, it in before)
    survivors = [p for h, p in enumerate(procs) if h != victim]
    _wait("the survivors to stop", lambda: all(p.poll() is not None for p in survivors), limit)
    snaps = sorted(int(p.name.split("_iter_")[1].split(".")[0])
                   for p in run.out.glob("snap_iter_*.solverstate"))
    if not snaps:
        raise BenchError("by hand: no snapshot to resume from")
    left = [a for h, a in enumerate(run.cluster.addresses[:workers]) if h != victim]
    again = run.out / "hosts_again.txt"
    again.write_text("".join(f"{a}:{PORT}\n" for a in left))
    state = run.out / f"snap_iter_{snaps[-1]}.solverstate"
    hosts_of = [h for h in range(workers) if h != victim]
    for r, h in enumerate(hosts_of):
        run.start(h, f"again{r}", ["--hosts", str(again), "--rank", str(r), "--snapshot",
                                   str(state)])
    got = _wait_regained(run, "again0", t_kill, snaps[-1], reached, limit)
    return Recovery("by hand", workers, reached, snaps[-1], reached + 1 - snaps[-1],
                    got[0] - t_kill, got[1] - t_kill, _pace(before))


def _pace(lines: list[tuple[float, int]]) -> float:
    gaps = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(lines, lines[1:]) if b[1] > a[1]]
    return statistics.median(gaps[len(gaps) // 2:]) if gaps else float("nan")


def run_bench(solver: Path, workers: list[int], bits_per_s: float, trace: Path,
              time_scale: float, commit_every: int, kill_at: int, timeout: float,
              repeats: int, say: Callable[[Recovery], None], victim: int = 1,
              limit: float = 600.0) -> list[Recovery]:
    """Every worker count, ``repeats`` times each way, alternating."""
    rows = []
    for p in workers:
        if p < 2:
            raise BenchError("--workers: a job that loses a machine needs at least 2")
        for _ in range(repeats):
            for way in (elastic, by_hand):
                with tempfile.TemporaryDirectory(prefix="poseidon-bench-elastic-") as d:
                    out = Path(d)
                    copy = bench_solver(solver, out, 100000)
                    text = copy.read_text().replace("snapshot: 0", "")
                    copy.write_text(text + f"snapshot: {commit_every}\n")
                    env = {**os.environ, KEY_ENV: key_hex(new_key())}
                    train = ["--replay", str(trace), "--time-scale", f"{time_scale:g}",
                             "--timeout", f"{timeout:g}"]
                    with EmulatedCluster(p + 1, bits_per_s / time_scale) as cluster:
                        r = way(Run(cluster, out, copy, train, env), p, victim, kill_at,
                                commit_every, limit)
                rows.append(r)
                say(r)
    return rows


def summary(rows: list[Recovery], commit_every: int) -> dict[str, Any]:
    """Medians per (workers, way), the ratio by hand / elastic of the time to regain, and
    whether elastic met the goal (regained <= 5 s + one commit interval)."""
    out: dict[str, Any] = {"rows": [asdict(r) for r in rows], "medians": []}
    for p in sorted({r.workers for r in rows}):
        med = {}
        for way in ("elastic", "by hand"):
            sel = [r for r in rows if r.workers == p and r.way == way]
            med[way] = {k: statistics.median(getattr(r, k) for r in sel)
                        for k in ("resumed_s", "regained_s", "lost", "iteration_s")}
        goal = 5.0 + commit_every * med["elastic"]["iteration_s"]
        out["medians"].append({"workers": p, **{w: m for w, m in med.items()},
                               "ratio_regained": med["by hand"]["regained_s"] /
                               med["elastic"]["regained_s"],
                               "goal_s": goal,
                               "goal_met": med["elastic"]["regained_s"] <= goal})
    return out
