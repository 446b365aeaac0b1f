"""Benchmark: how much of the gradients' trip from the GPU to the host the backward hides.

    python benchmarks/bench_d2h_overlap.py [--net vgg16] [--batch 32] [--repeats 7] [--gpu 0]
                                           [--out FILE]

A worker's gradients leave the device for the communicator layer by layer, as backward makes
them. Two ways are timed on the same net, alternating, each iteration whole (forward, backward,
and every layer's gradients on the host):

- ``thread``: the way before engine/comm/staging.py, the peer: a second thread (the progress
  thread) copies each released layer with ``cupy.asnumpy`` on its default stream, which
  serialises with the compute stream;
- ``staged``: ``Staging.begin`` at each release (a copy stream of its own, page-locked memory),
  every copy waited for at the end, as the schemes do.

``none`` (forward and backward, no copy) is the floor. For ``staged`` the copies' own CUDA
events give the fraction hidden: of the time the copy stream spent copying, the share that lay
before the backward's last kernel ended (the compute stream busy meanwhile). Prints medians,
ratios and JSON.
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(net_name: str, batch: int, gpu: int) -> tuple[Any, dict[int, Any]]:
    from engine import backend
    from engine.comm.bind import describe_net
    from engine.comm.units import Unit
    from engine.net import Net
    from poseidon_cli.benches.time import write_net
    backend.use_gpu(gpu)
    proto = write_net(net_name, Path(tempfile.mkdtemp()), batch)
    net = Net(str(proto), phase="TRAIN")
    slots, _ = describe_net(net)
    return net, {li: Unit([slot], "ps") for li, slot in slots.items()}


def iteration(net: Any, units: dict[int, Any], way: str, staging: Any) -> tuple[float, dict]:
    import cupy

    from engine.comm.units import gather
    start = time.perf_counter()
    net.forward_prefilled()
    began, ended = cupy.cuda.Event(), cupy.cuda.Event()
    began.record()
    staged: list[Any] = []
    jobs: queue.Queue = queue.Queue()
    worker = None
    if way == "thread":
        def copy_loop() -> None:
            while (unit := jobs.get()) is not None:
                gather(unit)
        worker = threading.Thread(target=copy_loop)
        worker.start()

    def released(layer: int) -> None:
        unit = units.get(layer)
        if unit is None:
            return
        if way == "staged":
            staged.append(staging.begin(unit))
        elif way == "thread":
            jobs.put(unit)

    net.backward(on_layer_done=released)
    ended.record()
    if worker is not None:
        jobs.put(None)
        worker.join()
    for s in staged:
        s.wait()
    ended.synchronize()
    seconds = time.perf_counter() - start
    info: dict[str, float] = {}
    if staged:
        copying = hidden = 0.0
        backward_end = cupy.cuda.get_elapsed_time(began, ended)
        for s in staged:
            a = cupy.cuda.get_elapsed_time(began, s.started)
            b = cupy.cuda.get_elapsed_time(began, s.finished)
            copying += b - a
            hidden += max(0.0, min(b, backward_end) - a)
        info = {"copy_ms": copying, "hidden_ms": hidden,
                "hidden": hidden / copying if copying else 0.0, "backward_ms": backward_end}
    return seconds * 1000.0, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="vgg16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from engine import backend
    if not backend.cupy_available():
        print("bench_d2h_overlap: needs CuPy and a CUDA GPU", file=sys.stderr)
        return 2
    from engine.comm.staging import Staging
    net, units = build(args.net, args.batch, args.gpu)
    staging = Staging()
    nbytes = sum(u.count * 4 for u in units.values())
    ways = ["none", "thread", "staged"]
    for way in ways:  # warm-up: plans, kernels, the memory pools, the page-locked vectors
        iteration(net, units, way, staging)
    ms: dict[str, list[float]] = {w: [] for w in ways}
    hidden: list[dict] = []
    for _ in range(args.repeats):
        for way in ways:
            t, info = iteration(net, units, way, staging)
            ms[way].append(t)
            if info:
                hidden.append(info)
    med = {w: statistics.median(v) for w, v in ms.items()}
    frac = statistics.median(h["hidden"] for h in hidden)
    copy_ms = statistics.median(h["copy_ms"] for h in hidden)
    result = {
        "net": args.net, "batch": args.batch, "repeats": args.repeats,
        "device": backend.device_name(), "gradient_bytes": nbytes,
        "median_ms": med, "runs_ms": ms,
        "staged_copy_ms": copy_ms, "staged_hidden_fraction": frac,
        "staged_over_none": med["staged"] / med["none"],
        "thread_over_none": med["thread"] / med["none"],
        "staged_over_thread": med["staged"] / med["thread"],
    }
    print(f"{args.net} b{args.batch} on {result['device']}: {nbytes / 1e6:.1f} MB of gradients")
    for w in ways:
        print(f"  {w:>6}: {med[w]:8.2f} ms an iteration (median of {args.repeats})")
    print(f"  staged copies: {copy_ms:.2f} ms on the copy stream, {100 * frac:.1f}% of it hidden "
          f"behind the backward; staged/none {result['staged_over_none']:.3f}, "
          f"thread/none {result['thread_over_none']:.3f}, "
          f"staged/thread {result['staged_over_thread']:.3f}")
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
