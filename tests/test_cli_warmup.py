"""The CPU kernels compile where a user expects waiting: `poseidon warmup`, or `poseidon train`
before its first iteration, saying so; a kernel compiled elsewhere (pycaffe, `poseidon time`)
is said once. Each test has a cache folder of its own (NUMBA_CACHE_DIR): a new machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

numba = pytest.importorskip("numba")

NET = """name: "tiny"
layer { name: "in" type: "Input" top: "x" top: "y"
        input_param { shape { dim: 2 dim: 1 dim: 6 dim: 6 } shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
        convolution_param { num_output: 2 kernel_size: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "c" top: "z" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "z" bottom: "y" top: "loss" }
"""
#: the kernels and argument types the engine compiles for one float type
FLOAT32_KERNELS = {"im2col float32", "max_pool_backward float32,int8",
                   "max_pool_backward float32,int16", "max_pool_backward float32,int32",
                   "max_pool_forward float32,int8", "max_pool_forward float32,int16",
                   "max_pool_forward float32,int32",
                   "lrn_forward float32", "lrn_backward float32", "sgd_step float32",
                   "relu float32", "relu_mask float32",
                   "images_last float32", "tiles float32", "outputs float32"}


def run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("POSEIDON_DEBUG", "POSEIDON_NUMBA")}
    env["NUMBA_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "poseidon_cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def compiled(stderr: str) -> set[str]:
    return {line.split("compiling ", 1)[1] for line in stderr.splitlines()
            if line.startswith("poseidon:   compiling ")}


def test_warm_reaches_every_kernel():
    """Each compiled kernel has a float32 and a float64 form after the parts' warm-ups: a new
    kernel without a warm-up call fails here."""
    from engine.kernels import cpu
    from poseidon_cli.warming import warm_part

    for dtype in ("float32", "float64"):
        warm_part(dtype)
    for kernel in cpu.KERNELS:
        kinds = {str(a.dtype) for sig in kernel.signatures for a in sig
                 if isinstance(a, numba.types.Array)}
        assert {"float32", "float64"} <= kinds, kernel.py_func.__name__


_LAZY = """
import sys
import numpy as np
import engine.solver, engine.layer_types, poseidon_cli.launch.worker, poseidon_cli.launch.shard
from engine.kernels import cpu
assert "numba" not in sys.modules, "imported with the engine"
first = sys.argv[1]
if first == "cpu":
    cpu.sgd_step(np.zeros(3, np.float32), np.ones(3, np.float32), np.ones(3, np.float32), 1, 1,
                 np.float32(0), np.float32(0.5), np.float32(2))
    assert "numba" in sys.modules
from engine.layers import winograd
winograd.warm(np.dtype(np.float32))  # loaded after the first kernel ran, or before it
cpu.warm(np.dtype(np.float32))
assert {type(k).__name__ for k in cpu.KERNELS} == {"CPUDispatcher"}, cpu.KERNELS
print(" ".join(k.py_func.__name__ for k in cpu.KERNELS))
"""


@pytest.mark.parametrize("first", ["cpu", "winograd"])
def test_numba_is_imported_at_the_first_kernel_call(first, tmp_path):
    """Importing the engine (a launcher, a shard, a worker on the NumPy forms) does not import
    Numba; the first kernel call does, and every kernel is compiled then, those of a module
    imported afterwards too."""
    env = {k: v for k, v in os.environ.items() if k != "POSEIDON_NUMBA"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _LAZY, first], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split()) == ["_im2col", "_images_last", "_lrn_backward",
                                           "_lrn_forward", "_max_pool_backward",
                                           "_max_pool_forward",
                                           "_outputs", "_relu",
                                           "_relu_mask", "_sgd_step", "_tiles"]


@pytest.mark.slow
def test_warmup_then_train_compiles_nothing(tmp_path):
    first = run(tmp_path / "cache", "warmup", "--dtype", "float32")
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    assert lines[0].startswith("poseidon: Compiling the CPU kernels (float32) for this machine")
    assert compiled(first.stderr) == FLOAT32_KERNELS
    assert lines[-1].startswith(f"poseidon: The CPU kernels (float32) are ready: "
                                f"{len(FLOAT32_KERNELS)} compiled")
    again = run(tmp_path / "cache", "warmup", "--dtype", "float32")  # idempotent, from the cache
    assert again.returncode == 0
    assert again.stderr.splitlines() == [again.stderr.splitlines()[-1]]
    assert "ready: 0 compiled" in again.stderr
    # a training finds them compiled: no warm-up, no compile notice
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 max_iter: 2 '
                                              'lr_policy: "fixed" momentum: 0.9')
    trained = run(tmp_path / "cache", "train", "--solver", str(tmp_path / "solver.prototxt"))
    assert trained.returncode == 0, trained.stderr
    assert "ompiling" not in trained.stderr


@pytest.mark.slow
def test_train_compiles_before_its_first_iteration(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 max_iter: 2 '
                                              'lr_policy: "fixed" momentum: 0.9')
    done = run(tmp_path / "cache", "train", "--solver", str(tmp_path / "solver.prototxt"))
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    ready = next(i for i, l in enumerate(lines) if "The CPU kernels (float32) are ready" in l)
    assert lines[0].startswith("poseidon: Compiling the CPU kernels (float32)")
    assert compiled(done.stderr) == FLOAT32_KERNELS
    assert ready < next(i for i, l in enumerate(lines) if "Use CPU." in l)
    assert "(Numba) for this machine, once" not in done.stderr  # nothing compiled in training
    again = run(tmp_path / "cache", "train", "--solver", str(tmp_path / "solver.prototxt"))
    assert again.returncode == 0 and "ompiling" not in again.stderr


@pytest.mark.slow
def test_a_compile_outside_the_warmup_is_said_once(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    cold = run(tmp_path / "cache", "time", "--model", str(tmp_path / "net.prototxt"),
               "--iterations", "2")
    assert cold.returncode == 0, cold.stderr
    notices = [l for l in cold.stderr.splitlines() if "Compiling the CPU kernels" in l]
    assert len(notices) == 1 and "(Numba) for this machine, once" in notices[0], cold.stderr
    assert str(tmp_path / "cache") in notices[0] and "poseidon warmup" in notices[0]
    warm = run(tmp_path / "cache", "time", "--model", str(tmp_path / "net.prototxt"),
               "--iterations", "2")
    assert warm.returncode == 0 and "Compiling" not in warm.stderr


def test_warmup_without_numba_says_so():
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "warmup"], cwd=ROOT,
                          env={**os.environ, "POSEIDON_NUMBA": "0"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    assert "Numba is not in use here" in done.stderr and "nothing to compile" in done.stderr
