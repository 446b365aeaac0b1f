"""Benchmark: data-parallel training on 1, 2 and 4 local workers, Poseidon vs PyTorch DDP (gloo).

    python benchmarks/bench_comm.py [--iters 60] [--workers 1,2,4] [--out bench_comm.json]

One net (8x8 digits: conv 3x3x20, InnerProduct 1280->1024, InnerProduct 1024->10, batch 32
per worker), trained by `poseidon train --hosts` with --comm ps, sfb and hybrid, and by the
same architecture under torch DistributedDataParallel with the gloo backend, in the same run,
every process on one BLAS thread. Reports images/s (from the solver's own iter/s lines after
warm-up), bytes per iteration per scheme (rank 0's counters), time waiting on the network,
the fraction of communication hidden behind backward, and the ratios Poseidon/DDP. Loopback
on one machine: the network is nearly free and the CPU cores are shared by all workers, so
this measures overheads, not the cluster scaling of the paper.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine.comm.hosts import free_base_port  # noqa: E402  (after the path is set)
from engine.data.converters import convert_digits  # noqa: E402
BATCH = 32
HIDDEN = 1024

NET = """name: "BenchNet"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{db}" backend: LMDB batch_size: {batch} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 20 kernel_size: 3 pad: 1 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu0" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
  inner_product_param {{ num_output: {hidden} weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""

SOLVER = """net: "{net}"
type: "SGD"
base_lr: 0.01
momentum: 0.9
lr_policy: "fixed"
max_iter: {iters}
display: {display}
random_seed: 1
"""

DDP_CHILD = r"""
import os, sys, time, json
import torch, torch.distributed as dist
from torch import nn
torch.set_num_threads(1)
rank, world, iters, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(1)
model = nn.Sequential(nn.Conv2d(1, 20, 3, padding=1), nn.ReLU(), nn.Flatten(),
                      nn.Linear(20 * 64, {hidden}), nn.ReLU(), nn.Linear({hidden}, 10))
if world > 1:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(rank)
x = torch.rand({batch}, 1, 8, 8, generator=g)
y = torch.randint(0, 10, ({batch},), generator=g)
warm = iters // 4
for i in range(iters):
    if i == warm:
        t0 = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
dt = time.perf_counter() - t0
if rank == 0:
    print(json.dumps({{"iter_per_s": (iters - warm) / dt}}))
dist.destroy_process_group()
"""


def one_thread_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


def run_poseidon(work: Path, db: Path, workers: int, comm: str, iters: int) -> dict:
    d = work / f"p{workers}_{comm}"
    d.mkdir()
    (d / "net.prototxt").write_text(NET.format(db=db, batch=BATCH, hidden=HIDDEN))
    display = max(iters // 6, 1)
    (d / "solver.prototxt").write_text(SOLVER.format(net="net.prototxt", iters=iters, display=display))
    cmd = [sys.executable, "-m", "poseidon_cli.main", "train", "--solver", str(d / "solver.prototxt")]
    stats = d / "stats.json"
    if workers > 1:
        base = free_base_port(workers)
        (d / "hosts").write_text("".join(f"127.0.0.1:{base + 2 * i}\n" for i in range(workers)))
        cmd += ["--hosts", str(d / "hosts"), "--comm", comm, "--stats", str(stats)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=one_thread_env())
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"poseidon P={workers} {comm} failed:\n{done.stderr[-3000:]}")
    rates = [float(m) for m in re.findall(r"Iteration \d+ \(([\d.e+-]+) iter/s", done.stderr)]
    rates = rates[2:] or rates  # skip the first window (start-up, warm-up)
    ips = statistics.median(rates) if rates else float("nan")
    out = {"workers": workers, "comm": comm if workers > 1 else "none", "iter_per_s": ips,
           "images_per_s": ips * BATCH * workers, "wall_s": wall}
    if workers > 1:
        s = json.loads(stats.read_text())
        out.update(wait_ms_per_iter=1e3 * s["wait_s_per_iter"], comm_ms_per_iter=1e3 * s["comm_s_per_iter"],
                   hidden_fraction=s["hidden_fraction"], plan={p["layer"]: p["scheme"] for p in s["plan"]},
                   bytes_per_iter={r["name"]: {"scheme": r["scheme"],
                                               "worker_sent_recv": r["all_sent_per_iter"] + r["all_recv_per_iter"],
                                               "network_sent_recv": r["net_sent_per_iter"] + r["net_recv_per_iter"]}
                                   for r in s["layers"]},
                   planned_bytes_per_node={p["layer"]: p["bytes_per_node"] for p in s["plan"]})
    return out


def run_ddp(workers: int, iters: int) -> dict:
    port = str(free_base_port(1))
    code = DDP_CHILD.format(hidden=HIDDEN, batch=BATCH)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(workers), str(iters), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=one_thread_env())
             for r in range(workers)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError("DDP failed:\n" + "\n".join(e[-1500:] for _, e in outs))
    ips = json.loads(outs[0][0].strip().splitlines()[-1])["iter_per_s"]
    return {"workers": workers, "iter_per_s": ips, "images_per_s": ips * BATCH * workers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--comms", default="ps,sfb,hybrid")
    ap.add_argument("--out", default="bench_comm.json")
    args = ap.parse_args(argv)
    sizes = [int(w) for w in args.workers.split(",")]
    comms = args.comms.split(",")
    results: dict = {"batch_per_worker": BATCH, "iters": args.iters, "cpu_count": os.cpu_count(),
                     "poseidon": [], "ddp": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        convert_digits(work / "digits")
        db = work / "digits" / "digits_train_lmdb"
        for n in sizes:
            ddp = run_ddp(n, args.iters)
            results["ddp"].append(ddp)
            for comm in (comms if n > 1 else ["none"]):
                r = run_poseidon(work, db, n, comm, args.iters)
                r["ratio_vs_ddp"] = r["images_per_s"] / ddp["images_per_s"]
                results["poseidon"].append(r)
                extra = ""
                if n > 1:
                    extra = (f"  wait {r['wait_ms_per_iter']:.1f} ms/iter, {100 * r['hidden_fraction']:.0f}%"
                             f" of comm hidden, bytes/iter (worker) "
                             + ", ".join(f"{k}:{v['scheme']}:{v['worker_sent_recv'] / 1e6:.2f}MB"
                                         for k, v in r["bytes_per_iter"].items()))
                print(f"P={n} {r['comm']:>6}: poseidon {r['images_per_s']:8.0f} img/s, DDP "
                      f"{ddp['images_per_s']:8.0f} img/s, ratio {r['ratio_vs_ddp']:.2f}{extra}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
