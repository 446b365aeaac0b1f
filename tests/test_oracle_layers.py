"""Every blob, diff and parameter gradient against the real BVLC Caffe (oracle/layers).

The checks are functions of the oracle alone, so tests/test_gpu_parity_nets.py runs the same
ones with the nets built on a GPU."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine import backend
from engine.net import Net
from tests.conftest import shared_path

NETS = ["lenet", "cifar10_quick"]
TOL = 1e-4  # relative to the array's largest magnitude


def close(ours: np.ndarray, theirs: np.ndarray) -> float:
    scale = max(float(np.abs(theirs).max()), 1e-12)
    return float(np.abs(backend.to_numpy(ours).astype(np.float64) - theirs).max()) / scale


@pytest.fixture(params=NETS)
def oracle(request):
    d = shared_path("fixtures", "oracle", "layers")
    manifest = json.loads((d / "manifest.json").read_text())["nets"][request.param]
    return d, request.param, manifest, np.load(d / manifest["npz"])


def run(d, name, manifest, ref, phase):
    net = Net(d / manifest["prototxt"], phase=phase, weights=str(d / manifest["init_caffemodel"]))
    inputs = {k.split("/", 1)[1]: ref[k] for k in ref.files if k.startswith("input/")}
    net.forward(**inputs)
    return net


def test_train_forward_backward_matches_caffe(oracle):
    check_train_forward_backward(oracle)


def test_test_phase_forward_matches_caffe(oracle):
    check_test_forward(oracle)


def check_train_forward_backward(oracle) -> None:
    d, name, manifest, ref = oracle
    net = run(d, name, manifest, ref, "TRAIN")
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            assert close(blob.data, ref[f"train/param/{layer}/{i}/init"]) == 0.0
    net.backward()
    assert net.loss() == pytest.approx(ref["train/loss/loss"].item(), rel=1e-5)
    worst = {}
    for key in ref.files:
        parts = key.split("/")
        if parts[0] != "train" or parts[1] not in ("blob", "param"):
            continue
        if parts[1] == "blob":
            blob, kind = parts[2], parts[3]
            arr = getattr(net.blobs[blob], kind)
        else:
            layer, i, kind = parts[2], int(parts[3]), parts[4]
            if kind != "diff":
                continue
            arr = net.params[layer][i].diff
        worst[key] = close(arr, ref[key])
    bad = {k: v for k, v in worst.items() if v > TOL}
    assert not bad, f"{name}: arrays off by more than {TOL}: {bad}"
    assert len(worst) > 20


def check_test_forward(oracle) -> None:
    d, name, manifest, ref = oracle
    net = run(d, name, manifest, ref, "TEST")
    keys = [k for k in ref.files if k.startswith("test/blob/")]
    assert keys
    for key in keys:
        blob = key.split("/")[2]
        assert close(net.blobs[blob].data, ref[key]) <= TOL, key
    for out, value in manifest["test_outputs"].items():
        assert net.blobs[out].data.item() == pytest.approx(value, rel=1e-5, abs=1e-6)
