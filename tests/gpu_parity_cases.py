"""The layer table of the GPU parity tests (tests/test_gpu_parity.py): for every layer class
that can run on a GPU, one or more layer definitions with bottoms to feed them.

Each case is a LayerParameter in prototxt, the shapes of its bottoms and how to fill them
(labels for losses, indices for Embed/BatchReindex/Filter, positive values for Log/Power...),
and which bottoms take a gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engine import backend

Fill = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape)


def positive(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Away from 0, where Log, Power 0.5 and their gradients are steep or undefined."""
    return rng.uniform(0.5, 2.0, shape)


def unit(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.0, 1.0, shape)


def labels(classes: int) -> Fill:
    """Whole-number class labels (or row indices) in [0, classes)."""
    return lambda rng, shape: rng.integers(0, classes, shape).astype(np.float64)


def fixed(*values: float) -> Fill:
    """Given values, when a case needs repeats or both kinds present (BatchReindex, Filter)."""
    return lambda rng, shape: np.asarray(values, dtype=np.float64).reshape(shape)


def probabilities(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Rows that sum to 1, all well above MultinomialLogisticLoss's 1e-20 floor."""
    p = rng.uniform(0.2, 1.0, shape)
    return p / p.sum(axis=-1, keepdims=True)


def sequence_starts(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """RNN/LSTM's cont (T, N): 0 starts a sequence; one stream restarts mid-way."""
    cont = np.ones(shape)
    cont[0] = 0
    cont[shape[0] // 2, 0] = 0
    return cont


def global_stats(layer: Any, rng: np.random.Generator) -> None:
    """BatchNorm's stored mean, variance and scale factor, as a trained net has them."""
    for blob, value in zip(layer.blobs, (0.6 * rng.standard_normal(3), rng.uniform(0.5, 2.0, 3),
                                         np.full(1, 2.0))):
        blob.data[...] = backend.get_array_module(blob.data).asarray(value, dtype=blob.dtype)


@dataclass(frozen=True)
class Case:
    """One layer definition and its inputs."""
    id: str
    type: str
    params: str  # the LayerParameter fields after name and type, in prototxt
    bottoms: tuple[tuple[tuple[int, ...], Fill], ...] = ()
    tops: int = 1
    phase: str = "TRAIN"
    #: which bottoms backward propagates to; None: those ``allow_force_backward`` allows
    down: tuple[bool, ...] | None = None
    #: called with (layer, rng) after setup on each side (MemoryData's reset)
    prepare: Callable[[Any, np.random.Generator], None] | None = None

    @property
    def prototxt(self) -> str:
        return f'name: "{self.id}" type: "{self.type}" {self.params}'


def B(*shape: int, fill: Fill = normal) -> tuple[tuple[int, ...], Fill]:
    return tuple(shape), fill


GAUSS = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 }'

#: Layer classes left out, by Caffe type name, and why: each reads or writes files, which is
#: host work by design; the device side of a data layer is StreamDataLayer.forward's copy
#: into the top, which MemoryData (in the table) runs on the GPU for all of them.
EXCLUDED = {
    "Data": "reads LMDB/LevelDB records on the host",
    "ImageData": "decodes image files on the host",
    "WindowData": "reads a window file and crops image files on the host",
    "HDF5Data": "reads HDF5 files on the host",
    "HDF5Output": "writes its bottoms to an HDF5 file (a host copy by design)",
    "Python": "runs the user's module: what it computes on a GPU is that module's business",
}


def _conv(id: str, type: str, engine: str, bottom: tuple[int, ...], spec: str) -> Case:
    eng = f" engine: {engine}" if engine else ""
    return Case(id, type, f"convolution_param {{ {spec}{eng} {GAUSS} }}", (B(*bottom),))


_GROUPED = "num_output: 6 group: 2 kernel_size: 3 stride: 2 pad: 1 dilation: 2"
_RECT = "num_output: 4 kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0"
#: 3x3, stride 1, >= 16 channels, >= 8 images: the NumPy path's default engine takes
#: Winograd F(2x2, 3x3) here, so the GPU's convolution is checked against a different
#: algorithm. 32 channels make the CAFFE engine's weight gradient (8 x 288 entries) take the
#: one-GEMM branch (> SMALL_WEIGHT_GRADIENT) and its forward the many-rows branch.
_WINOGRAD = "num_output: 8 kernel_size: 3 pad: 1"

CASES: list[Case] = [
    Case("input", "Input", "input_param { shape { dim: 2 dim: 3 } }"),
    Case("dummy_data", "DummyData",
         'dummy_data_param { shape { dim: 2 dim: 3 } data_filler { type: "gaussian" } }'),
    Case("memory_data", "MemoryData",
         "memory_data_param { batch_size: 2 channels: 3 height: 2 width: 2 }", tops=2,
         prepare=lambda layer, rng: layer.reset(rng.standard_normal((4, 3, 2, 2)).astype(
             np.float32), np.arange(4, dtype=np.float32))),
    *[_conv(f"conv_{e.lower() or 'default'}_{name}", "Convolution", e, shape, spec)
      for e in ("CAFFE", "")
      for name, shape, spec in (("grouped_strided_dilated", (2, 4, 9, 9), _GROUPED),
                                ("rectangular", (2, 3, 6, 7), _RECT),
                                ("3x3_32ch", (8, 32, 6, 6), _WINOGRAD))],
    *[_conv(f"deconv_{e.lower() or 'default'}_{name}", "Deconvolution", e, (2, 4, 5, 5), spec)
      for e in ("CAFFE", "")
      for name, spec in (
          ("grouped_strided", "num_output: 6 group: 2 kernel_size: 3 stride: 2 pad: 1"),
          ("dilated", "num_output: 3 kernel_size: 3 stride: 1 pad: 2 dilation: 2"))],
    Case("pool_max_mask", "Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }",
         (B(2, 3, 7, 7),), tops=2),
    Case("pool_max_rectangular", "Pooling",
         "pooling_param { pool: MAX kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 1 }",
         (B(2, 3, 7, 7),)),
    Case("pool_ave", "Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }",
         (B(2, 3, 7, 7),)),
    Case("pool_max_global", "Pooling", "pooling_param { pool: MAX global_pooling: true }",
         (B(2, 3, 5, 6),)),
    Case("pool_ave_global", "Pooling", "pooling_param { pool: AVE global_pooling: true }",
         (B(2, 3, 5, 6),)),
    Case("crop", "Crop", "crop_param { axis: 2 offset: 1 offset: 2 }",
         (B(2, 3, 7, 7), B(2, 3, 4, 5)), down=(True, False)),
    Case("spp_max", "SPP", "spp_param { pyramid_height: 3 pool: MAX }", (B(2, 3, 7, 9),)),
    Case("spp_ave", "SPP", "spp_param { pyramid_height: 2 pool: AVE }", (B(2, 3, 7, 9),)),
    Case("im2col", "Im2col", "convolution_param { kernel_size: 3 stride: 2 pad: 1 }",
         (B(2, 3, 7, 7),)),
    Case("im2col_dilated", "Im2col", "convolution_param { kernel_size: 3 pad: 2 dilation: 2 }",
         (B(2, 3, 6, 6),)),
    Case("lrn_across", "LRN", "lrn_param { local_size: 5 alpha: 0.5 beta: 0.75 k: 2 }",
         (B(2, 7, 4, 4),)),
    Case("lrn_within", "LRN",
         "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }",
         (B(2, 3, 5, 5),)),
    Case("relu_leaky", "ReLU", "relu_param { negative_slope: 0.1 }", (B(2, 3, 4),)),
    Case("prelu", "PReLU", 'prelu_param { filler { type: "uniform" min: 0.1 max: 0.4 } }',
         (B(2, 3, 4, 4),)),
    Case("elu", "ELU", "elu_param { alpha: 0.7 }", (B(2, 3, 4),)),
    Case("sigmoid", "Sigmoid", "", (B(2, 3, 4),)),
    Case("tanh", "TanH", "", (B(2, 3, 4),)),
    Case("absval", "AbsVal", "", (B(2, 3, 4),)),
    Case("power_square", "Power", "power_param { power: 2 scale: 0.5 shift: 0.3 }", (B(2, 3, 4),)),
    Case("power_sqrt", "Power", "power_param { power: 0.5 scale: 1.5 shift: 0.1 }",
         (B(2, 3, 4, fill=positive),)),
    Case("exp", "Exp", "exp_param { base: 2 scale: 0.5 shift: 0.1 }", (B(2, 3, 4),)),
    Case("log", "Log", "log_param { scale: 1.5 shift: 0.2 }", (B(2, 3, 4, fill=positive),)),
    Case("bnll", "BNLL", "", (B(2, 3, 4),)),
    # Caffe has no Threshold backward: forward only
    Case("threshold", "Threshold", "threshold_param { threshold: 0.1 }", (B(2, 3, 4),),
         down=(False,)),
    # the mask is drawn from backend.rng(), a NumPy stream on either side: seeded alike
    # before each pass (run_case), both sides drop the same units
    Case("dropout", "Dropout", "dropout_param { dropout_ratio: 0.4 }", (B(4, 3, 5),)),
    Case("clip", "Clip", "clip_param { min: -0.5 max: 0.7 }", (B(2, 3, 4),)),
    Case("swish", "Swish", "swish_param { beta: 1.3 }", (B(2, 3, 4),)),
    Case("concat", "Concat", "concat_param { axis: 1 }", (B(2, 3, 4), B(2, 5, 4))),
    Case("slice", "Slice", "slice_param { axis: 1 slice_point: 2 slice_point: 5 }",
         (B(2, 7, 3),), tops=3),
    Case("split", "Split", "", (B(2, 3, 4),), tops=2),
    Case("flatten", "Flatten", "", (B(2, 3, 4, 5),)),
    Case("reshape", "Reshape", "reshape_param { shape { dim: 0 dim: -1 dim: 5 } }",
         (B(2, 3, 4, 5),)),
    Case("eltwise_sum", "Eltwise", "eltwise_param { operation: SUM coeff: 1 coeff: -0.5 }",
         (B(2, 3, 4), B(2, 3, 4))),
    Case("eltwise_prod", "Eltwise", "eltwise_param { operation: PROD }",
         (B(2, 3, 4), B(2, 3, 4), B(2, 3, 4))),
    Case("eltwise_max", "Eltwise", "eltwise_param { operation: MAX }",
         (B(2, 3, 4), B(2, 3, 4), B(2, 3, 4))),
    Case("softmax", "Softmax", "softmax_param { axis: 1 }", (B(2, 5, 3, 3),)),
    Case("silence", "Silence", "", (B(2, 3), B(4,)), tops=0),
    Case("argmax_flat", "ArgMax", "argmax_param { top_k: 2 out_max_val: true }", (B(3, 10),),
         down=(False,)),
    Case("argmax_axis", "ArgMax", "argmax_param { top_k: 2 axis: 1 }", (B(2, 6, 3),),
         down=(False,)),
    Case("tile", "Tile", "tile_param { axis: 1 tiles: 3 }", (B(2, 3, 4),)),
    # SUM of the whole blob (axis 0) on positive values: 60 normal values could cancel to
    # near 0, and a bound relative to the result would then measure the cancellation
    *[Case(f"reduction_{op.lower()}", "Reduction",
           f"reduction_param {{ operation: {op} axis: {axis} coeff: 0.7 }}",
           (B(3, 4, 5, fill=positive if op == "SUM" else normal),))
      for op, axis in (("SUM", 0), ("ASUM", 1), ("SUMSQ", 2), ("MEAN", 1))],
    Case("parameter", "Parameter", "parameter_param { shape { dim: 2 dim: 3 } }"),
    Case("batch_reindex", "BatchReindex", "",
         (B(4, 3, 2), B(6, fill=fixed(0, 3, 3, 1, 0, 2))), down=(True, False)),
    Case("filter", "Filter", "", (B(5, 3), B(5, 1, fill=fixed(1, 0, 1, 1, 0))),
         down=(True, False)),
    Case("embed", "Embed",
         f"embed_param {{ input_dim: 7 num_output: 4 {GAUSS} }}", (B(2, 3, fill=labels(7)),),
         down=(False,)),
    Case("inner_product", "InnerProduct", f"inner_product_param {{ num_output: 10 {GAUSS} }}",
         (B(4, 3, 5, 5),)),
    Case("inner_product_transposed", "InnerProduct",
         f"inner_product_param {{ num_output: 6 transpose: true {GAUSS} }}", (B(4, 12),)),
    Case("softmax_loss", "SoftmaxWithLoss",
         "loss_param { ignore_label: 2 normalization: VALID }",
         (B(4, 5, 2, 3), B(4, 1, 2, 3, fill=labels(5))), down=(True, False)),
    Case("sigmoid_cross_entropy_loss", "SigmoidCrossEntropyLoss", "",
         (B(4, 6), B(4, 6, fill=unit)), down=(True, False)),
    Case("euclidean_loss", "EuclideanLoss", "", (B(4, 6), B(4, 6)), down=(True, True)),
    *[Case(f"hinge_loss_{norm.lower()}", "HingeLoss", f"hinge_loss_param {{ norm: {norm} }}",
           (B(5, 4), B(5, fill=labels(4))), down=(True, False)) for norm in ("L1", "L2")],
    Case("multinomial_logistic_loss", "MultinomialLogisticLoss", "",
         (B(5, 4, fill=probabilities), B(5, fill=labels(4))), down=(True, False)),
    Case("infogain_loss", "InfogainLoss", "",
         (B(5, 4), B(5, fill=labels(4)), B(4, 4, fill=unit)), down=(True, False, False)),
    # margin 3 against distances ~ sqrt(2 * 3): some dissimilar pairs inside the margin
    Case("contrastive_loss", "ContrastiveLoss", "contrastive_loss_param { margin: 3 }",
         (B(8, 3), B(8, 3), B(8, 1, 1, 1, fill=labels(2))), down=(True, True, False)),
    Case("accuracy", "Accuracy", "accuracy_param { top_k: 2 }",
         (B(6, 5), B(6, fill=labels(5))), tops=2, down=(False, False)),
    Case("batch_norm_train", "BatchNorm", "batch_norm_param { moving_average_fraction: 0.9 }",
         (B(4, 3, 2, 2),)),
    Case("batch_norm_global_stats", "BatchNorm", "batch_norm_param { use_global_stats: true }",
         (B(4, 3, 2, 2),), phase="TEST",
         prepare=global_stats),
    Case("mvn", "MVN", "mvn_param { normalize_variance: true }", (B(2, 3, 4, 5),)),
    Case("mvn_across_channels", "MVN",
         "mvn_param { normalize_variance: false across_channels: true }", (B(2, 3, 4, 5),)),
    Case("bias_learned", "Bias", 'bias_param { axis: 1 num_axes: 1 filler { type: "gaussian" } }',
         (B(2, 3, 4, 4),)),
    Case("bias_bottom", "Bias", "bias_param { axis: 1 }", (B(2, 3, 4, 4), B(3, 4))),
    Case("scale_learned", "Scale",
         'scale_param { axis: 1 num_axes: 1 bias_term: true filler { type: "gaussian" } '
         'bias_filler { type: "gaussian" } }', (B(2, 3, 4, 4),)),
    Case("scale_bottom", "Scale", "scale_param { axis: 0 }", (B(2, 3, 4, 4), B(2, 3))),
    Case("lstm_unit", "LSTMUnit", "", (B(1, 3, 4), B(1, 3, 16), B(1, 3, fill=labels(2))),
         tops=2, down=(True, True, False)),
    *[Case(type.lower(), type, f"recurrent_param {{ num_output: 5 {GAUSS} }}",
           (B(4, 2, 3), B(4, 2, fill=sequence_starts)), down=(True, False))
      for type in ("RNN", "LSTM")],
]
