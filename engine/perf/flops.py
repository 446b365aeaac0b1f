"""An estimated layer-time trace from a net's shapes and a device's speed.

For when no measured trace exists (no GPU at hand): every layer costs its arithmetic at the
device's sustained rate plus its memory traffic at the device's sustained bandwidth,

    forward  = 2·MACs / flops + (bottom + top bytes) / bandwidth
    backward = 2 x forward for layers with parameters (the input gradient and the weight
               gradient each cost one forward's arithmetic), 1 x forward's memory traffic
               otherwise (read the top gradient, write the bottom gradient)

This is a roofline estimate: it ignores kernel launch overheads and per-layer efficiency
differences, so it is good for ratios of compute to communication, not for absolute speed.
Every trace written from it says so in its ``source``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .netinfo import NetInfo
from .trace import LayerTime, Trace


@dataclass(frozen=True)
class DeviceSpeed:
    name: str
    #: sustained multiply-add throughput x 2 (FLOP/s) of convolutions and inner products
    flops_per_s: float
    #: sustained memory bandwidth (bytes/s)
    bytes_per_s: float


#: The Poseidon paper's GPU (Zhang et al. 2017, NVIDIA GeForce GTX Titan X, Maxwell): 6.1 TFLOP/s
#: fp32 peak and 336 GB/s peak; cuDNN sustains about two thirds of the arithmetic peak on
#: VGG-sized convolutions and about three quarters of the bandwidth.
TITAN_X = DeviceSpeed("NVIDIA GTX Titan X (Maxwell), estimated at 4.0 TFLOP/s and 250 GB/s "
                      "sustained", 4.0e12, 250e9)


def trace_from_flops(info: NetInfo, device: DeviceSpeed = TITAN_X) -> Trace:
    """A Trace of ``info``'s training net at its batch size on ``device`` (an estimate)."""
    param_layers = {p.layer for p in info.params}
    layers = []
    for l in info.layers:
        arith = 2.0 * l.macs / device.flops_per_s
        memory = (l.bottom_bytes + l.top_bytes) / device.bytes_per_s
        if l.type == "Split":  # the engine's own fan-out: Caffe shares the memory
            arith = memory = 0.0
        fwd = arith + memory
        bwd = 2.0 * arith + memory if l.index in param_layers else memory
        if not l.bottom_bytes:  # a data layer: nothing to propagate to, no backward
            bwd = 0.0
        layers.append(LayerTime(l.name, l.type, fwd * 1e3, bwd * 1e3))
    return Trace(info.name, info.batch, layers, device.name,
                 f"estimate: 2*MACs / {device.flops_per_s:.3g} FLOP/s + bytes / "
                 f"{device.bytes_per_s:.3g} B/s per layer (engine/perf/flops.py)")
