"""`poseidon train`'s options and the settings a new user trips on: what its help lists is what
it takes (--wire), Caffe's --level/--stage, --gpus without a GPU, a missing snapshot folder, and
a resume with another number of workers, each said in one line."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.caffe_io import read_solverstate, read_weights, write_solverstate
from engine.comm.errors import CommError
from engine.pb import poseidon_pb2
from poseidon_cli.job_config import JobConfig
from tests.test_cli_errors import one_line_error, run

#: "ip" is built only in the stage "small", "ipbig" only from level 1: which one trains shows
#: which NetState the train net was built with
STAGED = """name: "staged"
layer { name: "in" type: "Input" top: "x" top: "y" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "z" inner_product_param { num_output: 2 }
        include { stage: "small" } }
layer { name: "ipbig" type: "InnerProduct" bottom: "x" top: "z" inner_product_param { num_output: 2 }
        include { min_level: 1 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "z" bottom: "y" top: "loss" }
"""


def solver(tmp_path: Path, net: str, **fields: object) -> Path:
    (tmp_path / "net.prototxt").write_text(net)
    text = 'net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 1 ' + " ".join(
        f"{k}: {v}" for k, v in fields.items())
    (tmp_path / "solver.prototxt").write_text(text)
    return tmp_path / "solver.prototxt"


def test_wire_help_and_behaviour_agree(tmp_path: Path):
    shown = run("train", "--help").stdout
    listed = re.search(r"--wire \[([a-z0-9|]+)\]", shown).group(1).split("|")
    assert "fp32" in listed and "fp16" in listed and "sparse" not in listed
    missing = tmp_path / "missing.prototxt"
    for wire in listed:
        assert JobConfig(solver="s.prototxt", wire=wire).wire == wire
        # past the option's check: the next thing said is about the solver file
        done = run("train", "--solver", str(missing), "-n", "2", "--wire", wire)
        assert done.returncode == 1 and f"solver file {missing} not found" in done.stderr
    refused = run("train", "--solver", str(missing), "-n", "2", "--wire", "sparse")
    assert refused.returncode == 2 and "'sparse' is not one of" in refused.stderr
    with pytest.raises(CommError, match="--wire must be one of"):
        JobConfig(solver="s.prototxt", wire="sparse")


@pytest.mark.parametrize("flags, trained", [
    (["--stage", "small"], "ip"), (["-level", "1"], "ipbig"), (["-stage", "other,small"], "ip")])
def test_level_and_stage_build_the_train_net(tmp_path: Path, flags: list[str], trained: str):
    s = solver(tmp_path, STAGED, snapshot_prefix='"run"')
    done = run("train", "--solver", str(s), *flags)
    assert done.returncode == 0, done.stderr
    # the layer whose weights the snapshot holds is the one the train net was built with
    layers = [name for name, _, blobs in read_weights(tmp_path / "run_iter_1.caffemodel")
              if blobs]
    assert layers == [trained]
    without = run("train", "--solver", str(s))  # neither layer: the loss has no bottom
    assert without.returncode != 0 and "unknown bottom blob 'z'" in without.stderr


def test_gpus_all_without_a_gpu_names_the_flag_given(tmp_path: Path):
    from engine import backend
    if backend.cupy_available():
        pytest.skip("a GPU is here")
    s = str(solver(tmp_path, STAGED))
    for flag in ("--gpus", "--gpu"):
        one_line_error(run("train", "--solver", s, flag, "all"),
                       f"{flag} all: CuPy sees no GPU here (train on the CPU: leave out {flag}")


def test_a_missing_snapshot_folder_is_made_and_named(tmp_path: Path):
    s = solver(tmp_path, STAGED, snapshot_prefix='"snapshots/deep/run"')
    done = run("train", "--solver", str(s), "--stage", "small")
    assert done.returncode == 0, done.stderr
    assert f"Made the snapshot folder {tmp_path / 'snapshots/deep'} (snapshot_prefix " \
        "'snapshots/deep/run')" in done.stderr
    assert (tmp_path / "snapshots/deep/run_iter_1.caffemodel").is_file()
    (tmp_path / "blocked").write_text("a file where the folder would go")
    s = solver(tmp_path, STAGED, snapshot_prefix='"blocked/run"')
    done = run("train", "--solver", str(s), "--stage", "small")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"poseidon: error: solver {s}: cannot write snapshots to prefix 'blocked/run': "
        f"{tmp_path / 'blocked'} is not a writable folder")


def test_resuming_on_other_workers_says_the_batch_changes(tmp_path: Path):
    s = solver(tmp_path, STAGED, snapshot_prefix='"run"')
    assert run("train", "--solver", str(s), "--stage", "small").returncode == 0
    state_path = tmp_path / "run_iter_1.solverstate"
    # as a 2-worker run records it: the plan the workers followed
    state = read_solverstate(state_path)
    state.sync_state = poseidon_pb2.Plan(world_size=2, units=[
        poseidon_pb2.UnitPlan(layers=[1], scheme="ps", names=["ip"])]).SerializeToString()
    write_solverstate(state_path, state)
    s.write_text(s.read_text().replace("max_iter: 1", "max_iter: 2"))
    done = run("train", "--solver", str(s), "--stage", "small", "--snapshot", str(state_path))
    assert done.returncode == 0, done.stderr
    warnings = [l for l in done.stderr.splitlines() if l.startswith("W")]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"{state_path} was written by 2 workers and this run has 1: the global batch is now "
        "1/2 of what it was (the learning rate schedule counts iterations; resume on 2 "
        "workers to keep the batch)")
    # a single process's snapshot resumed on one process: nothing to say
    state.ClearField("sync_state")
    write_solverstate(state_path, state)
    quiet = run("train", "--solver", str(s), "--stage", "small", "--snapshot", str(state_path))
    assert quiet.returncode == 0 and "was written by" not in quiet.stderr
