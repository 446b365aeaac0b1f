"""Two machines started by hand, rehearsed on one (two terminals, as the README's quick start
says): rank 0 first, rank 1 a while later. Neither is ever silent while it waits for the
other: each says every few seconds whom it waits for and how much longer (the start-up window,
--startup-timeout, apart from --timeout), and waiting costs them next to no CPU; then they
train together."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from tests.test_comm_train import ROOT, digits_db, write_hosts, write_run  # noqa: F401

pytestmark = pytest.mark.numpy_kernels

#: the most a waiting process may stay silent (it speaks every SAY_EVERY = 3 s)
SILENT_S = 5.0
#: the CPU a worker and its shard may use, together, waiting for a peer that never speaks
IDLE_BOUND = 0.05
IDLE_WINDOW_S = 4.0


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``pid`` and its children alive now (Linux's /proc)."""
    from engine.perf.cpu import children, process_cpu
    return sum(process_cpu(p) or 0.0 for p in [pid, *children(pid)])


def cpu_share(pid: int, window: float) -> float:
    """The share of one core ``pid`` and its children used over ``window`` seconds."""
    before, start = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    return (cpu_seconds(pid) - before) / (time.monotonic() - start)


class Terminal:
    """A process started by hand, each line of its stderr stamped as it arrives."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", *args],
                                     cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def saw(self, text: str) -> int:
        return sum(text in line for _, line in self.lines)

    def finish(self, limit: float = 180.0) -> int:
        try:
            return self.proc.wait(limit)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._reader.join(5)

    def longest_silence(self, first: str, last: str) -> float:
        """The longest gap between lines from the first naming ``first`` to the first naming
        ``last``."""
        start = next(i for i, (_, l) in enumerate(self.lines) if first in l)
        end = next(i for i, (_, l) in enumerate(self.lines) if last in l)
        stamps = [t for t, _ in self.lines[start:end + 1]]
        return max(b - a for a, b in zip(stamps, stamps[1:]))


def test_two_machines_by_hand_say_whom_they_wait_for(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 16, "hand", iters=10)
    hosts, base = write_hosts(tmp_path, 2)
    key = tmp_path / "job.key"
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "keygen", str(key)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = ["train", "--solver", str(solver), "--hosts", str(hosts), "--key-file", str(key),
            "--startup-timeout", "120"]
    rank0 = Terminal([*args, "--rank", "0"])
    rank1 = None
    try:
        deadline = time.monotonic() + 120  # liveness: its net built, it waits and says so
        while rank0.saw("for start-up HELLO from worker 1") < 2:
            assert time.monotonic() < deadline and rank0.proc.poll() is None, \
                "\n".join(l for _, l in rank0.lines[-20:])
            time.sleep(0.1)
        idle = cpu_share(rank0.proc.pid, IDLE_WINDOW_S)
        rank1 = Terminal([*args, "--rank", "1"])
        assert rank0.finish() == 0, "\n".join(l for _, l in rank0.lines[-20:])
        assert rank1.finish() == 0, "\n".join(l for _, l in rank1.lines[-20:])
    finally:
        for t in (rank0, rank1):
            if t is not None and t.proc.poll() is None:
                t.proc.kill()
    # its shard may first wait for its own worker's layout (a busy machine builds nets slowly)
    waits = [l for _, l in rank0.lines if "waiting" in l and "HELLO from worker 1" in l]
    assert f"for start-up HELLO from worker 1 (127.0.0.1:{base + 2}" in waits[0], waits[0]
    assert "(at most" in waits[0] and "s more)" in waits[0]
    assert rank0.longest_silence("waiting", "Communication plan") <= SILENT_S
    # waiting costs nothing: no thread polls while nothing is due (a wide bound: the figure
    # on a quiet machine is well under 1% of a core, docs/benchmarks.md)
    assert idle < IDLE_BOUND, f"rank 0 and its shard used {idle:.1%} of a core while waiting"


def test_the_hint_for_other_machines_is_each_ranks_exact_command(tmp_path):
    """A hosts file naming another machine, no key file: the launcher prints, for each worker
    not on this machine, the exact command to run there (this command, its rank added), then
    says in one line why it cannot go on without a key, before anything starts."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("0 127.0.0.1 29611\n1 192.0.2.7 29611\n")  # TEST-NET-1: never this host
    solver = ROOT / "models" / "digits_lenet" / "solver.prototxt"
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "train", "--solver",
                           str(solver), "--hosts", str(hosts), "--startup-timeout", "90"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert "1 worker not on this machine: start each within 90 s (--startup-timeout)" in lines[0]
    assert lines[1] == (f"poseidon:   on 192.0.2.7: poseidon train --solver {solver} --hosts "
                        f"{hosts} --startup-timeout 90 --rank 1"), lines
    assert "--key-file" not in lines[1]  # no key file given: none to name
    assert "need this job's key" in lines[-1] and "poseidon keygen job.key" in lines[-1], lines
