"""Option values several commands read alike: worker counts, sizes, shapes; and the one-line
refusals they share (no matplotlib, no root for namespaces). Commands import this module,
never each other."""
from __future__ import annotations

from typing import Any, Callable

import click

from engine.kernels.cudnn_conv import DEFAULT_MATH, MATHS

from .console import fail

#: --gpu-math, as train (a JobConfig field), test, time and bench time take it
GPU_MATH = dict(
    type=click.Choice(list(MATHS)), show_default=True,
    help="Which cuDNN plans a GPU's convolutions take: fast (the fastest deterministic float32 "
    "plan, FFT and Winograd included, as Caffe's cuDNN path), strict (direct float32 sums, "
    "NumPy's numerics) or tf32 (TF32 tensor cores in convolutions and products too).")


def gpu_math_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--gpu-math", default=DEFAULT_MATH, **GPU_MATH)(command)  # type: ignore

def parse_workers(text: str) -> list[int]:
    """'1,2,4,8' or '1-16' (every count) or a mix: '1,2,4-8'."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--workers {text!r}: expected counts such as 1,2,4,8 or 1-16") from None
        if a < 1 or b < a:
            raise ValueError(f"--workers {text!r}: counts must be 1 or more, ranges low-high")
        out.extend(range(a, b + 1))
    return sorted(set(out))


def parse_shape(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        dims = [int(d) for d in text.replace("x", ",").split(",")]
    except ValueError:
        raise ValueError(f"--input-shape {text!r}: expected C,H,W such as 3,224,224") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"--input-shape {text!r}: dimensions must be positive")
    return dims


#: said instead of a plot where matplotlib is missing (the checkout's extra: PyPI's
#: `poseidon` is another project)
NO_MATPLOTLIB = "--plot needs matplotlib: pip install -e '.[plot]' in the checkout"


def check_plot(plot: str | None) -> None:
    """--plot asked and matplotlib missing: say so now, before the work, not after it."""
    import importlib.util
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        fail(NO_MATPLOTLIB)


UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = UNITS.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if t[-1:] in UNITS else t) * mult)
    except ValueError:
        raise ValueError(f"size {text!r}: expected e.g. 4K, 64M, 1048576") from None
    if n < 4:
        raise ValueError(f"size {text!r}: at least 4 bytes (one float)")
    return n


def parse_sizes(text: str) -> list[int]:
    """'1K-256M' (powers of 4 between) or '64M' or '1K,64M'."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        if not sep:
            out.append(parse_size(lo))
            continue
        a, b = parse_size(lo), parse_size(hi)
        while a <= b:
            out.append(a)
            a *= 4
    return sorted(set(out))


def namespaces_or_fail() -> None:
    """Root and iproute2, or one line saying what is missing; then remove what an emulated
    cluster killed midway left behind."""
    from engine.perf.netns import ClusterError, check_root, cleanup_stale

    try:
        check_root()
    except ClusterError as e:
        fail(str(e))
    cleanup_stale()
