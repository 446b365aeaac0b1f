"""WindowData (R-CNN's window file, sampled windows, context, warping) and HDF5Output."""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import engine.layer_types  # noqa: F401  (fills the registry, data layers included)
from engine import backend
from engine.blob import Blob
from engine.context import RunContext
from engine.data.datum import encode_image
from engine.data.hdf5 import HDF5OutputLayer
from engine.data.window import WarpBox, WindowDataLayer, warp_box
from engine.data.transformer import write_mean_file
from engine.layers.base import LayerError, create_layer, layer_class
from engine.pb import caffe_pb2
from tests.gradcheck import blob_of, make_layer as make_bottom_layer

# -- fixtures ---------------------------------------------------------------------------------

#: (image, [(class, overlap, x1, y1, x2, y2)]); with fg_threshold 0.7 and bg_threshold 0.3
#: classes 3, 5, 7 are foreground, the class-2 and class-0 windows background, class 9 unused
WINDOWS = [
    (0, [(3, 0.9, 2, 1, 5, 4), (2, 0.1, 0, 0, 3, 3), (9, 0.5, 1, 1, 4, 4), (5, 0.8, 4, 6, 7, 9)]),
    (1, [(7, 1.0, 0, 0, 3, 3), (0, 0.0, 3, 2, 6, 5)]),
]


def window_text(images: list[tuple[str, tuple[int, int, int]]], windows=WINDOWS) -> str:
    lines = []
    for (index, boxes), (name, (c, h, w)) in zip(windows, images):
        lines += [f"# {index}", name, str(c), str(h), str(w), str(len(boxes))]
        lines += [" ".join(str(v) for v in box) for box in boxes]
    return "\n".join(lines) + "\n"


@pytest.fixture
def pictures(tmp_path: Path) -> list[np.ndarray]:
    """Two BGR CHW images (10x12 and 8x8) saved as PNG under tmp_path/img/."""
    rng = np.random.default_rng(0)
    images = [rng.integers(40, 256, (3, 10, 12), dtype=np.uint8),
              rng.integers(40, 256, (3, 8, 8), dtype=np.uint8)]
    (tmp_path / "img").mkdir()
    for i, im in enumerate(images):
        (tmp_path / "img" / f"p{i}.png").write_bytes(encode_image(im))
    (tmp_path / "windows.txt").write_text(
        window_text([(f"p{i}.png", im.shape) for i, im in enumerate(images)]))
    return images


def window_layer(base: Path, params: str = "", transform: str = "crop_size: 4",
                 phase: str = "TRAIN", prefetch: int = 0, rank: int = 0, world: int = 1,
                 decoders: int = 0):
    text = f"""name: "w" type: "WindowData" top: "data" top: "label"
        transform_param {{ {transform} }}
        data_param {{ prefetch: {prefetch} decoders: {decoders} }}
        window_data_param {{ source: "windows.txt" root_folder: "img/" batch_size: 8
                             fg_threshold: 0.7 bg_threshold: 0.3 {params} }}"""
    layer = create_layer(text_format.Parse(text, caffe_pb2.LayerParameter()), phase)
    layer.context = RunContext(rank, world, [base])
    tops = [Blob(), Blob()]
    layer.check_blob_counts([], tops)
    layer.setup([], tops)
    layer.reshape([], tops)
    return layer, tops


def batches(layer, tops, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for _ in range(n):
        layer.forward([], tops)
        out.append((tops[0].data.copy(), tops[1].data.copy()))
    return out


# -- WindowData -------------------------------------------------------------------------------

def test_registered_under_both_names() -> None:
    assert layer_class("WindowData") is layer_class("WINDOW_DATA") is WindowDataLayer
    assert layer_class("HDF5Output") is layer_class("HDF5_OUTPUT") is HDF5OutputLayer


def test_batch_shape_and_foreground_fraction(tmp_path: Path, pictures) -> None:
    backend.seed(1)
    layer, tops = window_layer(tmp_path, "fg_fraction: 0.3")
    assert tops[0].shape == (8, 3, 4, 4) and tops[1].shape == (8,)
    # Caffe: int(8 * 0.3) = 2 foreground windows, after 6 background ones
    assert (layer.num_bg, layer.num_fg) == (6, 2)
    seen = set()
    for data, labels in batches(layer, tops, 30):
        assert data.shape == (8, 3, 4, 4)
        np.testing.assert_array_equal(labels[:6], 0)
        assert set(labels[6:]) <= {3, 5, 7}
        seen |= set(labels[6:].tolist())
    assert seen == {3, 5, 7}  # every foreground window is drawn; class 9 (in between) never
    assert layer.position() == 30 * 8


def test_default_fraction_and_all_foreground(tmp_path: Path, pictures) -> None:
    layer, tops = window_layer(tmp_path)  # fg_fraction 0.25 -> 2 of 8
    _, labels = batches(layer, tops, 1)[0]
    assert (labels[:6] == 0).all() and (labels[6:] > 0).all()
    layer, tops = window_layer(tmp_path, "fg_fraction: 1")
    _, labels = batches(layer, tops, 1)[0]
    assert (labels > 0).all()


def only_window(tmp_path: Path, box: tuple, image: int = 0, shape=(3, 10, 12)) -> None:
    """A window file whose one foreground window is ``box`` (plus a background one)."""
    (tmp_path / "windows.txt").write_text(window_text(
        [(f"p{image}.png", shape)], [(0, [(4, 0.9, *box), (0, 0.0, 0, 0, 1, 1)])]))


def test_crop_equals_the_window_after_mean_and_scale(tmp_path: Path, pictures) -> None:
    only_window(tmp_path, (2, 1, 5, 4))  # 4x4: warping to crop_size 4 leaves it as it is
    layer, tops = window_layer(tmp_path, "fg_fraction: 1 scale: 0.5",
                               "crop_size: 4 mean_value: 10 mean_value: 20 mean_value: 30")
    data, labels = batches(layer, tops, 1)[0]
    crop = pictures[0][:, 1:5, 2:6].astype(np.float32)
    expect = (crop - np.array([10, 20, 30], np.float32).reshape(3, 1, 1)) * np.float32(0.5)
    for item in data:
        np.testing.assert_array_equal(item, expect)
    np.testing.assert_array_equal(labels, 4)
    # a mean file is cut at its centre: (6 - 4) // 2 = 1 on both axes
    mean = np.random.default_rng(3).uniform(0, 40, (3, 6, 6)).astype(np.float32)
    write_mean_file(tmp_path / "mean.binaryproto", mean)
    layer, tops = window_layer(tmp_path, "fg_fraction: 1",
                               'crop_size: 4 scale: 0.25 mean_file: "mean.binaryproto"')
    data, _ = batches(layer, tops, 1)[0]
    np.testing.assert_array_equal(data[0], (crop - mean[:, 1:5, 1:5]) * np.float32(0.25))


def test_mirror_flips_some_windows(tmp_path: Path, pictures) -> None:
    only_window(tmp_path, (2, 1, 5, 4))
    backend.seed(4)
    layer, tops = window_layer(tmp_path, "fg_fraction: 1", "crop_size: 4 mirror: true")
    crop = pictures[0][:, 1:5, 2:6].astype(np.float32)
    flips = []
    for data, _ in batches(layer, tops, 4):
        for item in data:
            straight = np.array_equal(item, crop)
            assert straight or np.array_equal(item, crop[:, :, ::-1])
            flips.append(not straight)
    assert 0 < sum(flips) < len(flips)


def test_warp_box_geometry() -> None:
    # no context: the window itself, warped to the whole crop
    assert warp_box((2, 1, 5, 4), (10, 12), 4, 0, False, False) == WarpBox(2, 1, 5, 4, 4, 4, 0, 0)
    # context_pad 2 of crop 8 doubles the 4x4 box about its centre (2, 2): (-2, -2)-(6, 6),
    # 9 wide; the 2 pixels left of the image become round(2 * 8/9) = 2 of padding and the
    # 7 pixels inside warp to round(7 * 8/9) = 6
    assert warp_box((0, 0, 3, 3), (10, 10), 8, 2, False, False) == WarpBox(0, 0, 6, 6, 6, 6, 2, 2)
    # mirrored, the padding moves to the side the box left the image on after the flip
    assert warp_box((0, 0, 3, 3), (10, 10), 8, 2, False, True) == WarpBox(0, 0, 6, 6, 6, 6, 2, 0)
    # square: the 4x2 box grows to the 4x4 square about its centre (4, 3) -> (2, 1)-(6, 5)
    assert warp_box((2, 2, 5, 3), (10, 10), 4, 0, True, False) == WarpBox(2, 1, 6, 5, 4, 4, 0, 0)


def test_context_padding_leaves_zeros_outside_the_image(tmp_path: Path, pictures) -> None:
    only_window(tmp_path, (0, 0, 3, 3), image=1, shape=(3, 8, 8))
    layer, tops = window_layer(tmp_path, "fg_fraction: 1 context_pad: 2", "crop_size: 8")
    data, _ = batches(layer, tops, 1)[0]
    item = data[0]
    assert (item[:, :2, :] == 0).all() and (item[:, :, :2] == 0).all()
    assert (item[:, 2:, 2:] > 0).all()  # every pixel of the pictures is at least 40
    # (0, 0)-(6, 6) of the image warped to 6x6 with OpenCV's bilinear rule
    from engine.data.datum import resize_bilinear
    warped = resize_bilinear(pictures[1][:, :7, :7].transpose(1, 2, 0), 6, 6).transpose(2, 0, 1)
    np.testing.assert_array_equal(item[:, 2:, 2:], warped)


def test_same_position_same_batch_after_seek(tmp_path: Path, pictures) -> None:
    backend.seed(7)
    straight, t1 = window_layer(tmp_path, "", "crop_size: 4 mirror: true", prefetch=2)
    expected = batches(straight, t1, 5)
    backend.seed(7)
    resumed, t2 = window_layer(tmp_path, "", "crop_size: 4 mirror: true", prefetch=2)
    batches(resumed, t2, 1)
    resumed.seek(16)  # the position after two batches
    for (a, la), (b, lb) in zip(expected[2:], batches(resumed, t2, 3)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    resumed.seek(0)
    np.testing.assert_array_equal(batches(resumed, t2, 1)[0][0], expected[0][0])
    # the draws come from the run's seed: another seed, other windows
    backend.seed(8)
    other, t3 = window_layer(tmp_path, "", "crop_size: 4 mirror: true")
    assert any(not np.array_equal(a, b[0]) for (a, _), b in zip(expected, batches(other, t3, 5)))
    for layer in (straight, resumed, other):
        layer.close()


def test_workers_read_different_windows(tmp_path: Path, pictures) -> None:
    backend.seed(2)
    w0, t0 = window_layer(tmp_path, rank=0, world=2)
    backend.seed(2)
    w1, t1 = window_layer(tmp_path, rank=1, world=2)
    (a, _), (b, _) = batches(w0, t0, 1)[0], batches(w1, t1, 1)[0]
    assert not np.array_equal(a, b)
    assert w0.position() == w1.position() == 16


def test_cached_images_and_missing_images(tmp_path: Path, pictures) -> None:
    backend.seed(5)
    plain, t1 = window_layer(tmp_path)
    backend.seed(5)
    cached, t2 = window_layer(tmp_path, "cache_images: true")
    np.testing.assert_array_equal(batches(plain, t1, 1)[0][0], batches(cached, t2, 1)[0][0])
    (tmp_path / "img" / "p1.png").unlink()
    with pytest.raises(LayerError, match=r"layer 'w' \(WindowData\): cannot read image .*p1\.png"):
        window_layer(tmp_path, "cache_images: true")
    lazy, t3 = window_layer(tmp_path, "fg_fraction: 1")
    with pytest.raises(LayerError, match=r"cannot read image .*p1\.png"):
        batches(lazy, t3, 3)


GOOD = "# 0\np0.png\n3\n10\n12\n2\n3 0.9 2 1 5 4\n0 0.1 0 0 3 3\n"


@pytest.mark.parametrize("text, line, message", [
    ("", None, "is empty"),
    (GOOD.replace("# 0", "0"), 1, "expected '# <image index>'"),
    (GOOD.replace("# 0", "# 1"), 1, "image index 1 out of sequence, expected 0"),
    (GOOD.replace("\n3\n10", "\nthree\n10"), 3, "expected the number of channels, got 'three'"),
    (GOOD.replace("\n3\n10", "\n4\n10"), 3, "images must have 1 or 3 channels, got 4"),
    (GOOD.replace("3 0.9 2 1 5 4", "3 high 2 1 5 4"), 7, "expected a window line .*got 'high'"),
    (GOOD.replace("3 0.9 2 1 5 4", "3 0.9 5 1 2 4"), 7, r"window \(5, 1, 2, 4\) has x2 < x1"),
    (GOOD.replace("3 0.9", "0 0.9"), 7, "a foreground window .* needs a class > 0, got 0"),
    (GOOD.replace("0 0.1 0 0 3 3\n", ""), 7, "unexpected end of file, expected a window line"),
    (GOOD + "# 1\np0.png\n3\n", 11, "unexpected end of file, expected the image height"),
])
def test_bad_window_file_names_file_and_line(tmp_path: Path, pictures, text: str,
                                             line: int | None, message: str) -> None:
    (tmp_path / "windows.txt").write_text(text)
    where = rf"windows\.txt:{line}: " if line else r"window file .*windows\.txt "
    with pytest.raises(LayerError, match=rf"^layer 'w' \(WindowData\): .*{where}{message}"):
        window_layer(tmp_path)


def test_windows_outside_their_image_and_bad_parameters(tmp_path: Path, pictures) -> None:
    only_window(tmp_path, (9, 1, 12, 4))  # the image is 12 wide: x2 = 12 is past its edge
    layer, tops = window_layer(tmp_path, "fg_fraction: 1")
    with pytest.raises(LayerError, match=r"windows\.txt:7: window \(9, 1, 12, 4\) does not fit "
                                         r"in the 12x10"):
        layer.forward([], tops)
    only_window(tmp_path, (2, 1, 5, 4))
    with pytest.raises(LayerError, match="crop_size must be set"):
        window_layer(tmp_path, transform="")
    with pytest.raises(LayerError, match="context_pad 2 leaves no room"):
        window_layer(tmp_path, "context_pad: 2")
    with pytest.raises(LayerError, match='crop_mode must be "warp" or "square"'):
        window_layer(tmp_path, 'crop_mode: "stretch"')
    with pytest.raises(LayerError, match="scale differ"):
        window_layer(tmp_path, "scale: 2", "crop_size: 4 scale: 3")
    with pytest.raises(LayerError, match="has no background windows"):
        (tmp_path / "windows.txt").write_text(window_text(
            [("p0.png", (3, 10, 12))], [(0, [(4, 0.9, 2, 1, 5, 4)])]))
        window_layer(tmp_path)


# -- HDF5Output --------------------------------------------------------------------------------

def test_hdf5_output_appends_each_forward(tmp_path: Path) -> None:
    out = tmp_path / "out.h5"
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((2, 3, 2, 2)).astype(np.float32) for _ in range(2)]
    labels = [np.array([1, 2], np.float32), np.array([3, 4], np.float32)]
    bottom = [blob_of(data[0]), blob_of(labels[0])]
    layer = make_bottom_layer(f'name: "o" type: "HDF5Output" bottom: "data" bottom: "label" '
                              f'hdf5_output_param {{ file_name: "{out}" }}', bottom, [])
    with h5py.File(out, "r") as f:  # set-up leaves a valid, empty file
        assert f["data"].shape == (0, 3, 2, 2) and f["label"].shape == (0, 1, 1, 1)
    for x, y in zip(data, labels):
        bottom[0].data[...], bottom[1].data[...] = x, y
        layer.reshape(bottom, [])
        layer.forward(bottom, [])
    bottom[0].diff[...] = 5
    layer.backward([], [True, True], bottom)  # nothing to propagate
    assert (bottom[0].diff == 5).all()
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["data"][...], np.concatenate(data))
        # Caffe saves (num, channels, height, width): a label vector as N x 1 x 1 x 1
        np.testing.assert_array_equal(f["label"][...], np.concatenate(labels).reshape(4, 1, 1, 1))
        assert f["data"].dtype == np.float32
    # a new layer truncates the file, as Caffe's does
    make_bottom_layer(f'name: "o" type: "HDF5Output" bottom: "data" bottom: "label" '
                      f'hdf5_output_param {{ file_name: "{out}" }}', bottom, [])
    with h5py.File(out, "r") as f:
        assert f["data"].shape[0] == 0
    with pytest.raises(LayerError, match="same number of rows"):
        layer.reshape([bottom[0], blob_of(np.zeros(3, np.float32))], [])


def test_hdf5_output_errors(tmp_path: Path) -> None:
    bottom = [blob_of(np.zeros((2, 3), np.float32)), blob_of(np.zeros(2, np.float32))]
    with pytest.raises(LayerError, match="file_name is not set"):
        make_bottom_layer('name: "o" type: "HDF5Output" bottom: "a" bottom: "b"', bottom, [])
    with pytest.raises(LayerError, match=r"folder .*nowhere of hdf5_output_param"):
        make_bottom_layer(f'name: "o" type: "HDF5Output" bottom: "a" bottom: "b" '
                          f'hdf5_output_param {{ file_name: "{tmp_path}/nowhere/x.h5" }}',
                          bottom, [])


def test_v1_net_window_data_into_hdf5_output(tmp_path: Path, pictures) -> None:
    """A V1 net (upgraded: window_data_param's crop_size and scale move to transform_param)
    whose WindowData batches an HDF5Output writes: the file holds both batches."""
    from engine.net import Net
    (tmp_path / "net.prototxt").write_text("""name: "dump"
        layers { name: "w" type: WINDOW_DATA top: "data" top: "label"
                 window_data_param { source: "windows.txt" root_folder: "img/" batch_size: 4
                                     fg_threshold: 0.7 bg_threshold: 0.3 fg_fraction: 0.5
                                     crop_size: 4 scale: 0.5 } }
        layers { name: "o" type: HDF5_OUTPUT bottom: "data" bottom: "label"
                 hdf5_output_param { file_name: "dump.h5" } }""")
    backend.seed(0)
    net = Net(str(tmp_path / "net.prototxt"), phase="TRAIN")
    got = []
    for _ in range(2):
        net.forward()
        got.append((net.blobs["data"].data.copy(), net.blobs["label"].data.copy()))
    for layer in net.data_layers:
        layer.close()
    assert net.layers[0].scale == np.float32(0.5)
    with h5py.File(tmp_path / "dump.h5", "r") as f:
        np.testing.assert_array_equal(f["data"][...], np.concatenate([g[0] for g in got]))
        np.testing.assert_array_equal(f["label"][...].ravel(), np.concatenate([g[1] for g in got]))
    labels = np.concatenate([g[1] for g in got]).reshape(2, 4)
    assert (labels[:, :2] == 0).all() and (labels[:, 2:] > 0).all()
    assert np.abs(got[0][0]).max() <= 255 * 0.5
