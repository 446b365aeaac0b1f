"""Real trained Caffe models reach their stated accuracy on the real test sets.

LeNet (lenet_iter_10000.caffemodel): 99.14% on the 10,000 MNIST test images.
CIFAR10-quick (cifar10_quick_iter_5000.caffemodel): 76.8% on the 1,000 test images of the
CIFAR-10 subset, mean file subtracted. Through the Python API here; through `poseidon test`
on LMDBs written by `poseidon data` in test_cli_test.py.
"""
from __future__ import annotations

import numpy as np

from engine.caffe_io import read_blobproto
from engine.data.converters import load_idx_pair
from engine.net import Net
from tests.conftest import shared_path


def accuracy(net: Net, images: np.ndarray, labels: np.ndarray, batch: int) -> float:
    correct = 0
    for start in range(0, len(images), batch):
        x = images[start:start + batch]
        out = net.forward(data=x)
        scores = next(iter(out.values()))
        correct += int((scores.argmax(axis=1) == labels[start:start + batch]).sum())
    return correct / len(images)


def test_lenet_reaches_99_14_on_mnist():
    models = shared_path("fixtures", "caffemodels")
    mnist = shared_path("data", "mnist")
    images, labels = load_idx_pair(mnist, "test")
    x = images.astype(np.float32) * np.float32(0.00390625)
    net = Net(models / "lenet.prototxt", phase="TEST",
              weights=str(models / "lenet_iter_10000.caffemodel"))
    assert round(accuracy(net, x, labels, 500) * 100, 2) == 99.14


def test_cifar10_quick_reaches_76_8_on_the_subset():
    models = shared_path("fixtures", "caffemodels")
    raw = np.fromfile(shared_path("data", "cifar10-subset", "test_batch.bin"), np.uint8)
    raw = raw.reshape(-1, 3073)
    labels = raw[:, 0].astype(np.int64)
    images = raw[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32)
    mean = read_blobproto(models / "cifar10_mean.binaryproto").reshape(1, 3, 32, 32)
    net = Net(models / "cifar10_quick.prototxt", phase="TEST",
              weights=str(models / "cifar10_quick_iter_5000.caffemodel"))
    assert len(images) == 1000
    assert round(accuracy(net, images - mean, labels, 100) * 100, 1) == 76.8
