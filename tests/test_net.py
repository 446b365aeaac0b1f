"""Net construction: NetState filtering, split insertion, in-place, sharing, backward pruning."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from engine.net import Net, NetError, filter_net, insert_splits
from engine.pb import caffe_pb2


def netparam(text: str) -> caffe_pb2.NetParameter:
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return p


INPUT = 'layer { name: "in" type: "Input" top: "x" top: "y" input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }\n'
IP = ('layer {{ name: "{n}" type: "InnerProduct" bottom: "{b}" top: "{t}" {extra} '
      'inner_product_param {{ num_output: {k} weight_filler {{ type: "gaussian" std: 0.5 }} '
      'bias_filler {{ type: "gaussian" std: 0.5 }} }} }}\n')


def ip(n, b, t, k=3, extra=""):
    return IP.format(n=n, b=b, t=t, k=k, extra=extra)


def test_filter_by_phase_level_and_stage():
    p = netparam(INPUT + """
      layer { name: "a" type: "ReLU" bottom: "x" top: "a" include { phase: TRAIN } }
      layer { name: "b" type: "ReLU" bottom: "x" top: "b" include { phase: TEST } }
      layer { name: "c" type: "ReLU" bottom: "x" top: "c" include { min_level: 2 } }
      layer { name: "d" type: "ReLU" bottom: "x" top: "d" include { stage: "deploy" } }
      layer { name: "e" type: "ReLU" bottom: "x" top: "e" exclude { not_stage: "deploy" } }
    """)
    def names(phase, level=0, stages=()):
        s = caffe_pb2.NetState(phase=phase, level=level, stage=list(stages))
        return [l.name for l in filter_net(p, s).layer]
    assert names(caffe_pb2.TRAIN) == ["in", "a"]
    assert names(caffe_pb2.TEST) == ["in", "b"]
    assert names(caffe_pb2.TRAIN, level=2) == ["in", "a", "c"]
    assert names(caffe_pb2.TEST, stages=["deploy"]) == ["in", "b", "d", "e"]
    bad = netparam('layer { name: "z" type: "ReLU" include { phase: TRAIN } exclude { phase: TEST } }')
    with pytest.raises(NetError, match="either include"):
        filter_net(bad, caffe_pb2.NetState())


def test_split_insertion_uses_caffes_names():
    p = netparam(INPUT + ip("f1", "x", "h") + ip("f2", "h", "o1") + ip("f3", "h", "o2"))
    s = insert_splits(p)
    split = [l for l in s.layer if l.type == "Split"]
    assert [l.name for l in split] == ["h_f1_0_split"]
    assert list(split[0].top) == ["h_f1_0_split_0", "h_f1_0_split_1"]
    assert s.layer[3].bottom[0] == "h_f1_0_split_0" and s.layer[4].bottom[0] == "h_f1_0_split_1"


def test_split_for_a_loss_top_that_is_also_read():
    p = netparam(INPUT + ip("f1", "x", "h", extra="loss_weight: 2") + ip("f2", "h", "o"))
    s = insert_splits(p)
    split = [l for l in s.layer if l.type == "Split"][0]
    assert list(split.loss_weight) == [2.0, 0.0]
    assert list(s.layer[1].loss_weight) == []
    assert s.layer[3].bottom[0] == "h_f1_0_split_1"


def test_unknown_bottom_and_duplicate_top_are_clear_errors():
    with pytest.raises(NetError, match="unknown bottom blob 'nope'"):
        Net(netparam(INPUT + ip("f", "nope", "o")))
    with pytest.raises(NetError, match="multiple sources"):
        Net(netparam(INPUT + ip("f", "x", "o") + ip("g", "x", "o")))
    with pytest.raises(Exception, match="unknown layer type 'Bogus'"):
        Net(netparam(INPUT + 'layer { name: "q" type: "Bogus" bottom: "x" top: "q" }'))


def loss_net(extra_layers: str, force: bool = False) -> str:
    return (("force_backward: true\n" if force else "") + INPUT + extra_layers +
            'layer { name: "loss" type: "EuclideanLoss" bottom: "o" bottom: "t" top: "loss" }\n')


def test_shared_params_are_one_blob_and_gradients_add():
    body = (ip("f1", "x", "h", extra='param { name: "w" } param { name: "b" }') +
            'layer { name: "r" type: "ReLU" bottom: "h" top: "h" }' +
            ip("f2", "h", "o", extra='param { name: "w" } param { name: "b" }') +
            ip("tgt", "x", "t", extra="param { lr_mult: 0 } param { lr_mult: 0 }"))
    net = Net(netparam(loss_net(body)), dtype=np.float64)
    assert net.params["f1"][0] is net.params["f2"][0]
    assert net.param_names == ["f1/0", "f1/1", "tgt/0", "tgt/1"]
    assert net.params_lr == [1.0, 1.0, 0.0, 0.0]
    x = np.random.default_rng(0).standard_normal((4, 3))
    net.forward(x=x)
    net.backward()
    w = net.params["f1"][0]
    # The shared diff is the sum of both uses: check against finite differences of the loss.
    eps, num = 1e-6, np.zeros_like(w.data)
    for idx in np.ndindex(w.shape):
        orig = w.data[idx]
        w.data[idx] = orig + eps
        lp = net.forward_prefilled()
        w.data[idx] = orig - eps
        lm = net.forward_prefilled()
        w.data[idx] = orig
        num[idx] = (lp - lm) / (2 * eps)
    np.testing.assert_allclose(w.diff, num, rtol=1e-5, atol=1e-8)


def test_backward_pruning_and_force_backward():
    body = ip("f1", "x", "o") + ip("tgt", "x", "t", extra="param { lr_mult: 0 } param { lr_mult: 0 }")
    net = Net(netparam(loss_net(body)))
    need = dict(zip(net.layer_names, net.layer_need_backward))
    assert need == {"in": False, "x_in_0_split": False, "f1": True, "tgt": False, "loss": True}
    assert net.params["tgt"][0].diff.any() == False  # noqa: E712
    forced = Net(netparam(loss_net(body, force=True)))
    assert all(forced.layer_need_backward)
    x = np.random.default_rng(1).standard_normal((4, 3))
    forced.forward(x=x)
    forced.backward()
    assert np.abs(forced.blobs["x"].diff).sum() > 0


def test_propagate_down_false_stops_gradient():
    body = (ip("f1", "x", "h") + ip("f2", "h", "o", extra="propagate_down: false") +
            ip("tgt", "x", "t", extra="param { lr_mult: 0 } param { lr_mult: 0 }"))
    net = Net(netparam(loss_net(body)))
    net.forward(x=np.ones((4, 3)))
    net.clear_param_diffs()
    net.backward()
    assert not net.params["f1"][0].diff.any()
    assert net.params["f2"][0].diff.any()


def test_on_layer_done_runs_in_reverse_order_and_outputs():
    body = ip("f1", "x", "o") + ip("tgt", "x", "t", extra="param { lr_mult: 0 } param { lr_mult: 0 }")
    net = Net(netparam(loss_net(body)))
    assert net.output_blob_names == ["loss", "y"]
    assert net.input_blob_names == ["x", "y"]
    seen: list[int] = []
    out = net.forward(x=np.ones((4, 3)))
    assert set(out) == {"y", "loss"}
    net.backward(on_layer_done=seen.append)
    assert seen == [4, 3, 2, 1, 0]  # in, split of x, f1, tgt, loss


def test_loss_layer_without_top_gets_an_anonymous_one():
    body = ip("f1", "x", "o") + ip("tgt", "x", "t", extra="param { lr_mult: 0 } param { lr_mult: 0 }")
    text = INPUT + body + 'layer { name: "loss" type: "EuclideanLoss" bottom: "o" bottom: "t" }\n'
    net = Net(netparam(text))
    net.forward(x=np.ones((4, 3)))
    assert net.loss() > 0
    assert "loss" not in net.blobs and net.output_blob_names == ["y"]
