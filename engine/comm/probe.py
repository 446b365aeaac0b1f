"""Start-up probes: the link's alpha, beta and overhead, and this machine's add and GEMM speeds.

Rank 0 measures before it plans (a few milliseconds on a fast link): round trips of an empty
message and of a 4 MB stream to rank 1 (rank 1's transport echoes each message at once), so
alpha = half the fastest empty round trip and beta = the extra time per byte of the stream
(and half the least CPU time an empty round trip cost rank 0's process is a message's overhead,
LogP's o: what its send or its receipt costs the process at that end). A stream, not one
message: a link shaped by a token bucket (a cloud VM's NIC, the benches' tbf) lets a burst
through above its rate: one 1 MB message read a 1 Gbit/s tbf link (a 500 KB burst) at
1.70-1.80 Gbit/s, a 4 MB stream reads it at 1.17-1.20, nearer the rate a round's gradients
meet. On a shared machine these are noisy; ``--link`` replaces the probe with a
given bandwidth and latency.
"""
from __future__ import annotations

import time

import numpy as np

from engine.pb import poseidon_pb2 as pb

from .cost import Device
from .link import Link
from .transport import PROBE_ASK, Endpoint, PeerId, header, message_key

#: the frames of a large round trip, and how many bytes it streams in them (in at most
#: MAX_FRAMES frames, whatever the job's largest frame)
PROBE_BYTES = 1 << 20
STREAM_BYTES = 4 << 20
MAX_FRAMES = 64
#: no link is faster than memory: 1 / 100 GB/s
MIN_BETA = 1e-11


def probe_link(ep: Endpoint, peer: PeerId, small: int = 12, large: int = 3) -> Link:
    """alpha and beta of the link to ``peer`` from round trips (``small`` empty, ``large``
    streams of STREAM_BYTES in frames of up to 1 MB: no more than the job's largest frame)."""
    start = time.perf_counter()
    nbytes = min(PROBE_BYTES, ep.max_frame_bytes or PROBE_BYTES) // 4 * 4
    frames = min(max(STREAM_BYTES // max(nbytes, 1), 1), MAX_FRAMES)
    payload = np.zeros(nbytes // 4, np.float32)
    times: dict[bool, list[float]] = {False: [], True: []}
    cpu = []
    rnd = 0
    for i in range(small + large):
        big = i >= small
        sent = range(rnd, rnd + (frames if big else 1))
        rnd = sent.stop
        c, t = time.process_time(), time.perf_counter()
        for r in sent:  # a stream: each frame follows the last at once, the echoes alike
            ep.send(peer, header(pb.PROBE, op=PROBE_ASK, round=r), [payload] if big else [])
        ep.wait_for([message_key(pb.PROBE, peer, r) for r in sent], "the link probe's echo")
        times[big].append(time.perf_counter() - t)
        if not big:
            cpu.append(time.process_time() - c)
    # the fastest round trips: on a shared machine the others measure its other work
    empty = min(times[False])
    full = min(times[True])
    alpha = empty / 2
    # the stream goes out and comes back at once, both ways; its last frame's echo after it
    beta = max((full - empty) / ((frames + 1) * max(nbytes, 1)), MIN_BETA)
    # an empty round trip is this process's send and its receipt of the echo; the least CPU
    # of one: other threads of the process (a data layer's prefetch) add to the others
    overhead = min(cpu) / 2
    took = (time.perf_counter() - start) * 1e3
    return Link(alpha, beta, f"probed to {ep.name_of(peer)}: {small} empty round trips and "
                             f"{large} of {frames * nbytes >> 10} KB in {took:.1f} ms",
                overhead_s=overhead)


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
