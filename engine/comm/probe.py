"""Start-up probes: the link's alpha and beta, and this machine's add and GEMM speeds.

Rank 0 measures before it plans (a few milliseconds): round trips of an empty message and of
a large one to rank 1 (rank 1's transport echoes them at once), so alpha = half the fastest empty
round trip and beta = the extra time per byte of the large one, one way. On a shared machine
these are noisy; ``--link`` replaces the probe with a given bandwidth and latency.
"""
from __future__ import annotations

import time

import numpy as np

from engine.pb import poseidon_pb2 as pb

from .cost import Device
from .link import Link
from .transport import PROBE_ASK, Endpoint, PeerId, header, message_key

PROBE_BYTES = 1 << 20
#: no link is faster than memory: 1 / 100 GB/s
MIN_BETA = 1e-11


def probe_link(ep: Endpoint, peer: PeerId, small: int = 12, large: int = 5) -> Link:
    """alpha and beta of the link to ``peer`` from round trips (``small`` empty, ``large`` of
    up to 1 MB: no more than the job's largest frame)."""
    start = time.perf_counter()
    nbytes = min(PROBE_BYTES, ep.max_frame_bytes or PROBE_BYTES) // 4 * 4
    payload = np.zeros(nbytes // 4, np.float32)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(small + large):
        big = i >= small
        t = time.perf_counter()
        ep.send(peer, header(pb.PROBE, op=PROBE_ASK, round=i), [payload] if big else [])
        ep.wait_for([message_key(pb.PROBE, peer, i)], "the link probe's echo")
        times[big].append(time.perf_counter() - t)
    # the fastest round trips: on a shared machine the others measure its other work
    empty = min(times[False])
    full = min(times[True])
    alpha = empty / 2
    beta = max((full - empty) / 2 / max(nbytes, 1), MIN_BETA)
    took = (time.perf_counter() - start) * 1e3
    return Link(alpha, beta, f"probed to {ep.name_of(peer)}: {small} empty and {large} "
                             f"{nbytes >> 10} KB round trips in {took:.1f} ms")


def probe_device(on_gpu: bool = False) -> Device:
    """This machine's speed at what the communicator computes on the CPU: adds (sums, ring
    steps, the update's passes) and SFB's rebuild GEMM (a few milliseconds)."""
    a = np.ones(1 << 20, np.float32)
    b = np.ones(1 << 20, np.float32)
    m = np.ones((256, 256), np.float32)
    adds, gemms = [], []
    for _ in range(5):
        t = time.perf_counter()
        a += b
        adds.append(time.perf_counter() - t)
        t = time.perf_counter()
        m @ m
        gemms.append(time.perf_counter() - t)
    add = 3 * a.nbytes / max(min(adds), 1e-9)  # read two, write one
    gemm = 2 * 256 ** 3 / max(min(gemms), 1e-9)
    return Device(f"probed: adds {add / 1e9:.1f} GB/s, GEMM {gemm / 1e9:.1f} GFLOP/s",
                  update_bytes_per_s=add if not on_gpu else Device.update_bytes_per_s,
                  gemm_flops_per_s=gemm, add_bytes_per_s=add, update_on_device=on_gpu)
