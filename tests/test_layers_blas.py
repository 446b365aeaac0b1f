"""accumulate_matmul: c += a @ b in place (SciPy's GEMM with beta = 1) equals the buffer path,
and a small gradient never imports SciPy."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.layers import blas

SMALL_NET = """name: "small" force_backward: true
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 30 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 20 weight_filler { type: "gaussian" std: 0.1 } } }
"""


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True)])
def test_accumulates_in_place_like_matmul_plus(dtype, ta, tb, monkeypatch):
    pytest.importorskip("scipy.linalg")
    monkeypatch.setattr(blas, "BLAS_FROM_BYTES", 0)  # these small arrays take SciPy's GEMM
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
    assert blas._blas  # the GEMM path ran
    # the same on the buffer path (as without SciPy)
    monkeypatch.setattr(blas, "_blas", False)
    c2 = (want - a.astype(np.float64) @ b.astype(np.float64)).astype(dtype)
    blas.accumulate_matmul(a, b, c2, {})
    np.testing.assert_allclose(c2, want, rtol=tol, atol=tol)


def test_a_small_net_trains_without_importing_scipy():
    # a worker of a small net pays no SciPy import (about 0.2 s of CPU a process)
    code = ("import sys\n"
            "from google.protobuf import text_format\n"
            "from engine.net import Net\n"
            "from engine.pb import caffe_pb2\n"
            "from tests.test_layers_blas import SMALL_NET\n"
            "net = Net(text_format.Parse(SMALL_NET, caffe_pb2.NetParameter()), phase='TRAIN')\n"
            "net.blobs['x'].data[...] = 1\n"
            "net.forward_prefilled()\n"
            "net.backward(y=net.blobs['y'].data * 0 + 1)\n"
            "assert net.params['ip'][0].diff.any()\n"
            "print('scipy.linalg' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
