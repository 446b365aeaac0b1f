"""Benchmark: LeNet on MNIST, one worker at batch 64 vs 4 local workers at batch 16 each.

    python benchmarks/bench_workers_accuracy.py [--iters 1000] [--data DIR] [--out FILE]

Issue 4 asks that 4 local workers reach the same accuracy as one worker at equal total batch.
Both runs use models/lenet as it is (SGD, lr 0.01, momentum 0.9, weight decay 5e-4, "inv"
decay, random_seed 1) except for max_iter; each tests once, at the end, on the full 10,000-image
test set (100 x 100, read whole by rank 0: only TRAIN data is rank-strided). The 4 workers run
under `poseidon train --hosts` (4 local entries, ports step 2, default --comm hybrid). Every
process gets one BLAS thread, so on a small machine the workers share the cores rather than
oversubscribe them; images/s here measures that machine, not cluster scaling.

Prints and writes as JSON: test accuracy and loss, wall time of the whole command, and images/s
(the solver's own iter/s display windows after the first, times the total batch; and total
images over wall time, start-up and the final test included).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from google.protobuf import text_format

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.caffe_io import read_net_prototxt, read_solver_prototxt
from engine.pb import caffe_pb2
from poseidon_cli.benches.train import one_thread_env
from poseidon_cli.launch.hostfile import free_base_port

TOTAL_BATCH = 64
TEST_BATCH, TEST_ITER = 100, 100  # the 10,000 test images exactly once
MNIST_RAW = ROOT.parent / "shared" / "data" / "mnist"


def make_lmdbs(raw: Path, out: Path) -> Path:
    """`poseidon data mnist` into ``out`` unless both LMDBs are already there."""
    if not all((out / f"mnist_{s}_lmdb").is_dir() for s in ("train", "test")):
        done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "data", "mnist",
                               "--from", str(raw), "--out", str(out)],
                              cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"poseidon data mnist failed: {done.stderr.strip()[-2000:]}")
    return out


def write_run(d: Path, data: Path, batch: int, iters: int) -> Path:
    """models/lenet with the LMDBs in ``data``, ``batch`` TRAIN images per worker, one final test."""
    d.mkdir(parents=True)
    net = read_net_prototxt(ROOT / "models" / "lenet" / "train_val.prototxt")
    for layer in net.layer:
        if layer.type != "Data":
            continue
        test = any(r.HasField("phase") and r.phase == caffe_pb2.TEST for r in layer.include)
        layer.data_param.source = str(data / ("mnist_test_lmdb" if test else "mnist_train_lmdb"))
        layer.data_param.batch_size = TEST_BATCH if test else batch
    (d / "net.prototxt").write_text(text_format.MessageToString(net))
    solver = read_solver_prototxt(ROOT / "models" / "lenet" / "solver.prototxt")
    solver.net = "net.prototxt"
    solver.max_iter = iters
    del solver.test_iter[:]
    solver.test_iter.append(TEST_ITER)
    solver.test_interval = iters
    solver.test_initialization = False
    solver.display = max(iters // 10, 1)
    solver.snapshot = 0
    solver.snapshot_prefix = str(d / "lenet")
    solver.random_seed = 1  # both runs start from the same weights
    path = d / "solver.prototxt"
    path.write_text(text_format.MessageToString(solver))
    return path


def run(work: Path, data: Path, workers: int, iters: int, comm: str, flags: Sequence[str] = (),
        name: str | None = None) -> dict:
    """Train with ``workers`` local workers (more `poseidon train` ``flags``) in work/``name``."""
    batch = TOTAL_BATCH // workers
    d = work / (name or f"p{workers}")
    cmd = [sys.executable, "-m", "poseidon_cli.main", "train", "--solver",
           str(write_run(d, data, batch, iters))]
    if workers > 1:
        base = free_base_port(workers)
        (d / "hosts").write_text("".join(f"127.0.0.1:{base + 2 * i}\n" for i in range(workers)))
        cmd += ["--hosts", str(d / "hosts"), "--comm", comm, "--stats", str(d / "stats.json"),
                *flags]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=one_thread_env(),
                          check=False)
    wall = time.perf_counter() - t0
    (d / "log.txt").write_text(done.stderr)
    if done.returncode:
        raise RuntimeError(f"poseidon train with {workers} worker(s) failed:\n{done.stderr[-3000:]}")
    scores = dict(re.findall(r"Test net output #\d+: (\w+) = ([\d.eE+-]+|nan|inf)", done.stderr))
    if "accuracy" not in scores:
        raise RuntimeError(f"no test accuracy in the log of the {workers}-worker run ({d / 'log.txt'})")
    rates = [float(m) for m in re.findall(r"Iteration \d+ \(([\d.eE+-]+) iter/s", done.stderr)]
    rates = rates[1:] or rates  # the first window holds start-up
    iter_per_s = statistics.median(rates) if rates else float("nan")
    out = {"workers": workers, "batch_per_worker": batch, "comm": comm if workers > 1 else "none",
           "test_accuracy": float(scores["accuracy"]), "test_loss": float(scores.get("loss", "nan")),
           "wall_s": wall, "train_images_per_s": iter_per_s * TOTAL_BATCH,
           "wall_images_per_s": iters * TOTAL_BATCH / wall}
    if workers > 1:
        s = json.loads((d / "stats.json").read_text())
        index = [r for r in s["layers"] if r["scheme"].endswith("/index")]
        out.update(plan={p["layer"]: p["scheme"] for p in s["plan"]},
                   replicas_identical=s.get("replicas_identical"),
                   wait_ms_per_iter=1e3 * s["wait_s_per_iter"], hidden_fraction=s["hidden_fraction"],
                   # what rank 0 sent per iteration: gradient values, and a codec's index
                   sent_bytes_per_iter=sum(r["all_sent_per_iter"] for r in s["layers"]
                                           if r not in index),
                   index_bytes_per_iter=sum(r["all_sent_per_iter"] for r in index),
                   codec={k: v for k, v in s.items() if k.startswith(("fp16_", "sparse_"))})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=1000, help="max_iter of both runs")
    ap.add_argument("--workers", type=int, default=4, help="local workers of the second run")
    ap.add_argument("--comm", default="hybrid", choices=("ps", "sfb", "hybrid"))
    ap.add_argument("--mnist", type=Path, default=MNIST_RAW, help="the four MNIST idx files")
    ap.add_argument("--data", type=Path, default=None,
                    help="folder for (or with) mnist_train_lmdb and mnist_test_lmdb; default a temp dir")
    ap.add_argument("--out", type=Path, default=Path("bench_workers_accuracy.json"))
    args = ap.parse_args(argv)
    if TOTAL_BATCH % args.workers:
        ap.error(f"--workers must divide the total batch {TOTAL_BATCH}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_lmdbs(args.mnist, args.data or work / "mnist")
        runs = [run(work, data, n, args.iters, args.comm) for n in (1, args.workers)]
    for r in runs:
        print(f"{r['workers']} worker(s) x batch {r['batch_per_worker']:>2}: test accuracy "
              f"{r['test_accuracy']:.4f}, loss {r['test_loss']:.4f}, wall {r['wall_s']:.1f} s, "
              f"{r['train_images_per_s']:.0f} images/s training ({r['wall_images_per_s']:.0f} over the wall time)",
              flush=True)
    results = {"iters": args.iters, "total_batch": TOTAL_BATCH, "test_images": TEST_BATCH * TEST_ITER,
               "cpu_count": os.cpu_count(), "runs": runs,
               "accuracy_difference": runs[1]["test_accuracy"] - runs[0]["test_accuracy"]}
    args.out.write_text(json.dumps(results, indent=1))
    print(f"accuracy difference ({args.workers} workers - 1): {results['accuracy_difference']:+.4f}; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
