"""accumulate_matmul: c += a @ b in place (SciPy's GEMM with beta = 1) equals the buffer path."""
from __future__ import annotations

import numpy as np
import pytest

from engine.layers import blas


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True)])
def test_accumulates_in_place_like_matmul_plus(dtype, ta, tb):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((13, 7) if not ta else (7, 13)).astype(dtype)
    b = rng.standard_normal((7, 11) if not tb else (11, 7)).astype(dtype)
    a, b = (a.T if ta else a), (b.T if tb else b)
    c = rng.standard_normal((13, 11)).astype(dtype)
    want = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    before = c.__array_interface__["data"][0]
    blas.accumulate_matmul(a, b, c, {})
    assert c.__array_interface__["data"][0] == before
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol)
    # the same on the buffer path (no SciPy)
    saved, blas._blas = blas._blas, None
    try:
        c2 = (want - a.astype(np.float64) @ b.astype(np.float64)).astype(dtype)
        blas.accumulate_matmul(a, b, c2, {})
    finally:
        blas._blas = saved
    np.testing.assert_allclose(c2, want, rtol=tol, atol=tol)
