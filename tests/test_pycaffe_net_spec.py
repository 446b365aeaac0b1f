"""``caffe.NetSpec`` / ``caffe.layers`` / ``caffe.params`` make prototxts that build and run;
``caffe.coord_map`` lines up an FCN-style crop that really fits; ``caffe.draw`` draws a net."""
from __future__ import annotations

import shutil

import pytest
from google.protobuf import text_format

import caffe
from caffe import layers as L, params as P
from caffe.coord_map import coord_map_from_to, crop
from caffe.proto import caffe_pb2


def small_lenet(batch: int) -> caffe.NetSpec:
    n = caffe.NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[batch, 1, 12, 12]), dict(dim=[batch])],
                                  data_filler=[dict(type="gaussian", std=1),
                                               dict(type="constant", value=1)], ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=3, num_output=4, weight_filler=dict(type="xavier"),
                            param=[dict(lr_mult=1), dict(lr_mult=2)])
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool1, num_output=5, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.loss = L.SoftmaxWithLoss(n.relu1, n.label)
    return n


def build(proto: caffe_pb2.NetParameter, tmp_path, phase: int = caffe.TRAIN) -> caffe.Net:
    path = tmp_path / "spec.prototxt"
    path.write_text(str(proto))
    return caffe.Net(str(path), phase)


def test_a_netspec_writes_the_prototxt_caffe_would_and_it_trains(tmp_path):
    proto = small_lenet(6).to_proto()
    conv = proto.layer[1]
    assert (conv.name, conv.type, list(conv.bottom), list(conv.top)) == \
        ("conv1", "Convolution", ["data"], ["conv1"])
    assert list(conv.convolution_param.kernel_size) == [3]  # a lone value of a repeated field
    assert [p.lr_mult for p in conv.param] == [1, 2]
    assert proto.layer[2].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    relu = proto.layer[4]
    assert relu.name == "relu1" and list(relu.bottom) == list(relu.top) == ["ip1"]
    # the text parses back to the same message
    assert text_format.Parse(str(proto), caffe_pb2.NetParameter()) == proto

    net = build(proto, tmp_path)
    assert list(net.params) == ["conv1", "ip1"] and net.blobs["pool1"].shape == (6, 4, 5, 5)
    before = net.forward()["loss"].item()
    for _ in range(5):  # gradient steps on the batch DummyData drew (start= skips redrawing)
        net.clear_param_diffs()
        net.forward(start="conv1")
        net.backward()
        for blobs in net.params.values():
            for b in blobs:
                b.data -= 0.1 * b.diff
    assert net.forward(start="conv1")["loss"].item() < 0.9 * before


def test_anonymous_tops_zero_tops_and_mistakes():
    data, label = L.DummyData(shape=dict(dim=[2, 3]), ntop=2)
    proto = L.SoftmaxWithLoss(L.InnerProduct(data, num_output=2), label).to_proto()
    assert [l.name for l in proto.layer] == ["DummyData1", "InnerProduct1", "SoftmaxWithLoss1"]
    assert list(proto.layer[2].bottom) == ["InnerProduct1", "DummyData2"]
    n = caffe.NetSpec()
    n.x, n.y = data, label
    n.quiet = L.Silence(n.x, n.y, ntop=0)  # no top: the NetSpec holds the layer call itself
    quiet = n.to_proto().layer[-1]
    assert (quiet.name, list(quiet.bottom), list(quiet.top)) == ("quiet", ["x", "y"], [])
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence((data, label), ntop=0)
    with pytest.raises(AttributeError, match="no parameter 'kernal_size'"):
        L.Convolution(data, kernal_size=3).to_proto()
    deconv = L.Deconvolution(data, num_output=2, kernel_size=4).to_proto().layer[-1]
    assert deconv.convolution_param.num_output == 2  # Deconvolution's are convolution_param


def test_coord_map_crops_a_deconvolution_back_onto_its_input(tmp_path):
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 23, 23]))
    n.conv = L.Convolution(n.data, num_output=2, kernel_size=3, pad=5)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.up = L.Deconvolution(n.pool, num_output=2, kernel_size=4, stride=2)
    # conv: a = 1, b = pad - (3 - 1)/2 = 4; pool: a = 1/2, b = -1/4; deconv: a = 2, b = 3/2
    ax, a, b = coord_map_from_to(n.up, n.data)
    assert ax == 1 and a == pytest.approx(1) and b == pytest.approx(-5.0)
    n.score = crop(n.up, n.data)
    net = build(n.to_proto(), tmp_path, caffe.TEST)
    layer = n.to_proto().layer[-1]
    assert layer.type == "Crop" and list(layer.crop_param.offset) == [5]
    assert net.blobs["up"].shape[2] > 23 and net.blobs["score"].shape == (1, 2, 23, 23)
    with pytest.raises(RuntimeError, match="connected by spatial layers"):
        coord_map_from_to(L.InnerProduct(n.up, num_output=1), n.data)


def test_draw_lays_out_layers_and_blobs(tmp_path):
    pytest.importorskip("pydot")
    import caffe.draw

    proto = small_lenet(2).to_proto()
    proto.name = "spec"
    graph = caffe.draw.get_pydot_graph(proto, "TB", display_lrm=True)
    names = {node.get_name().strip('"') for node in graph.get_nodes()}
    assert {"conv1_Convolution", "relu1_ReLU", "data_blob", "label_blob", "loss_blob"} <= names
    labels = {node.get_name().strip('"'): node.get("label") for node in graph.get_nodes()}
    assert labels["conv1_Convolution"] == '"conv1 (Convolution) kernel size: 3 stride: 1 pad: 0 ' \
                                          'lr mult: 1.0, 2.0"'
    assert labels["pool1_Pooling"].startswith('"pool1 (Pooling MAX)')
    assert len(graph.get_edges()) == sum(len(l.bottom) + len(l.top) for l in proto.layer)
    assert caffe.draw.get_edge_label(proto.layer[3]) == "5"
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed: the picture itself is not rendered")
    caffe.draw.draw_net_to_file(proto, str(tmp_path / "net.png"))
    assert (tmp_path / "net.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_without_pydot_says_how_to_get_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pydot", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "caffe.draw", raising=False)
    with pytest.raises(ImportError, match=r"caffe.draw needs pydot: pip install -e '\.\[draw\]' in Poseidon's checkout"):
        import caffe.draw  # noqa: F401
