"""``caffe.Net``'s pycaffe surface: the names of Caffe's vectors, forward/backward between
layers against hand computations, the batched helpers, weights in both formats, sharing,
MemoryData inputs, callbacks, and Classifier/Detector on a tiny net."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import caffe

NET = """name: "small" force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 }
                        bias_filler { type: "constant" value: 0.5 } } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


@pytest.fixture
def net_file(tmp_path) -> Path:
    (tmp_path / "net.prototxt").write_text(NET)
    return tmp_path / "net.prototxt"


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def by_hand(net: caffe.Net, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w, b = (p.data.astype(np.float64) for p in net.params["ip"])
    ip = np.maximum(x @ w.T + b, 0)
    return ip, softmax(ip)


def test_the_names_pycaffe_scripts_read(net_file):
    net = caffe.Net(str(net_file), caffe.TEST)
    assert list(net.params) == ["ip"]  # layers without parameters are not listed
    assert [b.shape for b in net.params["ip"]] == [(2, 3), (2,)]
    assert net.inputs == ["data"] and net.outputs == ["prob"]
    assert net._layer_names == ["data", "ip", "relu", "prob"] == list(net.layer_dict)
    assert [l.type for l in net.layers] == ["Input", "InnerProduct", "ReLU", "Softmax"]
    assert net._blob_names == ["data", "ip", "prob"]
    assert net.top_names == OrderedDict([("data", ["data"]), ("ip", ["ip"]), ("relu", ["ip"]),
                                         ("prob", ["prob"])])
    assert net.bottom_names["relu"] == ["ip"] and net.bottom_names["data"] == []
    assert net._top_ids(2) == [1] and net._bottom_ids(3) == [1]
    assert net._inputs == [0] and net._outputs == [2]
    data = net.blobs["data"]
    assert (data.num, data.channels, data.height, data.width, data.count) == (4, 3, 1, 1, 12)
    data.reshape(2, 3)
    net.reshape()
    assert net.blobs["prob"].shape == (2, 2)


def test_forward_and_backward_between_named_layers(net_file):
    net = caffe.Net(str(net_file), caffe.TEST)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    ip, prob = by_hand(net, x)
    out = net.forward(data=x, blobs=["ip"])
    assert set(out) == {"prob", "ip"}
    np.testing.assert_allclose(out["prob"], prob, rtol=1e-5)
    np.testing.assert_allclose(out["ip"], ip, rtol=1e-5, atol=1e-6)

    # only the Softmax, from a hand-set ip blob
    net.blobs["ip"].data[...] = [[1, 0], [0, 1], [2, 2], [0, 0]]
    assert list(net.forward(start="prob", end="prob")) == ["prob"]
    np.testing.assert_allclose(net.blobs["prob"].data, softmax(net.blobs["ip"].data), rtol=1e-6)

    # backward from a diff given for the output, down to the input
    net.forward(data=x)
    g = np.array([[1, -1], [0.5, 2], [0, 1], [-3, 0]], np.float32)
    diffs = net.backward(prob=g)
    assert list(diffs) == ["data"]
    dip = prob * (g - (g * prob).sum(axis=1, keepdims=True)) * (ip > 0)
    np.testing.assert_allclose(diffs["data"], dip @ net.params["ip"][0].data, rtol=1e-4,
                               atol=1e-6)
    # backward through the InnerProduct alone, from its top's diff
    net.blobs["ip"].diff[...] = g
    out = net.backward(start="ip", end="ip")
    np.testing.assert_allclose(out["data"], g @ net.params["ip"][0].data, rtol=1e-5)


def test_forward_all_pads_the_last_batch_and_cuts_it_off(net_file):
    net = caffe.Net(str(net_file), caffe.TEST)
    x = np.random.default_rng(1).normal(size=(10, 3)).astype(np.float32)  # 4 + 4 + 2 padded
    out = net.forward_all(data=x, blobs=["ip"])
    assert out["prob"].shape == (10, 2)
    np.testing.assert_allclose(out["prob"], by_hand(net, x)[1], rtol=1e-5)
    blobs, diffs = net.forward_backward_all(data=x, prob=np.ones((10, 2), np.float32))
    assert blobs["prob"].shape == (10, 2) and diffs["data"].shape == (10, 3)
    # d(sum of softmax)/dx is zero: the probabilities always sum to one
    np.testing.assert_allclose(diffs["data"], 0, atol=1e-6)


def test_surgery_saved_and_loaded_in_both_formats_and_shared(net_file, tmp_path):
    net = caffe.Net(str(net_file), caffe.TEST)
    w, b = net.params["ip"]
    w.data[0] = 0
    b.data[...] = [3, -3]
    for kind in ("caffemodel", "h5"):
        path = str(tmp_path / f"w.{kind}.bin")  # a suffix that says neither format
        (net.save if kind == "caffemodel" else net.save_hdf5)(path)
        other = caffe.Net(str(net_file), caffe.TEST)
        (other.copy_from if kind == "caffemodel" else other.load_hdf5)(path)
        for mine, theirs in zip(net.params["ip"], other.params["ip"]):
            np.testing.assert_array_equal(mine.data, theirs.data)
    assert open(tmp_path / "w.h5.bin", "rb").read(4) == b"\x89HDF"
    again = caffe.Net(str(net_file), str(tmp_path / "w.caffemodel.bin"), caffe.TEST)
    np.testing.assert_array_equal(again.params["ip"][1].data, [3, -3])
    shared = caffe.Net(str(net_file), caffe.TEST)
    shared.share_with(net)
    w.data[1, 1] = 42
    assert shared.params["ip"][0].data[1, 1] == 42


def test_levels_and_stages_choose_layers(tmp_path):
    (tmp_path / "n.prototxt").write_text(NET + """
layer { name: "deep" type: "Softmax" bottom: "ip" top: "deep" include { min_level: 2 } }
layer { name: "staged" type: "Softmax" bottom: "ip" top: "staged" include { stage: "s" } }""")
    plain = caffe.Net(str(tmp_path / "n.prototxt"), caffe.TEST)
    assert plain.outputs == ["prob"]
    both = caffe.Net(str(tmp_path / "n.prototxt"), caffe.TEST, level=2, stages=["s"])
    assert both.outputs == ["deep", "prob", "staged"]  # Caffe keeps outputs sorted


def test_set_input_arrays_feeds_a_memory_data_layer_and_callbacks_see_each_layer(tmp_path):
    (tmp_path / "m.prototxt").write_text("""
layer { name: "mem" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: 2 channels: 1 height: 1 width: 2 } }
layer { name: "scale" type: "Power" bottom: "data" top: "twice" power_param { scale: 2 } }""")
    net = caffe.Net(str(tmp_path / "m.prototxt"), caffe.TEST)
    data = np.arange(8, dtype=np.float32).reshape(4, 1, 1, 2)
    net.set_input_arrays(data, np.array([5, 6, 7, 8], np.float32))
    seen: list[tuple[str, int]] = []
    net.before_forward(lambda i: seen.append(("before", i)))
    net.after_forward(lambda i: seen.append(("after", i)))
    first, second = net.forward()["twice"].copy(), net.forward()["twice"].copy()
    np.testing.assert_array_equal(first, 2 * data[:2])
    np.testing.assert_array_equal(second, 2 * data[2:])
    np.testing.assert_array_equal(net.blobs["label"].data, [7, 8])
    assert seen[:4] == [("before", 0), ("after", 0), ("before", 1), ("after", 1)]
    with pytest.raises(RuntimeError, match="must be float32"):
        net.set_input_arrays(data.astype(np.float64), np.zeros(4, np.float32))


def test_positional_phase_must_be_caffes(net_file):
    with pytest.raises(ValueError, match="caffe.TRAIN or caffe.TEST"):
        caffe.Net(str(net_file), "TEST")


# -- Classifier and Detector -----------------------------------------------------------------
DEPLOY = """name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 4 dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.002 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


@pytest.fixture
def deploy(tmp_path) -> tuple[str, str]:
    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    net = caffe.Net(str(tmp_path / "deploy.prototxt"), caffe.TEST)
    net.save(str(tmp_path / "w.caffemodel"))
    return str(tmp_path / "deploy.prototxt"), str(tmp_path / "w.caffemodel")


def expected(model: caffe.Net, hwc: np.ndarray, mean: np.ndarray) -> np.ndarray:
    w = model.params["ip"][0].data.astype(np.float64)
    x = (hwc.transpose(2, 0, 1)[::-1] * 255 - mean[:, None, None]).ravel()
    return softmax((w @ x)[None])[0]


def test_classifier_center_crop_and_oversampling(deploy):
    mean = np.array([10.0, 20.0, 30.0])
    clf = caffe.Classifier(*deploy, mean=mean, raw_scale=255, channel_swap=(2, 1, 0))
    image = np.random.default_rng(2).uniform(size=(4, 4, 3)).astype(np.float32)
    got = clf.predict([image, image[::-1]], oversample=False)
    np.testing.assert_allclose(got[0], expected(clf, image, mean), rtol=1e-5)
    np.testing.assert_allclose(got[1], expected(clf, image[::-1], mean), rtol=1e-5)
    flat = np.full((4, 4, 3), 0.25, np.float32)  # every crop of it is the same picture
    np.testing.assert_allclose(clf.predict([flat])[0], expected(clf, flat, mean), rtol=1e-5)


def test_detector_windows_with_and_without_context(deploy, tmp_path):
    rgb = np.random.default_rng(3).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "im.png")
    det = caffe.Detector(*deploy, raw_scale=255)
    window = np.array([2, 2, 6, 6])
    (hit,) = det.detect_windows([(str(tmp_path / "im.png"), [window])])
    patch = rgb[2:6, 2:6].astype(np.float32) / 255
    w = det.params["ip"][0].data.astype(np.float64)
    want = softmax((w @ (patch.transpose(2, 0, 1) * 255).ravel())[None])[0]
    np.testing.assert_allclose(hit["prediction"], want, rtol=1e-5)
    assert hit["filename"].endswith("im.png") and hit["window"] is window

    padded = caffe.Detector(*deploy, raw_scale=255, mean=np.array([1.0, 2.0, 3.0]),
                            context_pad=1)
    crop = padded.crop(rgb.astype(np.float32) / 255, np.array([0, 0, 3, 3]))
    assert crop.shape == (4, 4, 3)
    # the context box starts above and left of the image: the mean fills that border
    np.testing.assert_allclose(crop[0, 0], np.array([1.0, 2.0, 3.0]) / 255, rtol=1e-6)
