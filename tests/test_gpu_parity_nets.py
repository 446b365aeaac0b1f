"""Whole nets and solvers on the GPU: the real-Caffe oracle nets within the oracle's 1e-4,
and a few iterations of each of the six solvers equal to the CPU's.

Same harness as tests/test_gpu_parity.py: a run takes a ``Side`` (where it computes) and
the process is back on the CPU afterwards. The GPU tests skip without CuPy and a GPU; the
CPU self-checks run each solver on NumPy (it trains, and does not amplify a rounding-sized
difference, so the GPU comparison is neither vacuous nor chaotic).
"""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from engine import backend
from engine.pb import caffe_pb2
from engine.solver import Solver
from tests.test_gpu_parity import CPU, Side, gpu_side, mismatches, needs_gpu, on
from tests.test_oracle_layers import (  # noqa: F401
    check_test_forward,
    check_train_forward_backward,
    oracle,
)


# -- the oracle nets ------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
def test_oracle_net_trains_on_the_gpu_as_caffe(oracle):  # noqa: F811
    """TRAIN forward and backward: every blob, diff and parameter gradient within 1e-4."""
    with on(gpu_side()):
        check_train_forward_backward(oracle)


@pytest.mark.gpu
@needs_gpu
def test_oracle_net_tests_on_the_gpu_as_caffe(oracle):  # noqa: F811
    with on(gpu_side()):
        check_test_forward(oracle)


# -- the solvers ----------------------------------------------------------------------------
#: a convolution (the GPU's own engine) and an inner product under TanH: smooth, so a
#: rounding difference in one step is not amplified by the next (no ReLU switching units)
NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 16 dim: 2 dim: 5 dim: 5 } shape { dim: 16 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "act" type: "TanH" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
ITERS = 5
#: each solver with Caffe's usual settings for it, at rates where 5 steps move the weights
#: by a few percent (the self-check asserts they move)
SOLVERS = {
    "SGD": {"base_lr": 0.01, "momentum": 0.9},
    "Nesterov": {"base_lr": 0.01, "momentum": 0.9},
    "AdaGrad": {"base_lr": 0.01},
    "RMSProp": {"base_lr": 0.002, "rms_decay": 0.98},
    "AdaDelta": {"base_lr": 1.0, "momentum": 0.95, "delta": 1e-6},
    "Adam": {"base_lr": 0.005, "momentum": 0.9, "momentum2": 0.999},
}
#: The parameters after ITERS steps, relative to each blob's largest magnitude. One step's
#: gradients differ by float32 rounding (the layers' bound, 1e-5 and ~1e-6 in practice); an
#: update moves a weight by at most ~lr x its gradient (SGD, momentum summing <= 1/(1-0.9)
#: steps) or ~lr per step for the normalising rules (AdaGrad, RMSProp, AdaDelta, Adam), a
#: few percent of the weights over ITERS steps, so the rounding in the updates is ~1e-6 of
#: the weights at most; the smooth net keeps one step's difference from growing in the next.
SOLVER_BOUND = 1e-5


def solver_param(kind: str) -> caffe_pb2.SolverParameter:
    p = caffe_pb2.SolverParameter(type=kind, lr_policy="fixed", weight_decay=5e-4,
                                  max_iter=ITERS, random_seed=7, snapshot_after_train=False,
                                  **SOLVERS[kind])
    text_format.Parse(NET, p.net_param)
    return p


def train(kind: str, side: Side, start: list[np.ndarray] | None = None
          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(initial, final) learnable parameters of ITERS steps of ``kind`` on ``side``;
    ``start`` replaces the filled initial weights."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal((16, 2, 5, 5)).astype(np.float32)
    label = rng.integers(0, 3, 16).astype(np.float32)
    with on(side):
        xp = side.xp
        solver = Solver(solver_param(kind))
        try:
            params = solver.net.learnable_params
            if start is not None:
                for p, value in zip(params, start):
                    p.data[...] = xp.asarray(value)
            initial = [backend.to_numpy(p.data).copy() for p in params]
            # Input layers keep what they are given: every step trains on this batch
            solver.net.blobs["data"].data[...] = xp.asarray(data)
            solver.net.blobs["label"].data[...] = xp.asarray(label)
            solver.step(ITERS)
            return initial, [backend.to_numpy(p.data) for p in params]
        finally:
            solver.close()


def as_dict(arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"param{i}": a for i, a in enumerate(arrays)}


def relative_changes(before: list[np.ndarray], after: list[np.ndarray]) -> list[float]:
    return [float(np.abs(a - b).max() / np.abs(b).max()) for b, a in zip(before, after)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", sorted(SOLVERS))
def test_solver_steps_on_the_gpu_as_on_the_cpu(kind: str) -> None:
    start, want = train(kind, CPU)
    _, got = train(kind, gpu_side(), start)
    bad = mismatches(as_dict(got), as_dict(want), SOLVER_BOUND)
    assert not bad, f"{kind}: GPU parameters against the CPU's after {ITERS} steps: {bad}"


@pytest.mark.parametrize("kind", sorted(SOLVERS))
def test_solver_run_on_numpy_trains_and_does_not_amplify_a_rounding_difference(kind: str) -> None:
    """What the GPU comparison rests on: the weights move (so a skipped or wrong update
    shows), by a few percent (the small-step regime), and a difference of 1e-6 in the
    starting weights, the size of a step's float32 rounding, is still ~1e-6 after ITERS
    steps (measured 1.06e-6 to 1.19e-6), not amplified towards SOLVER_BOUND."""
    start, want = train(kind, CPU)
    moved = relative_changes(start, want)
    assert min(moved) > 100 * SOLVER_BOUND and max(moved) < 0.3, moved
    signs = np.random.default_rng(0)
    nudged = [(p * (1 + 1e-6 * signs.choice([-1, 1], p.shape))).astype(np.float32)
              for p in start]
    nudge = max(mismatches(as_dict(nudged), as_dict(start), 0.0).values())
    _, got = train(kind, CPU, nudged)
    assert not mismatches(as_dict(got), as_dict(want), 2 * nudge)
