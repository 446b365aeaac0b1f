"""Files that do not fit: weights of another net, a partial copy, and a file of another kind
given to a flag (a .solverstate as --weights, a solver as --model, a net as --solver), each
named in one line with what to do."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engine.caffe_io import FormatError, load_trained_weights, save_net
from engine.caffe_io.kinds import kind_of
from engine.net import Net
from tests.conftest import shared_path
from tests.test_cli_errors import one_line_error, run

NET = """name: "tiny"
layer { name: "in" type: "Input" top: "x" top: "y" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "h" inner_product_param { num_output: 4 } }
layer { name: "ip2" type: "InnerProduct" bottom: "h" top: "z" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "z" bottom: "y" top: "loss" }
"""


@pytest.fixture
def nets(tmp_path: Path) -> Path:
    """net.prototxt and its weights; other.prototxt (no layer name in common: fc6, fc7) and
    its weights; renamed.prototxt (ip2 renamed out, learned from scratch); their solvers."""
    texts = {"net": NET, "other": NET.replace('"ip"', '"fc6"').replace('"ip2"', '"fc7"'),
             "renamed": NET.replace('"ip2"', '"out"')}
    for name, text in texts.items():
        (tmp_path / f"{name}.prototxt").write_text(text)
        (tmp_path / f"{name}_solver.prototxt").write_text(
            f'net: "{name}.prototxt" base_lr: 0.1 max_iter: 1 lr_policy: "fixed" '
            'snapshot_after_train: false')
    for name in ("net", "other"):
        save_net(Net(tmp_path / f"{name}.prototxt"), tmp_path / f"{name}.caffemodel")
    return tmp_path


def last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["train", "test"])
def test_weights_of_another_net_are_refused(nets: Path, command: str):
    args = (["train", "--solver", str(nets / "net_solver.prototxt")] if command == "train" else
            ["test", "--model", str(nets / "net.prototxt"), "--iterations", "1"])
    done = run(*args, "--weights", str(nets / "other.caffemodel"))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "Optimization" not in done.stderr
    line = last_line(done)
    assert line.startswith("poseidon: error: ") and "other.caffemodel" in line
    assert "no layer with weights in common with net 'tiny'" in line
    assert "first layer with weights is 'fc6' (InnerProduct), the net's is 'ip'" in line
    assert "Ignoring source layer" not in done.stderr  # the error comes before any copy


def test_a_partial_copy_is_one_warning_naming_what_was_not_copied(nets: Path):
    done = run("train", "--solver", str(nets / "renamed_solver.prototxt"), "--weights",
               str(nets / "net.caffemodel"))
    assert done.returncode == 0, done.stderr
    warnings = [l for l in done.stderr.splitlines() if l.startswith("W")]
    assert len(warnings) == 1, done.stderr  # the train net's, not once more per test net
    assert warnings[0].endswith("net.caffemodel: copied 1 of the 2 layers with weights of net "
                                "'tiny'; not in the file, so left as their fillers made them: out")


def test_the_copy_is_by_name_into_every_net(nets: Path):
    net, test_net = Net(nets / "renamed.prototxt"), Net(nets / "renamed.prototxt", phase="TEST")
    source = Net(nets / "net.prototxt")
    copied = load_trained_weights([net, test_net], nets / "net.caffemodel")
    assert "ip" in copied and "out" not in copied
    for n in (net, test_net):
        assert (n.params["ip"][0].data == source.params["ip"][0].data).all()
    with pytest.raises(FormatError, match="no layer with weights in common"):
        load_trained_weights([Net(nets / "other.prototxt")], nets / "net.caffemodel")


ORACLE = ("fixtures", "oracle", "train")


@pytest.mark.parametrize("name, kind", [
    ("lenet_iter_100.solverstate", "solverstate"), ("lenet_iter_100.caffemodel", "caffemodel"),
    ("lenet_solver.prototxt", "solver"), ("lenet_train_test.prototxt", "net"),
    ("h5/lenet_iter_100.caffemodel.h5", "caffemodel"),
    ("h5/lenet_iter_100.solverstate.h5", "solverstate"), ("train_lenet.log", None)])
def test_caffes_files_are_told_apart(name: str, kind: str | None):
    assert kind_of(shared_path(*ORACLE, *name.split("/"))) == kind


@pytest.mark.parametrize("flag, name, needles", [
    ("--weights", "lenet_iter_100.solverstate", ["is a solverstate", "not a caffemodel",
                                                 "resume from it with `poseidon train --snapshot`"]),
    ("--weights", "h5/lenet_iter_100.solverstate.h5", ["is a solverstate", "--snapshot"]),
    ("--weights", "lenet_solver.prototxt", ["is a solver prototxt", "poseidon train --solver"]),
    ("--snapshot", "lenet_iter_100.caffemodel", ["is a caffemodel", "not a solverstate",
                                                 "weights go to `--weights`"]),
    ("--snapshot", "h5/lenet_iter_100.caffemodel.h5", ["is a caffemodel", "--weights"]),
])
def test_train_names_the_flag_a_file_belongs_to(tmp_path: Path, flag: str, name: str,
                                                needles: list[str]):
    solver = shared_path(*ORACLE, "lenet_solver.prototxt")
    done = run("train", "--solver", str(solver), flag, str(shared_path(*ORACLE, *name.split("/"))))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    line = last_line(done)
    assert line.startswith("poseidon: error: ") and name.split("/")[-1] in line
    for needle in needles:
        assert needle in line, line


def test_a_solver_as_a_net_and_a_net_as_a_solver(tmp_path: Path):
    solver = str(shared_path(*ORACLE, "lenet_solver.prototxt"))
    net = str(shared_path(*ORACLE, "lenet_train_test.prototxt"))
    weights = str(shared_path(*ORACLE, "lenet_iter_100.caffemodel"))
    for args in (["test", "--model", solver, "--weights", weights],
                 ["time", "--model", solver]):
        one_line_error(run(*args), "lenet_solver.prototxt is a solver prototxt, not a net "
                       "prototxt: a solver goes to `poseidon train --solver`")
    one_line_error(run("train", "--solver", net), "lenet_train_test.prototxt is a net prototxt, "
                   "not a solver prototxt: a net goes to `poseidon test|time --model`, or into "
                   "a solver's `net:`")
