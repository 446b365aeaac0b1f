"""The zoo's CIFAR10-quick trains on the real CIFAR-10 subset and its loss falls.

The data goes where the zoo's nets look for it (`models/data/cifar10`, relative to the net
files), rebuilt in a temporary copy of the zoo folder so the test leaves the checkout alone.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np

from tests.conftest import ROOT, shared_path


def poseidon(*args: str, cwd=ROOT) -> str:
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_cifar10_quick_loss_falls_on_the_subset(tmp_path):
    cifar = shared_path("data", "cifar10-subset")
    zoo = tmp_path / "models"
    shutil.copytree(ROOT / "models" / "cifar10_quick", zoo / "cifar10_quick")
    data = zoo / "data" / "cifar10"
    poseidon("data", "cifar10", "--from", str(cifar), "--out", str(data))
    poseidon("data", "mean", "--db", str(data / "cifar10_train_lmdb"),
             "--out", str(data / "mean.binaryproto"))
    solver = zoo / "cifar10_quick" / "solver.prototxt"
    text = solver.read_text()
    for key, value in (("max_iter", "60"), ("display", "1"), ("test_interval", "1000"),
                       ("test_iter", "2"), ("snapshot", "0")):
        text = re.sub(rf"^{key}:.*$", f"{key}: {value}", text, flags=re.M)
    solver.write_text(text + "test_initialization: false\nsnapshot_after_train: false\n")
    log = poseidon("train", "--solver", str(solver))
    losses = [float(v) for v in re.findall(r"Iteration \d+ \(.*\), loss = ([0-9.e+-]+)", log)]
    assert len(losses) == 60
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert first > 2.2  # ten classes, from scratch: about ln 10
    assert last < first - 0.2, (first, last)
