"""Faults: a worker or a shard killed with -9 mid-training, a host that never comes.

Every other process must stop within --timeout (plus a short grace) with an error naming the
lost peer and the last good snapshot; nothing may be left running.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.comm.auth import KEY_ENV
from tests.test_comm_train import ROOT, digits_db, write_hosts, write_run  # noqa: F401

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.numpy_kernels]

TIMEOUT = 3.0
#: a liveness bound, not a speed claim: detection after TIMEOUT, then EXIT_GRACE_S for a busy
#: process, with a wide margin for a machine loaded by other work (an error that waited for
#: something else would not name the lost peer, which each test asserts)
DEADLINE = TIMEOUT + 2.0 + 40.0


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


#: what a launcher would hand the workers it starts; here they are started by hand
JOB_ENV = {**os.environ, KEY_ENV: "ab" * 32}


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", "train", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True,
                            env=JOB_ENV)


def wait_for_line(log: Path, pattern: str, procs: list[subprocess.Popen], limit: float = 40) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text()):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not seen in {log}:\n{log.read_text()[-2000:]}")


def wait_gone(procs: list[subprocess.Popen], pids: list[int], limit: float) -> float:
    """Seconds until our children ``procs`` (reaped by poll) and other ``pids`` are gone."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if all(p.poll() is not None for p in procs) and not any(alive(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"still running after {limit} s: "
                         f"{[p.pid for p in procs if p.poll() is None] + [p for p in pids if alive(p)]}")


def kill_all(pids: list[int]) -> None:
    for p in pids:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def cluster(digits_db, tmp_path):  # noqa: F811
    """Two workers started by hand (--rank), training for long; yields what the tests need."""
    solver = write_run(tmp_path, digits_db, 16, "long", iters=100000, display=1)
    text = solver.read_text().replace("snapshot_after_train: true", "snapshot: 3")
    solver.write_text(text)
    # another run's newer snapshot beside ours, with the same prefix: never this run's "last good"
    (tmp_path / "long_iter_99999.solverstate").write_bytes(b"")
    hosts, base = write_hosts(tmp_path, 2)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    workers = [start(["--solver", str(solver), "--hosts", str(hosts), "--rank", str(r),
                      "--timeout", f"{TIMEOUT:g}"], logs[r]) for r in range(2)]
    pids = [w.pid for w in workers]
    try:
        wait_for_line(logs[0], r"Iteration 5 ", workers)
        shards = [children(w.pid)[0] for w in workers]
        pids += shards
        yield {"workers": workers, "shards": shards, "logs": logs, "base": base, "dir": tmp_path}
    finally:
        kill_all(pids + [c for p in pids for c in children(p)])
        for w in workers:
            w.wait()


def test_killed_worker_stops_everybody_with_a_clear_error(cluster):
    w0, w1 = cluster["workers"]
    os.kill(w1.pid, signal.SIGKILL)
    took = wait_gone([w0], cluster["shards"], DEADLINE)
    assert took <= DEADLINE
    assert w0.wait() != 0
    err = cluster["logs"][0].read_text()
    line = [ln for ln in err.splitlines() if ln.startswith("poseidon: error:")]
    assert len(line) == 1, err[-2000:]
    assert f"worker 1 (127.0.0.1:{cluster['base'] + 2})" in line[0]
    named = Path(line[0].split("last good snapshot: ")[1].split(";")[0])
    ours = max((int(p.name.split("_iter_")[1].split(".")[0]), p)
               for p in cluster["dir"].glob("long_iter_*.solverstate") if p.stat().st_size)[1]
    assert named == ours, line[0]


def test_killed_shard_stops_everybody_with_a_clear_error(cluster):
    w0, w1 = cluster["workers"]
    os.kill(cluster["shards"][1], signal.SIGKILL)
    took = wait_gone([w0, w1], [cluster["shards"][0]], DEADLINE)
    assert took <= DEADLINE
    assert w0.wait() != 0 and w1.wait() != 0
    for log in cluster["logs"]:
        line = [ln for ln in log.read_text().splitlines() if ln.startswith("poseidon: error:")]
        assert line and f"shard 1 (127.0.0.1:{cluster['base'] + 3})" in line[0], log.read_text()[-1500:]


def test_launcher_stops_all_when_a_worker_dies(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 16, "long", iters=100000, display=1)
    solver.write_text(solver.read_text() + "snapshot: 2\n")
    hosts, base = write_hosts(tmp_path, 2)
    log = tmp_path / "launcher.log"
    launcher = start(["--solver", str(solver), "--hosts", str(hosts), "--timeout", f"{TIMEOUT:g}"], log)
    pids = [launcher.pid]
    try:
        wait_for_line(log, r"Iteration 5 ", [launcher])
        workers = children(launcher.pid)
        assert len(workers) == 2
        pids += workers + [c for w in workers for c in children(w)]
        victim = next(w for w in workers if "--rank 1" in " ".join(
            Path(f"/proc/{w}/cmdline").read_text().split("\0")))
        os.kill(victim, signal.SIGKILL)
        launcher.wait(timeout=DEADLINE)
        assert launcher.returncode != 0
        wait_gone([launcher], pids[1:], DEADLINE)
        err = log.read_text()
        [line] = [ln for ln in err.splitlines() if ln.startswith("poseidon: error:")]
        assert line.startswith(f"poseidon: error: worker 1 (127.0.0.1:{base + 2}) was killed by "
                               "signal 9; stopped the other 1 worker; last good snapshot: ")
        named = Path(line.rsplit("last good snapshot: ", 1)[1])
        assert named.parent == tmp_path and named.name.startswith("long_iter_") and named.is_file()
    finally:
        kill_all(pids)
        launcher.wait()


def test_start_up_barrier_names_the_host_that_did_not_come(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 16, "x", iters=10)
    hosts, base = write_hosts(tmp_path, 2)
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "train", "--solver", str(solver),
                           "--hosts", str(hosts), "--rank", "0", "--timeout", "30",
                           "--startup-timeout", "1.5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=JOB_ENV)
    assert done.returncode != 0
    assert (f"poseidon: error: worker 1 (127.0.0.1:{base + 2}) did not come within 1.5 s "
            "(start-up barrier; --startup-timeout)" in done.stderr), done.stderr[-1500:]


def test_hung_worker_stops_everybody_with_a_clear_error(cluster):
    w0, w1 = cluster["workers"]
    os.kill(w1.pid, signal.SIGSTOP)  # hangs: alive, but silent
    took = wait_gone([w0], [cluster["shards"][0]], DEADLINE)
    assert took <= DEADLINE
    assert w0.wait() != 0
    err = cluster["logs"][0].read_text()
    assert f"lost worker 1 (127.0.0.1:{cluster['base'] + 2}): nothing heard for 3 s" in err


def test_ctrl_c_on_the_launcher_stops_every_process(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 16, "long", iters=100000, display=1)
    hosts, _ = write_hosts(tmp_path, 2)
    log = tmp_path / "launcher.log"
    launcher = start(["--solver", str(solver), "--hosts", str(hosts), "--timeout", f"{TIMEOUT:g}"], log)
    pids = [launcher.pid]
    try:
        wait_for_line(log, r"Iteration 2 ", [launcher])
        pids += children(launcher.pid)
        pids += [c for w in pids[1:] for c in children(w)]
        assert len(pids) == 5  # launcher, 2 workers, 2 shards
        os.kill(launcher.pid, signal.SIGINT)  # as Caffe: snapshot, stop, exit 0
        launcher.wait(timeout=DEADLINE)
        assert launcher.returncode == 0, log.read_text()[-2000:]
        wait_gone([launcher], pids[1:], DEADLINE)
        assert "Optimization stopped early." in log.read_text()
        assert len(list(tmp_path.glob("long_iter_*.caffemodel"))) == 1
    finally:
        kill_all(pids)
        launcher.wait()
