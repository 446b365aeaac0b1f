"""Loss layers and Accuracy (engine/layers/loss.py): values against NumPy references,
Caffe's normalization modes and ignore_label, float64 gradient checks."""
from __future__ import annotations

import numpy as np
import pytest

from engine.blob import Blob
from engine.layers import LayerError
from tests.gradcheck import blob_of, check_layer_gradients
from tests.test_layers_common import blobs, make, tops

FLT_MIN = np.finfo(np.float32).tiny


def labels(values, shape=None) -> Blob:
    arr = np.asarray(values, dtype=np.float64)
    b = Blob(shape or arr.shape)
    b.data[...] = arr.reshape(b.shape)
    return b


def softmax_loss_reference(x: np.ndarray, lab: np.ndarray, axis: int, ignore: int | None,
                           mode: str) -> float:
    """-sum log p[label] / normalizer, written independently with loops over positions."""
    xm = np.moveaxis(x, axis, -1)
    p = np.exp(xm - xm.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    p = p.reshape(-1, x.shape[axis])
    lab = lab.reshape(-1).astype(int)
    total, valid = 0.0, 0
    for row, l in zip(p, lab):
        if ignore is not None and l == ignore:
            continue
        total -= np.log(max(row[l], FLT_MIN))
        valid += 1
    outer = int(np.prod(x.shape[:axis]))
    norm = {"FULL": lab.size, "VALID": valid, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return total / max(1, norm)


# -- SoftmaxWithLoss -----------------------------------------------------------------------
MODES = ["FULL", "VALID", "BATCH_SIZE", "NONE"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ignore", [None, 1])
def test_softmax_loss_value_and_gradient(mode: str, ignore: int | None) -> None:
    x = blobs((3, 4, 2, 1), seed=4)[0]
    lab = labels([[0, 1], [3, 1], [2, 1]], shape=(3, 1, 2, 1))
    extra = f"ignore_label:{ignore}" if ignore is not None else ""
    b, t = [x, lab], tops(1)
    layer = make(f"name:'loss' type:'SoftmaxWithLoss' loss_param{{normalization:{mode} {extra}}}",
                 b, t)
    assert layer.is_loss and t[0].shape == ()
    layer.forward(b, t)
    want = softmax_loss_reference(x.data, lab.data, 1, ignore, mode)
    np.testing.assert_allclose(float(t[0].data), want, rtol=1e-12)
    check_layer_gradients(layer, b, t, check_bottom=[0])
    if ignore is not None:
        layer.backward(t, [True, False], b)
        d = x.diff.transpose(0, 2, 3, 1).reshape(-1, 4)
        assert (d[lab.data.reshape(-1) == ignore] == 0).all()


def test_softmax_loss_default_is_valid_and_legacy_normalize() -> None:
    x = blobs((4, 3), seed=1)[0]
    lab = labels([0, 2, 2, 1])
    lab.data[1] = 2
    results = {}
    for name, spec in [("default", "ignore_label:2"),
                       ("normalize_false", "ignore_label:2 normalize:false"),
                       ("normalize_true", "ignore_label:2 normalize:true")]:
        t = tops(1)
        layer = make(f"name:'l' type:'SoftmaxWithLoss' loss_param{{{spec}}}", [x, lab], t)
        layer.forward([x, lab], t)
        results[name] = float(t[0].data)
    np.testing.assert_allclose(results["default"],
                               softmax_loss_reference(x.data, lab.data, 1, 2, "VALID"))
    np.testing.assert_allclose(results["normalize_true"], results["default"])
    np.testing.assert_allclose(results["normalize_false"],
                               softmax_loss_reference(x.data, lab.data, 1, 2, "BATCH_SIZE"))


def test_softmax_loss_axis_and_prob_top() -> None:
    x = blobs((2, 3, 5), seed=6)[0]
    lab = labels(np.array([[0, 4, 2], [1, 3, 3]]))
    b, t = [x, lab], tops(2)
    layer = make("name:'l' type:'SoftmaxWithLoss' softmax_param{axis:2}", b, t)
    layer.forward(b, t)
    np.testing.assert_allclose(float(t[0].data),
                               softmax_loss_reference(x.data, lab.data, 2, None, "VALID"))
    e = np.exp(x.data - x.data.max(axis=2, keepdims=True))
    np.testing.assert_allclose(t[1].data, e / e.sum(axis=2, keepdims=True))
    check_layer_gradients(layer, b, t[:1], check_bottom=[0])


def test_softmax_loss_float32_and_loss_weight() -> None:
    x = Blob((2, 3), dtype=np.float32)
    x.data[...] = [[1, 2, 3], [60, -60, 0]]
    lab = Blob((2,), dtype=np.float32)
    lab.data[...] = [2, 1]
    t = [Blob((), dtype=np.float32)]
    layer = make("name:'l' type:'SoftmaxWithLoss'", [x, lab], t)
    layer.forward([x, lab], t)
    assert t[0].data.dtype == np.float32
    # p = e^-120 underflows float32 to 0: Caffe clamps at FLT_MIN, log(FLT_MIN) = -87.3
    want = (softmax_loss_reference(np.array([[1., 2, 3]]), np.array([2.]), 1, None, "VALID")
            - np.log(FLT_MIN)) / 2
    np.testing.assert_allclose(float(t[0].data), want, rtol=1e-5)
    t[0].diff[...] = 3.0  # loss_weight
    layer.backward(t, [True, False], [x, lab])
    assert x.diff.dtype == np.float32
    p = np.exp(x.data[0] - x.data[0].max())
    p /= p.sum()
    np.testing.assert_allclose(x.diff[0], 3.0 * (p - [0, 0, 1]) / 2, rtol=1e-5)


def test_softmax_loss_refuses_label_gradient_and_bad_labels() -> None:
    x, lab = blobs((2, 3))[0], labels([0, 1])
    t = tops(1)
    layer = make("name:'l' type:'SoftmaxWithLoss'", [x, lab], t)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)
    layer.forward([x, lab], t)
    with pytest.raises(LayerError, match="'l'.*label"):
        layer.backward(t, [True, True], [x, lab])
    lab.data[1] = 3
    with pytest.raises(LayerError, match="label value 3"):
        layer.forward([x, lab], t)
    with pytest.raises(LayerError, match="number of labels"):
        make("name:'l' type:'SoftmaxWithLoss'", [blobs((2, 3, 2))[0], labels([0, 1])], tops(1))


# -- SigmoidCrossEntropyLoss ---------------------------------------------------------------
def sigmoid_ce_reference(x: np.ndarray, target: np.ndarray, valid: np.ndarray,
                         norm: float) -> float:
    p = 1 / (1 + np.exp(-x))
    ll = target * np.log(p) + (1 - target) * np.log(1 - p)
    return -(ll * valid).sum() / norm


@pytest.mark.parametrize("spec, norm", [
    ("", lambda n, c, v: n),                               # Caffe 1.0 default: BATCH_SIZE
    ("loss_param{normalization:FULL}", lambda n, c, v: c),
    ("loss_param{normalization:VALID ignore_label:-1}", lambda n, c, v: v),
    ("loss_param{normalize:true ignore_label:-1}", lambda n, c, v: v),
    ("loss_param{normalization:NONE ignore_label:-1}", lambda n, c, v: 1),
])
def test_sigmoid_cross_entropy(spec: str, norm) -> None:
    rng = np.random.default_rng(7)
    x = blobs((3, 2, 2), seed=8)[0]
    target = labels(rng.integers(0, 2, size=(3, 4)).astype(float), shape=(3, 4))
    target.data[0, 1] = -1
    target.data[2, 3] = -1
    ignoring = "ignore_label" in spec
    valid = (target.data != -1) if ignoring else np.ones(target.shape, bool)
    b, t = [x, target], tops(1)
    layer = make(f"name:'sce' type:'SigmoidCrossEntropyLoss' {spec}", b, t)
    layer.forward(b, t)
    n = norm(3, 12, int(valid.sum()))
    xr, tr = x.data.reshape(3, 4), target.data
    np.testing.assert_allclose(float(t[0].data), sigmoid_ce_reference(xr, tr, valid, n),
                               rtol=1e-12)
    check_layer_gradients(layer, b, t, check_bottom=[0])
    if ignoring:
        layer.backward(t, [True, False], b)
        assert (x.diff.reshape(3, 4)[~valid] == 0).all()


def test_sigmoid_cross_entropy_extreme_logits_float32() -> None:
    x = Blob((1, 2), dtype=np.float32)
    x.data[...] = [200, -200]
    target = Blob((1, 2), dtype=np.float32)
    target.data[...] = [1, 1]
    t = [Blob((), dtype=np.float32)]
    layer = make("name:'sce' type:'SigmoidCrossEntropyLoss'", [x, target], t)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        layer.forward([x, target], t)
        t[0].diff[...] = 1
        layer.backward(t, [True, False], [x, target])
    np.testing.assert_allclose(float(t[0].data), 200, rtol=1e-6)
    np.testing.assert_allclose(x.diff, [[0, -1]], atol=1e-6)


# -- EuclideanLoss -------------------------------------------------------------------------
def test_euclidean_loss() -> None:
    a, b = blobs((4, 3), (4, 3, 1), seed=9)
    t = tops(1)
    layer = make("name:'e' type:'EuclideanLoss'", [a, b], t)
    layer.forward([a, b], t)
    want = ((a.data - b.data.reshape(4, 3)) ** 2).sum() / 4 / 2
    np.testing.assert_allclose(float(t[0].data), want, rtol=1e-12)
    assert layer.allow_force_backward(1)
    check_layer_gradients(layer, [a, b], t)


# -- Accuracy ------------------------------------------------------------------------------
SCORES = np.array([
    [0.1, 0.5, 0.3, 0.1],   # label 2: rank 2 (0.5 above it)
    [0.9, 0.0, 0.05, 0.05],  # label 0: rank 1
    [0.2, 0.2, 0.2, 0.4],   # label 1: 0.4 above, and class 2 ties with a higher index
    [0.1, 0.2, 0.3, 0.4],   # label 3: rank 1 (ignored below)
    [0.4, 0.3, 0.2, 0.1],   # label 3: rank 4
])
LABELS = [2, 0, 1, 3, 3]


@pytest.mark.parametrize("top_k, ignore, want, per_class", [
    (1, None, 2 / 5, [1, 0, 0, 0.5]),
    (2, None, 3 / 5, [1, 0, 1, 0.5]),
    (3, None, 4 / 5, [1, 1, 1, 0.5]),
    (1, 3, 1 / 3, [1, 0, 0, 0]),
    (2, 3, 2 / 3, [1, 0, 1, 0]),
])
def test_accuracy_top_k_ignore_and_per_class(top_k: int, ignore: int | None, want: float,
                                             per_class: list[float]) -> None:
    x = labels(SCORES)
    lab = labels(LABELS)
    extra = f"ignore_label:{ignore}" if ignore is not None else ""
    t = tops(2)
    layer = make(f"name:'acc' type:'Accuracy' accuracy_param{{top_k:{top_k} {extra}}}", [x, lab],
                 t, phase="TEST")
    assert not layer.is_loss
    layer.forward([x, lab], t)
    assert t[0].shape == () and t[1].shape == (4,)
    np.testing.assert_allclose(float(t[0].data), want)
    np.testing.assert_allclose(t[1].data, per_class)


def test_accuracy_spatial_axis() -> None:
    # scores (N=2, C=3, H=2): labels per position
    x = labels(np.array([[[1, 0], [2, 0], [0, 5]], [[0, 1], [0, 0], [3, 0]]], dtype=float))
    lab = labels([[1, 2], [2, 1]])  # the last is wrong: scores [1, 0, 0]
    t = tops(1)
    layer = make("name:'acc' type:'Accuracy'", [x, lab], t)
    layer.forward([x, lab], t)
    np.testing.assert_allclose(float(t[0].data), 3 / 4)


def test_accuracy_checks() -> None:
    with pytest.raises(LayerError, match="top_k 5 exceeds"):
        make("name:'acc' type:'Accuracy' accuracy_param{top_k:5}", [labels(SCORES), labels(LABELS)],
             tops(1))
    with pytest.raises(LayerError, match="number of labels"):
        make("name:'acc' type:'Accuracy'", [labels(SCORES), labels([0, 1])], tops(1))


# -- against the real Caffe ----------------------------------------------------------------
def _close(got: np.ndarray, want: np.ndarray) -> None:
    """Within 1e-4 of the reference's largest magnitude (the oracle README's rule)."""
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)


def test_lenet_tail_matches_caffe() -> None:
    """ip1 -> (ReLU) -> ip2 -> SoftmaxWithLoss, and the TEST Accuracy, from Caffe 1.0's
    stored pass (loss weight 1); ReLU is applied by hand as it belongs to another module."""
    from tests.conftest import shared_path
    z = np.load(shared_path("fixtures", "oracle", "layers", "lenet.npz"))
    f32 = np.float32

    def blob(arr: np.ndarray) -> Blob:
        return blob_of(np.asarray(arr, dtype=f32))

    ip_spec = "name:'{n}' type:'InnerProduct' inner_product_param{{num_output:{o}}}"
    pool2 = blob(z["train/blob/pool2/data"])
    ip1 = [Blob((), dtype=f32)]
    l1 = make(ip_spec.format(n="ip1", o=500), [pool2], ip1)
    for j in range(2):
        l1.blobs[j].data[...] = z[f"train/param/ip1/{j}/init"]
    l1.forward([pool2], ip1)
    relu = ip1[0].data > 0
    ip1[0].data *= relu
    _close(ip1[0].data, z["train/blob/ip1/data"])

    ip2 = [Blob((), dtype=f32)]
    l2 = make(ip_spec.format(n="ip2", o=10), ip1, ip2)
    for j in range(2):
        l2.blobs[j].data[...] = z[f"train/param/ip2/{j}/init"]
    l2.forward(ip1, ip2)
    _close(ip2[0].data, z["train/blob/ip2/data"])

    label = blob(z["input/label"])
    loss = [Blob((), dtype=f32)]
    ll = make("name:'loss' type:'SoftmaxWithLoss'", [ip2[0], label], loss)
    ll.forward([ip2[0], label], loss)
    _close(loss[0].data, z["train/blob/loss/data"])

    loss[0].diff[...] = 1
    ll.backward(loss, [True, False], [ip2[0], label])
    _close(ip2[0].diff, z["train/blob/ip2/diff"])
    l2.backward(ip2, [True], ip1)
    ip1[0].diff *= relu
    _close(ip1[0].diff, z["train/blob/ip1/diff"])
    l1.backward(ip1, [True], [pool2])
    _close(pool2.diff, z["train/blob/pool2/diff"])
    for layer in (l1, l2):
        for j in range(2):
            _close(layer.blobs[j].diff, z[f"train/param/{layer.name}/{j}/diff"])

    acc = [Blob((), dtype=f32)]
    scores = blob(z["test/blob/ip2/data"])
    la = make("name:'accuracy' type:'Accuracy'", [scores, label], acc, phase="TEST")
    la.forward([scores, label], acc)
    _close(acc[0].data, z["test/blob/accuracy/data"])
