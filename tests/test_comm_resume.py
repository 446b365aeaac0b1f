"""Distributed resume: 2 workers, 10 iterations straight == 5, stop, --snapshot, 5 more, bit for
bit (the snapshot records the plan, and the resumed run follows it); two runs pinned to one plan
(--plan) give the same bits whatever the link; a resume on other workers plans anew and says so;
and a run with dropout killed with SIGKILL after a snapshot, resumed, equals the uninterrupted
one."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.comm.plan_file import read_plan
from tests.test_comm_faults import children, kill_all, wait_for_line
from tests.test_comm_train import (ROOT, digits_db, digits_net, poseidon, weights,  # noqa: F401
                                   write_hosts, write_run)

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.numpy_kernels]


def train(*args: str) -> str:
    """A 2-worker (or more) run that must succeed; its log."""
    done = poseidon("train", *args, "--timeout", "20", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def same_bits(a: Path, b: Path) -> None:
    want, got = weights(a), weights(b)
    assert want.keys() == got.keys()
    for name, w in want.items():
        assert np.array_equal(got[name], w), name


@pytest.mark.parametrize("links", [(), ("100mbit@5ms", "100gbit@5ms")],
                         ids=["probed", "the resumed run's link plans otherwise"])
def test_resume_from_a_snapshot_is_exact_with_two_workers(links, digits_db, tmp_path):  # noqa: F811
    """Each run plans from a probe of the link, and on a busy machine two probes differ; the
    snapshot records the plan, and the resumed run follows it. With two given links whose
    plans differ (tests/test_comm_pinned_plan.py shows they do), the recorded plan wins."""
    hosts, _ = write_hosts(tmp_path, 2)
    runs = {}
    for name in ("straight", "resumed"):
        solver = write_run(tmp_path, digits_db, 16, name, iters=10)
        solver.write_text(solver.read_text() + "snapshot: 5\n")
        runs[name] = solver
    first, second = [["--link", k] for k in links] or [[], []]
    train("--solver", str(runs["straight"]), "--hosts", str(hosts), *first)
    state = tmp_path / "straight_iter_5.solverstate"
    log = train("--solver", str(runs["resumed"]), "--hosts", str(hosts), *second,
                "--snapshot", str(state))
    assert f"(recorded in {state}: the resumed run sums as the run that wrote it)" in log
    assert read_plan(tmp_path / "resumed_plan.prototxt") == read_plan(state)
    same_bits(tmp_path / "straight_iter_10.caffemodel", tmp_path / "resumed_iter_10.caffemodel")


def test_two_runs_pinned_to_one_plan_give_the_same_bits_whatever_the_link(digits_db,  # noqa: F811
                                                                         tmp_path):
    hosts, _ = write_hosts(tmp_path, 2)
    solvers = [write_run(tmp_path, digits_db, 16, name, iters=6) for name in ("a", "b", "c")]
    train("--solver", str(solvers[0]), "--hosts", str(hosts), "--link", "100mbit@5ms")
    plan = tmp_path / "a_plan.prototxt"
    assert "sfb" in plan.read_text()  # the slow link's plan sends the factors
    for solver, link, verbose in zip(solvers[1:], ("100gbit@5ms", "100mbit@5ms"), ([], ["-v"])):
        log = train("--solver", str(solver), "--hosts", str(hosts), "--link", link,
                    "--plan", str(plan), *verbose)
        assert f"(pinned by --plan {plan})" in log
        # the plan's whole table only with -v (the one-line summary always)
        assert ("Plan table: 2 workers" in log) == bool(verbose)
    same_bits(tmp_path / "a_iter_6.caffemodel", tmp_path / "b_iter_6.caffemodel")
    same_bits(tmp_path / "a_iter_6.caffemodel", tmp_path / "c_iter_6.caffemodel")

    # a plan made for other workers is refused, in one line naming the file and why
    edited = tmp_path / "three.prototxt"
    edited.write_text(plan.read_text().replace("world_size: 2", "world_size: 3"))
    done = poseidon("train", "--solver", str(solvers[1]), "--hosts", str(hosts), "--plan",
                    str(edited), "--timeout", "20", timeout=120)
    errors = [l for l in done.stderr.splitlines() if l.startswith("poseidon: error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-2000:]
    assert f"--plan {edited} does not fit this run: it was made for 3 workers, this run has 2" \
        in errors[0]


def test_a_resume_on_other_workers_plans_anew_and_says_so(digits_db, tmp_path):  # noqa: F811
    two, _ = write_hosts(tmp_path, 2)
    three, _ = write_hosts(tmp_path, 3)
    solver = write_run(tmp_path, digits_db, 8, "grow", iters=4)
    solver.write_text(solver.read_text() + "snapshot: 2\n")
    train("--solver", str(solver), "--hosts", str(two))
    state = tmp_path / "grow_iter_2.solverstate"
    log = train("--solver", str(solver), "--hosts", str(three), "--snapshot", str(state))
    assert [l for l in log.splitlines() if "planning anew" in l][0].endswith(
        f"The plan recorded in {state} does not fit this run (it was made for 2 workers, this "
        "run has 3): planning anew")
    assert "Communication plan for 3 workers: " in log


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
    # one job run twice: the second follows the first's plan (two probes may plan otherwise)
    launcher = subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", "train", "--solver",
                                 str(runs["killed"]), "--hosts", str(hosts), "--timeout", "20",
                                 "--plan", str(tmp_path / "straight_plan.prototxt")],
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
