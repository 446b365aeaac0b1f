"""Clip and Swish (neuron.py); the indexing and reducing layers Tile, Reduction, Parameter,
BatchReindex and Filter (routing.py) and Embed (inner_product.py), all from BVLC Caffe master. Values against hand computations from Caffe's
formulas, float64 finite-difference gradients, the one-line errors, and a few small nets."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
from google.protobuf import text_format

from engine.blob import Blob
from engine.layer_types import LayerError, layer_class
from engine.net import Net
from engine.pb import caffe_pb2
from tests.gradcheck import blob_of as blob, check_layer_gradients, make_layer as make


def tops(n: int = 1, dtype=np.float64) -> list[Blob]:
    return [Blob((), dtype=dtype) for _ in range(n)]


def away_from(points: Sequence[float], shape: tuple[int, ...], seed: int = 1,
              span: float = 2.5, gap: float = 0.05) -> np.ndarray:
    """Random values in [-span, span], none within ``gap`` of a kink at ``points``."""
    x = np.random.default_rng(seed).uniform(-span, span, shape)
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x


def run(layer, bottom: list[Blob], top: list[Blob]) -> np.ndarray:
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return top[0].data


def net_of(text: str) -> Net:
    param = caffe_pb2.NetParameter()
    text_format.Parse(text, param)
    return Net(param, dtype=np.float64)


# -- schema and registry -------------------------------------------------------------------
def test_proto_fields_match_caffe_master() -> None:
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert fields["swish_param"].number == 147 and fields["clip_param"].number == 148
    clip = caffe_pb2.ClipParameter.DESCRIPTOR.fields_by_name
    assert (clip["min"].number, clip["max"].number) == (1, 2)
    assert clip["min"].is_required and clip["max"].is_required
    assert caffe_pb2.SwishParameter.DESCRIPTOR.fields_by_name["beta"].number == 1
    assert caffe_pb2.SwishParameter().beta == 1.0


NEW_TYPES = ["Clip", "Swish", "Tile", "Reduction", "Parameter", "BatchReindex", "Filter", "Embed"]


@pytest.mark.parametrize("name", NEW_TYPES)
def test_registered_without_v1_names(name: str) -> None:
    # Caffe's V1LayerParameter.LayerType has none of these types
    assert layer_class(name).type == name
    v1 = caffe_pb2.V1LayerParameter.LayerType.keys()
    upper = {name.upper(), "BATCH_REINDEX"}
    assert not upper & set(v1)
    for alias in upper:
        with pytest.raises(LayerError, match="unknown layer type"):
            layer_class(alias)


# -- Clip ----------------------------------------------------------------------------------
def test_clip_values_float32() -> None:
    x = np.array([[-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]], dtype=np.float32)
    b, t = [blob(x)], tops(dtype=np.float32)
    layer = make("name:'c' type:'Clip' clip_param{min:-1 max:0.75}", b, t)
    y = run(layer, b, t)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, [[-1, -1, -0.5, 0, 0.5, 0.75, 0.75]])


def test_clip_min_above_max_gives_min() -> None:
    # Caffe computes max(min, min(x, max)): the lower bound wins (np.clip would give max)
    b, t = [blob(np.array([-3.0, 0.0, 3.0]))], tops()
    layer = make("name:'c' type:'Clip' clip_param{min:1 max:-1}", b, t)
    np.testing.assert_array_equal(run(layer, b, t), [1, 1, 1])
    t[0].diff[...] = 1
    layer.backward(t, [True], b)
    np.testing.assert_array_equal(b[0].diff, 0)


@pytest.mark.parametrize("in_place", [False, True])
def test_clip_gradient_mask_includes_the_bounds(in_place: bool) -> None:
    x = np.array([-1.5, -1.0, 0.25, 1.0, 1.5])
    b = blob(x.copy())
    t = b if in_place else Blob(dtype=np.float64)
    layer = make("name:'c' type:'Clip' clip_param{min:-1 max:1}", [b], [t])
    layer.forward([b], [t])
    np.testing.assert_array_equal(t.data, [-1, -1, 0.25, 1, 1])
    t.diff[...] = [10.0, 20.0, 30.0, 40.0, 50.0]
    layer.backward([t], [True], [b])
    # x >= min and x <= max pass; in place, the clipped outputs must not pass too
    np.testing.assert_array_equal(b.diff, [0, 20, 30, 40, 0])


def test_clip_gradients() -> None:
    b, t = [blob(away_from([-0.5, 1.2], (2, 3, 4)))], tops()
    layer = make("name:'c' type:'Clip' clip_param{min:-0.5 max:1.2}", b, t)
    check_layer_gradients(layer, b, t)


@pytest.mark.parametrize("spec, match", [
    ("clip_param{min:0}", "needs max"),
    ("clip_param{max:6}", "needs min"),
    ("", "needs min and max"),
])
def test_clip_requires_both_bounds(spec: str, match: str) -> None:
    with pytest.raises(LayerError, match=f"'c' \\(Clip\\).*{match}"):
        make(f"name:'c' type:'Clip' {spec}", [blob(np.ones(3))], tops())


# -- Swish ---------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [1.0, 2.0, 0.0, -0.5])
def test_swish_values(beta: float) -> None:
    x = np.array([[-3.0, -1.0, 0.0, 0.5, 4.0]])
    b, t = [blob(x)], tops()
    spec = "" if beta == 1.0 else f"swish_param{{beta:{beta}}}"
    layer = make(f"name:'s' type:'Swish' {spec}", b, t)
    np.testing.assert_allclose(run(layer, b, t), x / (1 + np.exp(-beta * x)), rtol=1e-13)


def test_swish_float32_stays_float32() -> None:
    x = np.linspace(-4, 4, 9, dtype=np.float32)
    b, t = [blob(x)], tops(dtype=np.float32)
    y = run(make("name:'s' type:'Swish'", b, t), b, t)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x / (1 + np.exp(-x)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("beta", [1.0, 0.3, -1.5])
def test_swish_gradients(beta: float) -> None:
    b, t = [blob(away_from([], (2, 3, 4)))], tops()
    layer = make(f"name:'s' type:'Swish' swish_param{{beta:{beta}}}", b, t)
    check_layer_gradients(layer, b, t)


def test_swish_in_place_matches_out_of_place() -> None:
    x = away_from([], (3, 5), seed=4)
    dy = np.random.default_rng(2).standard_normal(x.shape)
    results = []
    for in_place in (False, True):
        b = blob(x.copy())
        t = b if in_place else Blob(dtype=np.float64)
        layer = make("name:'s' type:'Swish' swish_param{beta:1.7}", [b], [t])
        layer.forward([b], [t])
        y = t.data.copy()
        t.diff[...] = dy
        layer.backward([t], [True], [b])
        results.append((y, b.diff.copy()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-14)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-12)


def test_swish_errors() -> None:
    with pytest.raises(LayerError, match="'s' \\(Swish\\).*beta"):
        make("name:'s' type:'Swish' swish_param{beta:inf}", [blob(np.ones(3))], tops())
    with pytest.raises(LayerError, match="'s' \\(Swish\\).*exactly 1 bottom"):
        make("name:'s' type:'Swish'", [blob(np.ones(3)), blob(np.ones(3))], tops())


# -- Tile ----------------------------------------------------------------------------------
def test_tile_values() -> None:
    b, t = [blob(np.arange(6.0).reshape(2, 3))], tops()
    layer = make("name:'t' type:'Tile' tile_param{tiles:2}", b, t)
    np.testing.assert_array_equal(run(layer, b, t), [[0, 1, 2, 0, 1, 2], [3, 4, 5, 3, 4, 5]])

    # axis 1 of a 3-axis blob: each item's whole (2, 2) block repeats along axis 1
    b3, t3 = [blob(np.arange(8.0).reshape(2, 2, 2))], tops()
    layer = make("name:'t' type:'Tile' tile_param{axis:1 tiles:3}", b3, t3)
    y = run(layer, b3, t3)
    assert y.shape == (2, 6, 2)
    np.testing.assert_array_equal(y[0], [[0, 1], [2, 3]] * 3)
    np.testing.assert_array_equal(y[1], [[4, 5], [6, 7]] * 3)

    b0, t0 = [blob(np.array([[1.0, 2.0]]))], tops()
    layer = make("name:'t' type:'Tile' tile_param{axis:-2 tiles:3}", b0, t0)
    np.testing.assert_array_equal(run(layer, b0, t0), [[1, 2], [1, 2], [1, 2]])


def test_tile_backward_sums_the_copies() -> None:
    b, t = [blob(np.zeros((2, 2)))], tops()
    layer = make("name:'t' type:'Tile' tile_param{axis:1 tiles:3}", b, t)
    run(layer, b, t)
    t[0].diff[...] = [[1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 50, 60]]
    layer.backward(t, [True], b)
    np.testing.assert_array_equal(b[0].diff, [[1 + 3 + 5, 2 + 4 + 6], [90, 120]])


@pytest.mark.parametrize("spec, shape", [
    ("tile_param{tiles:3}", (2, 3, 2)),
    ("tile_param{axis:0 tiles:2}", (2, 3)),
    ("tile_param{axis:-1 tiles:4}", (3, 2, 2)),
])
def test_tile_gradients(spec: str, shape: tuple[int, ...]) -> None:
    b, t = [blob(away_from([], shape))], tops()
    layer = make(f"name:'t' type:'Tile' {spec}", b, t)
    check_layer_gradients(layer, b, t)


@pytest.mark.parametrize("spec, match", [
    ("", "tiles .* must be given"),
    ("tile_param{tiles:0}", "must be positive"),
    ("tile_param{tiles:-2}", "must be positive"),
    ("tile_param{tiles:2 axis:2}", "axis 2 out of range"),
])
def test_tile_errors(spec: str, match: str) -> None:
    with pytest.raises(LayerError, match=f"'t' \\(Tile\\).*{match}"):
        make(f"name:'t' type:'Tile' {spec}", [blob(np.ones((2, 3)))], tops())


# -- Reduction -----------------------------------------------------------------------------
X_RED = np.array([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]])


@pytest.mark.parametrize("op, coeff, want", [
    ("SUM", 1, [2, -5]),
    ("ASUM", 1, [6, 15]),
    ("SUMSQ", 1, [14, 77]),
    ("MEAN", 1, [2 / 3, -5 / 3]),
    ("SUM", -0.5, [-1, 2.5]),
    ("MEAN", 3, [2, -5]),
])
def test_reduction_values(op: str, coeff: float, want: list[float]) -> None:
    b, t = [blob(X_RED)], tops()
    layer = make(f"name:'r' type:'Reduction' reduction_param{{operation:{op} axis:1 "
                 f"coeff:{coeff}}}", b, t)
    y = run(layer, b, t)
    assert y.shape == (2,)
    np.testing.assert_allclose(y, want, rtol=1e-14)


def test_reduction_default_is_a_scalar_sum_of_everything() -> None:
    b, t = [blob(X_RED)], tops()
    layer = make("name:'r' type:'Reduction'", b, t)
    y = run(layer, b, t)
    assert y.shape == () and float(y) == -3.0
    # the tail from the axis on is reduced: axis 1 of (2, 3, 2) reduces 6 values per item
    b3, t3 = [blob(np.arange(12.0).reshape(2, 3, 2))], tops()
    layer = make("name:'r' type:'Reduction' reduction_param{axis:-2}", b3, t3)
    np.testing.assert_array_equal(run(layer, b3, t3), [15, 51])


def test_reduction_backward_by_hand() -> None:
    dy = np.array([1.0, -2.0])
    want = {
        "SUM": np.outer(dy, np.ones(3)) * 2,
        "MEAN": np.outer(dy, np.ones(3)) * 2 / 3,
        "ASUM": np.sign(X_RED) * dy[:, None] * 2,
        "SUMSQ": 2 * X_RED * dy[:, None] * 2,
    }
    for op, expected in want.items():
        b, t = [blob(X_RED)], tops()
        layer = make(f"name:'r' type:'Reduction' reduction_param{{operation:{op} axis:1 "
                     "coeff:2}", b, t)
        run(layer, b, t)
        t[0].diff[...] = dy
        layer.backward(t, [True], b)
        np.testing.assert_allclose(b[0].diff, expected, rtol=1e-14, err_msg=op)


@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_reduction_gradients(op: str, axis: int) -> None:
    b, t = [blob(away_from([0.0], (2, 3, 2), seed=3))], tops()
    layer = make(f"name:'r' type:'Reduction' reduction_param{{operation:{op} axis:{axis} "
                 "coeff:-1.5}", b, t)
    check_layer_gradients(layer, b, t)


def test_reduction_bad_axis() -> None:
    with pytest.raises(LayerError, match="'r' \\(Reduction\\).*axis 3 out of range"):
        make("name:'r' type:'Reduction' reduction_param{axis:3}", [blob(X_RED)], tops())


# -- Parameter -----------------------------------------------------------------------------
def test_parameter_blob_and_top() -> None:
    t = tops()
    layer = make("name:'p' type:'Parameter' parameter_param{shape{dim:2 dim:3}}", [], t)
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (2, 3)
    assert (layer.blobs[0].data == 0).all() and t[0].shape == (2, 3)
    layer.blobs[0].data[...] = np.arange(6.0).reshape(2, 3)
    run(layer, [], t)
    np.testing.assert_array_equal(t[0].data, np.arange(6.0).reshape(2, 3))
    assert np.shares_memory(t[0].data, layer.blobs[0].data)  # no copy, as Caffe's ShareData
    # backward adds the top's diff into the parameter's
    t[0].diff[...] = 2.0
    layer.blobs[0].diff[...] = 1.0
    layer.backward(t, [], [])
    np.testing.assert_array_equal(layer.blobs[0].diff, 3.0)


def test_parameter_gradients() -> None:
    t = tops()
    layer = make("name:'p' type:'Parameter' parameter_param{shape{dim:3 dim:1 dim:2}}", [], t)
    layer.blobs[0].data[...] = away_from([], (3, 1, 2))
    check_layer_gradients(layer, [], t)


def test_parameter_errors() -> None:
    with pytest.raises(LayerError, match="'p' \\(Parameter\\).*dims must be >= 0"):
        make("name:'p' type:'Parameter' parameter_param{shape{dim:2 dim:-1}}", [], tops())
    with pytest.raises(LayerError, match="'p' \\(Parameter\\).*exactly 0 bottom"):
        make("name:'p' type:'Parameter' parameter_param{shape{dim:2}}",
             [blob(np.ones(2))], tops())


def test_parameter_in_a_net_learns_and_accumulates() -> None:
    net = net_of("""
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "p" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 3 } } }
      layer { name: "sum" type: "Eltwise" bottom: "x" bottom: "p" top: "s" }
      layer { name: "loss" type: "Reduction" bottom: "s" top: "loss" loss_weight: 1
              reduction_param { operation: SUMSQ } }
    """)
    x = np.arange(6.0).reshape(2, 3)
    p = net.params["p"][0]
    assert p.shape == (2, 3) and net.layer_by_name["p"].param_propagate_down == [True]
    p.data[...] = -1.0
    net.forward(x=x)
    np.testing.assert_allclose(net.blobs["loss"].data, ((x - 1) ** 2).sum())
    net.clear_param_diffs()
    net.backward()
    np.testing.assert_allclose(p.diff, 2 * (x - 1))
    net.backward()  # a second pass adds (iter_size)
    np.testing.assert_allclose(p.diff, 4 * (x - 1))


# -- BatchReindex --------------------------------------------------------------------------
def test_batch_reindex_values_and_backward() -> None:
    x = np.arange(6.0).reshape(3, 2)
    b, t = [blob(x), blob(np.array([2.0, 0.0, 2.0, 1.7]))], tops()
    layer = make("name:'br' type:'BatchReindex'", b, t)
    assert t[0].shape == (4, 2)
    # indices are truncated to int, as Caffe's static_cast<int>
    np.testing.assert_array_equal(run(layer, b, t), [[4, 5], [0, 1], [4, 5], [2, 3]])
    t[0].diff[...] = [[1, 2], [10, 20], [100, 200], [1000, 2000]]
    b[0].diff[...] = 7  # overwritten, not added to
    layer.backward(t, [True, False], b)
    np.testing.assert_array_equal(b[0].diff, [[10, 20], [1000, 2000], [101, 202]])


def test_batch_reindex_gradients() -> None:
    x = away_from([], (4, 2, 3))
    b, t = [blob(x), blob(np.array([3.0, 1.0, 1.0, 0.0, 3.0]))], tops()
    layer = make("name:'br' type:'BatchReindex'", b, t)
    check_layer_gradients(layer, b, t, check_bottom=[0])


def test_batch_reindex_errors() -> None:
    x = blob(np.zeros((3, 2)))
    for idx, match in (([3.0], "index 3 at position 0"), ([0.0, -0.5], "index -0.5 at position 1")):
        idx_blob = blob(np.array(idx))
        b, t = [x, idx_blob], tops()
        layer = make("name:'br' type:'BatchReindex'", b, t)
        with pytest.raises(LayerError, match=f"'br' \\(BatchReindex\\).*{match}.*\\[0, 3\\)"):
            layer.forward(b, t)
    with pytest.raises(LayerError, match="'br' \\(BatchReindex\\).*1 axis"):
        make("name:'br' type:'BatchReindex'", [x, blob(np.zeros((2, 1)))], tops())
    b, t = [x, blob(np.array([1.0]))], tops()
    layer = make("name:'br' type:'BatchReindex'", b, t)
    run(layer, b, t)
    with pytest.raises(LayerError, match="'br' \\(BatchReindex\\).*index bottom"):
        layer.backward(t, [True, True], b)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)


# -- Filter --------------------------------------------------------------------------------
def filter_bottoms() -> list[Blob]:
    return [blob(np.arange(8.0).reshape(4, 2)), blob(np.array([10.0, 11.0, 12.0, 13.0])),
            blob(np.array([[1.0], [0.0], [0.0], [-2.0]]))]


def test_filter_values_and_backward() -> None:
    b, t = filter_bottoms(), tops(2)
    layer = make("name:'f' type:'Filter'", b, t)
    # setup + the first reshape: the full batch, as in Caffe (the selector is not read yet)
    assert t[0].shape == (4, 2) and t[1].shape == (4,)
    run(layer, b, t)
    assert t[0].shape == (2, 2) and t[1].shape == (2,)
    np.testing.assert_array_equal(t[0].data, [[0, 1], [6, 7]])
    np.testing.assert_array_equal(t[1].data, [10, 13])
    t[0].diff[...] = [[1, 2], [3, 4]]
    t[1].diff[...] = [5, 6]
    for x in b:
        x.diff[...] = 9
    layer.backward(t, [True, True, False], b)
    np.testing.assert_array_equal(b[0].diff, [[1, 2], [0, 0], [0, 0], [3, 4]])
    np.testing.assert_array_equal(b[1].diff, [5, 0, 0, 6])
    # a new selector takes effect at the next reshape
    b[2].data[...] = [[0], [1], [1], [1]]
    run(layer, b, t)
    np.testing.assert_array_equal(t[1].data, [11, 12, 13])


def test_filter_selects_nothing() -> None:
    b, t = filter_bottoms(), tops(2)
    b[2].data[...] = 0
    layer = make("name:'f' type:'Filter'", b, t)
    run(layer, b, t)
    assert t[0].shape == (0, 2)
    layer.backward(t, [True, False, False], b)
    np.testing.assert_array_equal(b[0].diff, 0)


def test_filter_gradients() -> None:
    b = [blob(away_from([], (5, 2, 3))), blob(away_from([], (5, 4), seed=2)),
         blob(np.array([0.0, 1.0, 0.5, 0.0, 1.0]).reshape(5, 1, 1))]
    t = tops(2)
    layer = make("name:'f' type:'Filter'", b, t)
    check_layer_gradients(layer, b, t, check_bottom=[0, 1])


def test_filter_errors() -> None:
    with pytest.raises(LayerError, match="'f' \\(Filter\\).*one top per bottom"):
        make("name:'f' type:'Filter'", filter_bottoms(), tops(1))
    bad_sel = filter_bottoms()
    bad_sel[2] = blob(np.ones((4, 2)))
    with pytest.raises(LayerError, match="'f' \\(Filter\\).*selector"):
        make("name:'f' type:'Filter'", bad_sel, tops(2))
    bad_num = filter_bottoms()
    bad_num[1] = blob(np.ones(3))
    with pytest.raises(LayerError, match="'f' \\(Filter\\).*bottom 1 .*first dim"):
        make("name:'f' type:'Filter'", bad_num, tops(2))
    b, t = filter_bottoms(), tops(2)
    layer = make("name:'f' type:'Filter'", b, t)
    run(layer, b, t)
    with pytest.raises(LayerError, match="'f' \\(Filter\\).*selector"):
        layer.backward(t, [True, False, True], b)


def test_filter_in_a_net_with_force_backward() -> None:
    net = net_of("""
      force_backward: true
      layer { name: "in" type: "Input" top: "x" top: "sel"
              input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 1 } } }
      layer { name: "f" type: "Filter" bottom: "x" bottom: "sel" top: "kept" }
      layer { name: "loss" type: "Reduction" bottom: "kept" top: "loss" loss_weight: 1 }
    """)
    x = np.arange(12.0).reshape(4, 3)
    out = net.forward(x=x, sel=np.array([[0.0], [1.0], [0.0], [1.0]]))
    assert net.blobs["kept"].shape == (2, 3)
    np.testing.assert_allclose(out["loss"], x[[1, 3]].sum())
    net.backward()  # the selector is not forced to take a gradient
    np.testing.assert_array_equal(net.blobs["x"].diff, [[0] * 3, [1] * 3, [0] * 3, [1] * 3])


# -- Embed ---------------------------------------------------------------------------------
EMBED = ("name:'e' type:'Embed' embed_param{{num_output:3 input_dim:4 {extra} "
         "weight_filler{{type:'gaussian' std:1}} bias_filler{{type:'gaussian' std:1}}}}")


def test_embed_values_and_blobs() -> None:
    idx = np.array([[0.0, 3.0], [3.0, 1.0]])
    b, t = [blob(idx)], tops()
    layer = make(EMBED.format(extra=""), b, t)
    w, bias = (x.data for x in layer.blobs)
    assert w.shape == (4, 3) and bias.shape == (3,)
    assert layer.param_propagate_down == [True, True]
    y = run(layer, b, t)
    assert y.shape == (2, 2, 3)
    np.testing.assert_allclose(y[0, 0], w[0] + bias, rtol=1e-15)
    np.testing.assert_allclose(y[0, 1], w[3] + bias, rtol=1e-15)
    np.testing.assert_allclose(y[1, 0], w[3] + bias, rtol=1e-15)
    np.testing.assert_allclose(y[1, 1], w[1] + bias, rtol=1e-15)
    # repeated indices add up in the weight gradient; the parameter diffs accumulate
    t[0].diff[...] = np.arange(12.0).reshape(2, 2, 3)
    layer.blobs[0].diff[...] = 1
    layer.blobs[1].diff[...] = 0
    layer.backward(t, [False], b)
    np.testing.assert_array_equal(layer.blobs[0].diff,
                                  1 + np.array([[0, 1, 2], [9, 10, 11], [0, 0, 0], [9, 11, 13]]))
    np.testing.assert_array_equal(layer.blobs[1].diff, [18, 22, 26])


def test_embed_without_bias() -> None:
    b, t = [blob(np.array([2.0, 2.0, 0.0]))], tops()
    layer = make(EMBED.format(extra="bias_term:false"), b, t)
    assert len(layer.blobs) == 1 and layer.param_propagate_down == [True]
    np.testing.assert_array_equal(run(layer, b, t), layer.blobs[0].data[[2, 2, 0]])


@pytest.mark.parametrize("extra", ["", "bias_term:false"])
def test_embed_gradients(extra: str) -> None:
    b, t = [blob(np.array([[1.0, 3.0, 1.0], [0.0, 3.0, 3.0]]))], tops()
    layer = make(EMBED.format(extra=extra), b, t)
    check_layer_gradients(layer, b, t, check_bottom=[])


@pytest.mark.parametrize("spec, match", [
    ("embed_param{input_dim:4}", "num_output must be positive"),
    ("embed_param{num_output:3}", "input_dim .* must be positive"),
])
def test_embed_param_errors(spec: str, match: str) -> None:
    with pytest.raises(LayerError, match=f"'e' \\(Embed\\).*{match}"):
        make(f"name:'e' type:'Embed' {spec}", [blob(np.zeros(2))], tops())


@pytest.mark.parametrize("value, match", [
    (4.0, "input 4 at position 1 is not a whole number in \\[0, 4\\)"),
    (-1.0, "input -1 at position 1"),
    (1.5, "input 1.5 at position 1"),
    (np.nan, "input nan at position 1"),
])
def test_embed_bad_index(value: float, match: str) -> None:
    b, t = [blob(np.array([0.0, value]))], tops()
    layer = make(EMBED.format(extra=""), b, t)
    with pytest.raises(LayerError, match=f"'e' \\(Embed\\).*{match}"):
        layer.forward(b, t)


def test_embed_refuses_gradient_to_its_input() -> None:
    b, t = [blob(np.array([0.0, 1.0]))], tops()
    layer = make(EMBED.format(extra=""), b, t)
    run(layer, b, t)
    with pytest.raises(LayerError, match="'e' \\(Embed\\).*index input"):
        layer.backward(t, [True], b)
    assert not layer.allow_force_backward(0)


def test_embed_in_a_net() -> None:
    net = net_of("""
      force_backward: true
      layer { name: "in" type: "Input" top: "words" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "e" type: "Embed" bottom: "words" top: "vec"
              embed_param { num_output: 2 input_dim: 5
                            weight_filler { type: "uniform" min: -1 max: 1 } } }
      layer { name: "loss" type: "Reduction" bottom: "vec" top: "loss" loss_weight: 1 }
    """)
    words = np.array([[4.0, 0.0, 4.0], [2.0, 4.0, 1.0]])
    w, bias = net.params["e"]
    net.forward(words=words)
    assert net.blobs["vec"].shape == (2, 3, 2)
    np.testing.assert_allclose(net.blobs["loss"].data, w.data[[4, 0, 4, 2, 4, 1]].sum())
    net.clear_param_diffs()
    net.backward()  # force_backward does not reach the index input
    counts = np.bincount(words.astype(int).ravel(), minlength=5)
    np.testing.assert_array_equal(w.diff, np.repeat(counts[:, None], 2, axis=1))
    np.testing.assert_array_equal(bias.diff, [6, 6])
