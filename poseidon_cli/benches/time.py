"""`poseidon bench time`: the engine's forward + backward against the real Caffe and PyTorch.

The nets are the zoo's train_val nets with their data layers replaced by Input layers (zeros)
at the batch sizes Caffe's reference times were taken at, TRAIN phase, as `caffe time` runs
them; the prototxt is written out so that a Caffe binary (``--caffe PATH``) times the very
same net. Each repetition runs every peer in a fresh subprocess with the same BLAS thread
count, alternating, so all see the same machine load; medians and the ratios of Poseidon to
each peer are reported. Without a Caffe binary, Caffe's recorded times are shown, labelled
as recorded: a time taken on another day on a shared machine is no peer.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from google.protobuf import text_format

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BenchNet:
    train_val: Path
    batch: int
    iterations: int
    #: C, H, W of the data layer, where it has no crop_size (its database is not read)
    image: tuple[int, int, int] | None
    #: BVLC Caffe 1.0 `caffe time`, fwd+bwd ms with 1 and 2 OpenBLAS threads, recorded on a
    #: 2-vCPU AMD EPYC VM (shared/fixtures/oracle/time/TIMING.md); shown only without --caffe
    recorded_caffe_ms: dict[int, float]


NETS = {
    "lenet": BenchNet(ROOT / "models" / "lenet" / "train_val.prototxt", 64, 50, (1, 28, 28),
                      {1: 17.6, 2: 19.4}),
    "cifar10_quick": BenchNet(ROOT / "models" / "cifar10_quick" / "train_val.prototxt", 100, 10,
                              (3, 32, 32), {1: 160.7, 2: 175.5}),
    "alexnet": BenchNet(ROOT / "models" / "alexnet" / "train_val.prototxt", 32, 3, None,
                        {1: 1919.5, 2: 1634.8}),
}

_CHILD = r"""
import json, sys, time
peer, proto, iters, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from engine.net import Net
net = Net(proto, phase="TRAIN")
if peer == "poseidon":
    from engine.perf.timing import time_net
    ms = time_net(net, iters).total_ms
    from poseidon_cli.benches.time import blas_in_use
    print(json.dumps({"ms": ms, "blas": blas_in_use()}))
else:
    import torch
    torch.set_num_threads(threads)
    from poseidon_cli.benches.torch_peer import build
    step, _ = build(net)
    step()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    ms = (time.perf_counter() - t) * 1000 / iters
    print(json.dumps({"ms": ms, "blas": f"torch {torch.__version__}, {torch.get_num_threads()} "
                                        f"threads, oneDNN {torch.backends.mkldnn.is_available()}"}))
"""

_CAFFE_TOTAL = re.compile(r"Average Forward-Backward:\s*([0-9.]+)\s*ms")
_OPENBLAS_CORE = re.compile(r"Core:\s*(\S+)")
_GLOG_FATAL = re.compile(r"^F\d{4,8} [^\]]*\] (.*)$", re.MULTILINE)


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def blas_in_use() -> str:
    """The BLAS this process calls, its kernel and threads (threadpoolctl), and the CPU
    kernels in use: what an engine time depends on."""
    from engine.kernels import cpu as compiled
    kernels = (f"compiled kernels: numba {compiled.numba.__version__}" if compiled.available()
               else "kernels: NumPy")
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return f"BLAS unknown (pip install threadpoolctl); {kernels}"
    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    blas = "; ".join(f"{i.get('prefix')} ({i.get('internal_api')} {i.get('version')}, "
                     f"{i.get('architecture')} kernel, {i.get('num_threads')} threads)"
                     for i in libs) or "no BLAS found"
    return f"{blas}; {kernels}"


def write_net(name: str, folder: Path) -> Path:
    """The timed net of ``name`` as a prototxt in ``folder`` (Caffe reads it too)."""
    from engine.perf.netinfo import read_train_net, with_inputs
    spec = NETS[name]
    param, _ = with_inputs(read_train_net(spec.train_val), spec.batch, input_shape=spec.image,
                           where=spec.train_val.parent)
    path = folder / f"{name}_b{spec.batch}.prototxt"
    path.write_text(text_format.MessageToString(param))
    return path


def _env(threads: int) -> dict[str, str]:
    n = str(threads)
    return dict(os.environ, OPENBLAS_NUM_THREADS=n, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)


def _child(peer: str, proto: Path, iters: int, threads: int) -> tuple[float, str]:
    done = subprocess.run([sys.executable, "-c", _CHILD, peer, str(proto), str(iters),
                           str(threads)], cwd=ROOT, env=_env(threads), capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{peer} on {proto.name}: {done.stderr.strip().splitlines()[-1:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return float(out["ms"]), out["blas"]


def caffe_time(binary: str, proto: Path, iters: int, threads: int) -> tuple[float, str]:
    """`caffe time`'s average forward-backward, and the OpenBLAS kernel it says it picked."""
    env = dict(_env(threads), OPENBLAS_VERBOSE="2", GLOG_logtostderr="1")
    done = subprocess.run([binary, "time", "-model", str(proto), "-iterations", str(iters)],
                          env=env, capture_output=True, text=True, timeout=1800)
    text = done.stdout + done.stderr
    total = _CAFFE_TOTAL.search(text)
    if done.returncode != 0 or total is None:
        # glog's fatal line says why (a failed CHECK); a stack trace follows it
        fatal = _GLOG_FATAL.search(text)
        said = fatal.group(1).strip() if fatal else text.strip().splitlines()[-1:]
        raise RuntimeError(f"caffe time on {proto.name} failed: {said}")
    core = _OPENBLAS_CORE.search(text)
    blas = f"OpenBLAS {core.group(1)} kernel" if core else "BLAS not reported"
    return float(total.group(1)), f"{Path(binary).name}: {blas}, {threads} threads"


def run(nets: list[str], repeats: int, iterations: int | None = None, threads: int = 1,
        caffe: str | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Time ``nets`` on every available peer, alternating; returns the JSON report."""
    peers = ["poseidon"] + (["caffe"] if caffe else []) + (["torch"] if torch_available() else [])
    results: dict[str, Any] = {}
    blas: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="poseidon-bench-") as tmp:
        for name in nets:
            proto = write_net(name, Path(tmp))
            iters = iterations or NETS[name].iterations
            runs: dict[str, list[float]] = {p: [] for p in peers}
            for _ in range(repeats):
                for peer in peers:  # alternate
                    ms, blas[peer] = (caffe_time(caffe, proto, iters, threads) if peer == "caffe"
                                      else _child(peer, proto, iters, threads))
                    runs[peer].append(ms)
            results[name] = _summary(name, runs, iters, threads, say)
    return {"threads": threads, "peers": peers, "blas": blas, "nets": results}


def _summary(name: str, runs: dict[str, list[float]], iters: int, threads: int,
             say: Callable[[str], None]) -> dict[str, Any]:
    med = {p: statistics.median(v) for p, v in runs.items()}
    res: dict[str, Any] = {"batch": NETS[name].batch, "iterations": iters, "runs_ms": runs,
                           "median_ms": med}
    line = f"{name:14} poseidon {med['poseidon']:9.2f} ms"
    if "caffe" in med:
        res["ratio_vs_caffe"] = med["poseidon"] / med["caffe"]
        line += f"   caffe {med['caffe']:9.2f} ms ({res['ratio_vs_caffe']:.2f}x)"
    elif threads in NETS[name].recorded_caffe_ms:
        rec = NETS[name].recorded_caffe_ms[threads]
        res["recorded_caffe_ms"] = rec
        line += f"   caffe {rec:9.2f} ms RECORDED, not this run ({med['poseidon'] / rec:.2f}x)"
    if "torch" in med:
        res["ratio_vs_torch"] = med["poseidon"] / med["torch"]
        line += f"   torch {med['torch']:9.2f} ms ({res['ratio_vs_torch']:.2f}x)"
    say(line)
    return res
