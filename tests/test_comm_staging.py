"""Staging a unit's gradients from the GPU to the host (engine/comm/staging.py): the copy waits
for what the compute stream queued before the release, reads strided diffs right, and reuses
one page-locked vector per unit. Host arrays are not staged. The GPU tests skip without CuPy
and a GPU, as in CI."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine import backend
from engine.comm.staging import Staging
from engine.comm.units import LayerSlot, ParamSlot, Unit

gpu = pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")


def unit_of(*diffs) -> Unit:
    params = [ParamSlot(i, f"l/{i}", SimpleNamespace(diff=d, data=d))
              for i, d in enumerate(diffs)]
    return Unit([LayerSlot(3, "l", params)], "ps")


def test_host_gradients_are_not_staged():
    assert Staging().begin(unit_of(np.ones(4, np.float32))) is None


@gpu
@pytest.mark.gpu
def test_the_copy_waits_for_the_backward_queued_before_the_release():
    import cupy
    a = cupy.zeros(1 << 20, cupy.float32)
    b = cupy.arange(12, dtype=cupy.float32).reshape(3, 4).T  # strided: copied contiguous first
    for _ in range(200):  # queued on the compute stream, still running at the release
        a += 1
    staged = Staging().begin(unit_of(a, b))
    vec = staged.wait()
    assert vec.shape == (a.size + 12,) and vec.dtype == np.float32
    assert np.all(vec[:a.size] == 200)
    np.testing.assert_array_equal(vec[a.size:], np.arange(12, dtype=np.float32).reshape(3, 4).T.ravel())
    assert staged.copy_ms() >= 0


@gpu
@pytest.mark.gpu
def test_each_unit_reuses_its_page_locked_vector():
    import cupy
    staging = Staging()
    a = cupy.ones(100, cupy.float32)
    unit = unit_of(a)
    first = staging.begin(unit).wait()
    a *= 3
    second = staging.begin(unit).wait()
    assert second is first and np.all(second == 3)


@gpu
@pytest.mark.gpu
def test_the_sum_goes_back_on_the_copy_stream_before_the_update_that_follows():
    import cupy
    staging = Staging()
    a = cupy.full(1 << 20, 2.0, cupy.float32)
    b = cupy.full((3, 5), 4.0, cupy.float32)
    unit = unit_of(a, b)
    vec = staging.begin(unit).wait()
    total = vec * 3  # three workers' sum, as a scheme hands it over
    assert staging.scatter(unit, total, vec)
    a += 1  # the update: queued on the compute stream, which waits for the copy's event
    b *= 10
    assert np.all(cupy.asnumpy(a) == 7.0) and np.all(cupy.asnumpy(b) == 120.0)
    # strided diffs, or a vector not staged here, are the caller's to scatter
    strided = unit_of(cupy.zeros((4, 3), cupy.float32).T)
    assert not staging.scatter(strided, np.zeros(12, np.float32),
                               staging.begin(strided).wait())
    assert not staging.scatter(unit, total, vec.copy())
