"""Elastic training in the emulated cluster: a machine taken away, not only a process.

Three hosts each run one worker that joined the driver by hand (as srun or a pod starts them);
a fourth host runs the driver. Every process of one worker's host is killed at once (a
reclaimed spot machine): the driver sees its connection close (or its silence), the other two
go on from the commit, and the job finishes. Needs root and iproute2; skipped, saying so,
without them.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

from engine.comm.auth import write_key_file
from engine.perf.netns import EmulatedCluster, _kill_in_namespace
from tests.test_comm_train import ROOT, digits_db, write_run  # noqa: F401
from tests.test_elastic_train import LINE_S
from tests.test_perf_netns import needs_namespaces

pytestmark = needs_namespaces

K = 5


def test_a_machine_taken_away_leaves_the_others_training(digits_db, tmp_path):  # noqa: F811
    key = tmp_path / "job.key"
    write_key_file(key)
    solver = write_run(tmp_path, digits_db, 8, "el", iters=60, display=1)
    common = ["--solver", str(solver), "--elastic", "--key-file", str(key), "--commit-every",
              str(K), "--timeout", "10"]
    logs = {name: tmp_path / f"{name}.log" for name in ("driver", "w0", "w1", "w2")}

    def run(c: EmulatedCluster, host: int, name: str, args: list[str]) -> subprocess.Popen:
        with logs[name].open("w") as f:
            return c.run(host, [sys.executable, "-m", "poseidon_cli.main", "train", *common,
                                *args], stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT)

    def wait(pattern: str, name: str) -> re.Match:
        deadline = time.monotonic() + LINE_S
        while time.monotonic() < deadline:
            m = re.search(pattern, logs[name].read_text(), re.M)
            if m:
                return m
            time.sleep(0.02)
        raise AssertionError(f"{pattern!r} not in {name}'s log:\n"
                             f"{logs[name].read_text()[-2000:]}")

    with EmulatedCluster(4, 1e9) as c:  # everything started inside is killed on the way out
        driver = run(c, 3, "driver", ["--min-workers", "2", "--max-workers", "3",
                                      "--rendezvous-port", "29400"])
        for h in range(3):
            run(c, h, f"w{h}", ["--rendezvous", f"{c.addresses[3]}:29400"])
        wait(r"Elastic generation 1: 3 workers", "driver")
        deadline = time.monotonic() + LINE_S
        rank0 = None
        while rank0 is None and time.monotonic() < deadline:
            rank0 = next((h for h in range(3) if "] Iteration 1 (" in
                          logs[f"w{h}"].read_text()), None)
            time.sleep(0.02)
        assert rank0 is not None
        victim = (rank0 + 1) % 3
        wait(rf"\] Iteration {2 * K + 2} \(", f"w{rank0}")
        _kill_in_namespace(c.namespaces[victim])
        # Seen at once, by the connection's close; or, when the driver's monitor missed that
        # close, by silence after --timeout (seen once, 2026-11-26: the killed worker's close
        # matched no worker; a race in the driver's bookkeeping of connections, suspected
        # between ZeroMQ's ACCEPTED event and the JOIN, not established). Both are documented
        # outcomes, and the rest is the same
        m = wait(rf"Elastic: lost worker \d \({re.escape(c.addresses[victim])}:\d+\): (its "
                 r"connection to the driver closed \(the process ended, or its machine went\)|"
                 r"nothing heard for 10 s \(the process hangs, or its machine went\))\. "
                 r"Generation 2: 2 workers from commit (\d+)", "driver")
        assert int(m.group(2)) % K == 0 and int(m.group(2)) >= 2 * K
        assert driver.wait(LINE_S) == 0, logs["driver"].read_text()[-2000:]
        assert "Optimization Done." in logs[f"w{rank0}"].read_text()
    assert (tmp_path / "el_iter_60.caffemodel").is_file()
