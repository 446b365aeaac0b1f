"""Convolutions through cuDNN's graph API: Caffe's `engine: CUDNN`, for CuPy arrays.

CuPy 14 dropped its cuDNN bindings, so the GPU's convolutions reach cuDNN through NVIDIA's
Python frontend (the ``cudnn`` package of ``nvidia-cudnn-frontend``), which loads the
libcudnn that PyTorch's or CUDA's wheels installed. One operation graph per direction:

- ``fprop``: image (n, C, H, W) * filter (K, C/group, kh, kw) -> grid (n, K, oh, ow)
- ``dgrad``: grid, filter -> image (the transposed convolution)
- ``wgrad``: image, grid -> filter

Convolution runs fprop forward and dgrad + wgrad backward; Deconvolution (the transpose) runs
dgrad forward and fprop + wgrad backward, its top being the image side. The graphs are built
once per shape and cached for the process (a net's layers of equal shape share them); of the
plans cuDNN's heuristics offer, the fastest (timed when the graph is built) is kept (as PyTorch's
cudnn.benchmark does); workspaces come from CuPy's memory pool; they run on CuPy's current
stream.

Numerics: float32 in and out, and never a non-deterministic engine (atomics in wgrad), so a
plan computes the same bits every time. Which plans may run is the process's *math* mode
(``--gpu-math``, ``set_math``), as ``MATHS`` lists:

- ``fast`` (the default): the fastest deterministic float32 plan, FFT and Winograd transforms
  included, as Caffe's cuDNN path picks them. The transforms round differently from a direct
  sum (tests/test_gpu_parity.py bounds them against ``strict``);
- ``strict``: direct float32 sums only (no transform, no reduced-precision reduction), which
  agree with the NumPy path to float32 rounding; the oracle tests run this;
- ``tf32``: TF32 tensor cores allowed too (10-bit mantissas), only when asked.

Where cuDNN has no engine for a shape, the layer keeps im2col and says so once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .geometry import Geometry

_lock = threading.Lock()
_module: Any = None
_import_error: str | None = None
#: per device: cuDNN's handle and the stream it was last set to
_handles: dict[int, list[Any]] = {}
#: plans timed per graph (the heuristics' first ones that build) and runs timed of each
MAX_CANDIDATES = 8
_DETERMINISTIC = ("NONDETERMINISTIC", "REDUCED_PRECISION_REDUCTION")  # atomics; fp16 sums
_TF32 = ("TENSOR_CORE", "DOWN_CONVERT_INPUTS")
_TRANSFORMS = ("FFT", "WINOGRAD", "WINOGRAD_TILE_4x4", "WINOGRAD_TILE_6x6", "WINOGRAD_TILE_13x13")
#: math mode -> the plans it never takes (cudnn.numerical_note names). strict refuses the
#: transforms too: with them CIFAR10-quick's conv2 weight gradient missed real Caffe's by
#: 3.5e-4 (H100, 2026-11-26), over the 1e-4 the oracle tests allow
MATHS = {"fast": _DETERMINISTIC + _TF32,
         "strict": _DETERMINISTIC + _TF32 + _TRANSFORMS,
         "tf32": _DETERMINISTIC}
#: what the log says each mode runs
MATH_LINES = {
    "fast": "fastest deterministic float32 plans, FFT and Winograd included (Caffe's cuDNN "
            "choice)",
    "strict": "direct float32 sums only (no FFT, Winograd or TF32): NumPy's numerics",
    "tf32": "TF32 tensor cores allowed in convolutions and matrix products (10-bit mantissas)",
}
DEFAULT_MATH = "fast"
_math = DEFAULT_MATH
TIMED_RUNS = 3
_graphs: dict[tuple, "_Graph | Exception"] = {}


def _cudnn() -> Any:
    """The frontend module, imported once; None with the reason kept when it is missing."""
    global _module, _import_error
    if _module is None and _import_error is None:
        try:
            import cudnn  # type: ignore
            cudnn.backend_version()  # loads libcudnn: fails here, not in the first layer
            _module = cudnn
        except Exception as e:  # absent package, or no libcudnn beside it
            _import_error = f"{type(e).__name__}: {e}"
    return _module


def available() -> bool:
    """True when cuDNN's frontend imports and finds libcudnn."""
    return _cudnn() is not None


def unavailable_reason() -> str:
    _cudnn()
    return _import_error or ""


def version() -> str:
    """cuDNN's library and frontend versions, for timing reports."""
    cudnn = _cudnn()
    if cudnn is None:
        return "no cuDNN (pip install nvidia-cudnn-frontend)"
    return f"cuDNN {cudnn.backend_version()} (frontend {getattr(cudnn, '__version__', '?')})"


def set_math(mode: str) -> None:
    """Choose the plans later convolutions take (``MATHS``); graphs built before keep theirs."""
    global _math
    if mode not in MATHS:
        raise ValueError(f"--gpu-math must be one of {', '.join(MATHS)}, got {mode!r}")
    _math = mode


def math_mode() -> str:
    return _math


def _handle(cudnn: Any, cupy: Any) -> Any:
    """The device's handle, set to the current stream (a call per convolution: the stream
    is set only when it changed)."""
    device = cupy.cuda.Device().id
    stream = cupy.cuda.get_current_stream().ptr
    with _lock:
        entry = _handles.get(device)
        if entry is None:
            entry = _handles[device] = [cudnn.create_handle(), None]
        if entry[1] != stream:
            cudnn.set_stream(handle=entry[0], stream=stream)
            entry[1] = stream
        return entry[0]


def _packed(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


@dataclass(frozen=True)
class Shapes:
    """One convolution's three tensor shapes, image side and grid side as cuDNN sees them."""

    image: tuple[int, int, int, int]
    grid: tuple[int, int, int, int]
    filter: tuple[int, int, int, int]
    pad: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]


class _Graph:
    """One operation graph: its tensors by role, its built plans, and the one it runs."""

    def __init__(self, direction: str, s: Shapes, math: str) -> None:
        import cupy
        cudnn = _cudnn()
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32,
                              compute_data_type=f32, handle=_handle(cudnn, cupy))

        def tensor(name: str, shape: tuple[int, ...]) -> Any:
            return graph.tensor(name=name, dim=list(shape), stride=_packed(shape), data_type=f32)

        window = dict(pre_padding=list(s.pad), post_padding=list(s.pad), stride=list(s.stride),
                      dilation=list(s.dilation), compute_data_type=f32)
        if direction == "fprop":
            in_shapes = (s.image, s.filter)
            self.a, self.b = tensor("image", s.image), tensor("filter", s.filter)
            out, out_shape = graph.conv_fprop(image=self.a, weight=self.b, **window), s.grid
        elif direction == "dgrad":
            in_shapes = (s.grid, s.filter)
            self.a, self.b = tensor("grid", s.grid), tensor("filter", s.filter)
            out, out_shape = graph.conv_dgrad(loss=self.a, filter=self.b, **window), s.image
        else:
            in_shapes = (s.image, s.grid)
            self.a, self.b = tensor("image", s.image), tensor("grid", s.grid)
            out, out_shape = graph.conv_wgrad(image=self.a, loss=self.b, **window), s.filter
        out.set_output(True).set_data_type(f32).set_dim(list(out_shape)).set_stride(
            _packed(out_shape))
        self.out = out
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.deselect_numeric_notes([getattr(cudnn.numerical_note, n) for n in MATHS[math]
                                      if hasattr(cudnn.numerical_note, n)])
        graph.check_support()
        self.graph = graph
        #: the plans built, in the heuristics' order, and their workspaces
        self.candidates: list[tuple[int, int]] = []
        # the count includes the deselected plans (which fail to build), and on a Hopper GPU
        # the heuristics list TF32 plans first (refused but in tf32 mode): every index is
        # tried until enough are built
        for i in range(int(graph.get_execution_plan_count())):
            try:
                graph.build_plan_at_index(i)
                self.candidates.append((i, int(graph.get_workspace_size_plan_at_index(i))))
            except Exception:  # deselected, or an engine this shape cannot use
                continue
            if len(self.candidates) == MAX_CANDIDATES:
                break
        if not self.candidates:
            raise RuntimeError(f"no cuDNN engine for {direction} of {s}")
        # chosen here, on scratch operands, so that a plan that cannot run fails while the
        # layer can still keep im2col
        scratch = [cupy.zeros(shape, dtype=cupy.float32) for shape in (*in_shapes, out_shape)]
        self.chosen = self._fastest(self._pack(*scratch))

    def _pack(self, a: Any, b: Any, out: Any) -> dict:
        return {self.a: a.data.ptr, self.b: b.data.ptr, self.out: out.data.ptr}

    def run(self, a: Any, b: Any, out: Any) -> None:
        for arr in (a, b, out):
            if not arr.flags.c_contiguous:
                raise ValueError("cuDNN convolution operands must be C-contiguous")
        self._execute(self._pack(a, b, out), *self.chosen)

    def _execute(self, pack: dict, index: int, workspace: int) -> None:
        import cupy
        ws = cupy.empty(workspace, dtype=cupy.uint8)
        self.graph.execute_plan_at_index(pack, ws.data.ptr, index,
                                         handle=_handle(_cudnn(), cupy))

    def _fastest(self, pack: dict) -> tuple[int, int]:
        """cudnn.benchmark's choice, made once per shape: each candidate timed, and the
        heuristics' earliest within 10% of the fastest taken, so timing noise rarely changes
        the choice (another plan sums in another order)."""
        import cupy
        times = []
        for index, workspace in self.candidates:
            self._execute(pack, index, workspace)  # warm-up (and lazy module loads)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(TIMED_RUNS):
                self._execute(pack, index, workspace)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        best = min(times)
        return next(c for c, t in zip(self.candidates, times) if t <= best * 1.1)


def _graph(direction: str, shapes: Shapes) -> _Graph:
    import cupy
    key = (cupy.cuda.Device().id, direction, shapes, _math)
    with _lock:
        built = _graphs.get(key)
    if built is None:
        try:
            built = _Graph(direction, shapes, _math)
        except Exception as e:  # kept: a layer reshaped every iteration does not rebuild
            built = e
        with _lock:
            _graphs[key] = built
    if isinstance(built, Exception):
        raise built
    return built


def suits(dtype: Any) -> bool:
    """cuDNN takes this layer: float32 data and the frontend present (float64 keeps im2col,
    which the gradient checks use)."""
    import numpy as np
    return np.dtype(dtype) == np.float32 and available()


class Plan:
    """A convolution (or, ``transposed``, a deconvolution) layer's three cuDNN graphs.

    ``geometry`` is the layer's im2col geometry: ``channels``/``height``/``width`` the image
    side, ``out_h``/``out_w`` the grid; ``grid_channels`` the other side's channel count.
    Built eagerly, so a shape cuDNN cannot run fails at reshape (the caller falls back).
    """

    def __init__(self, geometry: Geometry, grid_channels: int, group: int, images: int,
                 transposed: bool = False) -> None:
        g = geometry
        self.transposed = transposed
        self.shapes = Shapes(
            image=(images, g.channels, g.height, g.width),
            grid=(images, grid_channels, g.out_h, g.out_w),
            filter=(grid_channels, g.channels // group, g.kernel_h, g.kernel_w),
            pad=(g.pad_h, g.pad_w), stride=(g.stride_h, g.stride_w),
            dilation=(g.dilation_h, g.dilation_w))
        self.fprop = _graph("fprop", self.shapes)
        self.dgrad = _graph("dgrad", self.shapes)
        self.wgrad = _graph("wgrad", self.shapes)

    def forward(self, x: Any, w: Any, y: Any) -> None:
        """y = the layer's output (bias not added)."""
        if self.transposed:
            self.dgrad.run(x, w, y)
        else:
            self.fprop.run(x, w, y)

    def backward(self, dy: Any, x: Any, w: Any, dw: Any | None, dx: Any | None) -> None:
        """dw (the filter's shape) += the weight gradient; dx = the bottom's gradient."""
        import cupy
        if dx is not None:
            (self.fprop if self.transposed else self.dgrad).run(dy, w, dx)
        if dw is not None:
            grad = cupy.empty(self.shapes.filter, dtype=dw.dtype)
            if self.transposed:
                self.wgrad.run(dy, x, grad)
            else:
                self.wgrad.run(x, dy, grad)
            dw += grad.reshape(dw.shape)
