"""The distributed path on a GPU: a worker on GPU 0 trains as the CPU does, and two workers
sharing GPU 0 (`-n 2 --gpu 0`) equal one GPU worker with twice the batch, for every scheme.

The gradients leave the device for the communicator (dense schemes: staged on a copy stream
of their own, engine/comm/staging.py) and the averaged ones come back, so this is the whole
GPU training step plus the wire. Same non-chaotic set-up and bound as
test_comm_train.py (see its docstring). Skipped without CuPy and a GPU, as in CI.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import backend
from engine.comm.schemes.gloo import GlooBackend
from engine.comm.schemes.nccl import NcclBackend
from tests.test_comm_train import (BOUND, ITERS, TOTAL_BATCH, digits_db, poseidon,  # noqa: F401
                                   relative_distance, weights, write_run)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")]


#: GPU 0 with direct float32 sums: the runs are compared with the CPU's within BOUND
GPU = ("--gpu", "0", "--gpu-math", "strict")


def train(d: Path, db: Path, batch: int, name: str, *args: str) -> dict[str, np.ndarray]:
    solver = write_run(d, db, batch, name)
    done = poseidon("train", "--solver", str(solver), *args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return weights(d / f"{name}_iter_{ITERS}.caffemodel")


@pytest.fixture(scope="module")
def gpu_reference(digits_db, tmp_path_factory) -> dict[str, np.ndarray]:  # noqa: F811
    return train(tmp_path_factory.mktemp("gpu_ref"), digits_db, TOTAL_BATCH, "ref", *GPU)


def test_one_gpu_worker_trains_as_the_cpu_does(digits_db, gpu_reference, tmp_path):  # noqa: F811
    cpu = train(tmp_path, digits_db, TOTAL_BATCH, "cpu")
    assert max(relative_distance(gpu_reference, cpu).values()) <= BOUND


@pytest.mark.parametrize("comm", ["ps", "sfb", "hybrid", "ring", "shm", "gloo"])
def test_two_workers_sharing_gpu_0_equal_one_gpu_worker_with_twice_the_batch(
        comm, digits_db, gpu_reference, tmp_path):  # noqa: F811
    if comm == "gloo" and GlooBackend.missing(True):
        pytest.skip(f"gloo: {GlooBackend.missing(True)}")
    # (gloo: the GPU's gradients are staged to the host and summed there by Gloo)
    got = train(tmp_path, digits_db, TOTAL_BATCH // 2, "n2", "-n", "2", *GPU, "--comm", comm)
    assert max(relative_distance(got, gpu_reference).values()) <= BOUND


def test_one_nccl_rank_on_gpu_0_trains_as_one_gpu_worker(digits_db, gpu_reference,  # noqa: F811
                                                        tmp_path):
    """NCCL's plumbing, one rank (NCCL refuses two on one GPU): the unique id in the
    handshake, a communicator, the gather, allreduce and mean on the device, the signal op,
    the probe. The sum of one rank is the rank's own gradient, so the run equals one GPU
    worker."""
    if NcclBackend.missing(True):
        pytest.skip(f"nccl: {NcclBackend.missing(True)}")
    solver = write_run(tmp_path, digits_db, TOTAL_BATCH, "nccl")
    done = poseidon("train", "--solver", str(solver), "-n", "1", *GPU, "--comm", "nccl",
                    "--fusion-mb", "0", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Collective engine nccl joined (NCCL " in done.stderr
    assert "travel on nccl (" in done.stderr
    got = weights(tmp_path / f"nccl_iter_{ITERS}.caffemodel")
    assert max(relative_distance(got, gpu_reference).values()) <= BOUND
