"""`poseidon test` scores the real trained models at their stated accuracy, on LMDBs that
`poseidon data` writes from the real data sets (LeNet 99.14% on MNIST, CIFAR10-quick 76.8%)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from google.protobuf import text_format

from engine.caffe_io import read_net_prototxt
from engine.pb import caffe_pb2
from tests.conftest import ROOT, shared_path


def poseidon(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "poseidon_cli.main", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def scoring_net(deploy: Path, source: Path, batch: int, transform: str, out: Path) -> Path:
    """The deploy net with its Input replaced by a TEST Data layer and an Accuracy on top."""
    net = read_net_prototxt(deploy)
    layers = [l for l in net.layer if l.type not in ("Input", "Softmax")]
    last = layers[-1].top[0]
    head = caffe_pb2.NetParameter()
    text_format.Parse(f"""
      layer {{ name: "data" type: "Data" top: "data" top: "label"
               transform_param {{ {transform} }}
               data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}""", head)
    tail = caffe_pb2.NetParameter()
    text_format.Parse(f"""
      layer {{ name: "accuracy" type: "Accuracy" bottom: "{last}" bottom: "label" top: "accuracy" }}
      layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "{last}" bottom: "label" top: "loss" }}""",
                      tail)
    del net.layer[:]
    net.layer.extend(list(head.layer) + layers + list(tail.layer))
    out.write_text(text_format.MessageToString(net))
    return out


def accuracy_of(log: str) -> float:
    return float(re.findall(r"\] accuracy = ([0-9.]+)", log)[-1])


def test_poseidon_test_lenet_on_mnist(tmp_path):
    models = shared_path("fixtures", "caffemodels")
    poseidon("data", "mnist", "--from", str(shared_path("data", "mnist")), "--out", str(tmp_path))
    net = scoring_net(models / "lenet.prototxt", tmp_path / "mnist_test_lmdb", 500,
                      "scale: 0.00390625", tmp_path / "lenet_score.prototxt")
    log = poseidon("test", "--model", str(net), "--weights",
                   str(models / "lenet_iter_10000.caffemodel"), "--iterations", "20")
    assert accuracy_of(log) == 0.9914


def test_poseidon_test_cifar10_quick_on_the_subset(tmp_path):
    models = shared_path("fixtures", "caffemodels")
    poseidon("data", "cifar10", "--from", str(shared_path("data", "cifar10-subset")),
             "--out", str(tmp_path))
    net = scoring_net(models / "cifar10_quick.prototxt", tmp_path / "cifar10_test_lmdb", 100,
                      f'mean_file: "{models / "cifar10_mean.binaryproto"}"',
                      tmp_path / "cifar_score.prototxt")
    log = poseidon("test", "--model", str(net), "--weights",
                   str(models / "cifar10_quick_iter_5000.caffemodel"), "--iterations", "10")
    assert accuracy_of(log) == 0.768
