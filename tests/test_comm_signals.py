"""SIGINT and SIGTERM stop a distributed run the way Caffe stops one process: every worker
snapshots at the same iteration, the run exits 0, and resuming from that snapshot trains on to
exactly the weights of an uninterrupted run.

The launcher is started in the background of a non-interactive shell, which starts it with
SIGINT ignored: it must install its own handlers.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_comm_train import (ROOT, digits_db, poseidon, relative_distance,  # noqa: F401
                                   weights, write_hosts, write_run)

pytestmark = pytest.mark.numpy_kernels

FAR = 100000  # max_iter of the interrupted run: it only ends by the signal


def start_in_background(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """`poseidon train ...` as `cmd &` in `bash -c` (no job control): (the shell, launcher pid)."""
    pidfile = tmp_path / "launcher.pid"
    cmd = " ".join([sys.executable, "-m", "poseidon_cli.main", *args])
    shell = subprocess.Popen(["bash", "-c", f"{cmd} & echo $! > {pidfile}; wait $!"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # liveness: a busy machine starts processes slowly
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, "the shell did not start the launcher"
        time.sleep(0.05)
    return shell, int(pidfile.read_text())


def wait_for_line(stream, pattern: str, timeout: float) -> list[str]:
    """Read ``stream`` on a thread until a line matches; returns every line (read on after)."""
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in stream:
            lines.append(line)
            if re.search(pattern, line):
                seen.set()
    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(timeout), "".join(lines[-30:])
    return lines


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_snapshots_every_rank_at_one_iteration_and_resume_is_exact(sig, digits_db,  # noqa: F811
                                                                          tmp_path):
    hosts, _ = write_hosts(tmp_path, 2)
    solver = write_run(tmp_path, digits_db, 16, "dist", iters=FAR, display=1)
    stats = tmp_path / "stats.json"
    shell, launcher = start_in_background(
        ["train", "--solver", str(solver), "--hosts", str(hosts), "--timeout", "20",
         "--stats", str(stats)], tmp_path)
    try:
        lines = wait_for_line(shell.stderr, r"Iteration 5\b", timeout=60)
        os.kill(launcher, sig)
        shell.wait(timeout=60)
    finally:
        if shell.poll() is None:
            os.killpg(os.getpgid(launcher), signal.SIGKILL)
            shell.kill()
    assert shell.returncode == 0, "".join(lines[-30:])
    states = sorted(tmp_path.glob("dist_iter_*.solverstate"))
    assert len(states) == 1, states
    stopped = int(re.search(r"_iter_(\d+)\.", states[0].name).group(1))
    assert 5 <= stopped < FAR
    s = json.loads(stats.read_text())
    assert s["replicas_identical"] is True  # both ranks stopped after the same iteration
    assert any("Optimization stopped early." in l for l in lines)

    # resume to stopped + 6, and compare with a run that went there without a stop
    target = stopped + 6
    resumed = write_run(tmp_path, digits_db, 16, "dist", iters=target)
    done = poseidon("train", "--solver", str(resumed), "--hosts", str(hosts), "--timeout", "20",
                    "--snapshot", str(states[0]), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    straight = write_run(tmp_path / "straight", digits_db, 16, "straight", iters=target)
    # the same job again, on the plan the stopped run followed (its own probe may plan otherwise)
    done = poseidon("train", "--solver", str(straight), "--hosts", str(hosts), "--timeout", "20",
                    "--plan", str(tmp_path / "dist_plan.prototxt"), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = weights(tmp_path / f"dist_iter_{target}.caffemodel")
    want = weights(tmp_path / "straight" / f"straight_iter_{target}.caffemodel")
    assert max(relative_distance(got, want).values()) <= 1e-6
    assert all(np.array_equal(got[k], want[k]) for k in want)  # in fact bit for bit


def test_sigterm_to_one_process_snapshots_and_exits_0(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 16, "one", iters=FAR, display=1)
    proc = subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", "train", "--solver",
                             str(solver)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = wait_for_line(proc.stderr, r"Iteration 3\b", timeout=60)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines[-20:])
    assert len(list(tmp_path.glob("one_iter_*.solverstate"))) == 1
