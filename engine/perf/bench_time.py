"""`poseidon bench time`: the engine's forward + backward against PyTorch CPU, same run.

Each repetition times Poseidon (engine.timing.time_net) and the PyTorch peer (same net, same
weights, engine/perf/torch_peer.py) in fresh subprocesses on one thread each, alternating, so
both see the same machine load; medians and the ratio Poseidon / PyTorch are reported.
Without PyTorch the engine is timed alone, and the report says so.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
#: name -> (net prototxt with an Input layer, iterations per timing)
NETS = {
    "lenet": (ROOT / "models" / "lenet" / "deploy.prototxt", 20),
    "cifar10_quick": (ROOT / "models" / "cifar10_quick" / "deploy.prototxt", 10),
    "alexnet": (ROOT / "models" / "alexnet" / "deploy.prototxt", 2),
}

_CHILD = r"""
import json, sys, time
from engine.net import Net
net = Net({proto!r})
if {peer!r} == "poseidon":
    from engine.timing import time_net
    r = time_net(net, {iters})
    print(json.dumps({{"ms": r.total_ms}}))
else:
    import torch
    torch.set_num_threads(1)
    from engine.perf.torch_peer import build
    step, _ = build(net)
    step()
    t = time.perf_counter()
    for _ in range({iters}):
        step()
    print(json.dumps({{"ms": (time.perf_counter() - t) * 1000 / {iters}}}))
"""


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _child(peer: str, proto: Path, iters: int) -> float:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _CHILD.format(proto=str(proto), peer=peer,
                                                                  iters=iters)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{peer} on {proto}: {done.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["ms"])


def run(nets: list[str], repeats: int, iterations: int | None = None,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    peers = ["poseidon", "torch"] if torch_available() else ["poseidon"]
    results: dict[str, Any] = {}
    for name in nets:
        proto, iters = NETS[name]
        iters = iterations or iters
        runs: dict[str, list[float]] = {p: [] for p in peers}
        for _ in range(repeats):
            for peer in peers:  # alternate
                runs[peer].append(_child(peer, proto, iters))
        med = {p: statistics.median(v) for p, v in runs.items()}
        res: dict[str, Any] = {"runs_ms": runs, "median_ms": med, "iterations": iters}
        if "torch" in med:
            res["ratio_vs_torch"] = med["poseidon"] / med["torch"]
        results[name] = res
        say(f"{name:14} poseidon {med['poseidon']:9.2f} ms"
            + (f"   torch {med['torch']:9.2f} ms   ratio {res['ratio_vs_torch']:.2f}"
               if "torch" in med else ""))
    return {"peers": peers, "nets": results}
