"""`poseidon convert`: weights between formats, V1 upgrades, --info, and one-line errors."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from engine import caffe_io as io
from poseidon_cli.commands.convert import convert
from tests.conftest import ROOT, shared_path


def run(*args: str):
    return CliRunner().invoke(convert, [str(a) for a in args])


def lenet() -> Path:
    return shared_path("fixtures", "caffemodels", "lenet_iter_10000.caffemodel")


def test_caffemodel_to_h5_to_npz_and_back(tmp_path: Path) -> None:
    h5, npz, back = tmp_path / "l.caffemodel.h5", tmp_path / "l.npz", tmp_path / "l.caffemodel"
    for src, dst in [(lenet(), h5), (h5, npz), (npz, back)]:
        r = run(src, dst)
        assert r.exit_code == 0, r.output
        assert "431,080 parameters" in r.output
    original = {n: a for n, _, a in io.read_weights(lenet()) if a}
    for path in (h5, npz, back):
        got = {n: a for n, _, a in io.read_weights(path) if a}
        assert got.keys() == original.keys()
        for name in got:
            assert all(np.array_equal(x, y) for x, y in zip(got[name], original[name]))
    with np.load(npz) as z:
        assert sorted(z.files) == ["conv1/0", "conv1/1", "conv2/0", "conv2/1",
                                   "ip1/0", "ip1/1", "ip2/0", "ip2/1"]


def test_binary_to_binary_keeps_layer_definitions(tmp_path: Path) -> None:
    r = run(lenet(), tmp_path / "copy.caffemodel")
    assert r.exit_code == 0, r.output
    net = io.read_net_binary(tmp_path / "copy.caffemodel")
    assert net == io.read_net_binary(lenet())
    assert net.layer[1].convolution_param.num_output == 20


def test_v1_prototxt_upgrade(tmp_path: Path) -> None:
    src = shared_path("fixtures", "prototxt",
                      "poseidon_v1__cifar10__cifar10_quick_train_test.prototxt")
    out = tmp_path / "cifar.prototxt"
    r = run(src, out)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "layers {" not in text and "blobs_lr" not in text and 'type: "Convolution"' in text
    assert io.read_net_prototxt(out) == io.read_net_prototxt(src)


def test_v1_caffemodel_upgrade(tmp_path: Path) -> None:
    from engine.pb import caffe_pb2

    v1 = caffe_pb2.NetParameter(name="old")
    layer = v1.layers.add(name="ip", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT,
                          blobs_lr=[1, 2])
    layer.blobs.add(num=1, channels=1, height=2, width=3, data=[1, 2, 3, 4, 5, 6])
    io.write_net_binary(tmp_path / "old.caffemodel", v1)
    r = run(tmp_path / "old.caffemodel", tmp_path / "new.caffemodel")
    assert r.exit_code == 0, r.output
    new = caffe_pb2.NetParameter.FromString((tmp_path / "new.caffemodel").read_bytes())
    assert len(new.layers) == 0 and new.layer[0].type == "InnerProduct"
    assert [p.lr_mult for p in new.layer[0].param] == [1.0, 2.0]
    assert list(new.layer[0].blobs[0].data) == [1, 2, 3, 4, 5, 6]


def test_info_lists_layers_shapes_and_counts() -> None:
    r = run("--info", lenet())
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].endswith("9 layers, 431,080 parameters")
    conv1 = next(l for l in lines if l.startswith("conv1"))
    assert conv1.split() == ["conv1", "Convolution", "20x1x5x5,", "20", "520"]
    r = run("--info", shared_path("fixtures", "prototxt", "mnist__lenet_solver_adam.prototxt"))
    assert r.exit_code == 0 and "type" in r.output and '"Adam"' in r.output


def test_info_on_a_mean_binaryproto(tmp_path: Path) -> None:
    mean = np.zeros((1, 3, 2, 2), np.float32)
    mean[0, 0], mean[0, 1], mean[0, 2] = 104.0, 117.0, 123.0
    mean[0, 2, 1, 1] = 127.0
    io.write_blobproto(tmp_path / "mean.binaryproto", mean)
    r = run("--info", str(tmp_path / "mean.binaryproto"))
    assert r.exit_code == 0, r.output
    rows = {l.split("  ")[0]: l.split()[-1] if not l.startswith("channel") else l
            for l in r.output.splitlines()[1:]}
    assert r.output.splitlines()[0].endswith("mean.binaryproto: blob 1x3x2x2")
    assert rows["shape"] == "1x3x2x2" and rows["count"] == "12"
    assert rows["min"] == "104" and rows["max"] == "127"
    assert rows["channel means"].split(None, 2)[2] == "104, 117, 124"


def test_info_on_a_v1_net_prototxt() -> None:
    r = run("--info", shared_path("fixtures", "prototxt",
                                  "poseidon_v1__mnist__lenet_train_test.prototxt"))
    assert r.exit_code == 0, r.output
    assert "11 layers" in r.output.splitlines()[0]
    assert any(l.split()[:2] == ["conv1", "Convolution"] for l in r.output.splitlines())


def one_error_line(result) -> str:
    assert result.exit_code != 0
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("poseidon: error: ")
    assert "Traceback" not in result.output
    return lines[0]


def test_bad_inputs_fail_with_one_line(tmp_path: Path) -> None:
    rand = tmp_path / "r.caffemodel"
    rand.write_bytes(np.random.default_rng(0).bytes(5000))
    assert "not a valid caffemodel" in one_error_line(run(rand, tmp_path / "o.npz"))
    trunc = tmp_path / "t.caffemodel"
    trunc.write_bytes(lenet().read_bytes()[:100_000])
    assert "truncated or corrupt" in one_error_line(run("--info", trunc))
    bad = tmp_path / "bad.prototxt"
    bad.write_text('name: "x"\nlayer {\n  name: "a"\n  bogus: 1\n}\n')
    assert f"{bad}:4:" in one_error_line(run(bad, tmp_path / "o.prototxt"))
    missing = run(tmp_path / "missing.caffemodel", tmp_path / "o.npz")
    assert "No such file" in one_error_line(missing)
    assert "prototxt and a weights file" in one_error_line(run(bad, tmp_path / "o.caffemodel"))
    assert "missing OUT" in one_error_line(run(lenet()))


def test_cli_entry_point_exit_code() -> None:
    """Through the real `poseidon` group, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "convert", "--info",
                           str(ROOT / "pyproject.toml") + ".caffemodel"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "poseidon: error:" in done.stderr


def test_an_unknown_output_suffix_is_refused(tmp_path: Path) -> None:
    for name in ("weights.pt", "weights"):
        line = one_error_line(run(lenet(), tmp_path / name))
        assert f"{tmp_path / name}: unknown output format" in line
        assert "*.caffemodel, *.caffemodel.h5" in line and "*.npz" in line
        assert not (tmp_path / name).exists()


def info_rows(path: Path) -> list[list[str]]:
    r = run("--info", path)
    assert r.exit_code == 0, r.output
    return [l.split() for l in r.output.splitlines()[2:]]


def test_info_on_h5_keeps_net_order_and_types(tmp_path: Path) -> None:
    caffes = shared_path("fixtures", "oracle", "train", "h5", "lenet_iter_100.caffemodel.h5")
    r = run("--info", caffes)
    assert r.output.splitlines()[0].endswith("(Caffe's HDF5 stores no layer types)")
    order = ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]
    assert [row[0] for row in info_rows(caffes)] == order  # as Caffe wrote them, not a-z
    # written by Poseidon: the order and the types
    assert run(lenet(), tmp_path / "l.caffemodel.h5").exit_code == 0
    assert [row[:2] for row in info_rows(tmp_path / "l.caffemodel.h5")] == \
        [row[:2] for row in info_rows(lenet())]
    assert [row[1] for row in info_rows(tmp_path / "l.caffemodel.h5")][:2] == ["Data",
                                                                               "Convolution"]


def test_info_on_a_solverstate(tmp_path: Path) -> None:
    from engine.pb import poseidon_pb2

    caffes = shared_path("fixtures", "oracle", "train", "lenet_iter_100.solverstate")
    r = run("--info", caffes)
    assert r.exit_code == 0, r.output
    fields = {l[:16].strip(): l[16:] for l in r.output.splitlines()[2:]}
    assert r.output.splitlines()[0].endswith("lenet_iter_100.solverstate: solverstate at "
                                             "iteration 100")
    assert fields["iteration"] == "100" and fields["history"] == "8 blobs, 431,080 values"
    assert fields["learned_net"].startswith("lenet_iter_100.caffemodel (found: ")
    assert fields["data positions"].startswith("not recorded (a Caffe snapshot")
    assert fields["plan"].startswith("none")
    # a distributed run's: the records read and the plan the workers followed
    state = io.read_solverstate(caffes)
    state.data_position.extend([12800])
    plan = poseidon_pb2.Plan(world_size=4, slots=2, comm="auto", codec="fp16", units=[
        poseidon_pb2.UnitPlan(layers=[7, 5], scheme="sfb", names=["ip2", "ip1"]),
        poseidon_pb2.UnitPlan(layers=[3, 1], scheme="ring", names=["conv2", "conv1"])])
    state.sync_state = plan.SerializeToString()
    io.write_solverstate(tmp_path / "run_iter_100.solverstate.h5", state)
    r = run("--info", tmp_path / "run_iter_100.solverstate.h5")
    assert r.exit_code == 0, r.output
    fields = {l[:16].strip(): l[16:] for l in r.output.splitlines()[2:]}
    assert fields["data positions"] == "12800 records read, per data layer"
    assert fields["plan workers"] == "4, 2 machines of 2"
    assert fields["plan comm"] == "auto, wire fp16"
    assert fields["plan units"] == "ip2+ip1 sfb; conv2+conv1 ring"
