"""Convolution by Winograd's F(2x2, 3x3) against Caffe's im2col convolution (`engine: CAFFE`).

In float64 the two algorithms differ only by rounding (1e-15), so a wrong transform, tile,
pad or group offset shows as an O(1) difference; in float32 the bound is derived from the
rounding of the transforms (below). The backward passes must be the forward's gradients:
the adjoint identity <dy, conv(x, w)> = <dx, x> and = <dw, w> holds to float64 rounding.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.blob import Blob
from engine.kernels import cpu as compiled
from engine.layers import winograd
from tests.gradcheck import check_layer_gradients, make_layer

pytestmark = pytest.mark.skipif(not compiled.available(), reason="needs Numba (poseidon[fast])")

#: (n, C, K, H, W, pad, group): several chunks with a short last one (the first), odd maps
#: (a half tile at the bottom and right), pad 0 and 2, groups, more tiles than images and
#: the reverse
SHAPES = [(32, 32, 64, 8, 8, 1, 1), (8, 16, 8, 7, 5, 1, 1), (8, 32, 16, 6, 9, 0, 2),
          (9, 16, 16, 5, 5, 2, 1), (8, 32, 12, 11, 3, 1, 2), (12, 16, 16, 3, 3, 0, 1)]


def _conv(n, c, k, h, w, pad, group, engine="DEFAULT", dtype=np.float64, seed=0):
    text = (f'name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param {{ '
            f'num_output: {k} kernel_size: 3 pad: {pad} group: {group} engine: {engine} '
            f'weight_filler {{ type: "gaussian" std: 0.3 }} bias_filler {{ type: "gaussian" }} }}')
    rng = np.random.default_rng(seed)
    bottom = [Blob((n, c, h, w), dtype=dtype, xp=np)]
    bottom[0].data[...] = rng.standard_normal(bottom[0].shape)
    top = [Blob((), dtype=dtype, xp=np)]
    layer = make_layer(text, bottom, top, "TRAIN")
    layer.reshape(bottom, top)
    return layer, bottom, top


def _run(layer, bottom, top, dy):
    layer.forward(bottom, top)
    top[0].diff[...] = dy
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, [True], bottom)
    return top[0].data.copy(), bottom[0].diff.copy(), [p.diff.copy() for p in layer.blobs]


def _pair(shape, dtype, ref_dtype=None):
    """(Winograd's, im2col's) forward and gradients of one layer on the same inputs and
    weights, im2col's in ``ref_dtype`` (default: the same)."""
    ours, bottom, top = _conv(*shape, dtype=dtype)
    ref, rbottom, rtop = _conv(*shape, engine="CAFFE", dtype=ref_dtype or dtype)
    assert isinstance(ours.plan, winograd.Plan) and ref.plan is None
    for p, q in zip(ref.blobs, ours.blobs):
        p.data[...] = q.data
    rbottom[0].data[...] = bottom[0].data
    dy = np.random.default_rng(1).standard_normal(top[0].shape)
    return _run(ours, bottom, top, dy), _run(ref, rbottom, rtop, dy)


@pytest.mark.parametrize("shape", SHAPES)
def test_equals_im2col_in_float64(shape):
    (y, dx, (dw, db)), (ry, rdx, (rdw, rdb)) = _pair(shape, np.float64)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())
    np.testing.assert_array_equal(db, rdb)


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_within_its_rounding(shape):
    """Bound: each output is a sum of 9*C/group products, computed by im2col with its own
    float32 rounding and by Winograd with the transforms' extra adds (at most 4 per value,
    scaled by G's 1/2 entries); both stay within ~1e-6 of the float64 result relative to the
    largest value (measured 2e-7 to 7e-7 on these shapes). 1e-5 holds for any BLAS blocking;
    an indexing mistake gives O(1)."""
    (y, dx, (dw, _)), (ry, rdx, (rdw, _)) = _pair(shape, np.float32, np.float64)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_finite_differences(shape):
    layer, bottom, top = _conv(*shape)
    assert isinstance(layer.plan, winograd.Plan)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("engine, kernel, stride, channels, images, ok", [
    ("DEFAULT", 3, 1, 16, 8, True),
    ("CAFFE", 3, 1, 16, 8, False),       # Caffe's own algorithm on request
    ("DEFAULT", 3, 1, 3, 8, False),      # too few input channels to pay for the transforms
    ("DEFAULT", 3, 1, 16, 4, False),     # too few images for the transforms' inner loops
    ("DEFAULT", 3, 2, 16, 8, False),     # stride 2
    ("DEFAULT", 5, 1, 16, 8, False),     # not 3x3
])
def test_chosen_only_where_it_applies(engine, kernel, stride, channels, images, ok):
    text = (f'name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param {{ '
            f'num_output: 8 kernel_size: {kernel} stride: {stride} pad: 1 engine: {engine} }}')
    bottom, top = [Blob((images, channels, 9, 9), dtype=np.float32, xp=np)], [Blob((), xp=np)]
    layer = make_layer(text, bottom, top, "TRAIN")
    layer.reshape(bottom, top)
    assert isinstance(layer.plan, winograd.Plan) == ok


def test_not_without_numba(monkeypatch):
    monkeypatch.setenv("POSEIDON_NUMBA", "0")
    layer, _, _ = _conv(8, 16, 8, 6, 6, 1, 1)
    assert layer.plan is None


def test_plan_follows_a_reshape():
    """A new batch size or map size after a reshape gets a plan of its own."""
    layer, bottom, top = _conv(8, 16, 8, 6, 6, 1, 1)
    bottom[0].reshape((11, 16, 10, 7))
    bottom[0].data[...] = np.random.default_rng(2).standard_normal(bottom[0].shape)
    layer.reshape(bottom, top)
    assert isinstance(layer.plan, winograd.Plan)
    ref, rbottom, rtop = _conv(11, 16, 8, 10, 7, 1, 1, engine="CAFFE")
    for p, q in zip(ref.blobs, layer.blobs):
        p.data[...] = q.data
    rbottom[0].data[...] = bottom[0].data
    layer.forward(bottom, top)
    ref.forward(rbottom, rtop)
    assert top[0].shape == (11, 8, 10, 7)
    np.testing.assert_allclose(top[0].data, rtop[0].data, rtol=0, atol=1e-12)


def test_filter_transform_is_lavins():
    """G g G^T of a delta filter at the centre is G's middle column's outer product."""
    w = np.zeros((1, 1, 3, 3))
    w[0, 0, 1, 1] = 1
    u = winograd.filters(w, 1).reshape(4, 4)
    col = np.array([0, .5, -.5, 0])
    np.testing.assert_array_equal(u, np.outer(col, col))
