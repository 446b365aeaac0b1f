"""Every layer type's forward and backward on CuPy equal to the NumPy path (float32).

Each case of tests/gpu_parity_cases.py is built twice on the same inputs: once with NumPy
blobs, once on the device with CuPy blobs and the NumPy layer's initial parameters copied in
(fillers draw random values). Both sides see the same random top diffs, run backward, and
tops, bottom diffs and parameter data and diffs must agree to
``max|gpu - cpu| / max(max|cpu|, tiny) <= BOUND`` (1e-5; see BOUND for why it holds).
Randomness inside a layer (Dropout's mask, DummyData's filler) comes from backend.rng(), a
NumPy stream on either side: it is seeded alike before each pass, so both draw the same.

The device side is a parameter of the harness (``Side``): the GPU tests run it on CuPy; the
CPU self-checks here run every case with NumPy on both sides (each must build, forward and
backward, and compute something) and check that the comparison catches a wrong result.

The bound assumes float32 math on the device, direct sums (``--gpu-math strict``): TF32 or
a cuDNN FFT/Winograd plan would be off by more and fail, as they should.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from engine import backend
from engine.blob import Blob
from engine.layers.base import _REGISTRY
from tests.gpu_parity_cases import CASES, EXCLUDED, Case
from tests.gradcheck import make_layer

SEED = 20240601
#: max|gpu - cpu| / max|cpu| allowed for every array. Both sides compute in float32 with their
#: own order of sums; each is within its rounding error of the exact result, so
#: |gpu - cpu| <= |gpu - exact| + |cpu - exact|. The NumPy side is within HOST_ACCURACY of a
#: float64 run of the same case (checked below, on every BLAS and thread count CI has:
#: measured <= 5e-7, the worst a 288-term convolution weight gradient); the device's error
#: for the same sums is of the same order, eps * sqrt(terms) = 6e-8 * sqrt(288) = 1e-6, so
#: the difference stays ~5x under BOUND.
BOUND = 1e-5
HOST_ACCURACY = 2e-6
#: guards the division when an array is all zeros (then any difference at all fails)
TINY = float(np.finfo(np.float32).tiny)

needs_gpu = pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")


@dataclass(frozen=True)
class Side:
    """Where one run of a case computes: its array module, and how to select it."""
    name: str
    xp: Any
    select: Callable[[], None]


CPU = Side("numpy", np, backend.use_cpu)


def gpu_side(math: str = "strict") -> Side:
    """GPU 0 in a --gpu-math mode: strict (direct float32 sums) for every comparison with
    NumPy or the real Caffe; tests/test_gpu_math.py bounds the others."""
    import cupy
    return Side(f"cupy ({math})", cupy, lambda: backend.use_gpu(0, math))


@contextlib.contextmanager
def on(side: Side) -> Iterator[None]:
    """Run on ``side``; the process is back on the CPU afterwards, whatever happened."""
    side.select()
    try:
        yield
    finally:
        backend.use_cpu()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max(initial=0.0)), TINY)
    return float(np.abs(got - want).max(initial=0.0)) / scale


def mismatches(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
               bound: float) -> dict[str, Any]:
    """The arrays of ``got`` that differ from ``want`` by more than ``bound``, with why."""
    bad: dict[str, Any] = {}
    for key in sorted(set(got) | set(want)):
        if key not in got or key not in want:
            bad[key] = "missing on the " + ("device" if key not in got else "NumPy") + " side"
        elif got[key].shape != want[key].shape:
            bad[key] = f"shape {got[key].shape} vs {want[key].shape}"
        else:
            err = relative_error(got[key], want[key])
            if not err <= bound:  # NaN fails too
                bad[key] = err
    return bad


def _values(xp: Any, values: np.ndarray, dtype: Any) -> Any:
    """``values`` rounded to float32 first: a float64 run sees the float32 run's inputs."""
    return xp.asarray(np.asarray(values, np.float32), dtype=dtype)


def _blob(values: np.ndarray, xp: Any, dtype: Any, name: str) -> Blob:
    b = Blob(values.shape, dtype=dtype, xp=xp, name=name)
    b.data[...] = _values(xp, values, dtype)
    return b


def run_case(case: Case, side: Side, params: list[np.ndarray] | None = None,
             dtype: Any = np.float32) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Build, forward and backward ``case`` on ``side`` in ``dtype``. Returns the results as
    host arrays and the layer's parameters as they were before forward; ``params`` replaces
    the freshly filled ones."""
    rng = np.random.default_rng(SEED)
    with on(side):
        xp = side.xp
        backend.seed(SEED)
        bottom = [_blob(fill(rng, shape), xp, dtype, f"bottom{i}")
                  for i, (shape, fill) in enumerate(case.bottoms)]
        top = [Blob((), dtype=dtype, xp=xp, name=f"top{i}") for i in range(case.tops)]
        layer = make_layer(case.prototxt, bottom, top, case.phase)
        try:
            if case.prepare is not None:
                case.prepare(layer, np.random.default_rng(SEED + 1))
            if params is not None:
                assert len(params) == len(layer.blobs)
                for blob, value in zip(layer.blobs, params):
                    blob.data[...] = xp.asarray(value, dtype=dtype)
            initial = [backend.to_numpy(b.data).copy() for b in layer.blobs]
            backend.seed(SEED + 2)
            layer.reshape(bottom, top)
            layer.forward(bottom, top)
            out = {f"top{i}": backend.to_numpy(t.data).copy() for i, t in enumerate(top)}
            # a layer overwrites the bottom diffs it propagates to: start them from noise
            for t in top:
                t.diff[...] = _values(xp, rng.standard_normal(t.shape), dtype)
            for b in bottom:
                b.diff[...] = _values(xp, rng.standard_normal(b.shape), dtype)
            down = case.down or tuple(layer.allow_force_backward(i) for i in range(len(bottom)))
            backend.seed(SEED + 3)
            layer.backward(top, list(down), bottom)
            out.update({f"bottom{i}.diff": backend.to_numpy(b.diff) for i, b in enumerate(bottom)})
            for j, p in enumerate(layer.blobs):
                out[f"param{j}.data"] = backend.to_numpy(p.data)
                out[f"param{j}.diff"] = backend.to_numpy(p.diff)
        finally:
            if hasattr(layer, "close"):  # MemoryData's stream
                layer.close()
    return out, initial


def check_case(case: Case, device: Side) -> None:
    want, params = run_case(case, CPU)
    got, _ = run_case(case, device, params)
    bad = mismatches(got, want, BOUND)
    assert not bad, f"{case.id}: {device.name} against numpy, bound {BOUND:g}: {bad}"


@pytest.fixture(autouse=True)
def back_on_the_cpu() -> Iterator[None]:
    yield
    assert backend.xp_default() is np, "a test left the backend on the GPU"


# -- the GPU tests ----------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layer_on_the_gpu_equals_numpy(case: Case) -> None:
    check_case(case, gpu_side())


# -- CPU self-checks (run everywhere, CI included) -----------------------------------------
def test_the_table_covers_every_layer_class_but_the_file_readers() -> None:
    classes = {cls for cls in _REGISTRY.values()}
    excluded = {_REGISTRY[name] for name in EXCLUDED}
    covered = {_REGISTRY[c.type] for c in CASES}
    assert not covered & excluded
    missing = classes - excluded - covered
    assert not missing, f"no GPU parity case for {sorted(c.__name__ for c in missing)}"
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case_runs_on_numpy_and_computes_something(case: Case) -> None:
    """The case builds, forwards and backwards through the harness, a second run agrees
    with the first (the harness is deterministic, so a GPU difference is the GPU's), and
    its tops hold values (a case comparing only zeros would prove nothing; Input's and
    Parameter's tops are zeros until the caller feeds or training changes them)."""
    want, params = run_case(case, CPU)
    got, _ = run_case(case, CPU, params)
    assert not mismatches(got, want, 0.0)
    assert all(np.isfinite(a).all() for a in want.values())
    if case.type not in ("Input", "Parameter"):
        assert any(np.abs(want[f"top{i}"]).max(initial=0) > 0 for i in range(case.tops)) \
            or case.tops == 0
    if case.type == "Parameter":
        assert np.abs(want["param0.diff"]).max() > 0


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_numpy_float32_is_within_host_accuracy_of_float64(case: Case) -> None:
    """What makes BOUND hold: the NumPy side's own rounding error is well under it."""
    got, params = run_case(case, CPU)
    exact, _ = run_case(case, CPU, params, dtype=np.float64)  # float32 params: exact in float64
    assert not mismatches(got, exact, HOST_ACCURACY)


def test_the_comparison_catches_a_wrong_result() -> None:
    case = next(c for c in CASES if c.id == "conv_caffe_grouped_strided_dilated")
    want, _ = run_case(case, CPU)
    assert mismatches(want, want, 0.0) == {}
    for key in ("top0", "bottom0.diff", "param0.diff", "param1.diff"):
        got = {k: v.copy() for k, v in want.items()}
        flat = got[key].reshape(-1)
        flat[flat.size // 2] += 3 * BOUND * np.abs(want[key]).max()
        assert set(mismatches(got, want, BOUND)) == {key}
        flat[flat.size // 2] = np.nan
        assert set(mismatches(got, want, BOUND)) == {key}
    short = dict(want)
    del short["param1.diff"]
    assert "missing" in mismatches(short, want, 1.0)["param1.diff"]
    wrong = dict(want, top0=want["top0"][:1])
    assert "shape" in mismatches(wrong, want, 1.0)["top0"]
