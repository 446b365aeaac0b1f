"""Tests of the model zoo in models/: every file parses, paths point where the README says,
the generated nets are current, parameter counts match the published numbers, every
training net runs one forward/backward pass, and the README's digits demo reaches 95%."""
from __future__ import annotations

import gc
import hashlib
import importlib.util
import ipaddress
import math
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format

from engine.pb import caffe_pb2
from tests.conftest import ROOT, shared_path

MODELS = ROOT / "models"
DATA = MODELS / "data"  # made by `poseidon data`, never committed


@dataclass(frozen=True)
class Zoo:
    """What a model must be: input geometry, class count, published parameter counts."""

    channels: int
    size: int  # crop or image side
    classes: int
    params: int  # deploy net (BatchNorm statistics excluded)
    test_images: int  # test_iter x TEST batch must cover the test set exactly once
    small: int  # side of the reduced input for the forward/backward test
    train_params: int | None = None  # when the training net has extra heads


ZOO = {
    "lenet": Zoo(1, 28, 10, 431_080, 10_000, 28),
    "digits_lenet": Zoo(1, 6, 10, 25_138, 297, 6),  # 6x6 crops of the 8x8 digits
    "cifar10_quick": Zoo(3, 32, 10, 145_578, 10_000, 32),
    "cifar10_full": Zoo(3, 32, 10, 89_578, 10_000, 32),
    # fc6 infers its input width at set-up, so AlexNet runs at 67x67 (3x3 at pool5)
    "alexnet": Zoo(3, 227, 1000, 60_965_224, 50_000, 67),
    "caffenet": Zoo(3, 227, 1000, 60_965_224, 50_000, 67),
    # the 7x7 average pool and the auxiliary heads' 5x5 pools need the full 224
    "googlenet": Zoo(3, 224, 1000, 6_998_552, 50_000, 224, train_params=13_378_280),
    "vgg16": Zoo(3, 224, 1000, 138_357_544, 50_000, 32),
    "vgg19": Zoo(3, 224, 1000, 143_667_240, 50_000, 32),
    "vgg19_22k": Zoo(3, 224, 21_841, 229_052_817, 50_000, 32),
    "vgg19_22k_s4": Zoo(3, 224, 5_460, 14_322_532, 50_000, 32),
    "resnet50": Zoo(3, 224, 1000, 25_557_032, 50_000, 32),  # global pool5
}
HEAVY = {"alexnet", "caffenet", "googlenet", "vgg16", "vgg19", "vgg19_22k", "vgg19_22k_s4",
         "resnet50"}


def slow_if_heavy(names: list[str] | dict[str, Zoo]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in names]


def read_net(path: Path) -> caffe_pb2.NetParameter:
    return text_format.Parse(path.read_text(), caffe_pb2.NetParameter())


def read_solver(path: Path) -> caffe_pb2.SolverParameter:
    return text_format.Parse(path.read_text(), caffe_pb2.SolverParameter())


def zoo_files(pattern: str) -> list[Path]:
    return sorted(p for p in MODELS.rglob(pattern) if DATA not in p.parents)


def in_phase(layer: caffe_pb2.LayerParameter, phase: int) -> bool:
    return not layer.include or any(r.phase == phase for r in layer.include)


def count_params(net: Any) -> int:
    """Learnable parameters: every layer's blobs but BatchNorm's running statistics."""
    return sum(b.count for layer in net.layers if layer.type != "BatchNorm" for b in layer.blobs)


def with_inputs(param: caffe_pb2.NetParameter, batch: int, channels: int, side: int
                ) -> caffe_pb2.NetParameter:
    """The TRAIN form of ``param`` with its Data layers turned into Input layers of the same
    tops: images (batch, channels, side, side) and labels (batch,). No LMDB needed."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for layer in param.layer:
        if layer.type != "Data":
            out.layer.add().CopyFrom(layer)
        elif in_phase(layer, caffe_pb2.TRAIN):
            inp = out.layer.add(name=layer.name, type="Input")
            inp.top.extend(layer.top)
            inp.input_param.shape.add().dim.extend([batch, channels, side, side])
            inp.input_param.shape.add().dim.append(batch)
    return out


def build(param: caffe_pb2.NetParameter, phase: str) -> Any:
    # imported here so that a broken layer module fails these tests, not the file checks
    from engine.net import Net
    return Net(param, phase=phase)


def build_from_file(path: Path, weights: Path) -> Any:
    from engine.net import Net
    return Net(path, phase="TEST", weights=str(weights))


def load_generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("zoo_generate", MODELS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


# -------------------------------------------------------------------------------------------
# Files
# -------------------------------------------------------------------------------------------
def test_every_model_has_its_three_files():
    for name in ZOO:
        for f in ("train_val.prototxt", "deploy.prototxt", "solver.prototxt"):
            assert (MODELS / name / f).is_file(), f"models/{name}/{f} missing"
    folders = {p.parent.name for p in zoo_files("*.prototxt")}
    assert folders == set(ZOO), "a model folder without tests, or a test without a folder"


def test_every_prototxt_parses():
    nets = zoo_files("*.prototxt")
    assert len(nets) == 3 * len(ZOO)
    for path in nets:
        if path.name == "solver.prototxt":
            assert read_solver(path).net == "train_val.prototxt", path
        else:
            net = read_net(path)
            assert net.name and len(net.layer) > 5, path
            assert not net.layers, f"{path}: V1 'layers' in the zoo"  # current format only


@pytest.mark.parametrize("name", list(ZOO))
def test_train_val_paths_and_phases(name):
    """Data layers: one per phase, LMDB paths that resolve into models/data/, and the TEST
    batch times the solver's test_iter equals the test set."""
    folder = MODELS / name
    net = read_net(folder / "train_val.prototxt")
    data = [layer for layer in net.layer if layer.type == "Data"]
    assert sorted(r.phase for layer in data for r in layer.include) == [caffe_pb2.TRAIN,
                                                                      caffe_pb2.TEST]
    for layer in data:
        assert list(layer.top) == ["data", "label"]
        assert layer.data_param.backend == caffe_pb2.DataParameter.LMDB
        for rel in (layer.data_param.source, layer.transform_param.mean_file):
            if rel:
                assert not Path(rel).is_absolute()
                assert DATA in (folder / rel).resolve().parents, f"{name}: {rel}"
    test_batch = next(layer.data_param.batch_size for layer in data
                      if layer.include[0].phase == caffe_pb2.TEST)
    solver = read_solver(folder / "solver.prototxt")
    assert list(solver.test_iter) and solver.test_iter[0] * test_batch == ZOO[name].test_images
    assert solver.max_iter > 0 and solver.base_lr > 0 and solver.test_interval > 0
    assert (folder / solver.snapshot_prefix).resolve().parent == DATA
    # accuracies are TEST-only; every training net has a loss in both phases
    for layer in net.layer:
        if layer.type == "Accuracy":
            assert [r.phase for r in layer.include] == [caffe_pb2.TEST], layer.name
    assert any(layer.type == "SoftmaxWithLoss" and not layer.include for layer in net.layer)


@pytest.mark.parametrize("name", list(ZOO))
def test_deploy_matches_train_val(name):
    """deploy.prototxt: an Input of the model's geometry, the training net's parameter layers
    with the same settings (so its weights load), Softmax instead of losses."""
    deploy = read_net(MODELS / name / "deploy.prototxt")
    train = read_net(MODELS / name / "train_val.prototxt")
    first = deploy.layer[0]
    assert first.type == "Input"
    assert list(first.input_param.shape[0].dim[1:]) == [ZOO[name].channels, ZOO[name].size,
                                                         ZOO[name].size]
    assert deploy.layer[-1].type == "Softmax"
    assert not any(layer.type in ("Data", "SoftmaxWithLoss", "Accuracy")
                   for layer in deploy.layer)

    def shape_fields(layer: caffe_pb2.LayerParameter) -> caffe_pb2.LayerParameter:
        p = caffe_pb2.LayerParameter(name=layer.name, type=layer.type)
        for field in ("convolution_param", "inner_product_param"):
            if layer.HasField(field):
                getattr(p, field).CopyFrom(getattr(layer, field))
                getattr(p, field).ClearField("weight_filler")
                getattr(p, field).ClearField("bias_filler")
        return p

    learn = ("Convolution", "InnerProduct", "BatchNorm", "Scale")
    train_layers = {layer.name: shape_fields(layer) for layer in train.layer
                    if layer.type in learn}
    for layer in deploy.layer:
        if layer.type in learn:
            assert shape_fields(layer) == train_layers[layer.name], layer.name


def test_generated_files_are_current():
    rendered = load_generator().render_all()
    assert {p.split("/")[0] for p in rendered} == {
        "alexnet", "caffenet", "googlenet", "vgg16", "vgg19", "vgg19_22k", "vgg19_22k_s4",
        "resnet50"}
    for rel, text in rendered.items():
        # compared as messages: protobuf versions may print floats differently
        kind = caffe_pb2.SolverParameter if rel.endswith("solver.prototxt") else \
            caffe_pb2.NetParameter
        committed = text_format.Parse((MODELS / rel).read_text(), kind())
        assert committed == text_format.Parse(text, kind()), \
            f"models/{rel} is stale: run python models/generate.py"


def test_no_file_is_a_copy_of_a_shared_one():
    shared = shared_path("fixtures", "prototxt")
    digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in shared.rglob("*") if p.is_file()}
    for path in zoo_files("*"):
        if path.is_file():
            assert hashlib.sha256(path.read_bytes()).hexdigest() not in digests, path


def test_hosts_files():
    hosts = MODELS / "hosts"
    local = [line.split() for line in (hosts / "localhost4.txt").read_text().splitlines()]
    assert local == [[str(i), "127.0.0.1", str(9000 + 2 * i)] for i in range(4)]
    for line in (hosts / "two_machines.txt").read_text().splitlines():
        host, _, port = line.partition(":")
        # documentation range (RFC 5737): an example must never reach a real machine
        assert ipaddress.ip_address(host) in ipaddress.ip_network("192.0.2.0/24"), line
        assert not port or 0 < int(port) < 65535
    from poseidon_cli.launch.hostfile import parse_hosts

    entries = parse_hosts(hosts / "localhost4.txt")
    assert [(e.rank, e.port, e.shard_port) for e in entries] == [
        (i, 9000 + 2 * i, 9001 + 2 * i) for i in range(4)]
    assert len(parse_hosts(hosts / "two_machines.txt")) == 2


# -------------------------------------------------------------------------------------------
# Nets built by the engine
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", slow_if_heavy(ZOO))
def test_parameter_count(name):
    """The deploy net at batch 1 holds exactly the published number of parameters."""
    param = read_net(MODELS / name / "deploy.prototxt")
    param.layer[0].input_param.shape[0].dim[0] = 1
    net = build(param, "TEST")
    try:
        assert count_params(net) == ZOO[name].params
    finally:
        del net
        gc.collect()


@pytest.mark.parametrize("name", slow_if_heavy(ZOO))
def test_forward_backward(name):
    """One TRAIN forward/backward at batch 2 on random images: a finite loss near that of a
    uniform guess, and finite gradients that reach the first layer."""
    z = ZOO[name]
    param = with_inputs(read_net(MODELS / name / "train_val.prototxt"), 2, z.channels, z.small)
    net = build(param, "TRAIN")
    try:
        if z.train_params is not None:
            assert count_params(net) == z.train_params
        rng = np.random.default_rng(0)
        net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
        net.blobs["label"].data[...] = rng.integers(0, z.classes, size=2)
        loss = net.forward_backward()
        heads = [layer for layer in net.layers if layer.type == "SoftmaxWithLoss"]
        weights = sum(layer.param.loss_weight[0] if layer.param.loss_weight else 1.0
                      for layer in heads)
        # freshly initialised nets guess nearly uniformly: loss ~ ln(classes) per head
        assert math.isfinite(loss) and 0.2 * weights * math.log(z.classes) < loss \
            < 5 * weights * math.log(z.classes)
        for blob in net.learnable_params:
            assert np.isfinite(blob.diff).all()
        first = next(layer for layer in net.layers if layer.blobs)
        assert np.abs(first.blobs[0].diff).sum() > 0, "no gradient reached the first layer"
    finally:
        del net
        gc.collect()


@pytest.mark.slow
def test_digits_demo_reaches_95_percent(tmp_path):
    """The README's demo, in a scratch copy of models/: DigitsLeNet on the digits LMDBs
    trains to >= 95% test accuracy (about 10 s) and snapshots beside the data."""
    from engine.data.converters import convert_digits
    from engine.solver import Solver
    # as `poseidon train` does: one BLAS thread (many threads on tiny matrices crawl on a
    # busy machine); threadpoolctl comes with scikit-learn, a test dependency
    threadpool_limits = pytest.importorskip("threadpoolctl").threadpool_limits

    shutil.copytree(MODELS / "digits_lenet", tmp_path / "models" / "digits_lenet")
    convert_digits(tmp_path / "models" / "data" / "digits")
    solver = Solver(tmp_path / "models" / "digits_lenet" / "solver.prototxt")
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            solver.solve()
        scores = {name: value for name, value, _ in solver.test(0).scores}
    finally:
        solver.close()
    assert scores["accuracy"] >= 0.95
    assert (tmp_path / "models" / "data" / "digits_lenet_iter_2000.caffemodel").is_file()


@pytest.mark.parametrize("name, weights, accuracy", [
    ("lenet", "lenet_iter_10000.caffemodel", 0.9914),  # the full MNIST test set
    ("cifar10_quick", "cifar10_quick_iter_5000.caffemodel", 0.768),  # 1,000 test images
])
def test_caffe_trained_weights_score_as_in_caffe(tmp_path, name, weights, accuracy):
    """Weights trained by BVLC Caffe load into the zoo's TEST net by layer name and reach the
    accuracy they reach in Caffe: the zoo's nets compute what Caffe's do."""
    from engine.data.converters import convert_cifar10, convert_mnist

    caffemodels = shared_path("fixtures", "caffemodels")
    models = tmp_path / "models"
    shutil.copytree(MODELS / name, models / name)
    if name == "lenet":
        counts = convert_mnist(shared_path("data", "mnist"), models / "data" / "mnist")
        test_images = counts["mnist_test_lmdb"]
    else:
        out = models / "data" / "cifar10"
        test_images = convert_cifar10(shared_path("data", "cifar10-subset"),
                                      out)["cifar10_test_lmdb"]
        shutil.copy(caffemodels / "cifar10_mean.binaryproto", out / "mean.binaryproto")
    net = build_from_file(models / name / "train_val.prototxt", caffemodels / weights)
    batch = net.blobs["data"].shape[0]
    scores = [float(net.forward()["accuracy"]) for _ in range(test_images // batch)]
    assert np.mean(scores) == pytest.approx(accuracy, abs=5e-4)
