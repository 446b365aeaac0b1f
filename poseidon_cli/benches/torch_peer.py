"""The PyTorch peer of a Poseidon Net: the same layers, shapes and weights as torch ops.

`poseidon bench time` runs it side by side with Poseidon on the same machine in the same run,
so a ratio means something on a shared, noisy machine. PyTorch is never a dependency: this
module imports it only when called. It covers the layer types of the timed
nets (Input, Convolution, Pooling, LRN, ReLU, Dropout, InnerProduct, Concat, BatchNorm, Scale,
Eltwise, Split, SoftmaxWithLoss with its loss_weight, Accuracy); another type is a clear error.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


def describe(device: str, threads: int) -> str:
    """The PyTorch build a time was taken with, and its settings."""
    import torch
    if device.startswith("cuda"):
        return (f"torch {torch.__version__} on {torch.cuda.get_device_name(device)}, cuDNN "
                f"{torch.backends.cudnn.version()}, cudnn.benchmark "
                f"{torch.backends.cudnn.benchmark}, TF32 {torch.backends.cudnn.allow_tf32}")
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, oneDNN "
            f"{torch.backends.mkldnn.is_available()}")


def build(net: Any, device: str = "cpu") -> tuple[Callable[[], Any], list[Any]]:
    """Return (step, params): step() runs forward and backward once and returns the loss."""
    import torch
    import torch.nn.functional as F

    from engine.backend import to_numpy

    blobs: dict[str, Any] = {}
    params: list[Any] = []
    ops: list[Callable[[], None]] = []
    losses: list[tuple[str, float]] = []

    def tensor(a: Any, grad: bool = False) -> Any:
        return torch.tensor(np.asarray(to_numpy(a), np.float32), requires_grad=grad,
                            device=device)

    for layer, lp in zip(net.layers, net.param.layer):
        t = layer.type
        bottoms, tops = list(lp.bottom), list(lp.top)
        if t == "Input":
            for name in tops:
                blobs[name] = tensor(net.blobs[name].data)
            if len(tops) > 1:  # labels as class indices
                blobs[tops[1]] = blobs[tops[1]].long()
            continue
        w = [tensor(b.data, grad=t not in ("BatchNorm",)) for b in layer.blobs]
        params.extend(p for p in w if p.requires_grad)
        if t == "SoftmaxWithLoss":
            losses.append((tops[0], lp.loss_weight[0] if len(lp.loss_weight) else 1.0))

        def op(t=t, lp=lp, layer=layer, w=w, b=bottoms, o=tops):
            x = blobs[b[0]]
            if t == "Convolution":
                cp = lp.convolution_param
                k = lambda r, d: (r[0] if len(r) else d)  # noqa: E731
                y = F.conv2d(x, w[0], w[1] if len(w) > 1 else None, stride=k(cp.stride, 1),
                             padding=k(cp.pad, 0), dilation=k(cp.dilation, 1), groups=cp.group)
            elif t == "Pooling":
                fn = F.max_pool2d if lp.pooling_param.pool == 0 else F.avg_pool2d
                kernel = tuple(x.shape[2:]) if layer.global_pooling else layer.kernel
                y = fn(x, kernel, layer.stride, layer.pad, ceil_mode=True)
            elif t == "LRN":
                rp = lp.lrn_param
                y = F.local_response_norm(x, rp.local_size, rp.alpha, rp.beta, rp.k)
            elif t == "ReLU":
                y = F.relu(x)
            elif t == "Dropout":
                y = F.dropout(x, lp.dropout_param.dropout_ratio, training=True)
            elif t == "Split":  # autograd sums the copies' gradients, as Split's backward
                for name in o:
                    blobs[name] = x
                return
            elif t == "Concat":
                y = torch.cat([blobs[n] for n in b], dim=lp.concat_param.axis)
            elif t == "BatchNorm":  # batch statistics, as Caffe's TRAIN phase
                y = F.batch_norm(x, None, None, training=True, eps=lp.batch_norm_param.eps)
            elif t == "Scale":
                y = x * w[0].view(1, -1, 1, 1)
                if len(w) > 1:
                    y = y + w[1].view(1, -1, 1, 1)
            elif t == "Eltwise":
                y = blobs[b[0]]
                for n in b[1:]:
                    y = y + blobs[n]
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

    if not losses:
        raise ValueError("torch peer: the net has no SoftmaxWithLoss")

    def step() -> Any:
        for p in params:
            p.grad = None
        for op in ops:
            op()
        loss = sum(weight * blobs[name] for name, weight in losses)
        loss.backward()
        return loss.detach()  # no float(): that would synchronise the GPU every step

    return step, params
