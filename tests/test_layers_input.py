"""Input and DummyData layers: top shapes and Caffe's refill rule."""
from __future__ import annotations

import numpy as np
import pytest

from engine import backend
from engine.blob import Blob
from engine.layers import LayerError
from tests.gradcheck import make_layer


def make(text: str, ntop: int):
    top = [Blob() for _ in range(ntop)]
    return make_layer(text, [], top), top


def test_input_one_shape_for_all_tops() -> None:
    _, top = make('name:"in" type:"Input" input_param{shape{dim:[2,3,4]}}', 2)
    assert [t.shape for t in top] == [(2, 3, 4), (2, 3, 4)]


def test_input_one_shape_per_top_and_caller_reshape_kept() -> None:
    layer, top = make('name:"in" type:"Input" input_param{shape{dim:[5,1]} shape{dim:[5]}}', 2)
    assert [t.shape for t in top] == [(5, 1), (5,)]
    top[0].reshape((7, 1))  # net.forward(data=...) reshapes inputs; reshape keeps that
    layer.reshape([], top)
    layer.forward([], top)
    assert top[0].shape == (7, 1)


def test_input_wrong_shape_count() -> None:
    with pytest.raises(LayerError, match="2 shapes for 3 tops"):
        make('name:"in" type:"Input" input_param{shape{dim:1} shape{dim:2}}', 3)


def test_dummy_data_default_is_constant_zero() -> None:
    layer, top = make('name:"d" type:"DummyData" dummy_data_param{shape{dim:[2,3]}}', 1)
    assert top[0].shape == (2, 3) and np.all(top[0].data == 0)
    assert layer.refill == [False]


def test_dummy_data_legacy_shapes_and_per_top_fillers() -> None:
    backend.seed(0)
    layer, top = make('name:"d" type:"DummyData" dummy_data_param{'
                      'num:[4,2] channels:3 height:2 width:1 '
                      'data_filler{type:"constant" value:7} data_filler{type:"gaussian"}}', 2)
    assert [t.shape for t in top] == [(4, 3, 2, 1), (2, 3, 2, 1)]
    assert np.all(top[0].data == 7)
    assert layer.refill == [False, True]
    layer.forward([], top)
    first = top[1].data.copy()
    assert np.all(first != 0)
    top[0].data[...] = 1  # constant tops are filled once, at setup
    layer.forward([], top)
    assert np.all(top[0].data == 1)
    assert not np.array_equal(top[1].data, first)  # random tops are refilled every forward


def test_dummy_data_rejects_mixed_shapes() -> None:
    with pytest.raises(LayerError, match="not both"):
        make('name:"d" type:"DummyData" dummy_data_param{num:1 channels:1 height:1 width:1 '
             'shape{dim:1}}', 1)
    with pytest.raises(LayerError, match="3 values for 2 tops"):
        make('name:"d" type:"DummyData" dummy_data_param{num:[1,2,3] channels:1 height:1 '
             'width:1}', 2)
