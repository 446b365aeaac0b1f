"""`poseidon bench time`: the engine's forward + backward against the real Caffe and PyTorch.

The nets are the zoo's train_val nets with their data layers replaced by Input layers (zeros)
at the batch sizes Caffe's reference times were taken at, TRAIN phase, as `caffe time` runs
them; the prototxt is written out so that a Caffe binary (``--caffe PATH``) times the very
same net. Each repetition runs every peer in a fresh subprocess with the same BLAS thread
count, alternating, so all see the same machine load; medians and the ratios of Poseidon to
each peer are reported. Without a Caffe binary, Caffe's recorded times are shown, labelled
as recorded: a time taken on another day on a shared machine is no peer.

With ``gpu`` both Poseidon (CuPy, cuDNN convolutions) and PyTorch (cudnn.benchmark on) run on
that GPU at the GPU batch sizes, fp32 with TF32 off for both, each pass timed whole with one
device synchronisation at its end (as `caffe time` times its total); the per-layer table of
the net furthest from PyTorch is timed separately (a synchronisation after each layer).
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

import numpy as np
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
    #: the batch timed on a GPU (the sizes GPU benchmarks of these nets are quoted at)
    gpu_batch: int = 32


def _zoo(name: str) -> Path:
    return ROOT / "models" / name / "train_val.prototxt"


NETS = {
    "lenet": BenchNet(_zoo("lenet"), 64, 50, (1, 28, 28), {1: 17.6, 2: 19.4}, gpu_batch=64),
    "cifar10_quick": BenchNet(_zoo("cifar10_quick"), 100, 10, (3, 32, 32),
                              {1: 160.7, 2: 175.5}, gpu_batch=100),
    "alexnet": BenchNet(_zoo("alexnet"), 32, 3, None, {1: 1919.5, 2: 1634.8}, gpu_batch=128),
    # GPU nets (minutes per pass on two cores: never in the CPU default)
    "googlenet": BenchNet(_zoo("googlenet"), 32, 2, None, {}),
    "vgg16": BenchNet(_zoo("vgg16"), 32, 1, None, {}),
    "resnet50": BenchNet(_zoo("resnet50"), 32, 1, None, {}),
}
#: passes per timing on a GPU (each a few to a few hundred milliseconds)
GPU_ITERATIONS = 20

_CHILD = r"""
import json, sys, time
peer, proto, iters, threads, gpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
math = sys.argv[6]
from engine import backend
if gpu >= 0 and peer.startswith("poseidon"):
    backend.use_gpu(gpu, math)
from engine.net import Net
if peer == "poseidon":
    from engine.perf.timing import time_passes
    from engine.perf.train_step import time_training_steps
    from poseidon_cli.benches.time import engine_in_use, solver_for
    solver = solver_for(proto)
    ms = time_passes(solver.net, iters)
    print(json.dumps({"ms": ms, "train_ms": time_training_steps(solver, iters),
                      "blas": engine_in_use()}))
elif peer == "poseidon-layers":
    from engine.perf.timing import time_net
    report = time_net(Net(proto, phase="TRAIN"), iters)
    print(json.dumps({"ms": report.total_ms, "blas": report.device,
                      "layers": [l.as_dict() for l in report.layers]}))
else:
    import torch
    net = Net(proto, phase="TRAIN")
    torch.set_num_threads(threads)
    from poseidon_cli.benches.torch_peer import build, describe
    device = f"cuda:{gpu}" if gpu >= 0 else "cpu"
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    step, params = build(net, device)
    sync = torch.cuda.synchronize if gpu >= 0 else (lambda: None)
    for _ in range(3 if gpu >= 0 else 1):  # cudnn.benchmark tries its algorithms here
        step()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    ms = (time.perf_counter() - t) * 1000 / iters
    # the training step: Poseidon's solver's SGD (solver_for), as torch.optim's
    from poseidon_cli.benches.time import SGD
    sgd = torch.optim.SGD(params, lr=SGD["base_lr"], momentum=SGD["momentum"],
                          weight_decay=SGD["weight_decay"])
    for _ in range(2):
        step(); sgd.step()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        step(); sgd.step()
    sync()
    train_ms = (time.perf_counter() - t) * 1000 / iters
    print(json.dumps({"ms": ms, "train_ms": train_ms, "blas": describe(device, threads)}))
"""

_CAFFE_TOTAL = re.compile(r"Average Forward-Backward:\s*([0-9.]+)\s*ms")
_OPENBLAS_CORE = re.compile(r"Core:\s*(\S+)")
_GLOG_FATAL = re.compile(r"^F\d{4,8} [^\]]*\] (.*)$", re.MULTILINE)


#: the timed training step's solver (a small rate: the weights barely move in a timing)
SGD = {"base_lr": 1e-4, "momentum": 0.9, "weight_decay": 5e-4}


def solver_for(proto: str | Path) -> Any:
    """An SGD solver of the timed net ``proto`` (SGD's settings; no test net, no snapshot)."""
    from engine.pb import caffe_pb2
    from engine.solver import Solver
    param = caffe_pb2.SolverParameter(net=str(proto), lr_policy="fixed", max_iter=10**9,
                                      display=0, snapshot_after_train=False, **SGD)
    return Solver(param)


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def engine_in_use() -> str:
    """What the engine's times depend on: the GPU and its libraries, or the CPU's BLAS."""
    from engine import backend
    return backend.device_name() if backend.xp_default() is not np else blas_in_use()


def blas_in_use() -> str:
    """The BLAS this process calls, its kernel and threads (threadpoolctl), and the CPU
    kernels in use: what an engine time depends on."""
    from importlib.metadata import version

    from engine.kernels import cpu as compiled
    kernels = (f"compiled kernels: numba {version('numba')}" if compiled.available()
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


def write_net(name: str, folder: Path, batch: int | None = None) -> Path:
    """The timed net of ``name`` as a prototxt in ``folder`` (Caffe reads it too)."""
    from engine.perf.netinfo import read_train_net, with_inputs
    spec = NETS[name]
    batch = batch or spec.batch
    param, _ = with_inputs(read_train_net(spec.train_val), batch, input_shape=spec.image,
                           where=spec.train_val.parent)
    path = folder / f"{name}_b{batch}.prototxt"
    path.write_text(text_format.MessageToString(param))
    return path


def _env(threads: int) -> dict[str, str]:
    n = str(threads)
    return dict(os.environ, OPENBLAS_NUM_THREADS=n, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)


def _child_report(peer: str, proto: Path, iters: int, threads: int, gpu: int | None,
                  math: str = "fast") -> dict[str, Any]:
    """One peer's timing in a process of its own: {"ms", "train_ms", "blas"}, or "layers"."""
    done = subprocess.run([sys.executable, "-c", _CHILD, peer, str(proto), str(iters),
                           str(threads), str(-1 if gpu is None else gpu), math], cwd=ROOT,
                          env=_env(threads), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{peer} on {proto.name}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
        caffe: str | None = None, say: Callable[[str], None] = print,
        gpu: int | None = None, math: str = "fast") -> dict[str, Any]:
    """Time ``nets`` on every available peer, alternating, forward + backward and (Poseidon
    and PyTorch) the training step; returns the JSON report."""
    peers = ["poseidon"] + (["caffe"] if caffe else []) + (["torch"] if torch_available() else [])
    results: dict[str, Any] = {}
    blas: dict[str, str] = {}
    protos: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="poseidon-bench-") as tmp:
        for name in nets:
            batch = NETS[name].gpu_batch if gpu is not None else NETS[name].batch
            protos[name] = proto = write_net(name, Path(tmp), batch)
            iters = iterations or (GPU_ITERATIONS if gpu is not None else NETS[name].iterations)
            runs: dict[str, list[float]] = {p: [] for p in peers}
            steps: dict[str, list[float]] = {p: [] for p in peers if p != "caffe"}
            for _ in range(repeats):
                for peer in peers:  # alternate
                    if peer == "caffe":
                        ms, blas[peer] = caffe_time(caffe, proto, iters, threads)
                    else:
                        out = _child_report(peer, proto, iters, threads, gpu, math)
                        ms, blas[peer] = float(out["ms"]), out["blas"]
                        steps[peer].append(float(out["train_ms"]))
                    runs[peer].append(ms)
            results[name] = _summary(name, batch, runs, iters, threads, say, gpu is None)
            results[name].update(_steps_summary(steps, say))
        report: dict[str, Any] = {"threads": threads, "gpu": gpu, "peers": peers, "blas": blas,
                                  "gpu_math": math if gpu is not None else None, "nets": results}
        compared = [n for n in results if "ratio_vs_torch" in results[n]]
        if gpu is not None and compared:
            worst = max(compared, key=lambda n: results[n]["ratio_vs_torch"])
            layers = _child_report("poseidon-layers", protos[worst],
                                   iterations or GPU_ITERATIONS, threads, gpu, math)["layers"]
            report["worst"] = {"net": worst, "layers": layers}
            _say_layers(worst, layers, say)
    return report


def _steps_summary(steps: dict[str, list[float]], say: Callable[[str], None]) -> dict[str, Any]:
    """The training steps' medians (forward, backward, staged release, update) and the ratio
    to PyTorch's (loss.backward and torch.optim.SGD's step)."""
    med = {p: statistics.median(v) for p, v in steps.items()}
    res: dict[str, Any] = {"train_runs_ms": steps, "train_median_ms": med}
    line = f"{'':14} train step poseidon {med['poseidon']:9.2f} ms"
    if "torch" in med:
        res["train_ratio_vs_torch"] = med["poseidon"] / med["torch"]
        line += f"   torch {med['torch']:9.2f} ms ({res['train_ratio_vs_torch']:.2f}x)"
    say(line)
    return res


def _say_layers(name: str, layers: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    """Where the net furthest from PyTorch spends its time, by layer type and by layer."""
    cost = [(l, l["forward_ms"] + l["backward_ms"]) for l in layers]
    total = sum(ms for _, ms in cost) or 1.0
    by_type: dict[str, float] = {}
    for l, ms in cost:
        by_type[l["type"]] = by_type.get(l["type"], 0.0) + ms
    say(f"{name}, furthest from PyTorch, synchronised after each layer: {total:.2f} ms; "
        + ", ".join(f"{t} {ms:.2f} ms ({ms / total:.0%})"
                    for t, ms in sorted(by_type.items(), key=lambda kv: -kv[1])[:6]))
    for l, _ in sorted(cost, key=lambda c: -c[1])[:12]:
        say(f"  {l['name']:24} {l['type']:14} forward {l['forward_ms']:8.3f} ms   "
            f"backward {l['backward_ms']:8.3f} ms")


def _summary(name: str, batch: int, runs: dict[str, list[float]], iters: int, threads: int,
             say: Callable[[str], None], cpu: bool = True) -> dict[str, Any]:
    med = {p: statistics.median(v) for p, v in runs.items()}
    res: dict[str, Any] = {"batch": batch, "iterations": iters, "runs_ms": runs,
                           "median_ms": med}
    line = f"{name:14} b{batch:<4} poseidon {med['poseidon']:9.2f} ms"
    if "caffe" in med:
        res["ratio_vs_caffe"] = med["poseidon"] / med["caffe"]
        line += f"   caffe {med['caffe']:9.2f} ms ({res['ratio_vs_caffe']:.2f}x)"
    elif cpu and threads in NETS[name].recorded_caffe_ms:
        rec = NETS[name].recorded_caffe_ms[threads]
        res["recorded_caffe_ms"] = rec
        line += f"   caffe {rec:9.2f} ms RECORDED, not this run ({med['poseidon'] / rec:.2f}x)"
    if "torch" in med:
        res["ratio_vs_torch"] = med["poseidon"] / med["torch"]
        line += f"   torch {med['torch']:9.2f} ms ({res['ratio_vs_torch']:.2f}x)"
    say(line)
    return res
