"""The launcher's pieces (ranks, commands, supervision) and the Net adapter (bind)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.comm.bind import describe_net
from engine.comm.errors import CommError
from engine.comm.hosts import table_from_json
from engine.comm.planner import plan_layers
from poseidon_cli.job_config import JobConfig
from poseidon_cli.launch.hostfile import parse_hosts_text
from poseidon_cli.launch.launcher import run, ssh_command, supervise, worker_command, worker_input
from poseidon_cli.launch.managers import rank_from_env
from poseidon_cli.launch.tables import resolve


def test_rank_from_the_environment():
    assert rank_from_env({}) is None
    assert rank_from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}) == (3, 4, "SLURM")
    # torchrun or mpirun inside a SLURM allocation: the per-process launcher's rank wins
    assert rank_from_env({"SLURM_PROCID": "0", "RANK": "1"}) == (1, None, "torchrun")
    assert rank_from_env({"OMPI_COMM_WORLD_RANK": "2"}) == (2, None, "Open MPI")
    assert rank_from_env({"PMI_RANK": "0", "PMI_SIZE": "2"}) == (0, 2, "MPICH / Intel MPI")
    with pytest.raises(CommError, match="RANK='x'"):
        rank_from_env({"RANK": "x"})


def test_a_worker_gets_the_jobs_configuration_as_typed_json():
    config = JobConfig("s.prototxt", "h.txt", comm="sfb", weights=("a.caffemodel", "b.caffemodel"),
                       gpus=(0, 1), stats="stats.json", signal_effects={"SIGINT": "snapshot"},
                       log_dir="logs")
    cmd = worker_command(2, 1)
    assert cmd[1:] == ["-m", "poseidon_cli.launch.worker", "--rank", "2", "--gpu", "1"]
    assert "--gpu" not in worker_command(0, None)
    entries = parse_hosts_text("127.0.0.1:7000\n127.0.0.1:7002\n")
    config_line, table_line = worker_input(config, entries).decode().splitlines()
    assert JobConfig.from_json(config_line) == config  # on standard input, where ps sees nothing
    assert table_from_json(table_line, "stdin") == entries
    assert worker_input(config, None).decode().splitlines() == [config_line]
    [entry] = parse_hosts_text("10.1.2.3:7000")
    ssh = ssh_command(entry, ["python", "-m", "x", "--solver", "my solver.prototxt"])
    assert ssh[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5"]
    assert ssh[5] == "10.1.2.3" and ssh[6].endswith("exec python -m x --solver 'my solver.prototxt'")


def test_supervise_names_the_failing_process_and_stops_the_rest():
    ok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    bad = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"], start_new_session=True)
    try:
        with pytest.raises(CommError, match=r"worker 1 \(h:1\) exited with code 3; stopped the other 1 "
                                            r"worker; last good snapshot: none"):
            supervise({"worker 0 (h:0)": ok, "worker 1 (h:1)": bad})
        assert ok.wait(timeout=10) != 0
    finally:
        ok.kill()
        ok.wait()


def test_run_rejects_what_it_cannot_do(tmp_path):
    hosts = tmp_path / "h"
    hosts.write_text("127.0.0.1:23000\n")
    with pytest.raises(CommError, match="--rank 3 out of range"):
        run(JobConfig("s", str(hosts)), resolve(str(hosts), None, None, None), rank=3)
    with pytest.raises(CommError, match="cannot read hosts file"):
        resolve(str(tmp_path / "missing"), None, None, None)


@pytest.mark.parametrize("text, needle", [
    ("[]", "not a JSON object"),
    ("{", "not JSON"),
    ('{"solver": "s"}', "no 'hosts'"),
    ('{"solver": "s", "hosts": "h", "gpu": 1}', "unknown field(s) gpu"),
    ('{"solver": "s", "hosts": "h", "timeout": "30"}', "'timeout' has the wrong type"),
    ('{"solver": "s", "hosts": "h", "gpus": [-1]}', "'gpus' has the wrong type"),
    ('{"solver": "s", "hosts": "h", "comm": "allreduce"}', "--comm must be one of"),
        ('{"solver": "s", "hosts": "h", "wire": "fp8"}', "--wire must be one of"),
    ('{"solver": "s", "hosts": "h", "signal_effects": {"SIGINT": "explode"}}', "SIGINT='explode'"),
])
def test_a_bad_configuration_is_named(text, needle):
    with pytest.raises(CommError) as e:
        JobConfig.from_json(text)
    assert needle in str(e.value)


NET = """name: "bind"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 5 dim: 2 dim: 3 } } }
layer { name: "in2" type: "Input" top: "x2" input_param { shape { dim: 5 dim: 3 } } }
layer { name: "fc" type: "InnerProduct" bottom: "x" top: "a"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "fct" type: "InnerProduct" bottom: "a" top: "b"
        inner_product_param { num_output: 3 transpose: true weight_filler { type: "gaussian" std: 1 }
                              bias_filler { type: "gaussian" std: 1 } } }
layer { name: "scale" type: "Scale" bottom: "b" top: "c" scale_param { bias_term: true } }
layer { name: "loss" type: "EuclideanLoss" bottom: "c" bottom: "x2" top: "loss" }
"""


def test_bind_describes_layers_and_factors_rebuild_the_gradient(tmp_path):
    from engine.net import Net
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    net = Net(str(path))
    rng = np.random.default_rng(0)
    net.blobs["x"].data[...] = rng.standard_normal((5, 2, 3))
    net.blobs["x2"].data[...] = rng.standard_normal((5, 3))
    net.clear_param_diffs()
    net.forward_prefilled()
    net.backward()
    slots, infos = describe_net(net)
    by_name = {s.name: s for s in slots.values()}
    assert [i.name for i in infos] == ["fc", "fct", "scale"]
    assert by_name["fc"].factor_shape == (5, 6, 4)
    assert by_name["fct"].factor_shape == (5, 4, 3)
    assert by_name["scale"].factors is None and by_name["scale"].factor_shape is None
    for name in ("fc", "fct"):
        slot = by_name[name]
        u, v = (np.asarray(a).copy() for a in slot.factors())
        backward = [p.blob.diff.copy() for p in slot.params]
        # the factors of one worker rebuild what its backward computed; of two, their sum
        slot.rebuild(u, v)
        for p, d in zip(slot.params, backward):
            np.testing.assert_allclose(p.blob.diff, d, rtol=1e-5, atol=1e-6)
        slot.rebuild(np.concatenate([u, 3 * u]), np.concatenate([v, v]))
        for p, d in zip(slot.params, backward):
            np.testing.assert_allclose(p.blob.diff, 4 * d, rtol=1e-5, atol=1e-6)
    plans = plan_layers(infos, 2, comm="sfb")
    assert [p.scheme for p in plans] == ["sfb", "sfb", "ps"]
    # a layer synchronised by SFB skips its own weight-gradient GEMM: the rebuild replaces it
    slot = by_name["fc"]
    slot.defer_weight_gradient(True)
    net.clear_param_diffs()
    net.forward_prefilled()
    net.backward()
    assert not np.any(slot.params[0].blob.diff)
    u, v = (np.asarray(a) for a in slot.factors())
    np.testing.assert_allclose(u.sum(0), slot.params[1].blob.diff, rtol=1e-5, atol=1e-6)
    assert np.any(by_name["fct"].params[0].blob.diff)


def test_ssh_launch_hands_the_job_key_over_stdin(tmp_path, monkeypatch):
    """--launch ssh, with an `ssh` that runs the remote command here: rank 1 gets the key the
    launcher made on its standard input (not in its environment, not on a command line), and
    the two ranks train together."""
    import os
    import re

    from engine.comm.auth import KEY_ENV
    from engine.data.converters import convert_digits
    from poseidon_cli.launch import launcher
    from tests.test_comm_train import write_hosts, write_run

    convert_digits(tmp_path / "db")
    solver = write_run(tmp_path, tmp_path / "db" / "digits_train_lmdb", 16, "ssh", iters=5)
    hosts, _ = write_hosts(tmp_path, 2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "ssh_args"
    fake = bin_dir / "ssh"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {seen}\n'
                    f'[ -z "${KEY_ENV}" ] || {{ echo "key in the environment" >&2; exit 9; }}\n'
                    'for last; do :; done\nexec sh -c "$last"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setattr(launcher, "is_local", lambda e, local=None: e.rank == 0)
    config = JobConfig(str(solver), str(hosts), timeout=20.0)
    launcher.run(config, resolve(str(hosts), None, None, None), launch="ssh")
    args = seen.read_text()
    assert "--rank 1" in args and "--rank 0" not in args
    assert f"read -r {KEY_ENV}" in args and not re.search(r"[0-9a-f]{64}", args)
    assert (tmp_path / "ssh_iter_5.caffemodel").is_file()


def test_a_managers_rank_is_the_rank_in_the_hosts_file(tmp_path, monkeypatch):
    """`srun poseidon train --hosts H`: SLURM's size must be the file's."""
    from poseidon_cli.launch.launcher import start

    hosts = tmp_path / "h"
    hosts.write_text("127.0.0.1:23000 slots=2\n")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(CommError, match=f"SLURM started 4 workers, but {hosts} lists 2$"):
        start(JobConfig("s", str(hosts)), None, str(hosts), None, None, None, "local")


def test_a_shard_that_outlives_its_wait_or_fails_is_one_comm_error():
    """A worker waits for its shard after BYE; a shard still waiting for a killed worker's
    time-out (later on a busy machine) or one that failed is a CommError naming it, which an
    elastic survivor ends its generation on, not an exception that ends its process."""
    from poseidon_cli.launch.worker import shard_ended

    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(CommError, match=r"shard 3 \(h:1\) did not end within 0.2 s"):
            shard_ended(slow, 0.2, "shard 3 (h:1)")
    finally:
        slow.kill()
        slow.wait()
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(CommError, match=r"shard 3 \(h:1\) exited with code 3"):
        shard_ended(failed, 30, "shard 3 (h:1)")
    shard_ended(subprocess.Popen([sys.executable, "-c", "pass"]), 30, "shard 3 (h:1)")
