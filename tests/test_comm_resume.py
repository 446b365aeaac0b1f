"""Distributed resume: 2 workers, 10 iterations straight == 5, stop, --snapshot, 5 more."""
from __future__ import annotations

import numpy as np

from tests.test_comm_train import digits_db, poseidon, weights, write_hosts, write_run  # noqa: F401


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
