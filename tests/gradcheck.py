"""Layer test helpers: build one layer from prototxt text, and check its gradients by
finite differences in float64 (Caffe's GradientChecker)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.blob import Blob
from engine.layers.base import Layer


def _objective(layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob],
               weights: Sequence[np.ndarray]) -> float:
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return float(sum((t.data * w).sum() for t, w in zip(top, weights)))


def check_layer_gradients(layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob],
                          check_bottom: Sequence[int] | None = None, check_params: bool = True,
                          eps: float = 1e-6, rtol: float = 1e-5, atol: float = 1e-7,
                          seed: int = 0) -> None:
    """Compare analytic gradients of sum(top * random weights) against central differences.

    The layer must already be set up; blobs must be float64. Raises AssertionError naming
    the offending blob and element.
    """
    rng = np.random.default_rng(seed)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    weights = [rng.standard_normal(t.shape) for t in top]
    for t, w in zip(top, weights):
        t.diff[...] = w
    for b in bottom:
        b.diff[...] = 0
    for p in layer.blobs:
        p.diff[...] = 0
    idx = list(range(len(bottom))) if check_bottom is None else list(check_bottom)
    layer.backward(top, [i in idx for i in range(len(bottom))], bottom)
    targets = [(f"bottom[{i}]", bottom[i]) for i in idx]
    if check_params:
        targets += [(f"param[{j}]", p) for j, p in enumerate(layer.blobs)]
    analytic = {name: blob.diff.copy() for name, blob in targets}
    for name, blob in targets:
        flat = blob.data.reshape(-1)
        num = np.empty(flat.size)
        for k in range(flat.size):
            orig = flat[k]
            flat[k] = orig + eps
            fp = _objective(layer, bottom, top, weights)
            flat[k] = orig - eps
            fm = _objective(layer, bottom, top, weights)
            flat[k] = orig
            num[k] = (fp - fm) / (2 * eps)
        got = analytic[name].reshape(-1)
        scale = max(1.0, np.abs(num).max())
        bad = np.abs(got - num) > atol + rtol * scale * 10
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise AssertionError(f"{layer.name}: {name} element {k}: analytic {got[k]:.8g} "
                                 f"vs numeric {num[k]:.8g} ({int(bad.sum())} of {bad.size} off)")


def make_layer(text: str, bottom: Sequence[Blob], top: Sequence[Blob], phase: str = "TRAIN") -> Layer:
    """A layer from its prototxt text, set up and reshaped on the given blobs."""
    from google.protobuf import text_format

    from engine.layer_types import create_layer
    from engine.pb import caffe_pb2

    param = caffe_pb2.LayerParameter()
    text_format.Parse(text, param)
    layer = create_layer(param, phase)
    layer.check_blob_counts(bottom, top)
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    return layer


def blob_of(values: np.ndarray) -> Blob:
    """A Blob holding a copy of ``values`` (same dtype)."""
    b = Blob(values.shape, dtype=values.dtype)
    b.data[...] = values
    return b
