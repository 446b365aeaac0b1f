"""HingeLoss, InfogainLoss, MultinomialLogisticLoss, ContrastiveLoss (engine/layers/loss.py),
MVN (engine/layers/normalization.py), SPP and Im2col (engine/layers/vision.py): values from
hand computations of Caffe's formulas, float64 finite-difference gradients, the layers'
one-line errors, and a few of them inside a Net."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from engine.blob import Blob
from engine.caffe_io import write_blobproto
from engine.layers import LayerError
from engine.net import Net
from engine.pb import caffe_pb2
from tests.gradcheck import blob_of, check_layer_gradients, make_layer

#: Caffe's kLOG_THRESHOLD, a float even in double nets
LOG_THRESHOLD = float(np.float32(1e-20))


def b64(values) -> Blob:
    return blob_of(np.asarray(values, dtype=np.float64))


def tops(n: int = 1) -> list[Blob]:
    return [Blob((), dtype=np.float64) for _ in range(n)]


def softmax_rows(x: np.ndarray, axis: int = 1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# ======================================================================== HingeLoss
HINGE_X = [[0.5, -0.2, 1.5], [-2.0, 0.3, 0.1]]
HINGE_LABEL = [0, 2]


@pytest.mark.parametrize("norm, loss, grad", [
    # margins max(0, 1 - t x), t = +1 at the label: [0.5, 0.8, 2.5] and [0, 1.3, 0.9]
    ("L1", (0.5 + 0.8 + 2.5 + 0 + 1.3 + 0.9) / 2, [[-0.5, 0.5, 0.5], [0, 0.5, -0.5]]),
    ("L2", (0.25 + 0.64 + 6.25 + 0 + 1.69 + 0.81) / 2, [[-0.5, 0.8, 2.5], [0, 1.3, -0.9]]),
])
def test_hinge_loss_values(norm: str, loss: float, grad) -> None:
    x, lab, t = b64(HINGE_X), b64(HINGE_LABEL), tops()
    layer = make_layer(f"name:'hinge' type:'HingeLoss' hinge_loss_param{{norm:{norm}}}",
                       [x, lab], t)
    assert layer.is_loss and t[0].shape == ()
    layer.forward([x, lab], t)
    np.testing.assert_allclose(float(t[0].data), loss, rtol=1e-12)
    t[0].diff[...] = 2.0  # the loss weight scales the gradient
    layer.backward(t, [True, False], [x, lab])
    np.testing.assert_allclose(x.diff, 2.0 * np.array(grad), rtol=1e-12, atol=1e-15)


def test_hinge_loss_default_norm_is_l1_and_v1_name() -> None:
    x = b64(np.array(HINGE_X).reshape(2, 3, 1, 1))
    lab = b64(np.array(HINGE_LABEL).reshape(2, 1, 1, 1))
    t = tops()
    layer = make_layer("name:'h' type:'HINGE_LOSS'", [x, lab], t)
    assert layer.type == "HingeLoss"
    layer.forward([x, lab], t)
    np.testing.assert_allclose(float(t[0].data), 3.0, rtol=1e-12)


def safe_hinge_scores(shape, seed: int) -> np.ndarray:
    """Scores whose margins 1 ± x stay at least 0.1 from the hinge's kink."""
    rng = np.random.default_rng(seed)
    base = rng.choice([-2.4, -1.5, -0.6, -0.2, 0.3, 0.7, 1.4, 2.2], size=shape)
    return base + rng.uniform(-0.05, 0.05, size=shape)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss_gradients(norm: str) -> None:
    x, lab = b64(safe_hinge_scores((4, 5), seed=3)), b64([0, 4, 2, 2])
    t = tops()
    layer = make_layer(f"name:'h' type:'HingeLoss' hinge_loss_param{{norm:{norm}}}", [x, lab], t)
    check_layer_gradients(layer, [x, lab], t, check_bottom=[0])


def test_hinge_loss_errors() -> None:
    x, t = b64(HINGE_X), tops()
    with pytest.raises(LayerError, match=r"layer 'h' \(HingeLoss\): label value 3 outside"):
        layer = make_layer("name:'h' type:'HingeLoss'", [x, b64([0, 3])], t)
        layer.forward([x, b64([0, 3])], t)
    with pytest.raises(LayerError, match=r"layer 'h'.*one label per item"):
        make_layer("name:'h' type:'HingeLoss'", [x, b64([[0, 1], [1, 0]])], t)
    with pytest.raises(LayerError, match=r"layer 'h'.*same first dimension"):
        make_layer("name:'h' type:'HingeLoss'", [x, b64([0, 1, 2])], t)
    with pytest.raises(LayerError, match=r"layer 'h'.*at most 4 axes"):
        make_layer("name:'h' type:'HingeLoss'", [b64(np.zeros((2, 1, 1, 1, 3))), b64([0, 1])], t)
    lab = b64(HINGE_LABEL)
    layer = make_layer("name:'h' type:'HingeLoss'", [x, lab], t)
    assert not layer.allow_force_backward(1)
    layer.forward([x, lab], t)
    with pytest.raises(LayerError, match=r"layer 'h'.*cannot backpropagate to label"):
        layer.backward(t, [True, True], [x, lab])


# ========================================================== MultinomialLogisticLoss
def test_multinomial_logistic_loss_values() -> None:
    p = b64([[0.2, 0.5, 0.3], [0.0, 0.9, 0.1]])
    lab = b64([1, 0])  # the second picks a probability of 0: floored at kLOG_THRESHOLD
    t = tops()
    layer = make_layer("name:'mll' type:'MultinomialLogisticLoss'", [p, lab], t)
    layer.forward([p, lab], t)
    np.testing.assert_allclose(float(t[0].data), -(np.log(0.5) + np.log(LOG_THRESHOLD)) / 2,
                               rtol=1e-12)
    t[0].diff[...] = 3.0
    layer.backward(t, [True, False], [p, lab])
    want = np.zeros((2, 3))
    want[0, 1] = -3.0 / 2 / 0.5
    want[1, 0] = -3.0 / 2 / LOG_THRESHOLD
    np.testing.assert_allclose(p.diff, want, rtol=1e-12)


def test_multinomial_logistic_loss_gradient_and_v1_name() -> None:
    rng = np.random.default_rng(5)
    p = b64(rng.uniform(0.1, 1.0, size=(3, 4, 1, 1)))
    lab = b64(np.array([3, 0, 1]).reshape(3, 1, 1, 1))
    t = tops()
    layer = make_layer("name:'m' type:'MULTINOMIAL_LOGISTIC_LOSS'", [p, lab], t)
    assert layer.type == "MultinomialLogisticLoss"
    check_layer_gradients(layer, [p, lab], t, check_bottom=[0])


def test_multinomial_logistic_loss_errors() -> None:
    p, t = b64([[0.5, 0.5], [0.1, 0.9]]), tops()
    with pytest.raises(LayerError,
                       match=r"layer 'm' \(MultinomialLogisticLoss\).*\(num, 1, 1, 1\)"):
        make_layer("name:'m' type:'MultinomialLogisticLoss'", [p, b64([[0, 1], [1, 0]])], t)
    layer = make_layer("name:'m' type:'MultinomialLogisticLoss'", [p, b64([0, 2])], t)
    with pytest.raises(LayerError, match=r"layer 'm'.*label value 2 outside \[0, 2\)"):
        layer.forward([p, b64([0, 2])], t)


# ======================================================================= InfogainLoss
INFO_X = np.array([[0.3, -1.0, 2.0], [1.5, 0.2, -0.4]])
INFO_H = np.array([[1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.25, 0.0, 2.0]])


def infogain_reference(x: np.ndarray, lab: np.ndarray, h: np.ndarray) -> tuple[float, np.ndarray]:
    """Caffe's formula for (N, K) scores: -sum_i sum_l H[y_i, l] log p_il, and the
    unnormalized gradient p_il * sum_k H[y_i, k] - H[y_i, l]."""
    p = softmax_rows(x)
    loss, grad = 0.0, np.zeros_like(x)
    for i, y in enumerate(lab.astype(int)):
        for l in range(x.shape[1]):
            loss -= h[y, l] * np.log(max(p[i, l], LOG_THRESHOLD))
            grad[i, l] = p[i, l] * h[y].sum() - h[y, l]
    return loss, grad


def test_infogain_loss_with_h_bottom() -> None:
    x, lab, h, t = b64(INFO_X), b64([0, 2]), b64(INFO_H), tops()
    layer = make_layer("name:'info' type:'InfogainLoss'", [x, lab, h], t)
    assert layer.is_loss
    layer.forward([x, lab, h], t)
    loss, grad = infogain_reference(INFO_X, np.array([0, 2]), INFO_H)
    np.testing.assert_allclose(float(t[0].data), loss / 2, rtol=1e-12)  # VALID: 2 labels
    t[0].diff[...] = 0.5
    layer.backward(t, [True, False, False], [x, lab, h])
    np.testing.assert_allclose(x.diff, 0.5 * grad / 2, rtol=1e-12)
    check_layer_gradients(layer, [x, lab, h], t, check_bottom=[0])


def test_infogain_loss_from_binaryproto_source(tmp_path) -> None:
    path = tmp_path / "H.binaryproto"
    write_blobproto(path, INFO_H.reshape(1, 1, 3, 3))
    x, lab, t = b64(INFO_X), b64([0, 2]), tops()
    layer = make_layer(f"name:'info' type:'INFOGAIN_LOSS' infogain_loss_param{{source:'{path}'}}",
                       [x, lab], t)
    assert layer.type == "InfogainLoss"
    layer.forward([x, lab], t)
    loss, _ = infogain_reference(INFO_X, np.array([0, 2]), INFO_H)
    np.testing.assert_allclose(float(t[0].data), loss / 2, rtol=1e-12)
    check_layer_gradients(layer, [x, lab], t, check_bottom=[0])


def test_infogain_loss_identity_h_is_softmax_loss() -> None:
    rng = np.random.default_rng(2)
    x, lab = b64(rng.standard_normal((4, 5))), b64([0, 4, 2, 2])
    t1, t2 = tops(), tops()
    info = make_layer("name:'i' type:'InfogainLoss'", [x, lab, b64(np.eye(5))], t1)
    soft = make_layer("name:'s' type:'SoftmaxWithLoss'", [x, lab], t2)
    info.forward([x, lab, b64(np.eye(5))], t1)
    soft.forward([x, lab], t2)
    np.testing.assert_allclose(float(t1[0].data), float(t2[0].data), rtol=1e-12)


@pytest.mark.parametrize("mode, norm", [("FULL", 4), ("VALID", 3), ("BATCH_SIZE", 2),
                                        ("NONE", 1)])
def test_infogain_loss_spatial_ignore_and_normalization(mode: str, norm: int) -> None:
    # scores (N=2, K=3, W=2): labels (2, 2), one ignored (its value may be out of range)
    rng = np.random.default_rng(4)
    xs = rng.standard_normal((2, 3, 2))
    labels = np.array([[0, 1], [2, 7]])
    x, lab, h, t = b64(xs), b64(labels), b64(INFO_H), tops(2)
    layer = make_layer("name:'i' type:'InfogainLoss' "
                       f"loss_param{{ignore_label:7 normalization:{mode}}}", [x, lab, h], t)
    assert t[1].shape == (2, 3, 2)
    layer.forward([x, lab, h], t)
    rows = xs.transpose(0, 2, 1).reshape(4, 3)[:3]  # (item, position) rows, the ignored last
    loss, grad = infogain_reference(rows, labels.reshape(4)[:3], INFO_H)
    np.testing.assert_allclose(float(t[0].data), loss / norm, rtol=1e-12)
    np.testing.assert_allclose(t[1].data, softmax_rows(xs, axis=1), rtol=1e-12)
    t[0].diff[...] = 1
    layer.backward(t, [True, False, False], [x, lab, h])
    want = np.zeros((4, 3))
    want[:3] = grad / norm
    np.testing.assert_allclose(x.diff.transpose(0, 2, 1).reshape(4, 3), want, rtol=1e-12,
                               atol=1e-15)
    check_layer_gradients(layer, [x, lab, h], t[:1], check_bottom=[0])


def test_infogain_loss_axis() -> None:
    # the class axis last: (N=2, W=2, K=3), so the batch size (outer count) is 4
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((2, 2, 3))
    labels = np.array([[0, 1], [2, 2]])
    x, lab, h, t = b64(xs), b64(labels), b64(INFO_H), tops()
    layer = make_layer("name:'i' type:'InfogainLoss' infogain_loss_param{axis:-1} "
                       "loss_param{normalization:BATCH_SIZE}", [x, lab, h], t)
    layer.forward([x, lab, h], t)
    loss, _ = infogain_reference(xs.reshape(4, 3), labels.reshape(4), INFO_H)
    np.testing.assert_allclose(float(t[0].data), loss / 4, rtol=1e-12)
    check_layer_gradients(layer, [x, lab, h], t, check_bottom=[0])


def test_infogain_loss_errors(tmp_path) -> None:
    x, lab, t = b64(INFO_X), b64([0, 2]), tops()
    with pytest.raises(LayerError, match=r"layer 'i' \(InfogainLoss\): .*H must be given"):
        make_layer("name:'i' type:'InfogainLoss'", [x, lab], t)
    with pytest.raises(LayerError, match=r"layer 'i'.*cannot read the infogain matrix"):
        make_layer(f"name:'i' type:'InfogainLoss' infogain_loss_param{{source:'{tmp_path}/no'}}",
                   [x, lab], t)
    with pytest.raises(LayerError, match=r"layer 'i'.*H has shape \(2, 2\).*3x3"):
        make_layer("name:'i' type:'InfogainLoss'", [x, lab, b64(np.eye(2))], t)
    with pytest.raises(LayerError, match=r"layer 'i'.*normalize is deprecated"):
        make_layer("name:'i' type:'InfogainLoss' loss_param{normalize:true}",
                   [x, lab, b64(INFO_H)], t)
    with pytest.raises(LayerError, match=r"layer 'i'.*takes at most 3 bottom"):
        make_layer("name:'i' type:'InfogainLoss'", [x, lab, b64(INFO_H), b64(INFO_H)], t)
    h = b64(INFO_H)
    layer = make_layer("name:'i' type:'InfogainLoss'", [x, lab, h], t)
    assert [layer.allow_force_backward(i) for i in range(3)] == [True, False, False]
    layer.forward([x, lab, h], t)
    with pytest.raises(LayerError, match=r"layer 'i'.*infogain matrix input"):
        layer.backward(t, [True, False, True], [x, lab, h])
    with pytest.raises(LayerError, match=r"layer 'i'.*label"):
        layer.backward(t, [True, True, False], [x, lab, h])


# ==================================================================== ContrastiveLoss
PAIR_A = [[1.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
PAIR_B = [[1.0, 1.0], [0.3, 0.4], [3.0, 1.0]]
PAIR_SIM = [1, 0, 0]  # distances 1, 0.5, 2


def contrastive_spec(legacy: bool) -> str:
    return (f"name:'c' type:'ContrastiveLoss' "
            f"contrastive_loss_param{{legacy_version:{str(legacy).lower()}}}")


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss_values(legacy: bool) -> None:
    a, b, y, t = b64(PAIR_A), b64(PAIR_B), b64(PAIR_SIM), tops()
    layer = make_layer(contrastive_spec(legacy), [a, b, y], t)
    layer.forward([a, b, y], t)
    # similar: d² = 1; dissimilar at d = 0.5 inside margin 1: (1 - 0.5)² or legacy 1 - 0.25;
    # dissimilar at d = 2: beyond the margin, 0
    apart = 0.75 if legacy else 0.25
    np.testing.assert_allclose(float(t[0].data), (1 + apart) / 3 / 2, rtol=1e-12)
    t[0].diff[...] = 1
    layer.backward(t, [True, True, False], [a, b, y])
    diff = np.array(PAIR_A) - np.array(PAIR_B)
    alpha = 1 / 3
    pull = -alpha if legacy else -alpha * 0.5 / (0.5 + 1e-4)
    want = np.array([alpha * diff[0], pull * diff[1], [0, 0]])
    np.testing.assert_allclose(a.diff, want, rtol=1e-12)
    np.testing.assert_allclose(b.diff, -want, rtol=1e-12)


def test_contrastive_loss_margin_and_truncated_similarity() -> None:
    # similarity 0.9 truncates to 0 (dissimilar); margin 3 puts d = 2 inside it
    a, b, y, t = b64(PAIR_A), b64(PAIR_B), b64([0.9, 0, 0]), tops()
    layer = make_layer("name:'c' type:'CONTRASTIVE_LOSS' contrastive_loss_param{margin:3}",
                       [a, b, y], t)
    assert layer.type == "ContrastiveLoss"
    layer.forward([a, b, y], t)
    np.testing.assert_allclose(float(t[0].data), ((3 - 1) ** 2 + 2.5 ** 2 + 1 ** 2) / 3 / 2,
                               rtol=1e-12)


def pairs_away_from_margin(seed: int) -> tuple[Blob, Blob, Blob]:
    """Pairs whose distances, and squared distances (legacy), are at least 0.3 from the
    margin 1."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((6, 3))
    direction = rng.standard_normal((6, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    dist = np.array([0.4, 0.7, 1.5, 0.3, 2.0, 0.6])
    y = np.array([1, 0, 0, 0, 1, 0])
    return (b64(a.reshape(6, 3, 1, 1)), b64((a + direction * dist[:, None]).reshape(6, 3, 1, 1)),
            b64(y.reshape(6, 1, 1, 1)))


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss_gradients(legacy: bool) -> None:
    a, b, y = pairs_away_from_margin(seed=8)
    t = tops()
    layer = make_layer(contrastive_spec(legacy), [a, b, y], t)
    assert layer.allow_force_backward(1) and not layer.allow_force_backward(2)
    # Caffe's gradient divides by (d + 1e-4), not d: off by about 1e-4 relative
    check_layer_gradients(layer, [a, b, y], t, check_bottom=[0, 1],
                          rtol=1e-12 if legacy else 3e-5)


def test_contrastive_loss_errors() -> None:
    a, b, y, t = b64(PAIR_A), b64(PAIR_B), b64(PAIR_SIM), tops()
    with pytest.raises(LayerError, match=r"layer 'c' \(ContrastiveLoss\): .*same channels"):
        make_layer("name:'c' type:'ContrastiveLoss'", [a, b64(np.zeros((3, 3))), y], t)
    with pytest.raises(LayerError, match=r"layer 'c'.*\(num, channels, 1, 1\)"):
        make_layer("name:'c' type:'ContrastiveLoss'",
                   [b64(np.zeros((3, 2, 2))), b64(np.zeros((3, 2, 2))), y], t)
    with pytest.raises(LayerError, match=r"layer 'c'.*similarity bottom must be \(3, 1, 1, 1\)"):
        make_layer("name:'c' type:'ContrastiveLoss'", [a, b, b64([1, 0])], t)
    with pytest.raises(LayerError, match=r"layer 'c'.*exactly 3 bottom"):
        make_layer("name:'c' type:'ContrastiveLoss'", [a, b], t)
    layer = make_layer("name:'c' type:'ContrastiveLoss'", [a, b, y], t)
    layer.forward([a, b, y], t)
    with pytest.raises(LayerError, match=r"layer 'c'.*similarity input"):
        layer.backward(t, [True, True, True], [a, b, y])


# ============================================================================== MVN
MVN_X = np.array([[[[1.0, 2.0, 3.0]], [[2.0, 4.0, 9.0]]]])  # (1, 2, 1, 3)


@pytest.mark.parametrize("spec, want", [
    # per channel: means 2 and 5, biased stds sqrt(2/3) and sqrt(26/3)
    ("", np.array([[-1, 0, 1], [-3, -1, 4]]) / np.array([[np.sqrt(2 / 3)], [np.sqrt(26 / 3)]])),
    ("normalize_variance:false", np.array([[-1, 0, 1], [-3, -1, 4]])),
    ("eps:0.5", np.array([[-1, 0, 1], [-3, -1, 4]])
     / np.array([[np.sqrt(2 / 3) + 0.5], [np.sqrt(26 / 3) + 0.5]])),
    # across channels: one mean 3.5 and one std sqrt(41.5 / 6) per item
    ("across_channels:true", np.array([[-2.5, -1.5, -0.5], [-1.5, 0.5, 5.5]]) / np.sqrt(41.5 / 6)),
    ("across_channels:true normalize_variance:false",
     np.array([[-2.5, -1.5, -0.5], [-1.5, 0.5, 5.5]])),
])
def test_mvn_values(spec: str, want: np.ndarray) -> None:
    x, t = b64(MVN_X), tops()
    layer = make_layer(f"name:'mvn' type:'MVN' mvn_param{{{spec}}}", [x], t)
    layer.forward([x], t)
    np.testing.assert_allclose(t[0].data, want.reshape(1, 2, 1, 3), rtol=1e-8)


@pytest.mark.parametrize("spec", ["", "normalize_variance:false", "across_channels:true",
                                  "across_channels:true normalize_variance:false"])
def test_mvn_gradients(spec: str) -> None:
    x, t = b64(np.random.default_rng(6).standard_normal((2, 3, 2, 3))), tops()
    layer = make_layer(f"name:'mvn' type:'MVN' mvn_param{{{spec}}}", [x], t)
    check_layer_gradients(layer, [x], t)


def test_mvn_backward_is_caffes_formula_with_large_eps() -> None:
    """Caffe's backward is (dy - mean(dy) - y·mean(dy·y)) / (std + eps): it leaves eps out
    of the std's derivative, so it is not the exact gradient when eps matters."""
    rng = np.random.default_rng(1)
    x, t = b64(rng.standard_normal((2, 2, 1, 4))), tops()
    layer = make_layer("name:'mvn' type:'MVN' mvn_param{eps:0.5}", [x], t)
    layer.forward([x], t)
    dy = rng.standard_normal((2, 2, 1, 4))
    t[0].diff[...] = dy
    layer.backward(t, [True], [x])
    xr, y, g = x.data.reshape(4, 4), t[0].data.reshape(4, 4), dy.reshape(4, 4)
    std = xr.std(axis=1, keepdims=True) + 0.5
    want = (g - g.mean(1, keepdims=True) - y * (g * y).mean(1, keepdims=True)) / std
    np.testing.assert_allclose(x.diff.reshape(4, 4), want, rtol=1e-12)


def test_mvn_top_is_4d_and_errors() -> None:
    x, t = b64([[1.0, 3.0], [0.0, 4.0]]), tops()
    layer = make_layer("name:'mvn' type:'MVN' mvn_param{across_channels:true}", [x], t)
    assert t[0].shape == (2, 2, 1, 1)  # Caffe's top is (num, channels, height, width)
    layer.forward([x], t)
    np.testing.assert_allclose(t[0].data.reshape(2, 2), [[-1, 1], [-1, 1]], rtol=1e-8)
    with pytest.raises(LayerError, match=r"layer 'mvn' \(MVN\): .*at most 4 axes"):
        make_layer("name:'mvn' type:'MVN'", [b64(np.zeros((1, 2, 1, 3, 1)))], tops())
    with pytest.raises(LayerError, match=r"layer 'mvn'.*exactly 1 bottom"):
        make_layer("name:'mvn' type:'MVN'", [x, x], tops())


# ============================================================================== SPP
ARANGE_4 = np.arange(16.0).reshape(1, 1, 4, 4)
ARANGE_5 = np.arange(25.0).reshape(1, 1, 5, 5)


@pytest.mark.parametrize("pool, x, want", [
    # 4x4: level 0 is the whole plane, level 1 four 2x2 bins without padding
    ("MAX", ARANGE_4, [15, 5, 7, 13, 15]),
    ("AVE", ARANGE_4, [7.5, 2.5, 4.5, 10.5, 12.5]),
    # 5x5: level 1 has kernel 3, stride 3, pad 1: rows/cols {0, 1} and {2, 3, 4}; AVE
    # divides by the 3x3 window clipped to the padded image, so by 9 everywhere
    ("MAX", ARANGE_5, [24, 6, 9, 21, 24]),
    ("AVE", ARANGE_5, [12, 12 / 9, 33 / 9, 93 / 9, 162 / 9]),
])
def test_spp_values(pool: str, x: np.ndarray, want: list[float]) -> None:
    b, t = b64(x), tops()
    layer = make_layer(f"name:'spp' type:'SPP' spp_param{{pyramid_height:2 pool:{pool}}}", [b], t)
    assert t[0].shape == (1, 5)
    layer.forward([b], t)
    np.testing.assert_allclose(t[0].data, [want], rtol=1e-12)


def test_spp_concatenates_levels_per_item_channel_major() -> None:
    x = np.stack([ARANGE_4[0, 0], 100 + ARANGE_4[0, 0]])[None]  # (1, 2, 4, 4)
    x = np.concatenate([x, -x])  # a second item: maxima become the upper-left values
    b, t = b64(x), tops()
    layer = make_layer("name:'spp' type:'SPP' spp_param{pyramid_height:2}", [b], t)
    assert t[0].shape == (2, 2 * 1 + 2 * 4)
    layer.forward([b], t)
    np.testing.assert_allclose(t[0].data[0], [15, 115, 5, 7, 13, 15, 105, 107, 113, 115])
    np.testing.assert_allclose(t[0].data[1], [0, -100, 0, -2, -8, -10, -100, -102, -108, -110])


def test_spp_height_one_keeps_pooling_shape_and_rebuilds_on_reshape() -> None:
    b, t = b64(ARANGE_4), tops()
    layer = make_layer("name:'spp' type:'SPP' spp_param{pyramid_height:1 pool:AVE}", [b], t)
    assert t[0].shape == (1, 1, 1, 1)
    layer.forward([b], t)
    assert float(t[0].data.reshape(())) == 7.5
    b5 = b64(ARANGE_5)
    layer.reshape([b5], t)
    layer.forward([b5], t)
    assert t[0].shape == (1, 1, 1, 1) and float(t[0].data.reshape(())) == 12


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_spp_gradients(pool: str) -> None:
    # 6x7 with 3 levels: every level pads differently (pads (0,1), (1,1) at levels 1, 2)
    rng = np.random.default_rng(9)
    n = 2 * 2 * 6 * 7
    x = b64(((rng.permutation(n) - n / 2) * 0.01).reshape(2, 2, 6, 7))  # no ties for MAX
    t = tops()
    layer = make_layer(f"name:'spp' type:'SPP' spp_param{{pyramid_height:3 pool:{pool}}}", [x], t)
    assert t[0].shape == (2, 2 * (1 + 4 + 16))
    check_layer_gradients(layer, [x], t)


def test_spp_errors() -> None:
    b = b64(ARANGE_5)
    with pytest.raises(LayerError, match=r"layer 'spp' \(SPP\): pyramid_height must be at least 1"):
        make_layer("name:'spp' type:'SPP'", [b], tops())
    # level 2 of a 5x5 input: kernel 2 but pad 2, which Caffe's Pooling refuses
    with pytest.raises(LayerError, match=r"layer 'spp' \(SPP\): pyramid level 2 \(4x4 bins\) "
                                         r"cannot pool a 5x5 input: .*pad"):
        make_layer("name:'spp' type:'SPP' spp_param{pyramid_height:3}", [b], tops())
    with pytest.raises(LayerError, match=r"layer 'spp'.*STOCHASTIC"):
        make_layer("name:'spp' type:'SPP' spp_param{pyramid_height:2 pool:STOCHASTIC}", [b], tops())
    with pytest.raises(LayerError, match=r"layer 'spp'.*4 axes"):
        make_layer("name:'spp' type:'SPP' spp_param{pyramid_height:2}", [b64(np.zeros((1, 5, 5)))],
                   tops())


# =========================================================================== Im2col
def im2col_reference(x: np.ndarray, k: tuple[int, int], pad: tuple[int, int],
                     stride: tuple[int, int], dil: tuple[int, int]) -> np.ndarray:
    """Caffe's im2col per item: top[(c·kh + i)·kw + j, y, x] = image[c, y·sh - ph + i·dh,
    x·sw - pw + j·dw], zero outside the image."""
    n, c, h, w = x.shape
    (kh, kw), (ph, pw), (sh, sw), (dh, dw) = k, pad, stride, dil
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    out = np.zeros((n, c * kh * kw, oh, ow))
    for ci in range(c):
        for i in range(kh):
            for j in range(kw):
                for yy in range(oh):
                    for xx in range(ow):
                        hh, ww = yy * sh - ph + i * dh, xx * sw - pw + j * dw
                        if 0 <= hh < h and 0 <= ww < w:
                            out[:, (ci * kh + i) * kw + j, yy, xx] = x[:, ci, hh, ww]
    return out


def test_im2col_small_literal() -> None:
    x, t = b64(np.arange(9.0).reshape(1, 1, 3, 3)), tops()
    layer = make_layer("name:'col' type:'Im2col' convolution_param{kernel_size:2}", [x], t)
    assert t[0].shape == (1, 4, 2, 2)
    layer.forward([x], t)
    np.testing.assert_array_equal(t[0].data[0, 0], [[0, 1], [3, 4]])
    np.testing.assert_array_equal(t[0].data[0, 1], [[1, 2], [4, 5]])
    np.testing.assert_array_equal(t[0].data[0, 3], [[4, 5], [7, 8]])


@pytest.mark.parametrize("spec, k, pad, stride, dil", [
    ("kernel_size:3 pad:1 stride:2", (3, 3), (1, 1), (2, 2), (1, 1)),
    ("kernel_h:2 kernel_w:3 pad_h:1 stride_h:1 stride_w:2 dilation:2",
     (2, 3), (1, 0), (1, 2), (2, 2)),
    ("kernel_size:2 kernel_size:1 stride:1 stride:2", (2, 1), (0, 0), (1, 2), (1, 1)),
])
def test_im2col_matches_reference_and_gradients(spec, k, pad, stride, dil) -> None:
    rng = np.random.default_rng(7)
    x, t = b64(rng.standard_normal((2, 3, 5, 6))), tops()
    layer = make_layer(f"name:'col' type:'IM2COL' convolution_param{{{spec}}}", [x], t)
    assert layer.type == "Im2col"
    layer.forward([x], t)
    np.testing.assert_allclose(t[0].data, im2col_reference(x.data, k, pad, stride, dil),
                               rtol=0, atol=0)
    check_layer_gradients(layer, [x], t)


def test_im2col_channel_axis() -> None:
    rng = np.random.default_rng(3)
    x, t = b64(rng.standard_normal((2, 2, 3, 4, 4))), tops()
    layer = make_layer("name:'col' type:'Im2col' convolution_param{kernel_size:2 axis:2}", [x], t)
    assert t[0].shape == (2, 2, 12, 3, 3)
    layer.forward([x], t)
    want = im2col_reference(x.data.reshape(4, 3, 4, 4), (2, 2), (0, 0), (1, 1), (1, 1))
    np.testing.assert_array_equal(t[0].data, want.reshape(2, 2, 12, 3, 3))
    check_layer_gradients(layer, [x], t)


def test_im2col_errors() -> None:
    x = b64(np.zeros((1, 2, 3, 3)))
    with pytest.raises(LayerError, match=r"layer 'col' \(Im2col\): filter dimensions"):
        make_layer("name:'col' type:'Im2col'", [x], tops())
    with pytest.raises(LayerError, match=r"layer 'col'.*output size"):
        make_layer("name:'col' type:'Im2col' convolution_param{kernel_size:5}", [x], tops())
    with pytest.raises(LayerError, match=r"layer 'col'.*not both"):
        make_layer("name:'col' type:'Im2col' convolution_param{kernel_size:2 kernel_h:2 "
                   "kernel_w:2}", [x], tops())
    with pytest.raises(LayerError, match=r"layer 'col'.*only 2 spatial axes"):
        make_layer("name:'col' type:'Im2col' convolution_param{kernel_size:1}",
                   [b64(np.zeros((1, 2, 3)))], tops())
    with pytest.raises(LayerError, match=r"layer 'col'.*axis 4 out of range"):
        make_layer("name:'col' type:'Im2col' convolution_param{kernel_size:1 axis:4}", [x], tops())


# ============================================================================ in a Net
def netparam(text: str) -> caffe_pb2.NetParameter:
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return p


PYRAMID_NET = """
name: "pyramid"
layer { name: "in" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 3 dim: 2 dim: 4 dim: 4 } shape { dim: 3 } } }
layer { name: "col" type: "Im2col" bottom: "data" top: "col" convolution_param { kernel_size: 1 } }
layer { name: "mvn" type: "MVN" bottom: "col" top: "col" }
layer { name: "spp" type: "SPP" bottom: "col" top: "spp" spp_param { pyramid_height: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "spp" top: "score"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "hinge" type: "HingeLoss" bottom: "score" bottom: "label" top: "hinge"
        hinge_loss_param { norm: L2 } }
layer { name: "softmax" type: "Softmax" bottom: "score" top: "prob" }
layer { name: "mll" type: "MultinomialLogisticLoss" bottom: "prob" bottom: "label"
        loss_weight: 0.5 }
"""


def test_losses_and_vision_layers_in_a_net() -> None:
    net = Net(netparam(PYRAMID_NET), dtype=np.float64)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal((3, 2, 4, 4))
    net.blobs["label"].data[...] = [0, 2, 1]
    loss = net.forward_prefilled()
    assert net.blobs["spp"].shape == (3, 2 * 5)
    score = net.blobs["score"].data
    t = np.where(np.arange(3)[None, :] == np.array([0, 2, 1])[:, None], 1, -1)
    hinge = (np.maximum(0, 1 - t * score) ** 2).sum() / 3
    prob = softmax_rows(score)
    mll = -np.log(prob[np.arange(3), [0, 2, 1]]).sum() / 3
    np.testing.assert_allclose(float(net.blobs["hinge"].data), hinge, rtol=1e-12)
    np.testing.assert_allclose(loss, hinge + 0.5 * mll, rtol=1e-12)
    net.backward()
    assert np.abs(net.params["ip"][0].diff).sum() > 0
    assert np.isfinite(net.params["ip"][0].diff).all()


SIAMESE_NET = """
name: "siamese"
force_backward: true
layer { name: "in" type: "Input" top: "a" top: "b" top: "sim" top: "label" top: "H"
        input_param { shape { dim: 3 dim: 2 } shape { dim: 3 dim: 2 } shape { dim: 3 }
                      shape { dim: 3 } shape { dim: 2 dim: 2 } } }
layer { name: "contrastive" type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "sim"
        top: "closs" contrastive_loss_param { margin: 1 } }
layer { name: "info" type: "InfogainLoss" bottom: "a" bottom: "label" bottom: "H" top: "iloss"
        loss_weight: 2 }
"""


def test_contrastive_and_infogain_in_a_net_with_force_backward() -> None:
    net = Net(netparam(SIAMESE_NET), dtype=np.float64)
    a, b = np.array(PAIR_A)[:, :2], np.array(PAIR_B)[:, :2]
    for name, value in (("a", a), ("b", b), ("sim", PAIR_SIM), ("label", [0, 1, 1]),
                        ("H", [[1.0, 0.5], [0.0, 2.0]])):
        net.blobs[name].data[...] = value
    loss = net.forward_prefilled()
    closs = (1 + 0.25) / 3 / 2
    iloss, _ = infogain_reference(a, np.array([0, 1, 1]), np.array([[1.0, 0.5], [0.0, 2.0]]))
    np.testing.assert_allclose(loss, closs + 2 * iloss / 3, rtol=1e-12)
    # force_backward reaches the features but never the similarity, labels or H
    li = net.layer_names.index("contrastive")
    assert net.bottom_need_backward[li] == [True, True, False]
    assert net.bottom_need_backward[net.layer_names.index("info")] == [True, False, False]
    net.backward()
    assert np.abs(net.blobs["b"].diff).sum() > 0


# ========================================================================= float32
@pytest.mark.parametrize("spec, shapes, values", [
    ("type:'HingeLoss' hinge_loss_param{norm:L2}", [(2, 3), (2,)], [None, [0, 2]]),
    ("type:'MultinomialLogisticLoss'", [(2, 3), (2,)], [[[0.2, 0.5, 0.3]] * 2, [1, 0]]),
    ("type:'InfogainLoss'", [(2, 3), (2,), (3, 3)], [None, [0, 2], INFO_H]),
    ("type:'ContrastiveLoss'", [(3, 2), (3, 2), (3,)], [PAIR_A, PAIR_B, PAIR_SIM]),
    ("type:'MVN'", [(2, 3, 2, 2)], [None]),
    ("type:'SPP' spp_param{pyramid_height:2 pool:AVE}", [(2, 3, 4, 4)], [None]),
    ("type:'Im2col' convolution_param{kernel_size:2}", [(2, 3, 4, 4)], [None]),
])
def test_float32_stays_float32(spec: str, shapes, values) -> None:
    rng = np.random.default_rng(0)
    bottom = []
    for shape, value in zip(shapes, values):
        b = Blob(shape, dtype=np.float32)
        b.data[...] = rng.standard_normal(shape) if value is None else np.reshape(value, shape)
        bottom.append(b)
    t = [Blob((), dtype=np.float32)]
    layer = make_layer(f"name:'l' {spec}", bottom, t)
    layer.forward(bottom, t)
    t[0].diff[...] = rng.standard_normal(t[0].shape)
    layer.backward(t, [True] + [False] * (len(bottom) - 1), bottom)
    assert t[0].data.dtype == np.float32 and bottom[0].diff.dtype == np.float32
    assert np.isfinite(t[0].data).all() and np.isfinite(bottom[0].diff).all()
