"""Every net in ../shared/fixtures/prototxt (BVLC's and the original Poseidon's V1 files)
builds in both phases and runs forward and backward.

Their data sources (ImageNet, CIFAR and MNIST LMDBs or LevelDBs) are not here, so each data
layer becomes an Input layer with the shape its source would give: MNIST 1×28×28, CIFAR
3×32×32, ImageNet 3×crop×crop. Small nets keep their real batch size; the ImageNet nets use
batch 2 so that CI's memory is not spent on activations.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.caffe_io import read_net_prototxt
from engine.net import Net
from engine.pb import caffe_pb2
from tests.conftest import SHARED, shared_path

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = pytest.mark.slow

FIXTURES = SHARED / "fixtures" / "prototxt"
NETS = sorted(p.name for p in FIXTURES.glob("*.prototxt") if "solver" not in p.name) \
    if FIXTURES.is_dir() else ["(fixtures absent)"]


def image_shape(layer: caffe_pb2.LayerParameter) -> tuple[int, int, int, int]:
    source = layer.data_param.source.lower()
    batch = layer.data_param.batch_size
    if "mnist" in source:
        return batch, 1, 28, 28
    if "cifar" in source:
        return batch, 3, 32, 32
    if "ilsvrc" in source or "imagenet" in source:
        crop = layer.transform_param.crop_size
        return 2, 3, crop, crop
    raise AssertionError(f"no known shape for data source {source!r} of layer {layer.name!r}")


def with_inputs(param: caffe_pb2.NetParameter) -> caffe_pb2.NetParameter:
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    for layer in out.layer:
        if layer.type != "Data":
            continue
        shape = image_shape(layer)
        layer.type = "Input"
        layer.ClearField("data_param")
        layer.ClearField("transform_param")
        layer.input_param.shape.add().dim.extend(shape)
        if len(layer.top) > 1:
            layer.input_param.shape.add().dim.append(shape[0])
    return out


@pytest.mark.parametrize("name", NETS)
@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_fixture_net_builds_and_runs(name, phase):
    path = shared_path("fixtures", "prototxt", name)
    param = with_inputs(read_net_prototxt(path))
    # The autoencoder's TEST data layers exist only in its solver's test stages.
    stages = ("test-on-test",) if "autoencoder" in name and phase == "TEST" else ()
    net = Net(param, phase=phase, stages=stages)
    assert len(net.layers) > 3
    rng = np.random.default_rng(0)
    for layer, tops in zip(net.layers, net.top_vecs):
        if layer.type != "Input":
            continue
        tops[0].data[...] = rng.random(tops[0].shape, dtype=np.float32)
        if len(tops) > 1:
            tops[1].data[...] = rng.integers(0, 10, tops[1].shape)
    loss = net.forward_prefilled()
    assert np.isfinite(loss)
    if phase == "TRAIN" and net.loss_tops:
        assert loss > 0
        net.backward()
        grads = [p.diff for p in net.learnable_params]
        assert all(np.isfinite(g).all() for g in grads)
        assert any(np.abs(g).sum() > 0 for g in grads)
