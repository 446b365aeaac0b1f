"""Fillers: Caffe's distributions, bounds by fan, and exact bilinear values."""
from __future__ import annotations

import math

import numpy as np
import pytest
from google.protobuf import text_format

from engine import backend
from engine.blob import Blob
from engine.fillers import FillerError, fill
from engine.pb import caffe_pb2


def filler(text: str) -> caffe_pb2.FillerParameter:
    return text_format.Parse(text, caffe_pb2.FillerParameter())


def filled(text: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    backend.seed(123)
    blob = Blob(shape, dtype=dtype)
    fill(filler(text), blob)
    assert blob.data.dtype == dtype and blob.shape == shape
    return blob.data


def test_constant() -> None:
    assert np.all(filled('type: "constant" value: 2.5', (3, 4)) == 2.5)
    assert np.all(filled('', (3, 4)) == 0)  # Caffe's default filler is constant 0


def test_uniform_bounds_and_moments() -> None:
    d = filled('type: "uniform" min: -2 max: 4', (200, 500))
    assert d.min() >= -2 and d.max() <= 4
    assert abs(d.mean() - 1.0) < 0.02
    assert abs(d.std() - 6 / math.sqrt(12)) < 0.02


def test_gaussian_moments_float64() -> None:
    d = filled('type: "gaussian" mean: 1.5 std: 0.5', (200, 500), np.float64)
    assert abs(d.mean() - 1.5) < 0.01
    assert abs(d.std() - 0.5) < 0.01


def test_gaussian_sparse_keeps_expected_fraction() -> None:
    # p = sparse / num_outputs = 5 / 20: a quarter of the weights survive.
    d = filled('type: "gaussian" std: 1 sparse: 5', (20, 10000))
    assert abs((d != 0).mean() - 0.25) < 0.01
    assert abs(d[d != 0].std() - 1.0) < 0.02


def test_xavier_bounds_by_fan() -> None:
    shape = (64, 32, 3, 3)
    fan_in, fan_out = 32 * 9, 64 * 9
    for norm, n in (("FAN_IN", fan_in), ("FAN_OUT", fan_out), ("AVERAGE", (fan_in + fan_out) / 2)):
        d = filled(f'type: "xavier" variance_norm: {norm}', shape)
        bound = math.sqrt(3 / n)
        assert np.abs(d).max() <= bound
        assert np.abs(d).max() > 0.98 * bound  # fills the whole interval
        assert abs(d.std() - bound / math.sqrt(3)) < 0.03 * bound


def test_xavier_1d_blob_uses_count_for_fan_out() -> None:
    # Caffe's legacy channels() of a 1-D blob is 1, so fan_out = count = 300, fan_in = 1.
    d = filled('type: "xavier" variance_norm: FAN_OUT', (300,))
    assert np.abs(d).max() <= math.sqrt(3 / 300)
    d = filled('type: "xavier"', (300,))
    assert np.abs(d).max() > 1.0  # bound sqrt(3 / fan_in) = sqrt(3)


def test_msra_std_by_fan() -> None:
    shape = (128, 64, 3, 3)
    fan_in, fan_out = 64 * 9, 128 * 9
    for norm, n in (("FAN_IN", fan_in), ("FAN_OUT", fan_out), ("AVERAGE", (fan_in + fan_out) / 2)):
        d = filled(f'type: "msra" variance_norm: {norm}', shape)
        assert abs(d.std() - math.sqrt(2 / n)) < 0.02 * math.sqrt(2 / n)
        assert abs(d.mean()) < 0.02 * math.sqrt(2 / n)


def test_bilinear_exact_values() -> None:
    d = filled('type: "bilinear"', (2, 1, 4, 4))
    # kernel 4: f = 2, c = 0.75 -> 1-D ramp [0.25, 0.75, 0.75, 0.25]
    ramp = np.array([0.25, 0.75, 0.75, 0.25])
    np.testing.assert_allclose(d[0, 0], np.outer(ramp, ramp))
    np.testing.assert_allclose(d[1, 0], np.outer(ramp, ramp))
    d5 = filled('type: "bilinear"', (1, 1, 5, 5))
    # kernel 5 (upsampling factor 3): f = 3, c = 2/3 -> [1/3, 2/3, 1, 2/3, 1/3]
    ramp5 = np.array([1, 2, 3, 2, 1]) / 3
    np.testing.assert_allclose(d5[0, 0], np.outer(ramp5, ramp5), rtol=1e-6)


def test_bilinear_requires_square_4d() -> None:
    with pytest.raises(FillerError, match="square"):
        filled('type: "bilinear"', (1, 1, 3, 4))
    with pytest.raises(FillerError, match="4-D"):
        filled('type: "bilinear"', (3, 3))


def test_positive_unitball_rows_sum_to_one() -> None:
    d = filled('type: "positive_unitball"', (10, 3, 4, 5))
    assert d.min() >= 0
    np.testing.assert_allclose(d.reshape(10, -1).sum(axis=1), 1, rtol=1e-5)


def test_seeded_fill_is_reproducible() -> None:
    a = filled('type: "gaussian"', (5, 7))
    b = filled('type: "gaussian"', (5, 7))
    np.testing.assert_array_equal(a, b)


def test_unknown_type_is_named() -> None:
    with pytest.raises(FillerError, match="unknown filler type 'foo'"):
        filled('type: "foo"', (2, 2))


def test_sparse_rejected_outside_gaussian() -> None:
    with pytest.raises(FillerError, match="sparse"):
        filled('type: "uniform" sparse: 3', (2, 2))
