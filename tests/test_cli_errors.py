"""Bad input on the command line: one line naming what and where, a non-zero exit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, shared_path

GOOD = """name: "tiny"
layer { name: "in" type: "Input" top: "x" top: "y" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "z" inner_product_param { num_output: 4 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "z" bottom: "y" top: "loss" }
"""


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "POSEIDON_DEBUG"}
    return subprocess.run([sys.executable, "-m", "poseidon_cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode != 0
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("text, needles", [
    (GOOD.replace("num_output: 4", "num_output: four"), ["bad.prototxt:3:", "num_output"]),
    (GOOD.replace("layer { name: \"ip\"", "layer { nme: \"ip\""), ["bad.prototxt:3:", "nme"]),
    (GOOD.replace("InnerProduct\"", "InnerProdukt\""), ["layer 'ip'", "InnerProdukt"]),
    (GOOD.replace("bottom: \"x\" top: \"z\"", "bottom: \"w\" top: \"z\""), ["layer 'ip'", "'w'"]),
    (GOOD + "layer {", ["bad.prototxt:", ]),
    # sizes past the machine's memory, checked before anything is allocated (shapes in Python
    # ints: 2**32 x 3 does not wrap)
    (GOOD.replace("dim: 2 dim: 3 }", "dim: 4294967296 dim: 3000 }"),
     ["layer 'in' (Input)", "(4294967296, 3000)", "more than", "available"]),
    (GOOD.replace("num_output: 4", "num_output: 2000000000").replace("dim: 3 }", "dim: 1000 }"),
     ["layer 'ip' (InnerProduct)", "(2000000000, 1000)", "more than"]),
])
def test_bad_net_files(tmp_path, text, needles):
    net = tmp_path / "bad.prototxt"
    net.write_text(text)
    one_line_error(run("time", "--model", str(net), "--iterations", "1"), *needles)


def test_bad_caffemodels(tmp_path):
    net = tmp_path / "tiny.prototxt"
    net.write_text(GOOD)
    junk = tmp_path / "junk.caffemodel"
    junk.write_bytes(os.urandom(3000))
    one_line_error(run("test", "--model", str(net), "--weights", str(junk), "--iterations", "1"),
                   "junk.caffemodel")
    lenet = shared_path("fixtures", "caffemodels", "lenet_iter_10000.caffemodel")
    cut = tmp_path / "cut.caffemodel"
    cut.write_bytes(lenet.read_bytes()[:5000])
    one_line_error(run("test", "--model", str(net), "--weights", str(cut), "--iterations", "1"),
                   "cut.caffemodel")
    # A caffemodel of another net that shares a layer name with a different shape.
    other = tmp_path / "other.prototxt"
    other.write_text(GOOD.replace('name: "ip"', 'name: "ip1"'))
    one_line_error(run("test", "--model", str(other), "--weights", str(lenet), "--iterations", "1"),
                   "ip1", "(500, 800)", "(4, 3)")


def test_time_needs_positive_iterations(tmp_path):
    net = tmp_path / "tiny.prototxt"
    net.write_text(GOOD)
    one_line_error(run("time", "--model", str(net), "--iterations", "0"), "--iterations")
    ok = run("time", "--model", str(net), "--iterations", "2", "--json")
    assert ok.returncode == 0 and '"forward_backward_ms"' in ok.stdout


def test_an_unknown_layer_type_is_named_at_its_line_with_the_nearest_type(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(GOOD.replace('type: "InnerProduct"', 'type: "InnerProdcut"'))
    one_line_error(run("time", "--model", str(net), "--iterations", "1"),
                   f"{net}:3: layer 'ip': unknown layer type 'InnerProdcut' (did you mean "
                   "'InnerProduct'?)")
    # a solver's net, and a type written twice: the line of the layer that has it
    text = GOOD.replace('layer { name: "loss"', 'layer { name: "act" type: "relu" bottom: "z" '
                        'top: "z" }\nlayer { name: "loss"')
    net.write_text(text.replace('"SoftmaxWithLoss"', '"SoftmaxWithLoss" }\n# type: "relu"\n#'))
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 1')
    done = run("train", "--solver", str(solver))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"poseidon: error: {net}:4: layer 'act': unknown layer type 'relu' (did you mean "
        "'ReLU'?)")
    net.write_text(GOOD.replace('type: "InnerProduct"', 'type: "Quux"'))
    one_line_error(run("time", "--model", str(net), "--iterations", "1"),
                   "layer 'ip': unknown layer type 'Quux'")
    assert "did you mean" not in run("time", "--model", str(net)).stderr
