"""Caffe's command-line habits: single-dash long flags, `device_query`, and `--version`."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

from poseidon_cli.main import caffe_flags
from tests.conftest import ROOT
from tests.test_cli_errors import GOOD


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poseidon_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_single_dash_long_flags_become_double_dash():
    assert caffe_flags(["train", "-solver", "s.prototxt", "-gpu", "0", "-weights=a,b",
                        "-sigint_effect", "snapshot", "-n", "2", "-h", "-1", "--hosts", "h"]) == [
        "train", "--solver", "s.prototxt", "--gpu", "0", "--weights=a,b",
        "--sigint-effect", "snapshot", "-n", "2", "-h", "-1", "--hosts", "h"]


def test_caffe_style_time_command_runs(tmp_path):
    net = tmp_path / "tiny.prototxt"
    net.write_text(GOOD)
    done = run("time", "-model", str(net), "-iterations", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["iterations"] == 2 and [l["name"] for l in report["layers"]] == ["in", "ip", "loss"]


def test_device_query_spelled_as_caffe_does():
    caffe, ours = run("device_query"), run("device-query")
    assert caffe.returncode == 0 == ours.returncode, caffe.stderr
    assert caffe.stdout.splitlines()[0] == ours.stdout.splitlines()[0]
    assert caffe.stdout.startswith("CPU: ")


def test_version():
    done = run("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"poseidon, version {version('poseidon')}"
