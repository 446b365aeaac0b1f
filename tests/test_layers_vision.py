"""Vision layers (Convolution, Deconvolution, Pooling, Crop, LRN) against naive loop
references written from Caffe's CPU code, and finite-difference gradient checks."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from engine import backend
from engine.blob import Blob
from engine.layer_types import LayerError, create_layer
from engine.kernels import cpu as compiled
from engine.kernels import cpu_pool
from engine.kernels import cuda
from engine.kernels.geometry import Geometry, conv_out_size, index_dtype, pool_out_size
from engine.layers import im2col as K
from engine.layers import pool as P
from engine.layers import vision as V
from engine.pb import caffe_pb2
from tests.gradcheck import check_layer_gradients, make_layer


def build(text: str, shapes, dtype=np.float64, seed: int = 0, distinct: bool = False,
          phase: str = "TRAIN"):
    """A set-up layer from prototxt ``text`` with random float bottoms of ``shapes``."""
    rng = np.random.default_rng(seed)
    bottom = []
    for shape in shapes:
        b = Blob(shape, dtype=dtype, xp=np)
        n = int(np.prod(shape))
        if distinct:  # well separated values: no ties for MAX pooling's argmax
            b.data[...] = (rng.permutation(n).reshape(shape) - n / 2) * 0.01
        else:
            b.data[...] = rng.standard_normal(shape)
        bottom.append(b)
    top = [Blob((), dtype=dtype, xp=np) for _ in range(text.count("top:"))]
    return make_layer(text, bottom, top, phase), bottom, top


def run(layer, bottom, top):
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return [t.data.copy() for t in top]


# ------------------------------------------------------------------ naive references

def naive_conv(x, w, b, stride, pad, dil, group):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dil
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (wd + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    xp_ = np.zeros((n, c, h + 2 * ph, wd + 2 * pw))
    xp_[:, :, ph:ph + h, pw:pw + wd] = x
    out = np.zeros((n, o, oh, ow))
    og = o // group
    for g in range(group):
        for y in range(oh):
            for xx in range(ow):
                patch = xp_[:, g * cg:(g + 1) * cg,
                            y * sh:y * sh + dh * (kh - 1) + 1:dh,
                            xx * sw:xx * sw + dw * (kw - 1) + 1:dw]
                out[:, g * og:(g + 1) * og, y, xx] = np.einsum(
                    "nckl,ockl->no", patch, w[g * og:(g + 1) * og])
    if b is not None:
        out += b[None, :, None, None]
    return out


def naive_deconv(x, w, b, stride, pad, dil, group):
    n, c, h, wd = x.shape
    _, og, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dil
    full_h = sh * (h - 1) + dh * (kh - 1) + 1
    full_w = sw * (wd - 1) + dw * (kw - 1) + 1
    full = np.zeros((n, og * group, full_h, full_w))
    cg = c // group
    for ci in range(c):
        g = ci // cg
        for y in range(h):
            for xx in range(wd):
                for i in range(kh):
                    for j in range(kw):
                        full[:, g * og:(g + 1) * og, y * sh + i * dh, xx * sw + j * dw] += \
                            x[:, ci, y, xx, None] * w[ci, :, i, j][None]
    out = full[:, :, ph:full_h - ph, pw:full_w - pw]
    if b is not None:
        out = out + b[None, :, None, None]
    return out


def caffe_pool_size(h, k, p, s, any_pad):
    out = int(np.ceil((h + 2 * p - k) / s)) + 1
    if any_pad and (out - 1) * s >= h + p:  # Caffe clips both axes whenever either pad is set
        out -= 1
    return out


def naive_pool(x, method, k, s, p):
    """Caffe's Forward_cpu loops, literally."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = k, s, p
    oh = caffe_pool_size(h, kh, ph, sh, bool(ph or pw))
    ow = caffe_pool_size(w, kw, pw, sw, bool(ph or pw))
    top = np.zeros((n, c, oh, ow))
    mask = np.full((n, c, oh, ow), -1)
    for a in range(n):
        for b in range(c):
            for y in range(oh):
                for xx in range(ow):
                    hs, ws = y * sh - ph, xx * sw - pw
                    if method == "MAX":
                        he, we = min(hs + kh, h), min(ws + kw, w)
                        hs, ws = max(hs, 0), max(ws, 0)
                        best, where = -np.finfo(np.float32).max, -1
                        for hh in range(hs, he):
                            for ww in range(ws, we):
                                if x[a, b, hh, ww] > best:
                                    best, where = x[a, b, hh, ww], hh * w + ww
                        top[a, b, y, xx], mask[a, b, y, xx] = best, where
                    else:
                        he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                        size = (he - hs) * (we - ws)
                        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
                        top[a, b, y, xx] = x[a, b, hs:he, ws:we].sum() / size
    return top, mask


def naive_lrn_across(x, size, alpha, beta, k):
    n, c, h, w = x.shape
    pre = (size - 1) // 2
    scale = np.full(x.shape, float(k))
    for ch in range(c):
        for j in range(max(0, ch - pre), min(c, ch + pre + 1)):
            scale[:, ch] += alpha / size * x[:, j] ** 2
    return x * scale ** -beta


def naive_lrn_within(x, size, alpha, beta):
    n, c, h, w = x.shape
    pre = (size - 1) // 2
    sq = np.zeros((n, c, h + 2 * pre, w + 2 * pre))
    sq[:, :, pre:pre + h, pre:pre + w] = x ** 2
    s = np.zeros(x.shape)
    for i in range(size):
        for j in range(size):
            s += sq[:, :, i:i + h, j:j + w]
    return x * (1 + alpha / size ** 2 * s) ** -beta


# ------------------------------------------------------------------ convolution

CONV_CASES = {
    "plain": ("num_output: 4 kernel_size: 3", (2, 3, 6, 5),
              dict(stride=(1, 1), pad=(0, 0), dil=(1, 1), group=1)),
    "group2_pad": ("num_output: 4 kernel_size: 3 pad: 1 group: 2", (2, 4, 5, 5),
                   dict(stride=(1, 1), pad=(1, 1), dil=(1, 1), group=2)),
    "stride2": ("num_output: 3 kernel_size: 3 stride: 2 pad: 1", (2, 2, 7, 6),
                dict(stride=(2, 2), pad=(1, 1), dil=(1, 1), group=1)),
    "dilation2": ("num_output: 3 kernel_size: 3 dilation: 2 pad: 2", (1, 2, 7, 7),
                  dict(stride=(1, 1), pad=(2, 2), dil=(2, 2), group=1)),
    "kh_ne_kw": ("num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0",
                 (2, 3, 6, 5), dict(stride=(2, 1), pad=(1, 0), dil=(1, 1), group=1)),
    "no_bias": ("num_output: 3 kernel_size: 2 bias_term: false", (2, 2, 4, 4),
                dict(stride=(1, 1), pad=(0, 0), dil=(1, 1), group=1)),
}


def conv_text(kind: str, body: str) -> str:
    return (f'name: "c" type: "{kind}" bottom: "x" top: "y" convolution_param {{ {body} '
            'weight_filler { type: "gaussian" std: 0.5 } '
            'bias_filler { type: "gaussian" std: 0.5 } }')


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_convolution_matches_naive_and_gradients(case):
    body, shape, geo = CONV_CASES[case]
    layer, bottom, top = build(conv_text("Convolution", body), [shape])
    w = layer.blobs[0].data
    b = layer.blobs[1].data if len(layer.blobs) > 1 else None
    (y,) = run(layer, bottom, top)
    np.testing.assert_allclose(y, naive_conv(bottom[0].data, w, b, **geo), rtol=1e-10, atol=1e-10)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_deconvolution_matches_naive_and_gradients(case):
    body, shape, geo = CONV_CASES[case]
    layer, bottom, top = build(conv_text("Deconvolution", body), [shape])
    w = layer.blobs[0].data
    assert w.shape[0] == shape[1]  # Caffe's layout: (channels_in, num_output / group, kh, kw)
    b = layer.blobs[1].data if len(layer.blobs) > 1 else None
    (y,) = run(layer, bottom, top)
    np.testing.assert_allclose(y, naive_deconv(bottom[0].data, w, b, **geo), rtol=1e-10,
                               atol=1e-10)
    check_layer_gradients(layer, bottom, top)


def test_deconvolution_is_the_adjoint_of_convolution():
    body = "num_output: 3 kernel_size: 3 stride: 2 pad: 1 group: 1 bias_term: false"
    conv, cb, ct = build(conv_text("Convolution", body), [(2, 4, 7, 7)])
    deconv, db, dt = build(conv_text("Deconvolution", body.replace("3 kernel", "4 kernel")),
                           [ct[0].shape], seed=1)
    deconv.blobs[0].data[...] = conv.blobs[0].data
    (y,) = run(conv, cb, ct)
    (z,) = run(deconv, db, dt)
    assert z.shape == cb[0].shape
    # <conv(x), u> == <x, deconv(u)> with shared weights
    assert np.isclose((y * db[0].data).sum(), (cb[0].data * z).sum())


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("strategy", [(K, "CHUNK_BYTES", 1), (K, "_NS_PER_ROW", 0.0),
                                      (K, "_NS_PER_ROW", 1e9), (V, "SMALL_WEIGHT_GRADIENT", 0),
                                      (V, "SMALL_WEIGHT_GRADIENT", 1 << 30),
                                      (V, "PER_IMAGE_FILTER_ROWS", 0),
                                      (V, "PER_IMAGE_FILTER_ROWS", 1 << 30)])
@pytest.mark.parametrize("numba", ["0", "1"])
def test_cpu_strategies_agree(monkeypatch, kind, strategy, numba):
    """One image per chunk, col2im with and without the wide grid, and the filtering and
    weight gradients by one GEMM or one per image, give the same, with the NumPy kernels and the compiled ones
    (which have no wide grid)."""
    monkeypatch.setenv("POSEIDON_NUMBA", numba)
    body = "num_output: 4 kernel_size: 3 pad: 1 group: 2"
    layer, bottom, top = build(conv_text(kind, body), [(5, 4, 5, 6)])

    def pass_():
        for p in layer.blobs:
            p.diff[...] = 0
        (y,) = run(layer, bottom, top)
        top[0].diff[...] = np.random.default_rng(3).standard_normal(top[0].shape)
        layer.backward(top, [True], bottom)
        return [y, bottom[0].diff.copy()] + [p.diff.copy() for p in layer.blobs]

    want = pass_()
    monkeypatch.setattr(*strategy)
    for got, ref in zip(pass_(), want):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_convolution_axis_2_treats_leading_axes_as_the_batch():
    body = "num_output: 3 kernel_size: 3 pad: 1 axis: 2"
    layer, bottom, top = build(conv_text("Convolution", body), [(2, 3, 4, 5, 5)])
    (y,) = run(layer, bottom, top)
    assert y.shape == (2, 3, 3, 5, 5)
    geo = dict(stride=(1, 1), pad=(1, 1), dil=(1, 1), group=1)
    want = naive_conv(bottom[0].data.reshape(6, 4, 5, 5), layer.blobs[0].data,
                      layer.blobs[1].data, **geo)
    np.testing.assert_allclose(y.reshape(want.shape), want, rtol=1e-10)
    check_layer_gradients(layer, bottom, top)


def test_convolution_float32_stays_float32_and_accumulates_param_diffs():
    layer, bottom, top = build(conv_text("Convolution", "num_output: 4 kernel_size: 3 pad: 1"),
                               [(2, 3, 5, 5)], dtype=np.float32)
    run(layer, bottom, top)
    assert top[0].data.dtype == np.float32 and layer.blobs[0].dtype == np.float32
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    first = layer.blobs[0].diff.copy()
    layer.backward(top, [True], bottom)
    assert bottom[0].diff.dtype == np.float32
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * first, rtol=1e-6)


def test_convolution_propagate_down_false_leaves_bottom_diff():
    layer, bottom, top = build(conv_text("Convolution", "num_output: 2 kernel_size: 3"),
                               [(1, 2, 5, 5)])
    run(layer, bottom, top)
    bottom[0].diff[...] = 7
    top[0].diff[...] = 1
    layer.backward(top, [False], bottom)
    assert (bottom[0].diff == 7).all() and np.abs(layer.blobs[0].diff).sum() > 0


def test_convolution_two_bottoms_share_weights():
    text = conv_text("Convolution", "num_output: 2 kernel_size: 3").replace(
        'top: "y"', 'bottom: "x2" top: "y" top: "y2"')
    layer, bottom, top = build(text, [(1, 2, 5, 5), (1, 2, 5, 5)])
    y, y2 = run(layer, bottom, top)
    w, b = layer.blobs[0].data, layer.blobs[1].data
    geo = dict(stride=(1, 1), pad=(0, 0), dil=(1, 1), group=1)
    np.testing.assert_allclose(y2, naive_conv(bottom[1].data, w, b, **geo), rtol=1e-10)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("body, message", [
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", "not both"),
    ("num_output: 3 kernel_size: 3 group: 2", "group 2"),
    ("num_output: 2 kernel_size: 9", "not positive"),
    ("num_output: 2", "nonzero"),
])
def test_convolution_bad_parameters_name_the_layer(body, message):
    with pytest.raises(LayerError, match=message) as err:
        build(conv_text("Convolution", body), [(1, 4, 5, 5)])
    assert "layer 'c'" in str(err.value)


def test_convolution_rejects_three_spatial_axes():
    with pytest.raises(LayerError, match="2 spatial axes"):
        build(conv_text("Convolution", "num_output: 2 kernel_size: 3"), [(1, 2, 5, 5, 5)])


# ------------------------------------------------------------------ pooling

def pool_text(body: str, tops: int = 1) -> str:
    extra = ' top: "mask"' if tops == 2 else ""
    return f'name: "p" type: "Pooling" bottom: "x" top: "y"{extra} pooling_param {{ {body} }}'


POOL_CASES = [
    ("MAX", (3, 3), (2, 2), (0, 0), (2, 3, 7, 7)),
    ("MAX", (3, 3), (2, 2), (1, 1), (2, 2, 5, 5)),
    ("MAX", (2, 2), (2, 2), (0, 0), (2, 2, 6, 5)),
    ("MAX", (3, 2), (1, 2), (1, 1), (1, 2, 5, 6)),
    ("MAX", (3, 3), (2, 2), (2, 2), (1, 2, 4, 4)),   # last window clipped away
    ("AVE", (3, 3), (2, 2), (0, 0), (2, 3, 7, 7)),
    ("AVE", (3, 3), (2, 2), (1, 1), (2, 2, 5, 5)),
    ("AVE", (3, 3), (2, 2), (2, 2), (1, 2, 4, 4)),
    ("AVE", (2, 3), (2, 1), (1, 2), (1, 2, 6, 5)),
]


def pool_body(method, k, s, p):
    return (f"pool: {method} kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} "
            f"stride_w: {s[1]} pad_h: {p[0]} pad_w: {p[1]}")


@pytest.mark.parametrize("method, k, s, p, shape", POOL_CASES)
def test_pooling_matches_caffe_loops_and_gradients(method, k, s, p, shape):
    layer, bottom, top = build(pool_text(pool_body(method, k, s, p)), [shape], distinct=True)
    (y,) = run(layer, bottom, top)
    want, _ = naive_pool(bottom[0].data, method, k, s, p)
    assert y.shape == want.shape
    np.testing.assert_allclose(y, want, rtol=1e-12)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("h, k, s, p, out", [(5, 3, 2, 1, 3), (32, 3, 2, 0, 16), (4, 3, 2, 2, 3),
                                              (6, 2, 2, 1, 4), (7, 3, 2, 0, 3), (24, 2, 2, 0, 12)])
def test_pooling_output_size_rounds_up_and_clips(h, k, s, p, out):
    layer, bottom, top = build(pool_text(f"pool: MAX kernel_size: {k} stride: {s} pad: {p}"),
                               [(1, 1, h, h)])
    assert top[0].shape == (1, 1, out, out)


def test_max_pooling_ties_pick_the_first_in_scan_order_and_mask_top():
    layer, bottom, top = build(pool_text("pool: MAX kernel_size: 3 stride: 2", tops=2),
                               [(2, 3, 7, 7)])
    bottom[0].data[...] = np.round(bottom[0].data)  # many ties
    bottom[0].data[0, 0] = 0.0  # all-tie plane
    y, mask = run(layer, bottom, top)
    want, want_mask = naive_pool(bottom[0].data, "MAX", (3, 3), (2, 2), (0, 0))
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(mask, want_mask)
    top[0].diff[...] = np.random.default_rng(1).standard_normal(top[0].shape)
    layer.backward(top, [True], bottom)
    expect = np.zeros(bottom[0].shape)
    for idx in np.ndindex(*mask.shape):
        n, c = idx[:2]
        expect[n, c].flat[int(want_mask[idx])] += top[0].diff[idx]
    np.testing.assert_allclose(bottom[0].diff, expect, rtol=1e-12)


def test_average_pooling_divides_by_window_clipped_to_padded_image():
    layer, bottom, top = build(pool_text("pool: AVE kernel_size: 3 stride: 2 pad: 1"),
                               [(1, 1, 6, 6)])
    bottom[0].data[...] = 1.0
    (y,) = run(layer, bottom, top)
    # windows start at -1, 1, 3, 5: the first holds 2 image rows of 3 (the pad row counts),
    # the last is cut at height + pad = 7, so it holds 1 image row of 2
    per_axis = np.array([2 / 3, 1, 1, 1 / 2])
    np.testing.assert_allclose(y[0, 0], np.outer(per_axis, per_axis))


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_global_pooling(method):
    layer, bottom, top = build(pool_text(f"pool: {method} global_pooling: true"),
                               [(2, 3, 4, 5)], distinct=True)
    (y,) = run(layer, bottom, top)
    x = bottom[0].data
    want = x.max(axis=(2, 3)) if method == "MAX" else x.mean(axis=(2, 3))
    np.testing.assert_allclose(y.reshape(2, 3), want, rtol=1e-12)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("body, message", [
    ("pool: MAX global_pooling: true kernel_size: 2", "cannot be specified"),
    ("pool: MAX kernel_size: 2 kernel_h: 2 kernel_w: 2", "not both"),
    ("pool: MAX kernel_size: 2 pad: 2", "smaller than the kernel"),
    ("pool: STOCHASTIC kernel_size: 2", "STOCHASTIC"),
    ("pool: MAX kernel_size: 2 stride: 2 stride_h: 1 stride_w: 1", "stride"),
])
def test_pooling_bad_parameters(body, message):
    with pytest.raises(LayerError, match=message):
        build(pool_text(body), [(1, 1, 6, 6)])


def test_pooling_mask_top_only_for_max():
    with pytest.raises(LayerError, match="at most 1 top"):
        build(pool_text("pool: AVE kernel_size: 2", tops=2), [(1, 1, 4, 4)])


# ------------------------------------------------------------------ LRN

def lrn_text(body: str) -> str:
    return f'name: "n" type: "LRN" bottom: "x" top: "y" lrn_param {{ {body} }}'


@pytest.mark.parametrize("size, alpha, beta, k", [(5, 1.0, 0.75, 2.0), (3, 0.5, 0.6, 1.0),
                                                  (1, 2.0, 0.5, 1.5)])
def test_lrn_across_channels(size, alpha, beta, k):
    layer, bottom, top = build(lrn_text(f"local_size: {size} alpha: {alpha} beta: {beta} k: {k}"),
                               [(2, 7, 3, 2)])
    (y,) = run(layer, bottom, top)
    def f32(v):  # the proto fields are float: Caffe computes with the rounded values
        return float(np.float32(v))

    np.testing.assert_allclose(
        y, naive_lrn_across(bottom[0].data, size, f32(alpha), f32(beta), f32(k)), rtol=1e-12)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("size, alpha, beta", [(3, 1.0, 0.75), (5, 2.0, 0.3)])
def test_lrn_within_channel(size, alpha, beta):
    body = f"local_size: {size} alpha: {alpha} beta: {beta} k: 5 norm_region: WITHIN_CHANNEL"
    layer, bottom, top = build(lrn_text(body), [(2, 2, 5, 6)])
    (y,) = run(layer, bottom, top)
    np.testing.assert_allclose(
        y, naive_lrn_within(bottom[0].data, size, float(np.float32(alpha)),
                            float(np.float32(beta))), rtol=1e-12)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.skipif(not compiled.available(), reason="needs Numba (poseidon[fast])")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size, beta", [(1, 0.75), (3, 0.5), (5, 0.75), (7, 1.0)])
def test_lrn_compiled_equals_numpy(monkeypatch, dtype, size, beta):
    """The compiled ACROSS_CHANNELS form does NumPy's operations in NumPy's order: equal to
    the bit, signs of zeros included, forward and backward."""
    def pass_(numba):
        monkeypatch.setenv("POSEIDON_NUMBA", numba)
        layer, bottom, top = build(lrn_text(f"local_size: {size} alpha: 0.001 beta: {beta} k: 2"),
                                   [(2, 6, 5, 7)], dtype=dtype)
        bottom[0].data[...] *= 30
        bottom[0].data[0, 0, 0, :2] = [0.0, -0.0]
        (y,) = run(layer, bottom, top)
        top[0].diff[...] = np.random.default_rng(1).standard_normal(top[0].shape)
        top[0].diff[0, :, 0, 0] = 0
        layer.backward(top, [True], bottom)
        return y, bottom[0].diff.copy()

    for got, want in zip(pass_("1"), pass_("0")):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_lrn_defaults_and_even_size():
    layer, bottom, top = build(lrn_text(""), [(1, 6, 2, 2)])
    (y,) = run(layer, bottom, top)  # Caffe defaults: local_size 5, alpha 1, beta 0.75, k 1
    np.testing.assert_allclose(y, naive_lrn_across(bottom[0].data, 5, 1.0, 0.75, 1.0), rtol=1e-12)
    with pytest.raises(LayerError, match="odd"):
        build(lrn_text("local_size: 4"), [(1, 6, 2, 2)])


# ------------------------------------------------------------------ crop

def crop_text(body: str) -> str:
    return f'name: "cr" type: "Crop" bottom: "a" bottom: "b" top: "y" crop_param {{ {body} }}'


@pytest.mark.parametrize("body, want", [
    ("axis: 2 offset: 1 offset: 2", (slice(None), slice(None), slice(1, 4), slice(2, 5))),
    ("axis: 1 offset: 1", (slice(None), slice(1, 3), slice(1, 4), slice(1, 4))),
    ("axis: -2", (slice(None), slice(None), slice(0, 3), slice(0, 3))),
    ("", (slice(None), slice(None), slice(0, 3), slice(0, 3))),
])
def test_crop(body, want):
    layer, bottom, top = build(crop_text(body), [(2, 4, 5, 6), (2, 2, 3, 3)])
    (y,) = run(layer, bottom, top)
    np.testing.assert_array_equal(y, bottom[0].data[want])
    check_layer_gradients(layer, bottom, top, check_bottom=[0], check_params=False)


def test_crop_out_of_bounds():
    with pytest.raises(LayerError, match="out of bounds"):
        build(crop_text("axis: 2 offset: 3"), [(1, 1, 5, 5), (1, 1, 3, 3)])


# ------------------------------------------------------------------ the real Caffe

@pytest.mark.parametrize("net", ["lenet", "cifar10_quick"])
def test_vision_layers_match_real_caffe(net):
    """Each Convolution/Pooling layer of the oracle nets, fed Caffe's own blobs (float32).

    Where an in-place ReLU follows, Caffe's stored data is after the ReLU and the stored
    diff of its input after the ReLU's backward, so the same ReLU is applied here.
    """
    import json
    from tests.conftest import shared_path
    root = shared_path("fixtures", "oracle", "layers")
    arrays = np.load(root / f"{net}.npz")
    relu_blobs = {e["blob"] for e in json.loads((root / "manifest.json").read_text())
                  ["nets"][net]["in_place"] if e["type"] == "ReLU"}
    net_param = caffe_pb2.NetParameter()
    text_format.Parse((root / f"{net}.prototxt").read_text(), net_param)

    def close(got, want, what):
        scale = max(np.abs(want).max(), 1e-30)
        assert np.abs(got - want).max() <= 1e-4 * scale, f"{net} {what}"

    checked = 0
    for lp in net_param.layer:
        if lp.type not in ("Convolution", "Pooling"):
            continue
        layer = create_layer(lp, "TRAIN")
        (bname,), (tname,) = lp.bottom, lp.top
        bottom = [Blob(arrays[f"train/blob/{bname}/data"].shape, dtype=np.float32, xp=np)]
        top = [Blob((), dtype=np.float32, xp=np)]
        bottom[0].data[...] = arrays[f"train/blob/{bname}/data"]
        layer.setup(bottom, top)
        for i, p in enumerate(layer.blobs):
            p.data[...] = arrays[f"train/param/{lp.name}/{i}/init"]
        (y,) = run(layer, bottom, top)
        if tname in relu_blobs:
            y = np.maximum(y, 0)
        close(y, arrays[f"train/blob/{tname}/data"], f"{lp.name} top")
        top[0].diff[...] = arrays[f"train/blob/{tname}/diff"]
        layer.backward(top, [True], bottom)
        dx = bottom[0].diff
        if bname in relu_blobs:
            dx = dx * (bottom[0].data > 0)
        close(dx, arrays[f"train/blob/{bname}/diff"], f"{lp.name} bottom diff")
        for i, p in enumerate(layer.blobs):
            close(p.diff, arrays[f"train/param/{lp.name}/{i}/diff"], f"{lp.name} param {i}")
        checked += 1
    assert checked >= 4


# ------------------------------------------------------------------ compiled CPU kernels

def conv_geometry(c, h, w, kh, kw, sh, sw, ph, pw, dh, dw):
    return Geometry(c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, conv_out_size(h, kh, ph, sh, dh),
                      conv_out_size(w, kw, pw, sw, dw))


@pytest.mark.skipif(not compiled.available(), reason="needs Numba (poseidon[fast])")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geo", [(3, 2, 2, 1, 1, 0, 1, 2), (3, 3, 1, 1, 2, 2, 2, 2),
                                 (1, 1, 1, 1, 0, 0, 1, 1), (5, 5, 1, 1, 0, 0, 1, 1),
                                 (4, 4, 3, 3, 1, 2, 1, 1)])
def test_compiled_conv_kernels_equal_the_numpy_ones(dtype, geo):
    """im2col copies and col2im adds in Caffe's order in both forms: equal to the bit."""
    n, c, h, w = 3, 4, 9, 8
    g = conv_geometry(c, h, w, *geo)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    np.testing.assert_array_equal(compiled.im2col(x, g), K._im2col_cpu(x, g))
    cols = rng.standard_normal((g.col_rows, n * g.out_h * g.out_w)).astype(dtype)
    np.testing.assert_array_equal(compiled.col2im(cols, g, np.empty_like(x)),
                                  K._col2im_cpu(cols, g, n))


def pool_geometry(c: int, h: int, w: int, kh: int, kw: int, sh: int, sw: int, ph: int,
                  pw: int) -> Geometry:
    """A pooling window on (c, h, w) planes, Caffe's output size (ceil when padded)."""
    pad = bool(ph or pw)
    return Geometry(c, h, w, kh, kw, sh, sw, ph, pw, 1, 1, pool_out_size(h, kh, ph, sh, pad),
                    pool_out_size(w, kw, pw, sw, pad))


@pytest.mark.skipif(not compiled.available(), reason="needs Numba (poseidon[fast])")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geo", [(3, 3, 2, 2, 0, 0), (3, 2, 2, 1, 1, 1), (3, 3, 2, 2, 2, 2),
                                 (2, 2, 2, 2, 0, 0), (3, 3, 1, 1, 1, 1), (12, 11, 3, 4, 1, 2)])
def test_compiled_max_pool_forward_equals_the_numpy_one(dtype, geo):
    """Top and argmax equal, ties, NaN, -inf, -0.0 and +-FLT_MAX included, and windows past
    the image (ceil) and padding; a 12x11 window keeps its argmax in int16. Equal values: a
    window whose maximum is 0.0 and -0.0 keeps the first, as Caffe does, where NumPy's
    maximum may take either."""
    kh, kw = geo[:2]
    n, c, h, w = 2, 3, 13, 12
    g = pool_geometry(c, h, w, *geo)
    rng = np.random.default_rng(1)
    x = (np.round(rng.standard_normal((n, c, h, w)) * 2) / 2).astype(dtype)  # with ties
    big = np.finfo(dtype).max
    x.reshape(-1)[rng.choice(x.size, 40, replace=False)] = np.array(
        [np.nan, -np.inf, np.inf, -0.0, 0.0, -big, big, -1.0] * 5, dtype)
    x[1, 2] = -np.inf  # a plane of -inf: Caffe's -FLT_MAX floor
    x[0, 1, :2] = np.nan
    want_top, want_arg = P._max_pool_forward_cpu(x, g)
    got_top, got_arg = cpu_pool.max_pool_forward(x, g, want_arg.dtype)
    assert got_arg.dtype == want_arg.dtype == index_dtype(kh * kw)
    np.testing.assert_array_equal(got_arg, want_arg)
    np.testing.assert_array_equal(got_top, want_top)  # NaN in the same places
    first = np.take_along_axis(x.reshape(n, c, -1), (mask := P.max_pool_mask(got_arg, g)).clip(
        0, h * w - 1).reshape(n, c, -1), axis=-1).reshape(got_top.shape)
    inside = (mask >= 0) & (mask < h * w) & (got_top == 0)
    assert (np.signbit(got_top[inside]) == np.signbit(first[inside])).all()


@pytest.mark.skipif(not compiled.available(), reason="needs Numba (poseidon[fast])")
@pytest.mark.parametrize("geo", [(3, 3, 2, 2, 0, 0), (3, 2, 2, 1, 1, 1), (3, 3, 2, 2, 2, 2),
                                 (2, 2, 2, 2, 0, 0), (3, 3, 1, 1, 1, 1)])
def test_compiled_max_pool_backward_equals_the_numpy_one(geo):
    """Same routing; the sums of overlapping windows differ only in order (Caffe's here)."""
    kh, kw, sh, sw = geo[:4]
    n, c, h, w = 2, 3, 9, 10
    g = pool_geometry(c, h, w, *geo)
    rng = np.random.default_rng(0)
    x = np.round(rng.standard_normal((n, c, h, w)) * 2).astype(np.float32) / 2  # with ties
    _, arg = P.max_pool_forward(x, g)
    dy = rng.standard_normal(arg.shape).astype(np.float32)
    want, got = np.empty_like(x), np.empty_like(x)
    P._max_pool_backward_cpu(dy, arg, g, want)
    cpu_pool.max_pool_backward(dy, arg, g, got)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if kh <= sh and kw <= sw:  # no overlap: one term per input, so equal to the bit
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not compiled.available(), reason="needs Numba (poseidon[fast])")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "apart"])
def test_compiled_relu_equals_the_numpy_one(dtype, in_place):
    """Forward and gradient equal NumPy's to the bit; the compiled forward keeps a -0.0 input
    as Caffe's std::max(x, 0) does (NumPy's maximum gives either zero), and NaN passes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 7)).astype(dtype)
    x.flat[:4] = [-0.0, np.nan, 0.0, -np.inf]
    dy = rng.standard_normal(x.shape).astype(dtype)
    y = x.copy() if in_place else np.empty_like(x)
    assert compiled.relu(y if in_place else x, y)
    want = np.maximum(x, 0)
    np.testing.assert_array_equal(y, want)
    assert np.signbit(y.flat[0]) and np.isnan(y.flat[1]) and y.flat[3] == 0
    ok = ~np.isnan(y) & (y != 0)
    assert np.array_equal(y[ok].view(np.uint8), want[ok].view(np.uint8))
    dx = dy.copy() if in_place else np.empty_like(dy)
    assert compiled.relu_gradient(y, dx if in_place else dy, dx)
    want = dy * (y > 0)  # a masked negative gradient is -0.0, as Caffe's product
    assert np.array_equal(dx.view(np.uint8), want.view(np.uint8))
    assert not compiled.relu(x, y.astype(np.float16))  # not one dtype: NumPy's form serves


# ------------------------------------------------------------------ GPU kernels

_EMULATION_PRELUDE = """#define __global__
struct D3 { unsigned x; }; static D3 blockIdx = {0}, blockDim = {1}, threadIdx = {0}, gridDim = {1};
template <class A> A min(A a, A b) { return a < b ? a : b; }
template <class A> A max(A a, A b) { return a < b ? b : a; }
#define T double
#define FLT_MAX_T 1.7976931348623158e+308
"""


@pytest.fixture(scope="module")
def cuda_source_on_cpu(tmp_path_factory):
    """The CuPy kernels' CUDA source compiled as C++ for one CPU thread (the grid-stride
    loops then cover every element), so the GPU index arithmetic is checked without a GPU."""
    import ctypes
    import shutil
    import subprocess
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ to run the CUDA kernel source on the CPU")
    work = tmp_path_factory.mktemp("kernels")
    (work / "k.cpp").write_text(_EMULATION_PRELUDE + cuda.SOURCE)
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(work / "k.so"),
                    str(work / "k.cpp")], check=True)
    return ctypes.CDLL(str(work / "k.so"))


def _c_args(*values):
    """Arrays as pointers, np.int64 as long long (the element counts), ints as int."""
    import ctypes
    return [v.ctypes.data_as(ctypes.c_void_p) if isinstance(v, np.ndarray)
            else ctypes.c_longlong(int(v)) if isinstance(v, np.int64) else ctypes.c_int(v)
            for v in values]


@pytest.mark.parametrize("geo", [(3, 2, 2, 1, 1, 0, 1, 2), (3, 3, 1, 1, 2, 2, 2, 2),
                                 (1, 1, 1, 1, 0, 0, 1, 1)])
def test_gpu_conv_kernels_on_cpu(cuda_source_on_cpu, geo):
    kh, kw, sh, sw, ph, pw, dh, dw = geo
    n, c, h, w = 2, 3, 7, 6
    g = conv_geometry(c, h, w, *geo)
    dims = (n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, g.out_h, g.out_w)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w))
    want = K.im2col(x, g)
    col = np.empty_like(want)
    cuda_source_on_cpu.im2col(*_c_args(x, col, np.int64(col.size), *dims))
    np.testing.assert_array_equal(col, want)
    cols = rng.standard_normal(want.shape)
    im = np.empty_like(x)
    cuda_source_on_cpu.col2im(*_c_args(cols, im, np.int64(im.size), *dims))
    np.testing.assert_allclose(im, K.col2im(cols, g, n), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("geo", [(3, 3, 2, 2, 0, 0), (3, 2, 2, 1, 1, 1), (3, 3, 2, 2, 2, 2),
                                 (2, 2, 2, 2, 0, 0)])
def test_gpu_pool_kernels_on_cpu(cuda_source_on_cpu, geo):
    n, c, h, w = 2, 3, 6, 7
    g = pool_geometry(c, h, w, *geo)
    dims = (c, h, w, *geo, g.out_h, g.out_w)
    rng = np.random.default_rng(0)
    x = np.round(rng.standard_normal((n, c, h, w)) * 2) / 2  # ties: first in scan order wins
    lib = cuda_source_on_cpu
    top, arg = P.max_pool_forward(x, g)
    gtop, garg = np.empty(top.shape), np.empty(top.shape, dtype=np.int32)
    lib.max_pool_forward(*_c_args(x, gtop, garg, np.int64(gtop.size), *dims))
    np.testing.assert_array_equal(gtop, top)
    np.testing.assert_array_equal(garg, P.max_pool_mask(arg, g))
    dy = rng.standard_normal(top.shape)
    dx, gdx = np.empty_like(x), np.empty_like(x)
    P.max_pool_backward(dy, arg, g, dx)
    lib.max_pool_backward(*_c_args(dy, garg, gdx, np.int64(gdx.size), *dims))
    np.testing.assert_allclose(gdx, dx, rtol=1e-12, atol=1e-12)
    gave = np.empty(top.shape)
    lib.ave_pool_forward(*_c_args(x, gave, np.int64(gave.size), *dims))
    np.testing.assert_allclose(gave, P.ave_pool_forward(x, g), rtol=1e-12)
    P.ave_pool_backward(dy, g, dx)
    lib.ave_pool_backward(*_c_args(dy, gdx, np.int64(gdx.size), *dims))
    np.testing.assert_allclose(gdx, dx, rtol=1e-12, atol=1e-12)


gpu = pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")


@gpu
@pytest.mark.parametrize("text, shape", [
    (conv_text("Convolution", "num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2"),
     (3, 4, 9, 8)),
    (conv_text("Convolution", "num_output: 3 kernel_size: 3 dilation: 2 pad: 1"), (2, 2, 9, 9)),
    (conv_text("Deconvolution", "num_output: 4 kernel_size: 4 pad: 1 stride: 2 group: 2"),
     (2, 4, 5, 5)),
    (pool_text("pool: MAX kernel_size: 3 stride: 2 pad: 1", tops=2), (2, 3, 9, 9)),
    (pool_text("pool: AVE kernel_size: 3 stride: 2 pad: 1"), (2, 3, 9, 9)),
    (pool_text("pool: MAX global_pooling: true"), (2, 3, 5, 4)),
    (lrn_text("local_size: 5 alpha: 1 beta: 0.75 k: 2"), (2, 7, 4, 4)),
    (lrn_text("local_size: 3 alpha: 1 beta: 0.75 norm_region: WITHIN_CHANNEL"), (2, 2, 5, 5)),
])
def test_gpu_matches_cpu(text, shape):
    import cupy
    layer, bottom, top = build(text, [shape], distinct=True)
    out_cpu = run(layer, bottom, top)
    for t in top:
        t.diff[...] = np.random.default_rng(2).standard_normal(t.shape)
    layer.backward(top, [True], bottom)
    grads_cpu = [bottom[0].diff.copy()] + [p.diff.copy() for p in layer.blobs]
    for blob in [*bottom, *top, *layer.blobs]:
        blob.data, blob.diff = cupy.asarray(blob.data), cupy.asarray(blob.diff)
    for p in layer.blobs:
        p.diff[...] = 0
    out_gpu = run(layer, bottom, top)
    layer.backward(top, [True], bottom)
    for got, want in zip(out_gpu, out_cpu):
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-10, atol=1e-10)
    grads_gpu = [bottom[0].diff] + [p.diff for p in layer.blobs]
    for got, want in zip(grads_gpu, grads_cpu):
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-10, atol=1e-10)
