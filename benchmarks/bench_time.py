"""Benchmark: `poseidon time` forward+backward on one CPU thread vs PyTorch and real Caffe.

    python benchmarks/bench_time.py [--reps 3] [--out bench_time.json] [--nets lenet,cifar,alexnet]

Each repetition runs Poseidon and the PyTorch peer (same net, same weights, one thread) in
fresh subprocesses, alternating, so both see the same machine load. Prints medians and the
ratios Poseidon/Caffe (Caffe 1.0, OpenBLAS, one thread, measured on this kind of machine: see
shared/fixtures/oracle/time/TIMING.md) and Poseidon/PyTorch, and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIME_DIR = ROOT.parent / "shared" / "fixtures" / "oracle" / "time"
#: name -> (prototxt, iterations, real Caffe 1.0 fwd+bwd ms, 1 thread, from the issue)
NETS = {
    "lenet": ("lenet_b64.prototxt", 50, 17.0),
    "cifar": ("cifar10_quick_b100.prototxt", 10, 161.0),
    "alexnet": ("alexnet_b32.prototxt", 2, 1920.0),
}

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
from engine.net import Net
net = Net({proto!r})
if {peer!r} == "poseidon":
    from engine.timing import time_net
    r = time_net(net, {iters})
    print(json.dumps({{"ms": r.total_ms, "forward_ms": r.forward_ms, "backward_ms": r.backward_ms,
                      "layers": [vars(l) for l in r.layers]}}))
else:
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {bench!r})
    from torch_peer import build
    step, _ = build(net)
    step()
    t = time.perf_counter()
    for _ in range({iters}):
        step()
    print(json.dumps({{"ms": (time.perf_counter() - t) * 1000 / {iters}}}))
"""


def run_child(peer: str, proto: Path, iters: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    code = CHILD.format(root=str(ROOT), proto=str(proto), peer=peer, iters=iters,
                        bench=str(ROOT / "benchmarks"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{peer} on {proto.name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nets", default="lenet,cifar,alexnet")
    ap.add_argument("--out", default="bench_time.json")
    args = ap.parse_args()
    if not TIME_DIR.is_dir():
        raise SystemExit(f"needs the timing nets in {TIME_DIR}")
    try:
        import torch  # noqa: F401
        peers = ["poseidon", "torch"]
    except ImportError:
        print("PyTorch not installed (pip install torch==2.13.0): Poseidon vs Caffe only")
        peers = ["poseidon"]
    results = {}
    for name in args.nets.split(","):
        proto, iters, caffe_ms = NETS[name]
        runs: dict[str, list[float]] = {p: [] for p in peers}
        layers = None
        for rep in range(args.reps):
            for peer in peers:
                r = run_child(peer, TIME_DIR / proto, iters)
                runs[peer].append(r["ms"])
                if peer == "poseidon":
                    layers = r["layers"]
            print(f"{name} rep {rep + 1}: " + ", ".join(f"{p} {runs[p][-1]:.1f} ms" for p in peers),
                  flush=True)
        med = {p: statistics.median(v) for p, v in runs.items()}
        res = {"caffe_ms": caffe_ms, "runs_ms": runs, "median_ms": med,
               "ratio_vs_caffe": med["poseidon"] / caffe_ms, "poseidon_layers_last_rep": layers}
        if "torch" in med:
            res["ratio_vs_torch"] = med["poseidon"] / med["torch"]
        results[name] = res
    print(f"\n{'net':8} {'poseidon ms':>12} {'torch ms':>9} {'caffe ms':>9} {'/caffe':>7} {'/torch':>7}")
    for name, r in results.items():
        t = r["median_ms"].get("torch", float("nan"))
        print(f"{name:8} {r['median_ms']['poseidon']:12.1f} {t:9.1f} {r['caffe_ms']:9.1f} "
              f"{r['ratio_vs_caffe']:7.2f} {r.get('ratio_vs_torch', float('nan')):7.2f}")
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
