"""Distributed resume: 2 workers, 10 iterations straight == 5, stop, --snapshot, 5 more; and a
run with dropout killed with SIGKILL after a snapshot, resumed, equals the uninterrupted one."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from tests.test_comm_faults import children, kill_all, wait_for_line
from tests.test_comm_train import (ROOT, digits_db, digits_net, poseidon, weights,  # noqa: F401
                                   write_hosts, write_run)


def test_resume_from_a_snapshot_is_exact_with_two_workers(digits_db, tmp_path):  # noqa: F811
    hosts, _ = write_hosts(tmp_path, 2)
    runs = {}
    for name in ("straight", "resumed"):
        solver = write_run(tmp_path, digits_db, 16, name, iters=10)
        solver.write_text(solver.read_text() + "snapshot: 5\n")
        runs[name] = solver
    done = poseidon("train", "--solver", str(runs["straight"]), "--hosts", str(hosts), "--timeout", "20")
    assert done.returncode == 0, done.stderr[-2000:]
    done = poseidon("train", "--solver", str(runs["resumed"]), "--hosts", str(hosts), "--timeout", "20",
                    "--snapshot", str(tmp_path / "straight_iter_5.solverstate"))
    assert done.returncode == 0, done.stderr[-2000:]
    want = weights(tmp_path / "straight_iter_10.caffemodel")
    got = weights(tmp_path / "resumed_iter_10.caffemodel")
    for name, w in want.items():
        assert np.array_equal(got[name], w), name


def dropout_net(db, batch: int) -> str:
    """The digits net with dropout after ip1: every iteration draws a random mask per worker."""
    return digits_net(db, batch).replace(
        'layer { name: "ip2"',
        'layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1"\n'
        '  dropout_param { dropout_ratio: 0.5 } }\nlayer { name: "ip2"')


def test_a_run_with_dropout_killed_and_resumed_equals_the_uninterrupted_one(digits_db,  # noqa: F811
                                                                            tmp_path):
    """kill -9 every process of a 2-worker run after its snapshot at 20, resume, train to 40:
    the dropout masks of iterations 20..39 are those the uninterrupted run drew, because each
    iteration draws from a stream of (seed, rank, iteration) alone."""
    hosts, _ = write_hosts(tmp_path, 2)
    runs = {}
    for name in ("straight", "killed"):
        solver = write_run(tmp_path, digits_db, 16, name, iters=40, net=dropout_net,
                           display=1)
        solver.write_text(solver.read_text() + "snapshot: 20\n")
        runs[name] = solver
    assert "Dropout" in (tmp_path / "killed_net.prototxt").read_text()
    done = poseidon("train", "--solver", str(runs["straight"]), "--hosts", str(hosts),
                    "--timeout", "20", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    # the killed run cannot finish before the kill lands (it goes on far beyond 40; polling
    # the log at a fast machine's pace once let it end first); the resume trains to 40
    killed = runs["killed"].read_text()
    runs["killed"].write_text(killed.replace("max_iter: 40", "max_iter: 100000"))
    log = tmp_path / "killed.log"
    launcher = subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", "train", "--solver",
                                 str(runs["killed"]), "--hosts", str(hosts), "--timeout", "20"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                start_new_session=True)
    tree = [launcher.pid]
    try:
        wait_for_line(log, r"Iteration 2[3-9] ", [launcher], limit=60)
        assert (tmp_path / "killed_iter_20.solverstate").is_file()
        tree += [c for p in children(launcher.pid) for c in [p, *children(p)]]
        kill_all(tree[::-1])  # kill -9: no snapshot, no goodbye
    finally:
        kill_all(tree)
        launcher.wait()
    for f in tmp_path.glob("killed_iter_*"):
        if f.name != "killed_iter_20.solverstate" and f.name != "killed_iter_20.caffemodel":
            f.unlink()
    runs["killed"].write_text(killed)
    done = poseidon("train", "--solver", str(runs["killed"]), "--hosts", str(hosts), "--timeout",
                    "20", "--snapshot", str(tmp_path / "killed_iter_20.solverstate"), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    want = weights(tmp_path / "straight_iter_40.caffemodel")
    got = weights(tmp_path / "killed_iter_40.caffemodel")
    for name, w in want.items():
        rel = np.linalg.norm(got[name] - w) / np.linalg.norm(w)
        assert rel <= 1e-6, (name, rel)
