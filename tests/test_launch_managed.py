"""4 workers started as each cluster manager starts them train together, with no hosts file,
to exactly the weights of the same 4 workers started from a hosts file (2 machines x 2 workers
on loopback, one for Open MPI, whose variables do not tell machines apart here).

Each process gets the variables its manager sets, and nothing else of the job but the key:
srun's SLURM_* (rendezvous at the step's first node, on a port derived from the job id),
mpirun's OMPI_COMM_WORLD_* (every rank on this machine: no MASTER_ADDR needed), torchrun's
RANK / LOCAL_RANK / GROUP_RANK / MASTER_*, and a PyTorchJob's pods, each of which starts its
node's 2 workers itself. And when a machine's worker dies, everyone stops naming it.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from engine.comm.auth import KEY_ENV, write_key_file
from poseidon_cli.launch.hostfile import free_base_port
from poseidon_cli.launch.managers import derived_port
from tests.test_comm_faults import (
    DEADLINE,
    TIMEOUT,
    children,
    kill_all,
    wait_for_line,
    wait_gone,
)
from tests.test_comm_train import ROOT, digits_db, poseidon, weights, write_run  # noqa: F401

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.numpy_kernels]

ITERS = 4
BATCH = 8  # per worker
KEY = "cd" * 32


def hosts_file_run(digits_db, d, machines: int, slots: int) -> dict[str, np.ndarray]:  # noqa: F811
    solver = write_run(d, digits_db, BATCH, "ref", iters=ITERS)
    hosts = d / "hosts.txt"
    hosts.write_text("".join(f"127.0.0.1:{free_base_port(slots)} slots={slots}\n"
                             for _ in range(machines)))
    done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--comm", "ps",
                    timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return weights(d / f"ref_iter_{ITERS}.caffemodel")


@pytest.fixture(scope="module")
def reference(digits_db, tmp_path_factory) -> dict[tuple[int, int], dict[str, np.ndarray]]:  # noqa: F811
    """The hosts-file runs, every layer by PS (a fixed order): 2 machines x 2 workers
    (slots=2), and 1 machine x 4. The machines decide the order of the sums (two levels)."""
    return {(m, k): hosts_file_run(digits_db, tmp_path_factory.mktemp(f"hosts{m}x{k}"), m, k)
            for m, k in ((2, 2), (1, 4))}


def free_job(port_of: Callable[[str], int]) -> str:
    """A job id whose derived rendezvous port is free here (the test must not meet another's)."""
    for _ in range(100):
        job = str(random.randrange(10**6))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port_of(job)))
            except OSError:
                continue
        return job
    raise AssertionError("no free derived port")


def srun_env() -> tuple[list[dict[str, str]], int]:
    """srun -N2 --ntasks-per-node=2, on two 'nodes' that are both this machine."""
    job = free_job(lambda j: derived_port(f"{j}.0"))
    return [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(r % 2),
             "SLURM_NODEID": str(r // 2), "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0"}
            for r in range(4)], derived_port(f"{job}.0")


def mpirun_env() -> tuple[list[dict[str, str]], int]:
    """mpirun -np 4 on this machine (Open MPI 4 names its job in OMPI_MCA_ess_base_jobid)."""
    job = free_job(derived_port)
    return [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
             "OMPI_MCA_ess_base_jobid": job} for r in range(4)], derived_port(job)


def torchrun_env(world: int = 4) -> tuple[list[dict[str, str]], int]:
    """torchrun --nnodes 2 --nproc-per-node 2: what each of its workers gets."""
    port = free_base_port(1)
    return [{"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r % 2),
             "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for r in range(world)], port


def pytorchjob_env() -> tuple[list[dict[str, str]], int]:
    """Two pods (master-0, worker-0) with nprocPerNode: "2", as the training operator sets."""
    port = free_base_port(1)
    return [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "4",
             "RANK": str(pod), "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(pod),
             "PET_NNODES": "2", "PYTHONUNBUFFERED": "0"} for pod in range(2)], port


MANAGERS: dict[str, tuple[Callable, str]] = {
    "srun": (srun_env, "Rendezvous (SLURM) at 127.0.0.1:{port}: 4 workers on 2 machines (2, 2 "
                       "workers)"),
    "mpirun": (mpirun_env, "Rendezvous (Open MPI) at 127.0.0.1:{port}: 4 workers on 1 machine "
                           "(4 workers)"),
    "torchrun": (torchrun_env, "Rendezvous (torchrun) at 127.0.0.1:{port}: 4 workers on 2 "
                               "machines (2, 2 workers)"),
    "pytorchjob": (pytorchjob_env, "Rendezvous (torchrun) at 127.0.0.1:{port}: 4 workers on 2 "
                                   "machines (2, 2 workers)"),
}


def start_all(envs: list[dict[str, str]], args: list[str], logs: list[Path],
              key_file: Path | None = None) -> list[subprocess.Popen]:
    """One `poseidon train` per environment, with that manager's variables and nothing of the
    job but its key (in $POSEIDON_JOB_KEY, or the key file)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PET_")) and k not in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", KEY_ENV)}
    extra = ["--key-file", str(key_file)] if key_file else []
    return [subprocess.Popen([sys.executable, "-m", "poseidon_cli.main", "train", *args, *extra],
                             cwd=ROOT, env={**base, **({} if key_file else {KEY_ENV: KEY}), **env},
                             stdout=subprocess.DEVNULL, stderr=log.open("w"),
                             start_new_session=True)
            for env, log in zip(envs, logs)]


def stop(procs: list[subprocess.Popen]) -> None:
    """Every process group we started (a worker, its shard; a pod's workers) is gone after."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@pytest.mark.parametrize("manager", sorted(MANAGERS))
def test_four_workers_started_by_a_manager_match_the_hosts_file_run(manager, reference,
                                                                    digits_db, tmp_path):  # noqa: F811
    make_env, banner = MANAGERS[manager]
    envs, port = make_env()
    solver = write_run(tmp_path, digits_db, BATCH, "m", iters=ITERS)
    logs = [tmp_path / f"p{i}.log" for i in range(len(envs))]
    key_file = None
    if manager == "mpirun":  # the key from a file, as README's "one job, one key" says
        key_file = tmp_path / "job.key"
        write_key_file(key_file)
    procs = start_all(envs, ["--solver", str(solver), "--comm", "ps", "--timeout", "20"], logs,
                      key_file)
    try:
        for p, log in zip(procs, logs):
            assert p.wait(timeout=120) == 0, log.read_text()[-2000:]
    finally:
        stop(procs)
    assert banner.format(port=port) in logs[0].read_text()
    got = weights(tmp_path / f"m_iter_{ITERS}.caffemodel")
    want = reference[(1, 4) if "on 1 machine " in banner else (2, 2)]
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want)  # bit for bit


def test_a_rank_that_never_comes_is_named_in_one_line(digits_db, tmp_path):  # noqa: F811
    envs, port = torchrun_env(world=3)
    envs = envs[:2]  # rank 2 never starts
    solver = write_run(tmp_path, digits_db, BATCH, "x", iters=ITERS)
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = start_all(envs, ["--solver", str(solver), "--timeout", "30", "--startup-timeout", "2"],
                      logs)
    try:
        for p in procs:
            assert p.wait(timeout=30) == 1
    finally:
        stop(procs)
    for log in logs:
        [line] = [ln for ln in log.read_text().splitlines() if ln.startswith("poseidon: error:")]
        assert line.startswith(f"poseidon: error: rendezvous at 127.0.0.1:{port}: rank 2 of 3 "
                               "did not come within 2 s (torchrun;"), line


def test_a_dead_local_worker_stops_the_job_naming_machine_and_worker(digits_db, tmp_path):  # noqa: F811
    """-H with two workers on this machine: kill the second; the launcher names it."""
    solver = write_run(tmp_path, digits_db, BATCH, "long", iters=100000, display=1)
    log = tmp_path / "launcher.log"
    procs = start_all([{}], ["--solver", str(solver), "-H", "127.0.0.1:2", "--timeout",
                             f"{TIMEOUT:g}"], [log])
    launcher = procs[0]
    pids = [launcher.pid]
    try:
        wait_for_line(log, r"Iteration 3 ", [launcher])
        workers = children(launcher.pid)
        pids += workers + [c for w in workers for c in children(w)]
        assert len(pids) == 5  # the launcher, 2 workers, their 2 shards
        victim = next(w for w in workers if "--rank 1" in " ".join(
            Path(f"/proc/{w}/cmdline").read_text().split("\0")))
        os.kill(victim, signal.SIGKILL)
        launcher.wait(timeout=DEADLINE)
        wait_gone([launcher], pids[1:], DEADLINE)
        [line] = [ln for ln in log.read_text().splitlines() if ln.startswith("poseidon: error:")]
        assert ", machine 0 local rank 1) was killed by signal 9; stopped the other 1 worker" \
            in line and line.startswith("poseidon: error: worker 1 (127.0.0.1:"), line
    finally:
        kill_all(pids)
        stop(procs)


@pytest.mark.parametrize("manager", ["srun", "pytorchjob"])
def test_sigterm_from_the_manager_snapshots_once_and_exits_0(manager, digits_db, tmp_path):  # noqa: F811
    """scancel / a pod's deletion: SIGTERM to every task (srun), or to each pod's first
    process, which passes it on. Every worker stops at one iteration; one snapshot."""
    envs, _ = MANAGERS[manager][0]()
    solver = write_run(tmp_path, digits_db, BATCH, "long", iters=100000, display=1)
    logs = [tmp_path / f"p{i}.log" for i in range(len(envs))]
    procs = start_all(envs, ["--solver", str(solver), "--timeout", "20"], logs)
    try:
        wait_for_line(logs[0], r"Iteration 3 ", procs)
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        for p, log in zip(procs, logs):
            assert p.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        stop(procs)
    assert "Optimization stopped early." in logs[0].read_text()
    assert len(list(tmp_path.glob("long_iter_*.solverstate"))) == 1
