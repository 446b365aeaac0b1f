"""`poseidon train -solver S -n N`: N local workers on free ports, no hosts file (torchrun's
--nproc-per-node). Two such jobs on one machine at once do not collide."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.test_comm_train import (BOUND, ROOT, TOTAL_BATCH, digits_db, poseidon,  # noqa: F401
                                   relative_distance, weights, write_run)

pytestmark = pytest.mark.numpy_kernels

ITERS = 10


def test_two_local_workers_equal_one_with_twice_the_batch(digits_db, tmp_path):  # noqa: F811
    ref = write_run(tmp_path / "ref", digits_db, TOTAL_BATCH, "ref", iters=ITERS)
    done = poseidon("train", "-solver", str(ref))
    assert done.returncode == 0, done.stderr[-2000:]
    dist = write_run(tmp_path / "n2", digits_db, TOTAL_BATCH // 2, "n2", iters=ITERS)
    stats, logs = tmp_path / "stats.json", tmp_path / "logs"
    done = poseidon("train", "-solver", str(dist), "-n", "2", "--stats", str(stats),
                    "--log-dir", str(logs))
    assert done.returncode == 0, done.stderr[-2000:]
    # --log-dir: each rank's whole log, rank 1's too, though its console stays quiet
    for rank in (0, 1):
        text = (logs / f"rank{rank}.log").read_text()
        assert "Solving CommNet" in text and "Optimization Done." in text, text[-500:]
    assert "Snapshotting solver state" in (logs / "rank0.log").read_text()
    s = json.loads(stats.read_text())
    assert s["world_size"] == 2 and s["replicas_identical"] is True
    assert ("The losses and outputs below are rank 0's, over its 16 of the 32 images of each "
            "iteration") in done.stderr
    got = weights(tmp_path / "n2" / f"n2_iter_{ITERS}.caffemodel")
    want = weights(tmp_path / "ref" / f"ref_iter_{ITERS}.caffemodel")
    assert max(relative_distance(got, want).values()) <= BOUND


def test_two_jobs_at_once_do_not_collide(digits_db, tmp_path):  # noqa: F811
    """Two jobs of one machine at once, each on free ports and shared-memory segments of its
    own. The scheme is pinned: auto plans from a probed link, and two plans that differ sum in
    different orders (both right, not bit-equal)."""
    procs = []
    for job in ("a", "b"):
        solver = write_run(tmp_path / job, digits_db, 8, job, iters=ITERS)
        procs.append(subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", "train",
                                       "--solver", str(solver), "--np", "2", "--comm", "shm"],
                                      cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    a = weights(tmp_path / "a" / f"a_iter_{ITERS}.caffemodel")
    b = weights(tmp_path / "b" / f"b_iter_{ITERS}.caffemodel")
    assert all(np.array_equal(a[k], b[k]) for k in a)  # same job twice: the same weights


def test_log_dir_without_workers_is_one_clear_error(tmp_path):
    solver = tmp_path / "s.prototxt"
    solver.write_text('net: "n.prototxt"\n')
    done = poseidon("train", "-solver", str(solver), "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 1 and done.stderr.startswith("poseidon: error: --log-dir names")


def test_n_and_hosts_together_is_one_clear_error(tmp_path):
    solver = tmp_path / "s.prototxt"
    solver.write_text('net: "n.prototxt"\n')
    done = poseidon("train", "-solver", str(solver), "-n", "2", "--hosts", "h.txt")
    assert done.returncode == 1
    assert done.stderr.strip() == ("poseidon: error: -n starts local workers on free ports: "
                                   "give -n or --hosts/--rank, not both")
