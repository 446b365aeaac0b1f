"""engine.caffe_io: prototxt parsing and Caffe's V0/V1 upgrade, binary/HDF5/npz weights,
mean files, solver states, copying weights into a net, and clear errors for bad files."""
from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from engine import caffe_io as io
from engine.blob import Blob
from engine.caffe_io import FormatError
from engine.pb import caffe_pb2
from tests.conftest import shared_path


def fixture_prototxts() -> list[Path]:
    from tests.conftest import SHARED

    return sorted((SHARED / "fixtures" / "prototxt").glob("*.prototxt"))


# ---------------------------------------------------------------------------------------
# prototxt and upgrades
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", fixture_prototxts(), ids=lambda p: p.name)
def test_every_fixture_prototxt_parses(path: Path) -> None:
    if "solver" in path.name:
        solver = io.read_solver_prototxt(path)
        assert solver.base_lr > 0 and solver.type in {
            "SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"}
        return
    net = io.read_net_prototxt(path)
    assert len(net.layers) == 0 and len(net.input) == 0  # upgraded to the current dialect
    assert len(net.layer) >= 9
    assert all(l.type and l.type[0].isupper() for l in net.layer)


def test_v1_prototxt_upgrades_to_what_caffe_ships() -> None:
    v1 = io.read_net_prototxt(shared_path(
        "fixtures", "prototxt", "poseidon_v1__mnist__lenet_train_test.prototxt"))
    cur = io.read_net_prototxt(shared_path("fixtures", "prototxt",
                                           "mnist__lenet_train_test.prototxt"))
    assert [(l.name, l.type) for l in v1.layer] == [(l.name, l.type) for l in cur.layer]
    conv1 = next(l for l in v1.layer if l.name == "conv1")
    assert [p.lr_mult for p in conv1.param] == [1.0, 2.0]
    assert conv1.convolution_param.num_output == 20
    data = v1.layer[0]
    assert data.data_param.shared_file_system is True
    assert data.data_param.backend == caffe_pb2.DataParameter.LMDB
    assert data.include[0].phase == caffe_pb2.TRAIN
    assert data.transform_param.scale == pytest.approx(1 / 256)


def test_v1_googlenet_upgrade_matches_bvlc_layer_types() -> None:
    v1 = io.read_net_prototxt(shared_path(
        "fixtures", "prototxt", "poseidon_v1__bvlc_googlenet__train_test.prototxt"))
    cur = io.read_net_prototxt(shared_path("fixtures", "prototxt",
                                           "bvlc_googlenet__train_val.prototxt"))
    assert [l.type for l in v1.layer] == [l.type for l in cur.layer]
    decays = {tuple(p.decay_mult for p in l.param) for l in v1.layer if l.type == "Convolution"}
    assert decays == {(1.0, 0.0)}  # weight_decay: 1 weight_decay: 0


V0_NET = """
name: "v0net"
input: "data"
input_dim: 2 input_dim: 3 input_dim: 8 input_dim: 8
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers {
  layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2 biasterm: false
          blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
          weight_filler { type: "gaussian" std: 0.01 } }
  bottom: "pad1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 2 stride: 2 }
         bottom: "conv1" top: "pool1" }
layers { layer { name: "drop1" type: "dropout" dropout_ratio: 0.3 } bottom: "pool1" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.5 beta: 0.25 }
         bottom: "pool1" top: "norm1" }
layers { layer { name: "ip1" type: "innerproduct" num_output: 10 } bottom: "norm1" top: "ip1" }
"""


def test_v0_net_upgrade_folds_padding_and_maps_fields() -> None:
    net = io.parse_net_text(V0_NET, "v0.prototxt")
    assert [(l.name, l.type) for l in net.layer] == [
        ("input", "Input"), ("conv1", "Convolution"), ("pool1", "Pooling"),
        ("drop1", "Dropout"), ("norm1", "LRN"), ("ip1", "InnerProduct")]
    assert list(net.layer[0].top) == ["data"]
    assert list(net.layer[0].input_param.shape[0].dim) == [2, 3, 8, 8]
    conv = net.layer[1]
    assert list(conv.bottom) == ["data"]  # the padding layer is gone, its pad folded in
    cp = conv.convolution_param
    assert (list(cp.pad), list(cp.kernel_size), list(cp.stride), cp.num_output, cp.bias_term) == \
        ([2], [3], [2], 4, False)
    assert cp.weight_filler.type == "gaussian" and cp.weight_filler.std == pytest.approx(0.01)
    assert [(p.lr_mult, p.decay_mult) for p in conv.param] == [(1.0, 1.0), (2.0, 0.0)]
    pp = net.layer[2].pooling_param
    assert (pp.pool, pp.kernel_size, pp.stride) == (caffe_pb2.PoolingParameter.AVE, 2, 2)
    assert net.layer[3].dropout_param.dropout_ratio == pytest.approx(0.3)
    lrn = net.layer[4].lrn_param
    assert (lrn.local_size, lrn.alpha, lrn.beta) == (3, 0.5, 0.25)
    assert net.layer[5].inner_product_param.num_output == 10


def test_v1_data_transform_fields_move_to_transform_param() -> None:
    net = io.parse_net_text("""
        layers { name: "d" type: DATA top: "data" top: "label"
                 data_param { source: "db" batch_size: 4 scale: 0.5 mirror: true crop_size: 7
                              mean_file: "m.binaryproto" } }""")
    d = net.layer[0]
    assert d.type == "Data"
    assert (d.transform_param.scale, d.transform_param.mirror, d.transform_param.crop_size,
            d.transform_param.mean_file) == (0.5, True, 7, "m.binaryproto")
    assert not d.data_param.HasField("scale") and not d.data_param.HasField("mirror")
    assert (d.data_param.source, d.data_param.batch_size) == ("db", 4)


def test_v1_param_names_and_share_mode() -> None:
    net = io.parse_net_text("""
        layers { name: "a" type: INNER_PRODUCT bottom: "x" top: "y"
                 param: "w" param: "b" blob_share_mode: PERMISSIVE blobs_lr: 3 loss_weight: 2 }""")
    p = net.layer[0].param
    assert [(s.name, s.lr_mult) for s in p] == [("w", 3.0), ("b", 1.0)]
    assert p[0].share_mode == caffe_pb2.ParamSpec.PERMISSIVE
    assert list(net.layer[0].loss_weight) == [2.0]


def test_input_shape_becomes_a_leading_input_layer() -> None:
    net = io.parse_net_text("""
        input: "a" input_shape { dim: 1 dim: 5 }
        input: "b" input_shape { dim: 1 }
        layer { name: "s" type: "Eltwise" bottom: "a" bottom: "a" top: "c" }""")
    assert [l.type for l in net.layer] == ["Input", "Eltwise"]
    assert list(net.layer[0].top) == ["a", "b"]
    assert [list(s.dim) for s in net.layer[0].input_param.shape] == [[1, 5], [1]]
    with pytest.raises(FormatError, match="input_dim"):
        io.parse_net_text('input: "a" input_dim: 1 input_dim: 2', "bad.prototxt")


def test_batchnorm_with_three_params_stops_learning_them() -> None:
    net = io.parse_net_text("""
        layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
                param { lr_mult: 1 } param { lr_mult: 1 } param { lr_mult: 1 decay_mult: 5 } }""")
    assert [(p.lr_mult, p.decay_mult) for p in net.layer[0].param] == [(0.0, 0.0)] * 3


def test_upgrade_net_reports_whether_it_changed() -> None:
    current = io.parse_net_text('layer { name: "a" type: "ReLU" }', upgrade=False)
    assert io.upgrade_net(current) is False
    old = io.parse_net_text('layers { name: "a" type: RELU }', upgrade=False)
    assert io.net_needs_upgrade(old) and io.upgrade_net(old) is True
    assert old.layer[0].type == "ReLU"


def test_solver_type_enum_upgrades_to_string() -> None:
    s = io.parse_solver_text("base_lr: 0.1 solver_type: NESTEROV")
    assert s.type == "Nesterov" and not s.HasField("solver_type")
    assert io.parse_solver_text("solver_type: ADADELTA").type == "AdaDelta"
    with pytest.raises(FormatError, match="solver_type"):
        io.parse_solver_text('solver_type: ADAM type: "Adam"', "s.prototxt")


@pytest.mark.parametrize("text,needle,line", [
    ('name: "x"\nlayer {\n  name: "a"\n  typo_field: 3\n}\n', "typo_field", 4),
    ('layer {\n  name: "a"\n  convolution_param { num_output: "abc" }\n}\n', "num_output", 3),
    ('layer {\n  name: "a"\n', 'Expected "}"', 2),
    ('force_backward: 7\n', "force_backward", 1),
    ('layer { type: CONVOLUTION }', "type", 1),
])
def test_malformed_prototxt_names_file_line_and_field(tmp_path: Path, text: str, needle: str,
                                                      line: int) -> None:
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    with pytest.raises(FormatError) as e:
        io.read_net_prototxt(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line}:") and needle in msg
    assert "\n" not in msg


def test_unreadable_and_binary_prototxt(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="cannot read"):
        io.read_net_prototxt(tmp_path / "missing.prototxt")
    (tmp_path / "bin.prototxt").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(FormatError, match="not a text prototxt"):
        io.read_net_prototxt(tmp_path / "bin.prototxt")


def test_write_prototxt_round_trips(tmp_path: Path) -> None:
    net = io.parse_net_text(V0_NET)
    io.write_prototxt(tmp_path / "n.prototxt", net)
    assert io.read_net_prototxt(tmp_path / "n.prototxt") == net


# ---------------------------------------------------------------------------------------
# weights files
# ---------------------------------------------------------------------------------------

def sample_weights() -> io.LayerWeights:
    rng = np.random.default_rng(0)
    return [("conv1", "Convolution", [rng.standard_normal((4, 3, 2, 2), dtype=np.float32),
                                       rng.standard_normal(4, dtype=np.float32)]),
            ("relu1", "ReLU", []),
            ("inception_3a/1x1", "InnerProduct", [rng.standard_normal((5, 12), dtype=np.float32)])]


def assert_same_weights(a: io.LayerWeights, b: io.LayerWeights, skip_empty: bool = False) -> None:
    da = {n: arrs for n, _, arrs in a if arrs or not skip_empty}
    db = {n: arrs for n, _, arrs in b if arrs or not skip_empty}
    assert da.keys() == db.keys()
    for name in da:
        assert len(da[name]) == len(db[name])
        for x, y in zip(da[name], db[name]):
            assert x.shape == y.shape and np.array_equal(x, y), name


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5", ".npz"])
def test_weights_round_trip(tmp_path: Path, suffix: str) -> None:
    w = sample_weights()
    path = tmp_path / f"m{suffix}"
    io.write_weights(path, w)
    back = io.read_weights(path)
    assert_same_weights(w, back, skip_empty=suffix == ".npz")
    if suffix == ".caffemodel":
        assert [t for _, t, _ in back] == ["Convolution", "ReLU", "InnerProduct"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_format_detected_by_magic_when_suffix_is_unusual(tmp_path: Path) -> None:
    w = sample_weights()
    io.write_net_hdf5(tmp_path / "x.h5", w)
    os.rename(tmp_path / "x.h5", tmp_path / "x.weights")
    assert io.weights_format(tmp_path / "x.weights") == "hdf5"
    assert_same_weights(w, io.read_weights(tmp_path / "x.weights"))


def test_float64_blobs_use_double_fields() -> None:
    a = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    blob = io.array_to_blob(a, diff=-a)
    assert len(blob.data) == 0 and len(blob.double_data) == 6
    assert np.array_equal(io.blob_to_array(blob), a)
    assert np.array_equal(io.blob_to_array(blob, diff=True), -a)


def test_blobproto_round_trip_and_legacy_shape(tmp_path: Path) -> None:
    mean = np.random.default_rng(1).random((1, 3, 4, 5), dtype=np.float32)
    io.write_blobproto(tmp_path / "m.binaryproto", mean)
    assert np.array_equal(io.read_blobproto(tmp_path / "m.binaryproto"), mean)
    legacy = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3, data=[1, 2, 3, 4, 5, 6])
    assert io.blob_to_array(legacy).shape == (1, 2, 1, 3)
    short = caffe_pb2.BlobProto(data=[1, 2])
    short.shape.dim.extend([3])
    with pytest.raises(FormatError, match="2 values for shape"):
        io.blob_to_array(short)


def test_real_caffe_models_load() -> None:
    lenet = io.read_weights(shared_path("fixtures", "caffemodels", "lenet_iter_10000.caffemodel"))
    shapes = {n: [a.shape for a in arrs] for n, _, arrs in lenet if arrs}
    assert shapes == {"conv1": [(20, 1, 5, 5), (20,)], "conv2": [(50, 20, 5, 5), (50,)],
                      "ip1": [(500, 800), (500,)], "ip2": [(10, 500), (10,)]}
    assert sum(a.size for _, _, arrs in lenet for a in arrs) == 431080
    cifar = io.read_weights(shared_path("fixtures", "caffemodels",
                                        "cifar10_quick_iter_5000.caffemodel"))
    assert [a.shape for n, _, arrs in cifar if n == "ip2" for a in arrs] == [(10, 64), (10,)]
    mean = io.read_blobproto(shared_path("fixtures", "caffemodels", "cifar10_mean.binaryproto"))
    assert mean.shape == (1, 3, 32, 32) and mean.dtype == np.float32
    assert 60 < float(mean.mean()) < 200 and float(mean.min()) >= 0 and float(mean.max()) <= 255


def test_caffe_binary_and_hdf5_snapshots_agree() -> None:
    train = shared_path("fixtures", "oracle", "train")
    binary = io.read_weights(train / "lenet_iter_100.caffemodel")
    h5 = io.read_weights(train / "h5" / "lenet_iter_100.caffemodel.h5")
    assert_same_weights(binary, h5)
    net = io.read_net_binary(train / "lenet_iter_100.caffemodel")
    assert net.name == "LeNet" and net.layer[1].type == "Convolution"
    assert [p.lr_mult for p in net.layer[1].param] == [1.0, 2.0]


def test_caffe_solverstates_load_binary_and_hdf5() -> None:
    train = shared_path("fixtures", "oracle", "train")
    binary = io.read_solverstate(train / "lenet_iter_100.solverstate")
    h5 = io.read_solverstate(train / "h5" / "lenet_iter_100.solverstate.h5")
    assert (binary.iter, binary.current_step, binary.learned_net) == \
        (100, 0, "lenet_iter_100.caffemodel")
    assert (h5.iter, h5.learned_net) == (100, "lenet_iter_100.caffemodel.h5")
    hb, hh = io.solverstate_history(binary), io.solverstate_history(h5)
    assert [a.shape for a in hb] == [(20, 1, 5, 5), (20,), (50, 20, 5, 5), (50,), (500, 800),
                                     (500,), (10, 500), (10,)]
    for a, b in zip(hb, hh):
        assert np.array_equal(a, b)
    assert float(np.abs(hb[0]).max()) > 0  # momentum history is really there
    later = io.read_solverstate(train / "lenet_iter_200.solverstate")
    assert later.iter == 200
    # learned_net is a bare name: found beside the state file, whatever the working directory.
    assert io.resolve_learned_net(train / "lenet_iter_100.solverstate", binary) == \
        train / "lenet_iter_100.caffemodel"


@pytest.mark.parametrize("suffix", [".solverstate", ".solverstate.h5"])
def test_solverstate_round_trip(tmp_path: Path, suffix: str) -> None:
    state = caffe_pb2.SolverState(iter=42, learned_net="x_iter_42.caffemodel", current_step=3,
                                  data_position=[2688, 100])
    hist = [np.full((2, 3), 0.5, np.float32), np.arange(4, dtype=np.float32)]
    for h in hist:
        state.history.add().CopyFrom(io.array_to_blob(h))
    path = tmp_path / f"s{suffix}"
    io.write_solverstate(path, state)
    back = io.read_solverstate(path)
    assert (back.iter, back.learned_net, back.current_step, list(back.data_position)) == \
        (42, "x_iter_42.caffemodel", 3, [2688, 100])
    for a, b in zip(hist, io.solverstate_history(back)):
        assert np.array_equal(a, b)
    if suffix.endswith(".h5"):
        with h5py.File(path, "r") as f:  # Caffe's keys and types
            assert set(f.keys()) >= {"iter", "learned_net", "current_step", "history"}
            assert f["iter"].dtype == np.int32 and f["iter"].shape == (1,)
            assert f["learned_net"][()] == b"x_iter_42.caffemodel"


# ---------------------------------------------------------------------------------------
# corrupt files
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_caffemodel_is_a_format_error(tmp_path: Path, keep: float) -> None:
    data = shared_path("fixtures", "caffemodels", "lenet_iter_10000.caffemodel").read_bytes()
    bad = tmp_path / "t.caffemodel"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(FormatError) as e:
        io.read_weights(bad)
    assert str(e.value).startswith(f"{bad}: not a valid caffemodel (truncated or corrupt)")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_caffemodel_is_a_format_error(tmp_path: Path, seed: int) -> None:
    bad = tmp_path / "r.caffemodel"
    bad.write_bytes(np.random.default_rng(seed).bytes(4096))
    with pytest.raises(FormatError, match="not a valid caffemodel"):
        io.read_net_binary(bad)


def test_empty_and_text_files_are_not_caffemodels(tmp_path: Path) -> None:
    (tmp_path / "e.caffemodel").write_bytes(b"")
    with pytest.raises(FormatError, match="no layers"):
        io.read_weights(tmp_path / "e.caffemodel")
    (tmp_path / "p.caffemodel").write_text('name: "LeNet"\nlayer { name: "a" }\n')
    with pytest.raises(FormatError, match="p.caffemodel is a net prototxt, not a caffemodel"):
        io.read_weights(tmp_path / "p.caffemodel")
    (tmp_path / "t.caffemodel").write_text('just some text\n')
    with pytest.raises(FormatError, match="not a valid caffemodel"):
        io.read_weights(tmp_path / "t.caffemodel")


def test_truncated_hdf5_and_npz_are_format_errors(tmp_path: Path) -> None:
    io.write_weights(tmp_path / "m.caffemodel.h5", sample_weights())
    io.write_weights(tmp_path / "m.npz", sample_weights())
    for name in ("m.caffemodel.h5", "m.npz"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
        with pytest.raises(FormatError, match="truncated or corrupt"):
            io.read_weights(tmp_path / name)


def test_corrupt_solverstate_is_a_format_error(tmp_path: Path) -> None:
    data = shared_path("fixtures", "oracle", "train", "lenet_iter_100.solverstate").read_bytes()
    (tmp_path / "s.solverstate").write_bytes(data[: len(data) // 3])
    with pytest.raises(FormatError, match="not a valid solverstate"):
        io.read_solverstate(tmp_path / "s.solverstate")


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "m.caffemodel"
    io.write_weights(path, sample_weights())
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with io.atomic_path(path) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("crash mid-write")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.caffemodel"]


# ---------------------------------------------------------------------------------------
# nets
# ---------------------------------------------------------------------------------------

class FakeLayer:
    def __init__(self, name: str, type_: str, shapes: list[tuple[int, ...]]):
        self.name = name
        self.phase = "TEST"
        self.param = caffe_pb2.LayerParameter(name=name, type=type_)
        self.blobs = [Blob(s, np.float32, np) for s in shapes]


class FakeNet:
    """The part of the Net API caffe_io uses: name, layers, layer_names."""

    def __init__(self, layers: list[FakeLayer]):
        self.name = "fake"
        self.layers = layers
        self.layer_names = [l.name for l in layers]


def lenet_like() -> FakeNet:
    return FakeNet([FakeLayer("conv1", "Convolution", [(4, 3, 2, 2), (4,)]),
                    FakeLayer("relu1", "ReLU", []),
                    FakeLayer("inception_3a/1x1", "InnerProduct", [(5, 12)])])


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5", ".npz"])
def test_copy_weights_into_a_net_by_name(tmp_path: Path, suffix: str) -> None:
    w = sample_weights() + [("extra_layer", "InnerProduct", [np.ones((2, 2), np.float32)])]
    io.write_weights(tmp_path / f"w{suffix}", w)
    net = lenet_like()
    copied = io.copy_weights_into(net, tmp_path / f"w{suffix}")
    assert "extra_layer" not in copied and "conv1" in copied
    assert np.array_equal(net.layers[0].blobs[0].data, w[0][2][0])
    assert np.array_equal(net.layers[0].blobs[1].data, w[0][2][1])
    assert np.array_equal(net.layers[2].blobs[0].data, w[2][2][0])


def test_copy_weights_shape_mismatch_names_layer_blob_and_shapes() -> None:
    net = lenet_like()
    w = [("conv1", "Convolution", [np.zeros((4, 3, 3, 3), np.float32), np.zeros(4, np.float32)])]
    with pytest.raises(FormatError) as e:
        io.copy_weights_into(net, w)
    msg = str(e.value)
    assert "layer 'conv1' blob 0" in msg and "(4, 3, 3, 3)" in msg and "(4, 3, 2, 2)" in msg
    with pytest.raises(FormatError, match="layer 'conv1': 1 parameter blobs in the file"):
        io.copy_weights_into(net, [("conv1", "Convolution", [np.zeros((4, 3, 2, 2), np.float32)])])


def test_copy_weights_from_another_net_is_an_error() -> None:
    net = FakeNet([FakeLayer("conv1", "Convolution", [(8, 1, 5, 5), (8,)])])
    with pytest.raises(FormatError, match=r"lenet_iter_10000.caffemodel: layer 'conv1' blob 0"):
        io.copy_weights_into(net, shared_path("fixtures", "caffemodels",
                                              "lenet_iter_10000.caffemodel"))


def test_legacy_4d_blobs_copy_by_caffes_shape_rule() -> None:
    net = FakeNet([FakeLayer("ip", "InnerProduct", [(10, 6), (10,)])])
    src = caffe_pb2.NetParameter()
    layer = src.layer.add(name="ip", type="InnerProduct")
    values = np.arange(60, dtype=np.float32)
    layer.blobs.add(num=1, channels=1, height=10, width=6, data=values.tolist())
    layer.blobs.add(num=1, channels=1, height=1, width=10, data=list(range(10)))
    io.copy_weights_into(net, src)
    assert np.array_equal(net.layers[0].blobs[0].data, values.reshape(10, 6))
    assert np.array_equal(net.layers[0].blobs[1].data, np.arange(10, dtype=np.float32))
    # Same count, wrong legacy layout: Caffe rejects it, and so do we.
    layer.blobs[0].height, layer.blobs[0].width = 6, 10
    with pytest.raises(FormatError, match=r"file has \(1, 1, 6, 10\), the net expects \(10, 6\)"):
        io.copy_weights_into(net, src)
    assert io.shape_matches((2, 3, 4, 5, 6), caffe_pb2.BlobProto(num=2)) is False


def test_net_to_proto_and_save_round_trip(tmp_path: Path) -> None:
    net = lenet_like()
    rng = np.random.default_rng(3)
    for layer in net.layers:
        for b in layer.blobs:
            b.data[...] = rng.standard_normal(b.shape)
            b.diff[...] = 2.0
    proto = io.net_to_proto(net, write_diff=True)
    assert [(l.name, l.type, l.phase) for l in proto.layer] == [
        ("conv1", "Convolution", caffe_pb2.TEST), ("relu1", "ReLU", caffe_pb2.TEST),
        ("inception_3a/1x1", "InnerProduct", caffe_pb2.TEST)]
    assert np.array_equal(io.blob_to_array(proto.layer[0].blobs[0]), net.layers[0].blobs[0].data)
    assert np.all(io.blob_to_array(proto.layer[0].blobs[0], diff=True) == 2.0)
    assert len(io.net_to_proto(net).layer[0].blobs[0].diff) == 0
    for name in ("s.caffemodel", "s.caffemodel.h5"):
        io.save_net(net, tmp_path / name, write_diff=True)
        other = lenet_like()
        io.copy_weights_into(other, tmp_path / name)
        for a, b in zip(net.layers, other.layers):
            for x, y in zip(a.blobs, b.blobs):
                assert np.array_equal(x.data, y.data)
    with h5py.File(tmp_path / "s.caffemodel.h5", "r") as f:  # Caffe's layout, diff included
        assert set(f.keys()) == {"data", "diff"}
        assert f["data/conv1/0"].shape == (4, 3, 2, 2) and "relu1" in f["data"]
        assert np.all(f["diff/conv1/1"][()] == 2.0)


def oracle_files(pattern: str) -> list[Path]:
    from tests.conftest import SHARED

    return sorted((SHARED / "fixtures").glob(pattern))


@pytest.mark.parametrize("path", oracle_files("**/*.caffemodel"), ids=lambda p: p.name)
def test_every_real_caffemodel_loads(path: Path) -> None:
    net = io.read_net_binary(path)
    weights = {n: a for n, _, a in io.net_to_weights(net) if a}
    assert weights["conv1"][0].ndim == 4 and weights["conv1"][1].ndim == 1
    assert all(np.isfinite(a).all() for arrays in weights.values() for a in arrays)


@pytest.mark.parametrize("path", oracle_files("oracle/**/*.solverstate"), ids=lambda p: p.name)
def test_every_real_solverstate_loads(path: Path) -> None:
    state = io.read_solverstate(path)
    assert state.iter in (20, 100, 200)
    assert len(io.solverstate_history(state)) == 8  # LeNet's 8 learnable blobs
    weights = io.read_weights(io.resolve_learned_net(path, state))
    assert sum(1 for _, _, a in weights for _ in a) == 8


@pytest.mark.parametrize("path", oracle_files("caffemodels/*.prototxt")
                         + oracle_files("oracle/*/*.prototxt"),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_other_shared_prototxt_parses(path: Path) -> None:
    if "solver" in path.name:
        assert io.read_solver_prototxt(path).base_lr > 0
    else:
        assert len(io.read_net_prototxt(path).layer) > 0


@pytest.mark.parametrize("net", ["lenet", "cifar10_quick"])
def test_init_caffemodel_matches_caffes_own_dump(net: str) -> None:
    layers = shared_path("fixtures", "oracle", "layers")
    dump = np.load(layers / f"{net}.npz")
    weights = io.read_weights(layers / f"{net}_init.caffemodel")
    checked = 0
    for name, _, arrays in weights:
        for i, a in enumerate(arrays):
            assert np.array_equal(a, dump[f"train/param/{name}/{i}/init"]), f"{name}/{i}"
            checked += 1
    assert checked >= 8
