"""Benchmark: what an elastic commit costs, to choose --commit-every's default.

    python benchmarks/bench_commit_cost.py [--repeats 5] [--out FILE]

A commit waits for the updates in flight (which the next forward waits for anyway) and copies
every blob of the train net and the solver's history (SGD's momentum: one more copy of the
weights) over the older of the worker's two commits. This times ``Solver.commit()`` so, on
the real parameter arrays of each reference net
(built as `--replay` builds them: every blob at its real size, no data read), the median of
``--repeats``, and sets it beside the net's iteration time on an H100 from models/traces (the
commit copied on this CPU: a GPU run copies on the device at its memory's bandwidth, so this
is the dearer case). Prints per net the bytes copied, the commit's milliseconds, and its share
of the iterations at K = 1, 10 and 100; writes all of it as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NETS = {"alexnet": "alexnet_b32_h100.json", "googlenet": "googlenet_b32_h100.json",
        "resnet50": "resnet50_b32_h100.json", "vgg19": "vgg19_b32_h100.json",
        "vgg19_22k_s4": "vgg19_22k_s4_b32_h100.json"}


def measure(net: str, trace: str, repeats: int) -> dict[str, float | int | str]:
    from engine.perf.replay import make_solver
    from engine.perf.trace import load_trace

    solver = make_solver(ROOT / "models" / net / "solver.prototxt",
                         ROOT / "models" / "traces" / trace, 1.0, is_root=False)
    held = [solver.commit(), solver.commit()]  # a worker's two, written once
    times = []
    for i in range(repeats):  # then each commit overwrites the older, as a worker's do
        t = time.perf_counter()
        solver.commit(into=held[i % 2])
        times.append(time.perf_counter() - t)
    copied = held[0].nbytes
    solver.close()
    layers = load_trace(ROOT / "models" / "traces" / trace).layers
    iteration_s = sum(l.forward_ms + l.backward_ms for l in layers) / 1e3
    commit_s = statistics.median(times)
    return {"net": net, "bytes": copied, "commit_s": commit_s, "h100_iteration_s": iteration_s,
            **{f"share_k{k}": commit_s / (k * iteration_s) for k in (1, 10, 100)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine import glog
    glog.set_enabled(False)
    rows = []
    print(f"{'net':>13} {'MB copied':>10} {'commit ms':>10} {'H100 iter ms':>12} "
          f"{'K=1':>7} {'K=10':>7} {'K=100':>7}")
    for net, trace in NETS.items():
        r = measure(net, trace, args.repeats)
        rows.append(r)
        print(f"{net:>13} {r['bytes'] / 1e6:>10.1f} {r['commit_s'] * 1e3:>10.1f} "
              f"{r['h100_iteration_s'] * 1e3:>12.1f} {r['share_k1']:>7.1%} "
              f"{r['share_k10']:>7.1%} {r['share_k100']:>7.1%}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
