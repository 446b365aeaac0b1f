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


def test_solver_mode_gpu_without_a_gpu_warns_once_and_trains_on_the_cpu(tmp_path):
    (tmp_path / "net.prototxt").write_text(GOOD)
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 2\n'
                      f'snapshot_prefix: "{tmp_path}/s"\nsolver_mode: GPU\n')
    from engine import backend
    if backend.cupy_available():
        import pytest
        pytest.skip("a GPU is here: solver_mode: GPU then trains on it")
    done = run("train", "-solver", str(solver))
    assert done.returncode == 0, done.stderr
    warnings = [l for l in done.stderr.splitlines() if l.startswith("poseidon: warning:")]
    assert warnings == [f"poseidon: warning: {solver} sets solver_mode: GPU, but CuPy or a GPU "
                        "is missing here: training on the CPU"]
    assert (tmp_path / "s_iter_2.caffemodel").is_file()
