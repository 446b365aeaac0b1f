"""Hosts-file mistakes a user makes are named at once, with the file and line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.comm.hosts import HostsError
from poseidon_cli.launch.hostfile import parse_hosts

pytestmark = pytest.mark.numpy_kernels

ROOT = Path(__file__).resolve().parent.parent


def test_unresolvable_host_names_the_line(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("127.0.0.1:29000\nlocalhsot:29002\n")
    with pytest.raises(HostsError, match=r"hosts.txt:2: host 'localhsot' does not resolve"):
        parse_hosts(hosts)


def test_train_with_a_typo_in_a_host_name_fails_at_once(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("0 127.0.0.1 29000\n1 localhsot 29002\n")
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "train", "--solver",
                           str(ROOT / "models" / "digits_lenet" / "solver.prototxt"),
                           "--hosts", str(hosts)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1  # at once: the one line below is all it printed, no net built
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"poseidon: error: {hosts}:2: host 'localhsot' does not resolve")
