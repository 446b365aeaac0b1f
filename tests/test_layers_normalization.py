"""BatchNorm, Scale and Bias: Caffe's running statistics, gradients, in-place use."""
from __future__ import annotations

import numpy as np
import pytest

from engine import backend
from engine.blob import Blob
from engine.layers import LayerError
from tests.gradcheck import blob_of as blob, check_layer_gradients, make_layer as make






def rand(shape: tuple[int, ...], seed: int = 0, dtype=np.float64) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- BatchNorm
def test_batchnorm_gradient_batch_mode() -> None:
    bottom, top = [blob(rand((3, 2, 3, 2)) * 2 + 1)], [Blob(dtype=np.float64)]
    layer = make('name:"bn" type:"BatchNorm"', bottom, top)
    check_layer_gradients(layer, bottom, top, check_params=False)


def test_batchnorm_gradient_global_stats() -> None:
    bottom, top = [blob(rand((3, 2, 3)))], [Blob(dtype=np.float64)]
    layer = make('name:"bn" type:"BatchNorm" batch_norm_param{use_global_stats:true}',
                 bottom, top)
    layer.blobs[0].data[...] = [0.4, -1.0]
    layer.blobs[1].data[...] = [2.0, 0.5]
    layer.blobs[2].data[...] = 2.0
    check_layer_gradients(layer, bottom, top, check_params=False)


def test_batchnorm_running_statistics_two_forwards() -> None:
    x1, x2 = rand((4, 3, 2, 5), 1, np.float32), rand((4, 3, 2, 5), 2, np.float32) * 3 + 1
    bottom, top = [blob(x1)], [Blob()]
    layer = make('name:"bn" type:"BatchNorm" batch_norm_param{moving_average_fraction:0.9}',
                 bottom, top)
    assert layer.use_global_stats is False
    assert layer.param_propagate_down == [False, False, False]
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,)]
    assert [s.lr_mult for s in layer.param.param] == [0, 0, 0]  # Caffe masks them in setup
    layer.forward(bottom, top)
    bottom[0].data[...] = x2
    layer.forward(bottom, top)
    m = x1.size // 3
    mean = lambda x: x.mean(axis=(0, 2, 3), dtype=np.float64)  # noqa: E731
    var = lambda x: x.var(axis=(0, 2, 3), dtype=np.float64)  # noqa: E731
    np.testing.assert_allclose(layer.blobs[2].data, [0.9 * 1 + 1], rtol=1e-6)
    np.testing.assert_allclose(layer.blobs[0].data, 0.9 * mean(x1) + mean(x2), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(layer.blobs[1].data,
                               (0.9 * var(x1) + var(x2)) * m / (m - 1), rtol=1e-5)
    # the output uses the batch's biased variance
    expected = (x2 - mean(x2).reshape(1, 3, 1, 1)) / np.sqrt(var(x2).reshape(1, 3, 1, 1) + 1e-5)
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-4, atol=1e-5)
    # no gradient ever reaches the statistics
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert all(np.all(b.diff == 0) for b in layer.blobs)


def test_batchnorm_global_stats_output() -> None:
    x = rand((2, 2, 3), 3, np.float32)
    bottom, top = [blob(x)], [Blob()]
    layer = make('name:"bn" type:"BatchNorm" batch_norm_param{eps:0.001}', bottom, top,
                 phase="TEST")
    assert layer.use_global_stats is True
    layer.blobs[0].data[...] = [1.0, -2.0]
    layer.blobs[1].data[...] = [4.0, 0.5]
    layer.blobs[2].data[...] = 2.0
    layer.forward(bottom, top)
    mean = np.array([0.5, -1.0]).reshape(1, 2, 1)
    var = np.array([2.0, 0.25]).reshape(1, 2, 1)
    np.testing.assert_allclose(top[0].data, (x - mean) / np.sqrt(var + 1e-3), rtol=1e-5)
    assert layer.blobs[2].data[0] == 2.0  # statistics untouched
    # a zero scale factor means "no statistics yet": mean 0, variance 0
    layer.blobs[2].data[...] = 0
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, x / np.sqrt(1e-3), rtol=1e-5)


def test_batchnorm_in_place_matches() -> None:
    x, dy = rand((3, 4, 5), 4), rand((3, 4, 5), 5)
    outs = []
    for in_place in (False, True):
        b = blob(x.copy())
        t = b if in_place else Blob(dtype=np.float64)
        layer = make('name:"bn" type:"BatchNorm"', [b], [t])
        layer.forward([b], [t])
        y = t.data.copy()
        t.data[...] = 123.0  # a later in-place layer clobbering the top must not matter
        t.diff[...] = dy
        layer.backward([t], [True], [b])
        outs.append((y, b.diff.copy(), layer.blobs[0].data.copy()))
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a, rtol=1e-12)


def test_batchnorm_rejects_learned_statistics() -> None:
    with pytest.raises(LayerError, match="lr_mult"):
        make('name:"bn" type:"BatchNorm" param{lr_mult:0} param{lr_mult:1}',
             [blob(rand((2, 3)))], [Blob(dtype=np.float64)])


# ---------------------------------------------------------------- Scale / Bias
SCALE_CASES = [
    # text, bottom shapes
    ('type:"Scale" scale_param{filler{type:"gaussian"}}', [(2, 3, 4)]),
    ('type:"Scale" scale_param{filler{type:"gaussian"} bias_term:true '
     'bias_filler{type:"gaussian"}}', [(2, 3, 4)]),
    ('type:"Scale" scale_param{axis:0 num_axes:2 filler{type:"gaussian"}}', [(2, 3, 4)]),
    ('type:"Scale" scale_param{axis:-1 num_axes:-1 filler{type:"gaussian"}}', [(2, 3, 4)]),
    ('type:"Scale" scale_param{num_axes:0 filler{type:"gaussian"} bias_term:true}', [(2, 3, 4)]),
    ('type:"Scale"', [(2, 3, 4), (3,)]),
    ('type:"Scale" scale_param{axis:0}', [(2, 3, 4), (2, 3)]),
    ('type:"Scale" scale_param{bias_term:true bias_filler{type:"gaussian"}}', [(2, 3, 4), (3, 4)]),
    ('type:"Bias" bias_param{filler{type:"gaussian"}}', [(2, 3, 4)]),
    ('type:"Bias" bias_param{axis:0 num_axes:-1 filler{type:"gaussian"}}', [(2, 3, 4)]),
    ('type:"Bias"', [(2, 3, 4), (3, 4)]),
    ('type:"Bias" bias_param{axis:0}', [(2, 3, 4), (2,)]),
]


def scale_blobs(shapes: list[tuple[int, ...]]) -> list[Blob]:
    return [blob(rand(s, i + 10)) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("text,shapes", SCALE_CASES, ids=[c[0] for c in SCALE_CASES])
def test_scale_bias_gradients(text: str, shapes) -> None:
    bottom, top = scale_blobs(shapes), [Blob(dtype=np.float64)]
    layer = make('name:"s" ' + text, bottom, top)
    check_layer_gradients(layer, bottom, top)


@pytest.mark.parametrize("text,shapes", SCALE_CASES, ids=[c[0] for c in SCALE_CASES])
def test_scale_bias_in_place_matches(text: str, shapes) -> None:
    dy = rand(shapes[0], 99)
    outs = []
    for in_place in (False, True):
        bottom = scale_blobs(shapes)
        top = [bottom[0] if in_place else Blob(dtype=np.float64)]
        layer = make('name:"s" ' + text, bottom, top)
        for p in layer.blobs:  # same parameters both times
            p.data[...] = rand(p.shape, 7)
        layer.forward(bottom, top)
        y = top[0].data.copy()
        top[0].diff[...] = dy
        layer.backward(top, [True] * len(bottom), bottom)
        outs.append([y] + [b.diff.copy() for b in bottom] + [p.diff.copy() for p in layer.blobs])
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a, rtol=1e-12)


def test_scale_values_and_defaults() -> None:
    x = rand((2, 3, 2), 1, np.float32)
    bottom, top = [blob(x)], [Blob()]
    layer = make('name:"s" type:"Scale" scale_param{bias_term:true}', bottom, top)
    assert [p.shape for p in layer.blobs] == [(3,), (3,)]
    assert np.all(layer.blobs[0].data == 1) and np.all(layer.blobs[1].data == 0)
    layer.blobs[0].data[...] = [1, 2, 3]
    layer.blobs[1].data[...] = [0.5, 0, -1]
    layer.forward(bottom, top)
    expected = x * np.array([1, 2, 3]).reshape(1, 3, 1) + np.array([0.5, 0, -1]).reshape(1, 3, 1)
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-6)
    assert top[0].data.dtype == np.float32


def test_scale_param_gradients_accumulate() -> None:
    bottom, top = [blob(rand((2, 3)))], [Blob(dtype=np.float64)]
    layer = make('name:"s" type:"Scale" scale_param{bias_term:true}', bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    first = [p.diff.copy() for p in layer.blobs]
    layer.backward(top, [True], bottom)
    for p, f in zip(layer.blobs, first):
        np.testing.assert_allclose(p.diff, 2 * f)


def test_scale_shape_mismatch_names_layer() -> None:
    with pytest.raises(LayerError, match="'s'.*does not match"):
        make('name:"s" type:"Scale"', scale_blobs([(2, 3, 4), (4,)]), [Blob(dtype=np.float64)])


@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("text,shapes", SCALE_CASES + [('type:"BatchNorm"', [(3, 4, 5)])],
                         ids=[c[0] for c in SCALE_CASES] + ["BatchNorm"])
def test_gpu_matches_cpu(text: str, shapes) -> None:
    import cupy

    dy = rand(shapes[0], 99)
    results = []
    for xp in (np, cupy):
        backend.seed(5)
        bottom = []
        for b in scale_blobs(shapes):
            g = Blob(b.shape, dtype=np.float64, xp=xp)
            g.data[...] = xp.asarray(b.data)
            bottom.append(g)
        top = [Blob(dtype=np.float64, xp=xp)]
        layer = make('name:"s" ' + text, bottom, top)
        layer.forward(bottom, top)
        top[0].diff[...] = xp.asarray(dy)
        layer.backward(top, [True] * len(bottom), bottom)
        results.append([backend.to_numpy(a) for a in [top[0].data] + [b.diff for b in bottom]
                        + [p.data for p in layer.blobs] + [p.diff for p in layer.blobs]])
    for a, g in zip(*results):
        np.testing.assert_allclose(g, a, rtol=1e-10, atol=1e-12)
