"""``caffe.io``: BlobProto and Datum round trips, images in pycaffe's convention, resizing,
oversampling and the Transformer's steps, checked against values worked out by hand."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import caffe
from caffe.proto import caffe_pb2


def test_blobproto_round_trips_and_shapes():
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    blob = caffe.io.array_to_blobproto(arr, diff=-arr)
    assert list(blob.shape.dim) == [2, 3, 4] and len(blob.double_data) == 0
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob), arr)
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob, return_diff=True), -arr)

    legacy = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3, data=range(6))
    assert caffe.io.blobproto_to_array(legacy).shape == (1, 2, 1, 3)
    scalar = caffe_pb2.BlobProto(data=[7.5])
    assert caffe.io.blobproto_to_array(scalar).shape == () and caffe.io.blobproto_to_array(scalar) == 7.5
    with pytest.raises(ValueError, match="4 values for shape"):
        caffe.io.blobproto_to_array(caffe_pb2.BlobProto(data=[1, 2, 3, 4]))

    arrays = [arr, np.ones((5,), np.float32)]
    back = caffe.io.blobprotovector_str_to_arraylist(
        caffe.io.arraylist_to_blobprotovector_str(arrays))
    assert [a.shape for a in back] == [(2, 3, 4), (5,)]
    np.testing.assert_array_equal(back[0], arr)


def test_datum_round_trips_with_and_without_a_label():
    pixels = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    d = caffe.io.array_to_datum(pixels, label=4)
    assert (d.channels, d.height, d.width, d.label) == (3, 2, 2, 4) and d.data == pixels.tobytes()
    np.testing.assert_array_equal(caffe.io.datum_to_array(d), pixels)
    floats = caffe.io.array_to_datum(np.full((1, 2, 3), 0.25))
    assert not floats.HasField("label") and list(floats.float_data) == [0.25] * 6
    assert len(floats.SerializeToString()) < len(caffe.io.array_to_datum(
        np.full((1, 2, 3), 0.25), label=0).SerializeToString())
    with pytest.raises(ValueError, match="C x H x W"):
        caffe.io.array_to_datum(np.zeros((2, 2)))


def test_load_image_is_rgb_in_0_1(tmp_path):
    rgb = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [51, 102, 153]]], np.uint8)
    Image.fromarray(rgb).save(tmp_path / "c.png")
    im = caffe.io.load_image(str(tmp_path / "c.png"))
    assert im.shape == (2, 2, 3) and im.dtype == np.float32
    np.testing.assert_allclose(im, rgb / 255.0, rtol=1e-6)
    grey = caffe.io.load_image(str(tmp_path / "c.png"), color=False)
    assert grey.shape == (2, 2, 1)
    # Pillow's L = (299 R + 587 G + 114 B) / 1000
    assert grey[0, 0, 0] == pytest.approx(round(255 * 0.299) / 255, abs=1 / 255)


def test_resize_image_by_hand():
    im = np.array([[0.0, 1.0], [2.0, 3.0]], np.float32)[:, :, None]
    up = caffe.io.resize_image(im, (4, 4))
    # half-pixel centres: output column x samples input x/2 - 0.25, clamped to [0, 1]
    np.testing.assert_allclose(up[0, :, 0], [0, 0.25, 0.75, 1])
    np.testing.assert_allclose(up[:, 0, 0], [0, 0.5, 1.5, 2])
    near = caffe.io.resize_image(im, (4, 4), interp_order=0)
    np.testing.assert_array_equal(near[:, :, 0], [[0, 0, 1, 1], [0, 0, 1, 1],
                                                  [2, 2, 3, 3], [2, 2, 3, 3]])
    five = np.random.default_rng(0).uniform(size=(3, 5, 5)).astype(np.float32)
    assert caffe.io.resize_image(five, (7, 2)).shape == (7, 2, 5)  # any number of channels
    with pytest.raises(ValueError, match="interp_order"):
        caffe.io.resize_image(im, (3, 3), interp_order=3)


def test_oversample_takes_corners_centre_and_mirrors():
    im = np.arange(16, dtype=np.float32).reshape(4, 4, 1)
    crops = caffe.io.oversample([im], (2, 2))
    assert crops.shape == (10, 2, 2, 1)
    assert [c[0, 0, 0] for c in crops[:5]] == [0, 2, 8, 10, 5]
    np.testing.assert_array_equal(crops[5:], crops[:5, :, ::-1])


def test_transformer_steps_and_their_inverse():
    t = caffe.io.Transformer({"data": (1, 3, 2, 2)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([1.0, 2.0, 3.0]))
    t.set_input_scale("data", 0.5)
    rgb = np.random.default_rng(1).uniform(size=(2, 2, 3)).astype(np.float32)
    out = t.preprocess("data", rgb)
    want = (rgb.transpose(2, 0, 1)[::-1] * 255 - np.array([1, 2, 3])[:, None, None]) * 0.5
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_allclose(t.deprocess("data", out), rgb, rtol=1e-5, atol=1e-6)
    assert t.preprocess("data", np.ones((5, 5, 3), np.float32)).shape == (3, 2, 2)  # resized
    t.set_mean("data", np.full((3, 4, 4), 7.0))  # an image mean is resized to the input
    assert t.mean["data"].shape == (3, 2, 2) and np.allclose(t.mean["data"], 7)
    with pytest.raises(Exception, match="not one of the net inputs"):
        t.preprocess("label", rgb)
    with pytest.raises(ValueError, match="Mean channels"):
        t.set_mean("data", np.zeros(2))
