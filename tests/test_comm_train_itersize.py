"""Gradient accumulation under the syncer: only the last of iter_size backwards releases.

Two workers, batch 8, iter_size 2 must equal one worker, batch 16, iter_size 2 (the same
images in the same passes). With iter_size > 1 the planner keeps every layer on PS: the
sufficient factors describe one backward only.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_comm_train import digits_db, poseidon, weights, write_hosts, write_run  # noqa: F401

pytestmark = pytest.mark.numpy_kernels


def test_iter_size_two_workers_equal_one_worker(digits_db, tmp_path):  # noqa: F811
    ref = write_run(tmp_path / "ref", digits_db, 16, "ref", iters=10)
    ref.write_text(ref.read_text() + "iter_size: 2\n")
    done = poseidon("train", "--solver", str(ref))
    assert done.returncode == 0, done.stderr[-2000:]
    dist = write_run(tmp_path / "dist", digits_db, 8, "dist", iters=10)
    dist.write_text(dist.read_text() + "iter_size: 2\n")
    hosts, _ = write_hosts(tmp_path, 2)
    stats = tmp_path / "stats.json"
    done = poseidon("train", "--solver", str(dist), "--hosts", str(hosts), "--comm", "hybrid",
                    "--timeout", "20", "--stats", str(stats))
    assert done.returncode == 0, done.stderr[-3000:]
    want = weights(tmp_path / "ref" / "ref_iter_10.caffemodel")
    got = weights(tmp_path / "dist" / "dist_iter_10.caffemodel")
    for name, w in want.items():
        assert np.linalg.norm(got[name] - w) / np.linalg.norm(w) <= 1e-5, name
    s = json.loads(stats.read_text())
    assert {row["scheme"] for row in s["plan"]} == {"ps"}
    assert s["replicas_identical"] is True
