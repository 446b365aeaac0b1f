"""A snapshot on a full disk stops every rank at once with one line naming ENOSPC and the file.

Before, rank 0 went silent and the run ended, a --timeout later, blaming another rank. The full
disk is a 200 KB tmpfs (mounting one needs root; the test skips, saying so, without it); the
digits net's snapshot needs about 530 KB. Nothing half-written may be left on it.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from engine.comm.plan_file import read_plan
from tests.test_comm_train import digits_db, poseidon, write_hosts, write_run  # noqa: F401

pytestmark = pytest.mark.numpy_kernels


@pytest.fixture
def full_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (the full disk) needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_snapshot_on_a_full_disk_names_enospc_and_the_path(workers, full_disk, digits_db,  # noqa: F811
                                                            tmp_path):
    solver = write_run(tmp_path, digits_db, 16, "run", iters=40)
    text = solver.read_text().replace(f'snapshot_prefix: "{tmp_path / "run"}"',
                                      f'snapshot_prefix: "{full_disk / "run"}"\nsnapshot: 10')
    assert "snapshot: 10" in text
    solver.write_text(text)
    # at once, not after --timeout: a run that waited for it would outlive the liveness bound
    args = ["train", "--solver", str(solver), "--timeout", "600"]
    if workers > 1:
        hosts, _ = write_hosts(tmp_path, workers)
        args += ["--hosts", str(hosts)]
    done = poseidon(*args, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("poseidon: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "No space left on device (ENOSPC)" in errors[0], errors
    assert str(full_disk / "run_iter_10.caffemodel") in errors[0], errors
    assert "Traceback" not in done.stderr
    # no half-written snapshot: at most the plan rank 0 wrote at start, whole
    left = list(full_disk.iterdir())
    assert [p.name for p in left] in ([], ["run_plan.prototxt"]), left
    for p in left:
        assert read_plan(p).world_size == workers
