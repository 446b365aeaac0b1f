"""--gpu-math: which cuDNN plans a GPU's convolutions take, and what each mode costs in accuracy.

On the GPU, each mode's convolution (forward, data gradient, weight gradient) is measured
against a float64 NumPy run of the same float32-rounded operands, as a fraction of the
*absolute* convolution's largest element (the same layer run on |x|, |w|, |dy|: A = sum of
|term|, what a sum's rounding error is proportional to):

- strict (direct float32 sums, any order): within n * u * max(A), the rigorous bound of a sum
  of n terms in float32 (u = 2**-24; n the terms of one output: C*kh*kw forward, K*kh*kw
  backward to the data, N*oh*ow to the weights);
- fast (FFT and Winograd allowed): the transforms multiply the rounding error by their
  matrices' norms (for the tile sizes cuDNN uses, below the 16 allowed here), so
  within 16 * n * u * max(A); and still float32: under a sixteenth of TF32's error wherever
  the tf32 mode took a TF32 plan (an error over 16 times strict's) other than fast's;
- tf32: takes a TF32 plan in some direction (the mode does reach cuDNN).

Plans are chosen by timing, so a run may pick another plan than the last. Measured on one
H200 in two runs (2026-11-28), error / max(A): strict 5.5e-8 to 1.7e-4, fast 2.8e-7 to
1.7e-4 (the largest, CIFAR10-quick's weight gradient, the same plan in all three modes), tf32
6.5e-5 to 7.6e-5 forward and backward to the data, where it always took TF32.

Without a GPU the CLI side is checked: the option's choices and its one-line refusal.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from engine import backend
from engine.blob import Blob
from tests.gradcheck import make_layer
from tests.test_gpu_parity import Side, gpu_side, needs_gpu, on

U = 2.0 ** -24
#: (name, bottom shape, num_output, kernel, pad): CIFAR10-quick's conv2 (whose FFT/Winograd
#: weight gradient missed real Caffe's by 3.5e-4) and a VGG-style 3x3 layer (Winograd's case)
SHAPES = [("cifar10_quick_conv2", (100, 32, 16, 16), 32, 5, 2),
          ("vgg_3x3", (32, 64, 28, 28), 64, 3, 1)]


def _conv(side: Side, dtype: Any, x: np.ndarray, w: np.ndarray, dy: np.ndarray,
          num_output: int, kernel: int, pad: int) -> dict[str, np.ndarray]:
    """y, dx and dw of one Convolution layer (no bias) on ``side``."""
    text = (f'name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param '
            f'{{ num_output: {num_output} kernel_size: {kernel} pad: {pad} bias_term: false }}')
    with on(side):
        xp = side.xp
        bottom = Blob(x.shape, dtype=dtype, xp=xp, name="x")
        bottom.data[...] = xp.asarray(x, dtype=dtype)
        top = Blob((), dtype=dtype, xp=xp, name="y")
        layer = make_layer(text, [bottom], [top])
        layer.blobs[0].data[...] = xp.asarray(w, dtype=dtype)
        layer.forward([bottom], [top])
        y = backend.to_numpy(top.data).astype(np.float64)
        top.diff[...] = xp.asarray(dy, dtype=dtype)
        layer.blobs[0].diff[...] = 0
        layer.backward([top], [True], [bottom])
        return {"y": y, "dx": backend.to_numpy(bottom.diff).astype(np.float64),
                "dw": backend.to_numpy(layer.blobs[0].diff).astype(np.float64)}


def _errors(shape: tuple[int, ...], num_output: int, kernel: int, pad: int,
            modes: tuple[str, ...]) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Each mode's error per direction as a fraction of max(A), and each direction's n."""
    rng = np.random.default_rng(7)
    n, c, h, w_ = shape
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((num_output, c, kernel, kernel)) * 0.1).astype(np.float32)
    dy = rng.standard_normal((n, num_output, h, w_)).astype(np.float32)  # stride 1, same size
    cpu = Side("numpy", np, backend.use_cpu)
    exact = _conv(cpu, np.float64, x, w, dy, num_output, kernel, pad)
    absolute = _conv(cpu, np.float64, np.abs(x), np.abs(w), np.abs(dy), num_output, kernel, pad)
    errors = {}
    for mode in modes:
        got = _conv(gpu_side(mode), np.float32, x, w, dy, num_output, kernel, pad)
        errors[mode] = {k: float(np.abs(got[k] - exact[k]).max() / absolute[k].max())
                        for k in exact}
    terms = {"y": c * kernel * kernel, "dx": num_output * kernel * kernel, "dw": n * h * w_}
    return errors, terms


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name,shape,num_output,kernel,pad", SHAPES, ids=[s[0] for s in SHAPES])
def test_each_math_mode_stays_within_its_stated_bound(name, shape, num_output, kernel, pad):
    errors, terms = _errors(shape, num_output, kernel, pad, ("strict", "fast", "tf32"))
    print(f"{name}: error / max(A) per mode and direction: {errors}; n = {terms}")
    tf32_plans = [k for k in terms if errors["tf32"][k] > 16 * errors["strict"][k]]
    assert tf32_plans, errors
    for k, n in terms.items():
        assert errors["strict"][k] <= n * U, (k, errors)
        assert errors["fast"][k] <= 16 * n * U, (k, errors)
        if k in tf32_plans and errors["tf32"][k] != errors["fast"][k]:
            assert errors["fast"][k] < errors["tf32"][k] / 16, (k, errors)


@pytest.mark.gpu
@needs_gpu
def test_the_mode_is_named_in_the_device_line():
    with on(gpu_side("fast")):
        assert backend.device_name().endswith("math fast")
        assert backend.gpu_math_line().startswith("GPU math: fast (fastest deterministic")


def test_an_unknown_mode_is_refused_before_any_gpu_is_touched():
    with pytest.raises(ValueError, match="--gpu-math must be one of fast, strict, tf32"):
        backend.use_gpu(0, "fp16")
    assert backend.xp_default() is np


@pytest.mark.parametrize("command", [["train", "--solver", "s.prototxt"],
                                     ["test", "--model", "m", "--weights", "w"],
                                     ["time", "--model", "m"], ["bench", "time"]])
def test_every_gpu_command_takes_the_three_modes(command):
    from poseidon_cli.main import cli
    r = CliRunner().invoke(cli, [*command, "--gpu-math", "fp16"])
    assert r.exit_code == 2
    assert "'fp16' is not one of 'fast', 'strict', 'tf32'" in r.output


def test_workers_receive_the_mode_in_their_job_configuration(tmp_path):
    from poseidon_cli.job_config import JobConfig
    config = JobConfig(solver="s.prototxt", gpu_math="strict")
    assert JobConfig.from_json(config.to_json()).gpu_math == "strict"
