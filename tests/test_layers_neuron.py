"""Neuron layers: values, finite-difference gradients (float64) and in-place equivalence."""
from __future__ import annotations

import numpy as np
import pytest

from engine import backend
from engine.blob import Blob
from engine.layers import LayerError
from tests.gradcheck import blob_of as blob, check_layer_gradients, make_layer as make






def away_from_zero(shape: tuple[int, ...], seed: int = 1, low: float = 0.05) -> np.ndarray:
    """Random float64 values with |x| >= low, so kinks are never straddled by a difference."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(low, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return x


SHAPE = (2, 3, 4, 5)

# layer text, input generator: differentiable neuron layers checked by finite differences
GRAD_CASES = [
    ('type:"ReLU"', away_from_zero),
    ('type:"ReLU" relu_param{negative_slope:0.1}', away_from_zero),
    ('type:"ReLU" relu_param{negative_slope:-0.3}', away_from_zero),
    ('type:"ELU"', away_from_zero),
    ('type:"ELU" elu_param{alpha:0.5}', away_from_zero),
    ('type:"Sigmoid"', away_from_zero),
    ('type:"TanH"', away_from_zero),
    ('type:"AbsVal"', away_from_zero),
    ('type:"Power" power_param{power:2 scale:0.5 shift:1}', away_from_zero),
    ('type:"Power" power_param{power:3 scale:-0.7}', away_from_zero),
    ('type:"Power" power_param{power:0.5 scale:0.3 shift:1}', away_from_zero),
    ('type:"Power" power_param{power:1 scale:2 shift:-1}', away_from_zero),
    ('type:"Power" power_param{power:-1.5 scale:1 shift:3}', away_from_zero),
    ('type:"Exp"', away_from_zero),
    ('type:"Exp" exp_param{base:2 scale:0.5 shift:1}', away_from_zero),
    ('type:"Log"', lambda s: np.abs(away_from_zero(s)) + 0.1),
    ('type:"Log" log_param{base:10 scale:2 shift:0.5}', lambda s: np.abs(away_from_zero(s))),
    ('type:"BNLL"', away_from_zero),
    ('type:"PReLU"', away_from_zero),
    ('type:"PReLU" prelu_param{channel_shared:true}', away_from_zero),
    ('type:"PReLU" prelu_param{filler{type:"uniform" min:-0.5 max:0.5}}', away_from_zero),
]


@pytest.mark.parametrize("text,gen", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients(text: str, gen) -> None:
    backend.seed(5)
    bottom, top = [blob(gen(SHAPE))], [Blob(dtype=np.float64)]
    layer = make('name:"n" ' + text, bottom, top)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("text,gen", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_in_place_matches_out_of_place(text: str, gen) -> None:
    if "AbsVal" in text:
        pytest.skip("Caffe forbids AbsVal in place")
    x = gen(SHAPE)
    dy = np.random.default_rng(9).standard_normal(SHAPE)
    results = []
    for in_place in (False, True):
        backend.seed(5)
        b = blob(x.copy())
        t = b if in_place else Blob(dtype=np.float64)
        layer = make('name:"n" ' + text, [b], [t])
        layer.forward([b], [t])
        y = t.data.copy()
        t.diff[...] = dy
        for p in layer.blobs:
            p.diff[...] = 0
        layer.backward([t], [True], [b])
        results.append((y, b.diff.copy(), [p.diff.copy() for p in layer.blobs]))
    (y0, dx0, p0), (y1, dx1, p1) = results
    np.testing.assert_allclose(y1, y0, rtol=1e-12)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-12)
    for a, b in zip(p0, p1):
        np.testing.assert_allclose(b, a, rtol=1e-12)


def forward_values(text: str, x: np.ndarray, phase: str = "TRAIN") -> np.ndarray:
    bottom, top = [blob(x)], [Blob(dtype=x.dtype)]
    layer = make('name:"n" ' + text, bottom, top, phase)
    layer.forward(bottom, top)
    assert top[0].data.dtype == x.dtype
    return top[0].data


def test_forward_values_float32() -> None:
    x = np.array([[-2.0, -0.5, 0.0, 0.5, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(forward_values('type:"ReLU"', x), [[0, 0, 0, 0.5, 2]])
    np.testing.assert_allclose(forward_values('type:"ReLU" relu_param{negative_slope:0.1}', x),
                               [[-0.2, -0.05, 0, 0.5, 2]], rtol=1e-6)
    np.testing.assert_allclose(forward_values('type:"ELU" elu_param{alpha:2}', x),
                               [[2 * np.expm1(-2), 2 * np.expm1(-0.5), 0, 0.5, 2]], rtol=1e-6)
    np.testing.assert_allclose(forward_values('type:"Sigmoid"', x), 1 / (1 + np.exp(-x)),
                               rtol=1e-6)
    np.testing.assert_allclose(forward_values('type:"AbsVal"', x), np.abs(x))
    np.testing.assert_allclose(forward_values('type:"Power" power_param{power:2 scale:2 shift:1}',
                                              x), (1 + 2 * x) ** 2, rtol=1e-6)
    np.testing.assert_allclose(forward_values('type:"Power" power_param{power:0 scale:3}', x), 1)
    np.testing.assert_allclose(forward_values('type:"Exp" exp_param{base:2 shift:1}', x),
                               2.0 ** (1 + x), rtol=1e-6)
    np.testing.assert_allclose(forward_values('type:"Log" log_param{base:2 shift:3}', x),
                               np.log2(3 + x), rtol=1e-6)
    np.testing.assert_allclose(forward_values('type:"BNLL"', x), np.log1p(np.exp(x)), rtol=1e-6)
    np.testing.assert_allclose(forward_values('type:"PReLU"', x.reshape(1, 5, 1)).ravel(),
                               [-0.5, -0.125, 0, 0.5, 2])


def test_threshold_values_and_no_gradient() -> None:
    x = np.array([[-1.0, 0.2, 0.3, 0.31, 5.0]], dtype=np.float32)
    bottom, top = [blob(x)], [Blob()]
    layer = make('name:"t" type:"Threshold" threshold_param{threshold:0.3}', bottom, top)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, [[0, 0, 0, 1, 1]])
    layer.backward(top, [False], bottom)  # nothing asked, nothing to do
    with pytest.raises(LayerError, match="no gradient"):
        layer.backward(top, [True], bottom)


def test_prelu_param_shapes_and_default_filler() -> None:
    x = away_from_zero((2, 3, 4))
    layer = make('name:"p" type:"PReLU"', [blob(x)], [Blob(dtype=np.float64)])
    assert layer.blobs[0].shape == (3,) and np.all(layer.blobs[0].data == 0.25)
    layer = make('name:"p" type:"PReLU" prelu_param{channel_shared:true}', [blob(x)],
                 [Blob(dtype=np.float64)])
    assert layer.blobs[0].shape == () and layer.blobs[0].data == 0.25
    assert layer.param_propagate_down == [True]


def test_prelu_rejects_1d_bottom() -> None:
    with pytest.raises(LayerError, match="at least 2 axes"):
        make('name:"p" type:"PReLU"', [blob(np.ones(4))], [Blob(dtype=np.float64)])


def test_absval_rejects_in_place() -> None:
    b = blob(np.ones((2, 2)))
    with pytest.raises(LayerError, match="in-place"):
        make('name:"a" type:"AbsVal"', [b], [b])


def test_exp_rejects_bad_base() -> None:
    with pytest.raises(LayerError, match="base"):
        make('name:"e" type:"Exp" exp_param{base:-2}', [blob(np.ones(3))], [Blob()])


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_train(in_place: bool) -> None:
    backend.seed(3)
    x = np.random.default_rng(0).uniform(1, 2, (50, 40, 10)).astype(np.float32)
    b = blob(x.copy())
    t = b if in_place else Blob()
    layer = make('name:"d" type:"Dropout" dropout_param{dropout_ratio:0.3}', [b], [t])
    layer.forward([b], [t])
    y = t.data.copy()
    assert y.dtype == np.float32
    dropped = y == 0
    assert abs(dropped.mean() - 0.3) < 0.01
    np.testing.assert_allclose(y[~dropped], x[~dropped] / 0.7, rtol=1e-6)
    dy = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    t.diff[...] = dy
    layer.backward([t], [True], [b])
    np.testing.assert_array_equal(b.diff[dropped], 0)  # the same mask as forward
    np.testing.assert_allclose(b.diff[~dropped], dy[~dropped] / 0.7, rtol=1e-6)
    # a second forward draws a new mask
    b.data[...] = x
    layer.forward([b], [t])
    assert not np.array_equal(t.data == 0, dropped)


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_test_is_identity(in_place: bool) -> None:
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    b = blob(x.copy())
    t = b if in_place else Blob()
    layer = make('name:"d" type:"Dropout"', [b], [t], phase="TEST")
    layer.forward([b], [t])
    np.testing.assert_array_equal(t.data, x)
    t.diff[...] = 2.0
    layer.backward([t], [True], [b])
    np.testing.assert_array_equal(b.diff, 2.0)


@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("text,gen", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gpu_matches_cpu(text: str, gen) -> None:
    import cupy

    x = gen(SHAPE)
    dy = np.random.default_rng(9).standard_normal(SHAPE)
    results = []
    for xp in (np, cupy):
        backend.seed(5)
        b = Blob(SHAPE, dtype=np.float64, xp=xp)
        b.data[...] = xp.asarray(x)
        t = Blob(dtype=np.float64, xp=xp)
        layer = make('name:"n" ' + text, [b], [t])
        layer.forward([b], [t])
        t.diff[...] = xp.asarray(dy)
        layer.backward([t], [True], [b])
        results.append([backend.to_numpy(a) for a in (t.data, b.diff)]
                       + [backend.to_numpy(p.diff) for p in layer.blobs])
    for a, g in zip(*results):
        np.testing.assert_allclose(g, a, rtol=1e-10, atol=1e-12)
