"""Caffe's common layers (engine/layers/routing.py, reductions.py): gradient checks in float64, values against
hand computations, and InnerProduct's sufficient factors."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
from google.protobuf import text_format

from engine.blob import Blob
from engine.layer_types import LayerError, create_layer
from engine.pb import caffe_pb2
from tests.gradcheck import check_layer_gradients, make_layer as make




def blobs(*shapes: Sequence[int], seed: int = 0, dtype=np.float64) -> list[Blob]:
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        b = Blob(s, dtype=dtype)
        b.data[...] = rng.standard_normal(s)
        out.append(b)
    return out


def tops(n: int, dtype=np.float64) -> list[Blob]:
    return [Blob((), dtype=dtype) for _ in range(n)]


GAUSS = "weight_filler{type:'gaussian' std:0.5} bias_filler{type:'gaussian' std:0.5}"


def ip_spec(extra: str = "", num_output: int = 4) -> str:
    return (f"name:'ip' type:'InnerProduct' "
            f"inner_product_param{{num_output:{num_output} {extra} {GAUSS}}}")


# -- InnerProduct --------------------------------------------------------------------------
@pytest.mark.parametrize("extra, shape", [
    ("", (3, 2, 2, 2)),
    ("axis:2", (2, 3, 4)),
    ("transpose:true", (3, 5)),
    ("bias_term:false", (3, 5)),
    ("transpose:true axis:-1 bias_term:false", (2, 2, 3)),
])
def test_inner_product_gradients(extra: str, shape: tuple[int, ...]) -> None:
    b, t = blobs(shape), tops(1)
    layer = make(ip_spec(extra), b, t)
    check_layer_gradients(layer, b, t)


def test_inner_product_forward_values_and_shapes() -> None:
    b, t = blobs((2, 3, 4)), tops(1)
    layer = make(ip_spec("axis:2", 5), b, t)
    assert layer.blobs[0].shape == (5, 4) and layer.blobs[1].shape == (5,)
    assert t[0].shape == (2, 3, 5)
    layer.forward(b, t)
    want = b[0].data @ layer.blobs[0].data.T + layer.blobs[1].data
    np.testing.assert_allclose(t[0].data, want, rtol=1e-12)

    bt, tt = blobs((2, 3, 4)), tops(1)
    lt = make(ip_spec("transpose:true", 5), bt, tt)
    assert lt.blobs[0].shape == (12, 5) and tt[0].shape == (2, 5)


def test_inner_product_float32_stays_float32() -> None:
    b, t = blobs((4, 6), dtype=np.float32), tops(1, dtype=np.float32)
    layer = make(ip_spec(num_output=3), b, t)
    layer.forward(b, t)
    t[0].diff[...] = 1
    layer.backward(t, [True], b)
    for arr in (t[0].data, b[0].diff, layer.blobs[0].data, layer.blobs[0].diff,
                layer.blobs[1].diff):
        assert arr.dtype == np.float32


def test_inner_product_accumulates_param_gradients() -> None:
    b, t = blobs((4, 6)), tops(1)
    layer = make(ip_spec(num_output=3), b, t)
    layer.forward(b, t)
    t[0].diff[...] = np.arange(12.0).reshape(4, 3)
    layer.backward(t, [True], b)
    once = layer.blobs[0].diff.copy(), layer.blobs[1].diff.copy()
    layer.backward(t, [True], b)
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * once[0])
    np.testing.assert_allclose(layer.blobs[1].diff, 2 * once[1])


@pytest.mark.parametrize("transpose", [False, True])
def test_sufficient_factors_rebuild_weight_gradient(transpose: bool) -> None:
    b, t = blobs((3, 2, 5), seed=3), tops(1)
    flag = "transpose:true" if transpose else ""
    layer = make(ip_spec(flag), b, t)
    layer.forward(b, t)
    with pytest.raises(LayerError, match="backward"):
        layer.sufficient_factors()
    t[0].diff[...] = np.random.default_rng(1).standard_normal(t[0].shape)
    layer.blobs[0].diff[...] = 0
    layer.backward(t, [False], b)
    u, v = layer.sufficient_factors()
    assert u.shape == (3, 4) and v.shape == (3, 10)
    rebuilt = v.T @ u if transpose else u.T @ v
    np.testing.assert_allclose(layer.blobs[0].diff, rebuilt, rtol=1e-12)
    # views of the blobs' memory, not copies
    assert np.shares_memory(u, t[0].diff) and np.shares_memory(v, b[0].data)


def test_inner_product_rejects_wrong_input_size() -> None:
    b, t = blobs((2, 6)), tops(1)
    layer = make("name:'ip' type:'InnerProduct' inner_product_param{num_output:3}", b, t)
    b[0].reshape((2, 7))
    with pytest.raises(LayerError, match="'ip'.*incompatible"):
        layer.reshape(b, t)


# -- Concat / Slice / Split ----------------------------------------------------------------
@pytest.mark.parametrize("spec, shapes", [
    ("concat_param{axis:1}", [(2, 3, 2), (2, 1, 2), (2, 2, 2)]),
    ("concat_param{axis:0}", [(1, 3), (2, 3)]),
    ("concat_param{axis:-1}", [(2, 2, 1), (2, 2, 3)]),
    ("concat_param{concat_dim:2}", [(2, 2, 1), (2, 2, 2)]),
])
def test_concat(spec: str, shapes: list[tuple[int, ...]]) -> None:
    b, t = blobs(*shapes), tops(1)
    layer = make(f"name:'c' type:'Concat' {spec}", b, t)
    layer.forward(b, t)
    np.testing.assert_array_equal(t[0].data, np.concatenate([x.data for x in b], axis=layer.axis))
    check_layer_gradients(layer, b, t)


def test_concat_shape_mismatch_names_layer() -> None:
    b, t = blobs((2, 3), (3, 3)), tops(1)
    param = caffe_pb2.LayerParameter()
    text_format.Parse("name:'cat' type:'Concat'", param)
    layer = create_layer(param)
    layer.setup(b, t)
    with pytest.raises(LayerError, match="'cat'.*bottom 1"):
        layer.reshape(b, t)


@pytest.mark.parametrize("spec, ntop, sizes", [
    ("slice_param{axis:1 slice_point:1 slice_point:4}", 3, [1, 3, 1]),
    ("slice_param{axis:1}", 5, [1] * 5),
    ("slice_param{slice_dim:0}", 2, [1, 1]),
    ("slice_param{axis:-1 slice_point:2}", 2, [2, 1]),
])
def test_slice(spec: str, ntop: int, sizes: list[int]) -> None:
    b, t = blobs((2, 5, 3)), tops(ntop)
    layer = make(f"name:'s' type:'Slice' {spec}", b, t)
    layer.forward(b, t)
    assert [x.shape[layer.axis] for x in t] == sizes
    np.testing.assert_array_equal(np.concatenate([x.data for x in t], axis=layer.axis), b[0].data)
    check_layer_gradients(layer, b, t)


def test_slice_bad_points() -> None:
    b, t = blobs((2, 5)), tops(2)
    with pytest.raises(LayerError, match="slice_point"):
        make("name:'s' type:'Slice' slice_param{slice_point:5}", b, t)
    with pytest.raises(LayerError, match="equal parts"):
        make("name:'s' type:'Slice'", blobs((2, 5)), tops(3))


def test_split() -> None:
    b, t = blobs((2, 3)), tops(3)
    layer = make("name:'sp' type:'Split'", b, t)
    layer.forward(b, t)
    for x in t:
        np.testing.assert_array_equal(x.data, b[0].data)
        assert not np.shares_memory(x.data, b[0].data)
    check_layer_gradients(layer, b, t)


# -- Flatten / Reshape ---------------------------------------------------------------------
@pytest.mark.parametrize("spec, want", [
    ("", (2, 24)),
    ("flatten_param{axis:2}", (2, 3, 8)),
    ("flatten_param{axis:1 end_axis:2}", (2, 12, 2)),
    ("flatten_param{axis:0 end_axis:-2}", (24, 2)),
])
def test_flatten(spec: str, want: tuple[int, ...]) -> None:
    b, t = blobs((2, 3, 4, 2)), tops(1)
    layer = make(f"name:'f' type:'Flatten' {spec}", b, t)
    layer.forward(b, t)
    assert t[0].shape == want
    assert np.shares_memory(t[0].data, b[0].data)
    np.testing.assert_array_equal(t[0].data.reshape(-1), b[0].data.reshape(-1))
    check_layer_gradients(layer, b, t)


@pytest.mark.parametrize("spec, bottom_shape, want", [
    ("shape{dim:0 dim:-1}", (2, 3, 4), (2, 12)),
    ("shape{dim:0 dim:2 dim:-1 dim:3}", (2, 3, 4), (2, 2, 2, 3)),
    ("shape{dim:-1}", (2, 3, 4), (24,)),
    ("shape{dim:2 dim:2} axis:1 num_axes:1", (3, 4, 5), (3, 2, 2, 5)),
    ("shape{dim:1} axis:0 num_axes:0", (3, 4), (1, 3, 4)),
    ("shape{dim:1} axis:-1 num_axes:0", (3, 4), (3, 4, 1)),
    ("shape{dim:0 dim:0 dim:-1} axis:1", (2, 3, 4, 5), (2, 3, 4, 5)),
    ("shape{dim:-1 dim:3} axis:-2", (2, 3, 4, 6), (2, 3, 4, 2, 3)),
])
def test_reshape_inference(spec: str, bottom_shape: tuple[int, ...],
                           want: tuple[int, ...]) -> None:
    b, t = blobs(bottom_shape), tops(1)
    layer = make(f"name:'r' type:'Reshape' reshape_param{{{spec}}}", b, t)
    layer.forward(b, t)
    assert t[0].shape == want
    assert np.shares_memory(t[0].data, b[0].data)


def test_reshape_gradient_and_shared_diff() -> None:
    b, t = blobs((2, 3, 4)), tops(1)
    layer = make("name:'r' type:'Reshape' reshape_param{shape{dim:0 dim:-1 dim:2}}", b, t)
    check_layer_gradients(layer, b, t)
    layer.backward(t, [True], b)
    assert np.shares_memory(b[0].diff, t[0].diff)


@pytest.mark.parametrize("spec, match", [
    ("shape{dim:-1 dim:-1}", "at most one -1"),
    ("shape{dim:5 dim:-1}", "cannot infer"),
    ("shape{dim:7 dim:3}", "count"),
    ("shape{dim:0 dim:0 dim:0 dim:0}", "no axis"),
])
def test_reshape_errors(spec: str, match: str) -> None:
    with pytest.raises(LayerError, match=match):
        make(f"name:'r' type:'Reshape' reshape_param{{{spec}}}", blobs((2, 3, 4)), tops(1))


def test_view_layers_refuse_in_place() -> None:
    b = blobs((2, 3))
    with pytest.raises(LayerError, match="in-place"):
        make("name:'f' type:'Flatten'", b, b)


# -- Eltwise -------------------------------------------------------------------------------
def test_eltwise_sum_with_coeffs() -> None:
    b, t = blobs((2, 3, 2), (2, 3, 2), (2, 3, 2)), tops(1)
    layer = make("name:'e' type:'Eltwise' eltwise_param{operation:SUM coeff:1 coeff:-0.5 coeff:2}",
                 b, t)
    layer.forward(b, t)
    np.testing.assert_allclose(t[0].data, b[0].data - 0.5 * b[1].data + 2 * b[2].data)
    check_layer_gradients(layer, b, t)


@pytest.mark.parametrize("stable", ["true", "false"])
def test_eltwise_prod(stable: str) -> None:
    b, t = blobs((2, 3), (2, 3), (2, 3)), tops(1)
    spec = f"operation:PROD stable_prod_grad:{stable}"
    layer = make(f"name:'e' type:'Eltwise' eltwise_param{{{spec}}}", b, t)
    layer.forward(b, t)
    np.testing.assert_allclose(t[0].data, b[0].data * b[1].data * b[2].data)
    check_layer_gradients(layer, b, t)


def test_eltwise_max() -> None:
    b, t = blobs((2, 3, 2), (2, 3, 2), (2, 3, 2), seed=5), tops(1)
    layer = make("name:'e' type:'Eltwise' eltwise_param{operation:MAX}", b, t)
    layer.forward(b, t)
    np.testing.assert_array_equal(t[0].data, np.maximum.reduce([x.data for x in b]))
    check_layer_gradients(layer, b, t, eps=1e-7)


def test_eltwise_max_ties_follow_caffe() -> None:
    # Caffe: bottom 1 wins a tie with bottom 0; a later bottom needs to be strictly greater
    b, t = [Blob((3,)) for _ in range(3)], tops(1)
    b[0].data[...] = [1, 2, 0]
    b[1].data[...] = [1, 1, 0]
    b[2].data[...] = [1, 2, 0]
    layer = make("name:'e' type:'Eltwise' eltwise_param{operation:MAX}", b, t)
    layer.forward(b, t)
    np.testing.assert_array_equal(layer.max_idx, [1, 0, 1])


def test_eltwise_coeff_errors() -> None:
    with pytest.raises(LayerError, match="one per bottom"):
        make("name:'e' type:'Eltwise' eltwise_param{coeff:1}", blobs((2,), (2,)), tops(1))
    with pytest.raises(LayerError, match="only allowed with operation SUM"):
        make("name:'e' type:'Eltwise' eltwise_param{operation:MAX coeff:1 coeff:1}",
             blobs((2,), (2,)), tops(1))


# -- Softmax / Silence / ArgMax ------------------------------------------------------------
@pytest.mark.parametrize("axis", [1, 2, -1])
def test_softmax(axis: int) -> None:
    b, t = blobs((2, 3, 4)), tops(1)
    layer = make(f"name:'sm' type:'Softmax' softmax_param{{axis:{axis}}}", b, t)
    layer.forward(b, t)
    e = np.exp(b[0].data - b[0].data.max(axis=axis, keepdims=True))
    np.testing.assert_allclose(t[0].data, e / e.sum(axis=axis, keepdims=True), rtol=1e-12)
    check_layer_gradients(layer, b, t)


def test_softmax_large_logits_float32() -> None:
    b, t = [Blob((1, 3), dtype=np.float32)], tops(1, dtype=np.float32)
    b[0].data[...] = [1000, 1001, 0]
    layer = make("name:'sm' type:'Softmax'", b, t)
    layer.forward(b, t)
    assert t[0].data.dtype == np.float32 and np.isfinite(t[0].data).all()
    np.testing.assert_allclose(t[0].data.sum(), 1, rtol=1e-6)


def test_silence_zeroes_diffs() -> None:
    b = blobs((2, 3), (4,))
    for x in b:
        x.diff[...] = 7
    layer = make("name:'s' type:'Silence'", b, [])
    layer.forward(b, [])
    layer.backward([], [True, False], b)
    assert (b[0].diff == 0).all() and (b[1].diff == 7).all()


def test_argmax_flat() -> None:
    b, t = [Blob((2, 2, 2))], tops(1)
    b[0].data[...] = np.array([[5, 1, 3, 5], [0, 2, 9, -1]], dtype=float).reshape(2, 2, 2)
    layer = make("name:'a' type:'ArgMax' argmax_param{top_k:2 out_max_val:true}", b, t)
    layer.forward(b, t)
    assert t[0].shape == (2, 2, 2)
    # equal values rank the higher index first (Caffe sorts (value, index) pairs)
    np.testing.assert_array_equal(t[0].data[0], [[3, 0], [5, 5]])
    np.testing.assert_array_equal(t[0].data[1], [[2, 1], [9, 2]])

    t1 = tops(1)
    layer = make("name:'a' type:'ArgMax'", b, t1)
    layer.forward(b, t1)
    assert t1[0].shape == (2, 1, 1)
    np.testing.assert_array_equal(t1[0].data.reshape(-1), [3, 2])


def test_argmax_axis() -> None:
    b, t = blobs((2, 4, 3), seed=2), tops(1)
    layer = make("name:'a' type:'ArgMax' argmax_param{axis:1 top_k:2}", b, t)
    layer.forward(b, t)
    assert t[0].shape == (2, 2, 3)
    order = np.argsort(-b[0].data, axis=1)[:, :2]
    np.testing.assert_array_equal(t[0].data, order)

    tv = tops(1)
    layer = make("name:'a' type:'ArgMax' argmax_param{axis:1 top_k:2 out_max_val:true}", b, tv)
    layer.forward(b, tv)
    np.testing.assert_array_equal(tv[0].data, np.take_along_axis(b[0].data, order, axis=1))


def test_argmax_top_k_too_large() -> None:
    with pytest.raises(LayerError, match="top_k"):
        make("name:'a' type:'ArgMax' argmax_param{top_k:7}", blobs((2, 3)), tops(1))
