"""`--gpu` with `--hosts`: every local worker gets its GPU (0 included), round robin per machine.

There is no GPU in CI, so this is checked at the level of each worker's command line.
"""
from __future__ import annotations

import io

import pytest

from poseidon_cli.launch import launcher, tables
from poseidon_cli.job_config import JobConfig
from poseidon_cli.launch.hostfile import parse_hosts_text
from poseidon_cli.launch.tables import resolve
from poseidon_cli.commands.train import parse_gpus
from tests.test_cli_caffe_habits import run


def test_gpus_are_assigned_round_robin_per_machine():
    entries = parse_hosts_text("127.0.0.1:29000\n127.0.0.1:29002\n127.0.0.1:29004\n"
                               "192.0.2.7:29000\n192.0.2.7:29002\n")
    assert tables.assign_gpus(entries, (0, 1)) == {0: 0, 1: 1, 2: 0, 3: 0, 4: 1}
    assert tables.assign_gpus(entries, (0,)) == {r: 0 for r in range(5)}
    assert tables.assign_gpus(entries, None) == {r: None for r in range(5)}


def test_parse_gpus():
    assert parse_gpus("0") == [0] and parse_gpus("0,1,3") == [0, 1, 3]
    with pytest.raises(ValueError, match="expected a device id"):
        parse_gpus("zero")


class FakeWorker:
    """Stands in for a worker process: records its command line and exits 0 at once."""
    commands: list[list[str]] = []

    def __init__(self, cmd: list[str], **_: object) -> None:
        FakeWorker.commands.append(cmd)
        self.pid = 0
        self.returncode = 0
        self.stderr = io.BytesIO()  # read to its end by the launcher's error relay
        self.stdin = io.BytesIO()  # the host table goes here

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_gpu_0_with_hosts_reaches_every_local_worker(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("127.0.0.1:29000\n127.0.0.1:29002\n127.0.0.1:29004\n")
    monkeypatch.setattr(launcher.subprocess, "Popen", FakeWorker)
    monkeypatch.setattr(launcher, "_signal_group", lambda p, sig: None)
    for gpu, want in (((0,), ["0", "0", "0"]), ((0, 1), ["0", "1", "0"])):
        FakeWorker.commands = []
        launcher.run(JobConfig("s.prototxt", str(hosts), gpus=gpu),
                     resolve(str(hosts), None, None, None))
        got = [cmd[cmd.index("--gpu") + 1] for cmd in FakeWorker.commands]
        ranks = [cmd[cmd.index("--rank") + 1] for cmd in FakeWorker.commands]
        assert (ranks, got) == (["0", "1", "2"], want)
        # the job's configuration goes on standard input, not where `ps` shows it
        assert not any("s.prototxt" in arg for cmd in FakeWorker.commands for arg in cmd)


def test_several_gpus_without_hosts_is_one_clear_error(tmp_path):
    done = run("train", "-solver", str(tmp_path / "missing.prototxt"))
    assert done.returncode == 1  # the solver is checked first
    solver = tmp_path / "s.prototxt"
    solver.write_text('net: "n.prototxt"\n')
    done = run("train", "-solver", str(solver), "-gpu", "0,1")
    assert done.returncode == 1
    assert done.stderr.strip() == ("poseidon: error: --gpu 0,1: one process trains on one GPU; "
                                   "give --hosts to train on several")
