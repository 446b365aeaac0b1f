"""Every layer type of BVLC Caffe (master: Caffe 1.0's 59 plus Clip and Swish) builds from a
prototxt inside a net, runs forward (and backward, where it learns or passes gradients), and
gives its first top the shape Caffe's Reshape gives it.

The formulas and gradients of each type are tested in the per-family test modules; this one
is the contract that a Caffe user's prototxt naming any registered type builds here too.
"""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import engine.layer_types  # noqa: F401  (fills the registry, data layers included)
from engine.data.datum import array_to_datum, encode_image
from engine.data.lmdb_source import write_lmdb
from engine.layers.base import layer_class, registered_types
from engine.net import Net

#: src/caffe/layers/*.cpp and layer_factory.cpp of BVLC/caffe master: every REGISTER_LAYER_*
CAFFE_TYPES = (
    "AbsVal Accuracy ArgMax BNLL BatchNorm BatchReindex Bias Clip Concat ContrastiveLoss "
    "Convolution Crop Data Deconvolution Dropout DummyData ELU Eltwise Embed EuclideanLoss Exp "
    "Filter Flatten HDF5Data HDF5Output HingeLoss Im2col ImageData InfogainLoss InnerProduct "
    "Input LRN LSTM LSTMUnit Log MVN MemoryData MultinomialLogisticLoss PReLU Parameter Pooling "
    "Power Python RNN ReLU Reduction Reshape SPP Scale Sigmoid SigmoidCrossEntropyLoss Silence "
    "Slice Softmax SoftmaxWithLoss Split Swish TanH Threshold Tile WindowData").split()

#: the inputs every case may use, from DummyData (so that forward sees real numbers):
#: x (2,3,4,5), s, s2 (2,3), r (2,3,2,3) in [0.1, 1]; lab (2,) = 1; idx (2,) = 0; one (2,) = 1;
#: seq (3,2,4) and cont (3,2) = 1 for the recurrent layers; c0 (1,2,5), g (1,2,20), c1 (1,2) = 1
INPUTS = """
layer { name: "in_x" type: "DummyData" top: "x" top: "s" top: "s2" top: "r"
  dummy_data_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } shape { dim: 2 dim: 3 }
                     shape { dim: 2 dim: 3 } shape { dim: 2 dim: 3 dim: 2 dim: 3 }
                     data_filler { type: "uniform" min: 0.1 max: 1 } } }
layer { name: "in_lab" type: "DummyData" top: "lab" top: "one"
  dummy_data_param { shape { dim: 2 } data_filler { type: "constant" value: 1 } } }
layer { name: "in_idx" type: "DummyData" top: "idx"
  dummy_data_param { shape { dim: 2 } data_filler { type: "constant" value: 0 } } }
layer { name: "in_seq" type: "DummyData" top: "seq" top: "c0" top: "g"
  dummy_data_param { shape { dim: 3 dim: 2 dim: 4 } shape { dim: 1 dim: 2 dim: 5 }
                     shape { dim: 1 dim: 2 dim: 20 }
                     data_filler { type: "uniform" min: -1 max: 1 } } }
layer { name: "in_cont" type: "DummyData" top: "cont" top: "c1"
  dummy_data_param { shape { dim: 3 dim: 2 } shape { dim: 1 dim: 2 }
                     data_filler { type: "constant" value: 1 } } }
layer { name: "in_h" type: "DummyData" top: "H"
  dummy_data_param { shape { dim: 3 dim: 3 } data_filler { type: "constant" value: 0.5 } } }
"""

_W = 'weight_filler { type: "uniform" min: -1 max: 1 }'

#: type -> (the layer's bottoms, tops and params; its first top's shape; runs backward)
CASES: dict[str, tuple[str, tuple[int, ...], bool]] = {
    "AbsVal": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "Accuracy": ('bottom: "s" bottom: "lab" top: "t"', (), False),
    "ArgMax": ('bottom: "s" top: "t"', (2, 1, 1), False),
    "BNLL": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "BatchNorm": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "BatchReindex": ('bottom: "x" bottom: "idx" top: "t"', (2, 3, 4, 5), True),
    "Bias": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "Clip": ('bottom: "x" top: "t" clip_param { min: 0.2 max: 0.8 }', (2, 3, 4, 5), True),
    "Concat": ('bottom: "x" bottom: "x" top: "t"', (2, 6, 4, 5), True),
    "ContrastiveLoss": ('bottom: "s" bottom: "s2" bottom: "one" top: "t"', (), True),
    "Convolution": (f'bottom: "x" top: "t" convolution_param {{ num_output: 4 kernel_size: 3 '
                    f'pad: 1 {_W} }}', (2, 4, 4, 5), True),
    "Crop": ('bottom: "x" bottom: "r" top: "t" crop_param { offset: 1 }', (2, 3, 2, 3), True),
    "Deconvolution": (f'bottom: "x" top: "t" convolution_param {{ num_output: 2 kernel_size: 2 '
                      f'stride: 2 {_W} }}', (2, 2, 8, 10), True),
    "Dropout": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "DummyData": ('top: "t" dummy_data_param { shape { dim: 7 } }', (7,), False),
    "ELU": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "Eltwise": ('bottom: "x" bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "Embed": (f'bottom: "lab" top: "t" embed_param {{ input_dim: 4 num_output: 6 {_W} }}',
              (2, 6), True),
    "EuclideanLoss": ('bottom: "s" bottom: "s2" top: "t"', (), True),
    "Exp": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "Filter": ('bottom: "x" bottom: "one" top: "t"', (2, 3, 4, 5), True),
    "Flatten": ('bottom: "x" top: "t"', (2, 60), True),
    "HingeLoss": ('bottom: "s" bottom: "lab" top: "t"', (), True),
    "Im2col": ('bottom: "x" top: "t" convolution_param { kernel_size: 2 }', (2, 12, 3, 4), True),
    "InfogainLoss": ('bottom: "s" bottom: "lab" bottom: "H" top: "t"', (), True),
    "InnerProduct": (f'bottom: "x" top: "t" inner_product_param {{ num_output: 7 {_W} }}',
                     (2, 7), True),
    "Input": ('top: "t" input_param { shape { dim: 1 dim: 2 } }', (1, 2), False),
    "LRN": ('bottom: "x" top: "t" lrn_param { local_size: 3 }', (2, 3, 4, 5), True),
    "LSTM": (f'bottom: "seq" bottom: "cont" top: "t" recurrent_param {{ num_output: 5 {_W} }}',
             (3, 2, 5), True),
    "LSTMUnit": ('bottom: "c0" bottom: "g" bottom: "c1" top: "t" top: "h"', (1, 2, 5), True),
    "Log": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "MVN": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "MultinomialLogisticLoss": ('bottom: "s" bottom: "lab" top: "t"', (), True),
    "PReLU": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "Parameter": ('top: "t" parameter_param { shape { dim: 2 dim: 3 } }', (2, 3), True),
    "Pooling": ('bottom: "x" top: "t" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
                (2, 3, 2, 3), True),
    "Power": ('bottom: "x" top: "t" power_param { power: 2 scale: 3 shift: 1 }', (2, 3, 4, 5),
              True),
    "RNN": (f'bottom: "seq" bottom: "cont" top: "t" recurrent_param {{ num_output: 5 {_W} }}',
            (3, 2, 5), True),
    "ReLU": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "Reduction": ('bottom: "x" top: "t" reduction_param { axis: 1 operation: SUMSQ }', (2,),
                  True),
    "Reshape": ('bottom: "x" top: "t" reshape_param { shape { dim: 0 dim: -1 dim: 2 } }',
                (2, 30, 2), True),
    "SPP": ('bottom: "x" top: "t" spp_param { pyramid_height: 2 }', (2, 15), True),
    "Scale": ('bottom: "x" top: "t" scale_param { bias_term: true }', (2, 3, 4, 5), True),
    "Sigmoid": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "SigmoidCrossEntropyLoss": ('bottom: "s" bottom: "s2" top: "t"', (), True),
    "Silence": ('bottom: "x"', (), True),
    "Slice": ('bottom: "x" top: "t" top: "u" slice_param { slice_point: 1 }', (2, 1, 4, 5),
              True),
    "Softmax": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "SoftmaxWithLoss": ('bottom: "s" bottom: "lab" top: "t"', (), True),
    "Split": ('bottom: "x" top: "t" top: "u"', (2, 3, 4, 5), True),
    "Swish": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    "TanH": ('bottom: "x" top: "t"', (2, 3, 4, 5), True),
    # Caffe has no Threshold backward (NOT_IMPLEMENTED), nor has this engine
    "Threshold": ('bottom: "x" top: "t" threshold_param { threshold: 0.5 }', (2, 3, 4, 5),
                  False),
    "Tile": ('bottom: "x" top: "t" tile_param { axis: 2 tiles: 3 }', (2, 3, 12, 5), True),
    # the types that read or write files: their files are made in ``files`` below
    "Data": ('top: "t" top: "dl" data_param { source: "db" backend: LMDB batch_size: 2 }',
             (2, 1, 3, 3), False),
    "ImageData": ('top: "t" top: "dl" image_data_param { source: "images.txt" batch_size: 2 }',
                  (2, 3, 3, 3), False),
    "HDF5Data": ('top: "t" top: "dl" hdf5_data_param { source: "h5.txt" batch_size: 2 }',
                 (2, 4), False),
    "HDF5Output": ('bottom: "s" bottom: "lab" hdf5_output_param { file_name: "out.h5" }', (),
                   False),
    "MemoryData": ('top: "t" top: "dl" memory_data_param { batch_size: 2 channels: 1 height: 3 '
                   'width: 2 }', (2, 1, 3, 2), False),
    "WindowData": ('top: "t" top: "dl" window_data_param { source: "windows.txt" batch_size: 2 '
                   'root_folder: "img/" } transform_param { crop_size: 3 }', (2, 3, 3, 3), False),
    "Python": ('bottom: "x" top: "t" python_param { module: "pytwice" layer: "Twice" }',
               (2, 3, 4, 5), True),
}

TWICE = '''
import caffe


class Twice(caffe.Layer):
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 2 * top[0].diff
'''


def files(base: Path) -> None:
    """What the file-reading types read: an LMDB, an image list, an HDF5 list, a window
    file, and the Python layer's module."""
    rng = np.random.default_rng(0)
    write_lmdb(base / "db", [(f"{i:08d}".encode(), array_to_datum(
        rng.integers(0, 256, (1, 3, 3), dtype=np.uint8), label=i).SerializeToString())
        for i in range(3)])
    (base / "img").mkdir()
    for i in range(2):
        (base / "img" / f"p{i}.png").write_bytes(
            encode_image(rng.integers(0, 256, (3, 3, 3), dtype=np.uint8)))
    (base / "images.txt").write_text("img/p0.png 0\nimg/p1.png 1\n")
    with h5py.File(base / "d.h5", "w") as f:
        f["t"] = rng.standard_normal((3, 4)).astype(np.float32)
        f["dl"] = np.arange(3, dtype=np.float32)
    (base / "h5.txt").write_text(f"{base / 'd.h5'}\n")
    (base / "windows.txt").write_text("# 0\np0.png\n3\n3\n3\n2\n1 1.0 0 0 2 2\n0 0.1 1 1 2 2\n")
    (base / "pytwice.py").write_text(TWICE)


def test_the_registry_has_every_caffe_type_and_each_has_a_case():
    ours = {layer_class(t).type for t in registered_types()}  # V1 enum names are aliases
    assert ours == set(CAFFE_TYPES)
    assert set(CASES) == set(CAFFE_TYPES) and len(CAFFE_TYPES) == 61


@pytest.mark.parametrize("kind", CAFFE_TYPES)
def test_each_caffe_type_builds_from_a_prototxt_and_runs(kind, tmp_path, monkeypatch):
    spec, shape, backward = CASES[kind]
    files(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # HDF5Output writes beside the net
    text = ('name: "types" force_backward: true\n' + INPUTS
            + f'layer {{ name: "under_test" type: "{kind}" {spec} }}\n')
    (tmp_path / "net.prototxt").write_text(text)
    net = Net(tmp_path / "net.prototxt", "TRAIN")
    layer = net.layers[net.layer_index("under_test")]
    assert layer.param.type == kind
    tops = list(net.top_vecs[net.layer_index("under_test")])
    if kind == "MemoryData":
        layer.reset(np.ones((2, 1, 3, 2), np.float32), np.zeros(2, np.float32))
    net.forward_prefilled()
    if tops:
        assert tuple(tops[0].shape) == shape, (kind, tops[0].shape)
        assert np.all(np.isfinite(tops[0].data))
    if kind == "HDF5Output":
        with h5py.File(tmp_path / "out.h5") as f:
            # Caffe's HDF5OutputLayer writes 4-axis (num, channels, height, width) arrays
            np.testing.assert_array_equal(f["label"][...], np.ones((2, 1, 1, 1)))
            np.testing.assert_array_equal(f["data"][...].reshape(2, 3), net.blobs["s"].data)
    if backward:
        for t in tops:
            t.diff[...] = 1
        net.backward()
        grads = [b.diff for b in net.bottom_vecs[net.layer_index("under_test")]]
        grads += [p.diff for p in layer.blobs]
        assert grads, kind
        assert all(np.all(np.isfinite(g)) for g in grads)
