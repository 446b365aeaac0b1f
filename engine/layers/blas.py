"""c += a @ b in place, as Caffe's GEMM with beta = 1 does, without a product-sized temporary.

NumPy's matmul has no beta: accumulating a weight gradient there takes the product into a
buffer and then another pass over the weight (AlexNet's fc6 is 151 MB). SciPy's BLAS wrappers
expose beta, so with SciPy installed (the `fast` extra) a large product is added straight into
the gradient. A small one keeps the buffer path (the reference, also CuPy's): its scratch and
extra pass cost less than importing scipy.linalg, about 0.2 s of CPU in every worker process,
which is paid only once a gradient of ``BLAS_FROM_BYTES`` or more needs it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

#: the smallest gradient (bytes) added by SciPy's GEMM in place rather than through a buffer
BLAS_FROM_BYTES = 8 << 20

#: scipy.linalg.blas once a large gradient needed it; False where SciPy is not installed
_blas: Any = None


def _scipy_blas() -> Any:
    global _blas
    if _blas is None:
        try:
            from scipy.linalg import blas
            _blas = blas
        except ImportError:  # the fast extra is optional
            _blas = False
    return _blas or None


def _fortran(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``x`` as a Fortran-ordered operand and its BLAS transpose flag, without copying when
    ``x`` or its transpose already is one."""
    if x.flags.f_contiguous:
        return x, 0
    if x.T.flags.f_contiguous:
        return x.T, 1
    return np.asfortranarray(x), 0


def accumulate_matmul(a: Any, b: Any, c: Any, buffer: dict[str, Any]) -> None:
    """``c += a @ b``. ``buffer`` keeps the product's scratch array between calls (for the
    path without BLAS access)."""
    if isinstance(c, np.ndarray) and c.nbytes >= BLAS_FROM_BYTES \
            and c.dtype in (np.float32, np.float64) and c.flags.c_contiguous \
            and a.dtype == b.dtype == c.dtype and (scipy_blas := _scipy_blas()) is not None:
        # c is C-ordered, so c.T is Fortran-ordered: c.T += b.T @ a.T, in place
        gemm = scipy_blas.get_blas_funcs("gemm", (c,))
        x, tx = _fortran(b.T)
        y, ty = _fortran(a.T)
        out = gemm(1.0, x, y, beta=1.0, c=c.T, trans_a=tx, trans_b=ty, overwrite_c=1)
        if not np.shares_memory(out, c):  # the wrapper had to copy: put the result back
            c.T[...] = out
        return
    from engine import backend

    xp = backend.get_array_module(c)
    tmp = buffer.get("product")
    if tmp is None or tmp.shape != c.shape or tmp.dtype != c.dtype:
        tmp = buffer["product"] = xp.empty_like(c)
    xp.matmul(a, b, out=tmp)
    c += tmp
