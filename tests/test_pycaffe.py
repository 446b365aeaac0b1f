"""``import caffe`` (engine/pycaffe) and Python layers: pycaffe's contract, learnable blobs,
and a Python layer's parameters synchronised in a distributed run like any other."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.gradcheck import blob_of, check_layer_gradients, make_layer
from tests.test_comm_train import (ROOT, TOTAL_BATCH, digits_db, digits_net,  # noqa: F401
                                   poseidon, weights, write_hosts, write_run)

SCALE = '''
import caffe
import numpy as np


class Scale(caffe.Layer):
    """top = w * bottom, with one learnable w starting at float(param_str)."""

    def setup(self, bottom, top):
        if len(bottom) != 1:
            raise Exception("Scale takes one bottom")
        self.blobs.add_blob(1)
        self.blobs[0].data[...] = float(self.param_str)
        self.seen_phase = self.phase

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data[0] * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[0] += np.sum(top[0].diff * bottom[0].data)
        if propagate_down[0]:
            bottom[0].diff[...] = self.blobs[0].data[0] * top[0].diff
'''

def scale_layer(module: str, w: float, cls: str = "Scale") -> str:
    """The fields of a Python layer running ``module.cls`` (wrap in ``layer { }`` for a net)."""
    return (f'name: "scale" type: "Python" bottom: "ip1" top: "ip1s" python_param {{ '
            f'module: "{module}" layer: "{cls}" param_str: "{w}" }}')


@pytest.fixture
def scale_module(tmp_path, monkeypatch):
    (tmp_path / "pyscale.py").write_text(SCALE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the workers import it themselves
    return "pyscale"


def test_every_package_folder_is_installed():
    """pyproject lists its packages (to map `caffe`): a new folder must be listed too."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([a-z_.]+)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".")
             for top in ("engine", "poseidon_cli") for p in (ROOT / top).rglob("__init__.py")}
    # and each engine.pycaffe package again under its import name, caffe
    found |= {"caffe" + name[len("engine.pycaffe"):] for name in found
              if name.startswith("engine.pycaffe")}
    assert found == listed


def test_import_caffe_gives_the_pycaffe_names(tmp_path):
    import caffe

    assert (caffe.TRAIN, caffe.TEST) == (0, 1) and caffe.has_nccl() is False
    types = caffe.layer_type_list()
    assert {"Convolution", "Python", "InnerProduct", "Clip"} <= set(types)
    assert "CONVOLUTION" not in types
    deploy = ROOT / "models" / "lenet" / "deploy.prototxt"
    net = caffe.Net(str(deploy), caffe.TEST)
    net.save(str(tmp_path / "w.caffemodel"))
    again = caffe.Net(str(deploy), str(tmp_path / "w.caffemodel"), caffe.TEST)
    for name, blobs in net.params.items():
        for a, b in zip(blobs, again.params[name]):
            assert np.array_equal(a.data, b.data)
    with pytest.raises(ValueError, match="caffe.TRAIN or caffe.TEST"):
        caffe.Net(str(deploy), "TEST")


def test_a_python_layer_follows_pycaffes_contract(scale_module):
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    bottom, top = [blob_of(x)], [blob_of(np.zeros(1, np.float32))]
    layer = make_layer(scale_layer(scale_module, 1.5), bottom, top, phase="TEST")
    assert layer.impl.param_str == "1.5" and layer.impl.seen_phase == 1  # caffe.TEST
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (1,)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, 1.5 * x)
    # float32 blobs (pycaffe's); the layer is linear in x and w, so differences of 1e-2 are exact
    check_layer_gradients(layer, bottom, top, eps=1e-2, rtol=1e-4, atol=1e-4)


def test_a_bad_python_param_is_named(scale_module):
    bottom, top = [blob_of(np.ones((2, 3), np.float32))], [blob_of(np.zeros(1, np.float32))]
    with pytest.raises(ValueError, match=r"layer 'scale' \(Python\): cannot import"):
        make_layer(scale_layer("no_such_module", 1), bottom, top)
    with pytest.raises(ValueError, match="has no class 'Nope'"):
        make_layer(scale_layer(scale_module, 1, cls="Nope"), bottom, top)


def python_net(db: Path, batch: int) -> str:
    """The digits net with a learnable Python Scale after ip1."""
    text = digits_net(db, batch)
    text = text.replace('layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }',
                        f"layer {{ {scale_layer('pyscale', 0.8)} }}\n"
                        'layer { name: "relu1" type: "ReLU" bottom: "ip1s" top: "ip1s" }')
    return text.replace('bottom: "ip1" top: "ip2"', 'bottom: "ip1s" top: "ip2"')


def test_a_python_layers_blob_trains_exactly_with_two_workers(scale_module, digits_db,  # noqa: F811
                                                              tmp_path):
    """2 workers with batch B == one worker with 2B (rel L2 <= 1e-5, as for the built-in
    layers): each worker imports the module, and the Python layer's w is synchronised."""
    one = write_run(tmp_path / "one", digits_db, TOTAL_BATCH, "one", net=python_net)
    two = write_run(tmp_path / "two", digits_db, TOTAL_BATCH // 2, "two", net=python_net)
    assert "Python" in (tmp_path / "two" / "two_net.prototxt").read_text()
    done = poseidon("train", "--solver", str(one), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    hosts, _ = write_hosts(tmp_path, 2)
    done = poseidon("train", "--solver", str(two), "--hosts", str(hosts), "--timeout", "20",
                    timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    want = weights(tmp_path / "one" / "one_iter_20.caffemodel")
    got = weights(tmp_path / "two" / "two_iter_20.caffemodel")
    assert want["scale/0"][0] != pytest.approx(0.8)  # w learned
    for name, w in want.items():
        assert np.linalg.norm(got[name] - w) / np.linalg.norm(w) <= 1e-5, name


def test_the_readmes_net_surgery_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    section = text.split("## pycaffe", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").symlink_to(ROOT / "models")
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "surgery.caffemodel").is_file()
