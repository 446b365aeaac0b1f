"""The PyTorch peer of a Poseidon Net: the same layers, shapes and weights as torch ops.

`poseidon bench time` runs it side by side with Poseidon on the same machine in the same run,
so a ratio means something on a shared, noisy machine. PyTorch is never a dependency: this
module imports it only when called. It covers the layer types of the timed
nets (Input, Convolution, Pooling, LRN, ReLU, Dropout, InnerProduct, SoftmaxWithLoss,
Accuracy); another type is a clear error.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


def build(net: Any) -> tuple[Callable[[], Any], list[Any]]:
    """Return (step, params): step() runs forward and backward once and returns the loss."""
    import torch
    import torch.nn.functional as F

    blobs: dict[str, Any] = {}
    params: list[Any] = []
    ops: list[Callable[[], None]] = []

    def tensor(a: np.ndarray, grad: bool = False) -> Any:
        return torch.tensor(np.asarray(a, np.float32), requires_grad=grad)

    for layer, lp in zip(net.layers, net.param.layer):
        t = layer.type
        bottoms, tops = list(lp.bottom), list(lp.top)
        if t == "Input":
            for name in tops:
                blobs[name] = tensor(net.blobs[name].data)
            if len(tops) > 1:  # labels as class indices
                blobs[tops[1]] = blobs[tops[1]].long()
            continue
        w = [tensor(b.data, grad=True) for b in layer.blobs]
        params.extend(w)

        def op(t=t, lp=lp, w=w, b=bottoms, o=tops):
            x = blobs[b[0]]
            if t == "Convolution":
                cp = lp.convolution_param
                k = lambda r, d: (r[0] if len(r) else d)  # noqa: E731
                y = F.conv2d(x, w[0], w[1] if len(w) > 1 else None, stride=k(cp.stride, 1),
                             padding=k(cp.pad, 0), dilation=k(cp.dilation, 1), groups=cp.group)
            elif t == "Pooling":
                pp = lp.pooling_param
                fn = F.max_pool2d if pp.pool == 0 else F.avg_pool2d
                y = fn(x, pp.kernel_size, pp.stride, pp.pad, ceil_mode=True)
            elif t == "LRN":
                rp = lp.lrn_param
                y = F.local_response_norm(x, rp.local_size, rp.alpha, rp.beta, rp.k)
            elif t == "ReLU":
                y = F.relu(x)
            elif t == "Dropout":
                y = F.dropout(x, lp.dropout_param.dropout_ratio, training=True)
            elif t == "InnerProduct":
                y = F.linear(x.flatten(1), w[0], w[1] if len(w) > 1 else None)
            elif t == "SoftmaxWithLoss":
                y = F.cross_entropy(x, blobs[b[1]])
            elif t == "Accuracy":
                y = (x.argmax(1) == blobs[b[1]]).float().mean().detach()
            else:
                raise ValueError(f"torch peer: no mapping for layer type {t!r} ({lp.name})")
            blobs[o[0]] = y

        ops.append(op)

    loss_name = next(lp.top[0] for lp in net.param.layer if lp.type == "SoftmaxWithLoss")

    def step() -> float:
        for p in params:
            p.grad = None
        for op in ops:
            op()
        loss = blobs[loss_name]
        loss.backward()
        return float(loss)

    return step, params
