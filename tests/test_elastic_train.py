"""Elastic training end to end on loopback: real worker processes, a real driver, kill -9.

The job is the digits net of tests/test_comm_train.py with 8 images per worker, committing
every K = 5 iterations. Every test bounds its wait for each line it expects (a liveness bound
with a wide margin for a busy machine, not a speed claim) and kills the whole process tree on
every path.

Exactness: after a membership change at commit c, the run equals a fresh run of the new
workers resumed from the snapshot at c with the new generation's plan pinned, bit for bit. The
solver snapshots every K iterations (every iteration where the change is at any boundary), so
the snapshot of iteration c is the state the commit holds; the last generation's rank 0 wrote
its plan to <prefix>_plan.prototxt. The victim is killed on the line of iteration c + 2, two
after a commit; on a busy machine the signal may land a few iterations later, so the tests
assert what holds wherever it lands: the survivors go on from a commit and redo at most K
iterations (a survivor may have released the round after the commit, but not applied it).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.comm.hosts import port_owner
from poseidon_cli.launch.hostfile import free_base_port
from tests.test_comm_faults import alive, children
from tests.test_comm_train import ROOT, digits_db, poseidon, weights, write_run  # noqa: F401

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.numpy_kernels]

K = 5
#: a liveness bound for each awaited line: start-up of 4-5 processes on a busy 2-core
#: machine takes 5-20 s; a test that waits for a line that never comes fails naming it
LINE_S = 120.0
ERROR = "poseidon: error: "
WAITING = re.compile(r"waiting \d+ s for ")


def tree(pid: int) -> list[int]:
    out = [pid]
    for c in children(pid):
        out += tree(c)
    return out


class Job:
    """An elastic run of the digits net: its files, its launcher, its log."""

    def __init__(self, d: Path, db: Path, slots: int, iters: int, snapshot: int = K,
                 name: str = "el") -> None:
        self.d, self.name, self.iters = d, name, iters
        self.solver = write_run(d, db, 8, name, iters=iters, display=1)
        text = self.solver.read_text()
        if snapshot:
            text = text.replace("snapshot_after_train: true",
                                f"snapshot_after_train: true\nsnapshot: {snapshot}")
        self.solver.write_text(text)
        self.base = free_base_port(slots + 1)
        self.hosts = d / f"{name}_hosts.txt"
        self.hosts.write_text("".join(self.line(i) for i in range(slots)))
        self.log = d / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []

    def line(self, i: int) -> str:
        return f"{i} 127.0.0.1 {self.port(i)}\n"

    def port(self, i: int) -> int:
        return self.base + 2 * i

    def start(self, *args: str) -> "Job":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "poseidon_cli.main", "train", "--solver", str(self.solver),
             "--hosts", str(self.hosts), "--elastic", "--commit-every", str(K),
             # a loss by kill or SIGTERM is seen at once; --timeout is for silence, and a
             # machine loaded by other work can keep a starting worker quiet for 10 s
             "--timeout", "30", *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("w"),
            start_new_session=True)
        return self

    def text(self) -> str:
        return self.log.read_text()

    def tail(self, chars: int = 3000) -> str:
        """The log's end for a failure's message: the repeated "waiting N s for" lines left
        out (but the last three), so the line that names the cause stays in view."""
        lines = self.text().splitlines()
        skip = set([i for i, line in enumerate(lines) if WAITING.search(line)][:-3])
        kept = [line for i, line in enumerate(lines) if i not in skip]
        return (f"({len(skip)} waiting lines left out)\n" if skip else "") + \
            "\n".join(kept)[-chars:]

    def wait_for(self, pattern: str, limit: float = LINE_S) -> re.Match:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            self._track()
            m = re.search(pattern, self.text(), re.M)
            if m:
                return m
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.01)
        raise AssertionError(f"{pattern!r} not seen in {self.log}:\n{self.tail()}")

    def member(self, i: int, limit: float = LINE_S) -> int:
        """The pid of the worker listening at slot ``i``'s port (it binds it per generation),
        looked for among the job's own processes: a search of every process took longer
        under stress-ng than a short run."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            assert self.proc is not None
            owner = port_owner(self.port(i), tree(self.proc.pid))
            if owner is not None:
                return int(owner.split()[1])
            time.sleep(0.05)
        raise AssertionError(f"nobody listens at port {self.port(i)}:\n{self.tail(2000)}")

    def finish(self, limit: float = 300.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job still runs after {limit:g} s:\n"
                                 f"{self.tail()}") from None

    def _track(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.pids = sorted(set(self.pids) | set(tree(self.proc.pid)))

    def kill_everything(self) -> None:
        self._track()
        for pid in self.pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc is not None:
            self.proc.wait()

    def errors(self) -> list[str]:
        return [l for l in self.text().splitlines() if l.startswith(ERROR)]


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for job in started:
        job.kill_everything()


def same_bits(a: Path, b: Path) -> None:
    want, got = weights(a), weights(b)
    assert want.keys() == got.keys()
    for name, w in want.items():
        assert np.array_equal(got[name], w), name


def resumed_reference(job: Job, db: Path, workers: int, commit: int, *extra: str) -> Path:
    """A fresh run of ``workers`` resumed from the snapshot at ``commit`` on the last
    generation's plan (``extra``: more train options); its final weights."""
    d = job.d / "reference"
    solver = write_run(d, db, 8, "ref", iters=job.iters)
    base = free_base_port(workers)
    hosts = d / "hosts.txt"
    hosts.write_text("".join(f"{i} 127.0.0.1 {base + 2 * i}\n" for i in range(workers)))
    state = job.d / f"{job.name}_iter_{commit}.solverstate"
    assert state.is_file(), f"no snapshot at the commit {commit}"
    done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--snapshot",
                    str(state), "--plan", str(job.d / f"{job.name}_plan.prototxt"),
                    "--timeout", "20", *extra, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(pinned by --plan" in done.stderr
    return d / f"ref_iter_{job.iters}.caffemodel"


#: the driver's line for a kill; "nothing lost" where the survivors had applied no update
#: beyond the commit (the kill landed at it)
LOST = (r"Elastic: lost worker {rank} \(127\.0\.0\.1:{port}\): killed by signal 9\. Generation "
        r"2: 3 workers from commit (\d+) \((?:iterations (\d+)\.\.(\d+) done again: (\d+) lost|"
        r"nothing lost)\), in ([\d.]+) s")


def redone(m: re.Match) -> tuple[int, int, int, int]:
    """A LOST line's (commit, first and last iteration done again, how many); with nothing
    lost, (commit, commit, commit - 1, 0)."""
    commit = int(m.group(1))
    if m.group(4) is None:
        return commit, commit, commit - 1, 0
    return commit, int(m.group(2)), int(m.group(3)), int(m.group(4))


@pytest.mark.parametrize("rank", [1, 0], ids=["rank 1", "rank 0"])
def test_kill_9_of_a_worker_leaves_three_that_go_on_from_the_commit(rank, jobs, digits_db,  # noqa: F811
                                                                    tmp_path):
    """4 workers, kill -9 of one mid-run: the job finishes with 3 and exits 0; from the commit
    on it equals a 3-worker run resumed from it; it lost at most K iterations. For rank 0 the
    log and the snapshots move to the new rank 0 (another process writes them)."""
    # the kill lands at iteration 2K+2, seen in the log file: 200 leaves it 188 iterations
    # to land mid-run (with 25, and then with 60, under stress-ng the run had ended before
    # the test had found the victim: the search of /proc for its port took longer than the
    # run, at 100-280 iterations a second)
    job = Job(tmp_path, digits_db, 4, iters=200)
    stats = tmp_path / "stats.json"
    jobs.append(job.start("--min-workers", "3", "--backoff", "600", "--stats", str(stats)))
    job.wait_for(r"Elastic generation 1: 4 workers")
    victim = job.member(rank)
    job.wait_for(rf"Iteration {2 * K + 2} ")
    os.kill(victim, signal.SIGKILL)
    m = job.wait_for(LOST.format(rank=rank, port=job.port(rank)))
    commit, first, reached, lost = redone(m)
    assert commit == first and commit % K == 0 and commit >= 2 * K
    assert 0 <= lost == reached + 1 - commit <= K
    assert job.finish() == 0, job.tail()
    assert not job.errors()
    after = job.text()[m.end():]
    assert f"Iteration {job.iters}, loss = " in after and "Optimization Done." in after
    if rank == 0:  # the new rank 0 is another process: its log lines carry its pid
        pid_of = re.compile(r"^I\d{4} \S+ (\d+) solver\.py:\d+\] Optimization Done", re.M)
        assert int(pid_of.search(after).group(1)) != victim
    counts = json.loads(stats.read_text())["elastic"]
    assert (counts["generations"], counts["lost"], counts["joined"], counts["left"],
            counts["iterations_lost"], len(counts["recovery_s"])) == (2, 1, 0, 0, lost, 1)
    log = job.text()
    # the log a user reads: the solver printed once, the failure not an order to resume by
    # hand, the back-off after the loss it follows, the key hint of a job without a key file,
    # and a summary at the end
    assert log.count("Initializing solver from parameters") == 1
    assert "Generation 2: the solver and its nets built again for 3 workers" in log
    assert "last good snapshot" not in log
    if rank != 0:  # a surviving rank 0 says what happened; a killed one cannot
        assert "nothing to do by hand" in log
    backoff = f"Elastic: worker at 127.0.0.1:{job.port(rank)} may start again in 600 s"
    assert log.index(backoff) > m.start()
    assert "--key-file KEY" not in log and "the launcher made this job's key" in log
    assert re.search(rf"Elastic: the job ends after 2 generations: 1 lost, 0 joined, 0 left, "
                     rf"0 excluded; {lost} iterations done again, recoveries took [\d.]+ s", log)
    same_bits(resumed_reference(job, digits_db, 3, commit),
              tmp_path / f"el_iter_{job.iters}.caffemodel")


def stop(job: Job) -> int:
    """SIGINT to the driver: every worker stops at one agreed iteration with a snapshot; the
    iteration of that snapshot."""
    assert job.proc is not None
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.finish() == 0, job.tail()
    return int(re.findall(r"Snapshotting solver state to .*_iter_(\d+)\.solverstate",
                          job.text())[-1])


def test_a_worker_added_to_the_hosts_file_joins_within_one_commit(jobs, digits_db, tmp_path):  # noqa: F811
    """3 workers; a 4th line in the hosts file: the driver starts that worker, which joins at
    the first commit after it is ready, with the state of the new rank 0 (not from disk); from
    that commit on the run equals a 4-worker run resumed from it."""
    job = Job(tmp_path, digits_db, 3, iters=100000)
    jobs.append(job.start("--min-workers", "3"))
    job.wait_for(r"Elastic generation 1: 3 workers")
    with job.hosts.open("a") as f:
        f.write(job.line(3))
    ready = job.wait_for(rf"Elastic: the worker at 127\.0\.0\.1:{job.port(3)} is ready")
    before = [int(i) for i in re.findall(r"\] Iteration (\d+) \(", job.text()[:ready.start()])]
    m = job.wait_for(rf"Elastic: worker at 127\.0\.0\.1:{job.port(3)} \(.*hosts\.txt:4\) came\. "
                     r"Generation 2: 4 workers from commit (\d+) \(nothing lost\)")
    commit = int(m.group(1))
    assert commit % K == 0 and commit <= max(before, default=0) + 1 + K
    job.wait_for(rf"Iteration {commit + K} ")
    job.iters = stop(job)
    same_bits(resumed_reference(job, digits_db, 4, commit),
              tmp_path / f"el_iter_{job.iters}.caffemodel")


def test_sigterm_makes_a_worker_leave_at_a_boundary_and_nothing_is_rolled_back(
        jobs, digits_db, tmp_path):  # noqa: F811
    """SIGTERM to one worker (its manager's notice): every worker ends the generation at the
    same boundary, the leaver exits 0, and the next generation starts there: nothing lost."""
    job = Job(tmp_path, digits_db, 4, iters=100000, snapshot=1)
    jobs.append(job.start("--min-workers", "3", "--backoff", "600"))
    job.wait_for(r"Elastic generation 1: 4 workers")
    leaver = job.member(2)
    signalled = int(job.wait_for(r"\] Iteration (1[2-9]) \(").group(1))
    os.kill(leaver, signal.SIGTERM)
    m = job.wait_for(rf"Elastic: worker 2 \(127\.0\.0\.1:{job.port(2)}\) left \(SIGTERM\)\. "
                     r"Generation 2: 3 workers from commit (\d+) \(nothing lost\)")
    boundary = int(m.group(1))
    assert boundary > signalled
    deadline = time.monotonic() + LINE_S
    while alive(leaver) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(leaver)
    job.wait_for(rf"Iteration {boundary + K} ")
    job.iters = stop(job)
    assert "Elastic: lost " not in job.text()
    same_bits(resumed_reference(job, digits_db, 3, boundary),
              tmp_path / f"el_iter_{job.iters}.caffemodel")


def test_fewer_than_min_workers_stops_naming_who_is_missing_with_the_commit_on_disk(
        jobs, digits_db, tmp_path):  # noqa: F811
    """3 workers, --min-workers 3, one killed: one error line naming it and the file the last
    commit was written to (the solver writes no snapshots itself); that file is the state a
    straight 3-worker run has at that iteration."""
    job = Job(tmp_path, digits_db, 3, iters=100000, snapshot=0)
    jobs.append(job.start("--min-workers", "3", "--backoff", "600", "--timeout", "3"))
    job.wait_for(r"Elastic generation 1: 3 workers")
    victim = job.member(1)
    job.wait_for(rf"Iteration {2 * K + 2} ")
    os.kill(victim, signal.SIGKILL)
    assert job.finish() != 0
    [line] = job.errors()
    # the commit is the newest the survivors hold: 2K, or later where a loaded machine let
    # the workers run on past the next boundary before the kill landed
    m = re.fullmatch(rf"{re.escape(ERROR)}elastic: 2 workers can train, fewer than "
                     rf"--min-workers 3 \(lost worker 1 \(127\.0\.0\.1:{job.port(1)}\): "
                     rf"killed by signal 9\); the last commit \(iteration (\d+)\) is written "
                     rf"to (\S+): resume from it with --snapshot (\S+)", line)
    assert m, line
    commit = int(m.group(1))
    state = tmp_path / f"el_iter_{commit}.solverstate"
    assert commit >= 2 * K and commit % K == 0
    assert m.group(2) == m.group(3) == str(state)
    d = tmp_path / "straight"
    solver = write_run(d, digits_db, 8, "ref", iters=commit)
    done = poseidon("train", "--solver", str(solver), "--hosts", str(job.hosts), "--plan",
                    str(tmp_path / "el_plan.prototxt"), "--timeout", "20", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    same_bits(d / f"ref_iter_{commit}.caffemodel", tmp_path / f"el_iter_{commit}.caffemodel")


def test_a_flapping_worker_backs_off_then_is_excluded_and_the_job_goes_on(jobs, digits_db,  # noqa: F811
                                                                          tmp_path):
    """A worker that dies again right after each join: it waits 1 s, and is excluded after its
    second failure, each said in the log; the job keeps training through it. (The doubling of
    the wait is test_elastic_rules.py's: a third start here would cost a generation more.)"""
    job = Job(tmp_path, digits_db, 3, iters=100000, snapshot=0)
    jobs.append(job.start("--min-workers", "2", "--backoff", "1", "--max-failures", "2",
                          "--commit-every", "40"))
    job.wait_for(r"Elastic generation 1: 3 workers")
    with job.hosts.open("a") as f:
        f.write(job.line(3))
    at = f"127.0.0.1:{job.port(3)}"
    excluded = rf"Elastic: worker at {re.escape(at)} excluded: it failed 2 times in a row"
    deadline = time.monotonic() + 4 * LINE_S
    while not re.search(excluded, job.text()):
        assert time.monotonic() < deadline, job.tail()
        owner = port_owner(job.port(3), tree(job.proc.pid))
        if owner is not None:
            os.kill(int(owner.split()[1]), signal.SIGKILL)
        time.sleep(0.02)
    log = job.text()
    said = [log.index(s) for s in (f"Elastic: worker at {at} may start again in 1 s (back-off)",
                                   f"Elastic: worker at {at} excluded")]
    assert said == sorted(said)
    reached = max(int(i) for i in re.findall(r"\] Iteration (\d+) \(", log))
    job.wait_for(rf"\] Iteration {reached + 2 * K} \(")
    stop(job)
    assert log.count(f"Elastic: started the worker at {at}") == 2


def test_workers_that_join_by_hand_stop_when_the_driver_goes(digits_db, tmp_path):  # noqa: F811
    """No listing: the driver only takes workers that join with its address (as srun or a
    pod starts them). kill -9 of the driver (its machine goes): every worker stops, saying so,
    and the last generation's rank 0 writes the newest commit first."""
    from engine.comm.auth import write_key_file

    key = tmp_path / "job.key"
    write_key_file(key)
    solver = write_run(tmp_path, digits_db, 8, "el", iters=100000, display=1)
    port = free_base_port(1)
    common = ["--solver", str(solver), "--elastic", "--key-file", str(key), "--commit-every",
              str(K), "--timeout", "10"]
    procs: list[subprocess.Popen] = []

    def run(args: list[str], log: Path) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", "train",
                                       *common, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=log.open("w"), start_new_session=True))
        return procs[-1]

    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    driver = run(["--min-workers", "2", "--rendezvous-port", str(port)], tmp_path / "d.log")
    workers = [run(["--rendezvous", f"127.0.0.1:{port}"], log) for log in logs]
    try:
        deadline = time.monotonic() + LINE_S
        while not any(re.search(rf"\] Iteration {2 * K + 2} ", l.read_text()) for l in logs):
            assert time.monotonic() < deadline and driver.poll() is None, \
                (tmp_path / "d.log").read_text()[-2000:]
            time.sleep(0.02)
        os.kill(driver.pid, signal.SIGKILL)
        for w in workers:
            assert w.wait(LINE_S) != 0
        said = {}
        for log in logs:
            [line] = [l for l in log.read_text().splitlines() if l.startswith(ERROR)]
            assert line.startswith(f"{ERROR}lost the elastic driver at 127.0.0.1:{port}: its "
                                   "connection closed (the driver process ended); the job "
                                   "stops, as a torchrun job stops"), line
            said[log] = line
        [written] = [l for l in said.values() if "the last commit" in l]
        m = re.search(r"the last commit \(iteration (\d+)\) is written to (\S+)$", written)
        assert m and int(m.group(1)) % K == 0 and int(m.group(1)) >= 2 * K, written
        assert Path(m.group(2)).is_file()
    finally:
        for p in procs:
            for pid in tree(p.pid)[::-1]:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            p.wait()


def test_the_global_batch_is_kept_by_iter_size_and_a_worker_it_cannot_use_waits(
        jobs, digits_db, tmp_path):  # noqa: F811
    """--global-batch 32 with a batch of 8: 3 workers cannot keep it (32 / 24), 2 can with
    iter_size 2; the third waits, and takes the place of one that is lost (from rank 0's
    state). --elastic-lr linear leaves base_lr alone while the global batch stays."""
    job = Job(tmp_path, digits_db, 3, iters=100000, snapshot=0)
    jobs.append(job.start("--min-workers", "2", "--backoff", "600", "--global-batch", "32",
                          "--elastic-lr", "linear"))
    job.wait_for(r"Elastic generation 1: 2 workers from iteration 0; global batch 2 x 8 x "
                 r"iter_size 2 = 32; plan")
    victim = job.member(1)
    job.wait_for(rf"\] Iteration {2 * K + 2} \(")
    os.kill(victim, signal.SIGKILL)
    m = job.wait_for(rf"Elastic: lost worker 1 \(127\.0\.0\.1:{job.port(1)}\): killed by signal "
                     rf"9; worker at 127\.0\.0\.1:{job.port(2)} \(.*:3\) came\. Generation 2: 2 "
                     r"workers from commit (\d+) .*; global batch 2 x 8 x iter_size 2 = 32; plan")
    job.wait_for(rf"\] Iteration {int(m.group(1)) + K} \(")
    stop(job)
    assert "base_lr x" not in job.text() and ", lr = 0.01" in job.text()
