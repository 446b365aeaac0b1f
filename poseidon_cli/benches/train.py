"""`poseidon bench train`: data-parallel training on local workers, Poseidon against PyTorch
DistributedDataParallel (gloo), in the same run.

Two nets on the 8x8 digits, batch 32 per worker: ``fc`` (conv 3x3x20, InnerProduct 1280->1024,
InnerProduct 1024->10: FC-heavy, 1.3 M parameters) and ``conv`` (three 3x3 convolutions of 32,
64 and 64 channels, a pooling, InnerProduct 1024->10: conv-heavy, 66 K parameters and most of
the arithmetic in convolutions), trained by `poseidon train --hosts` with each scheme, and by the
same architecture under DDP. Both read the same LMDB records in the same order: worker r of P takes the r-th block
of B records of each P·B, as Poseidon's data layers do. Every process runs on one BLAS thread.
Reports images/s (medians of the solver's iter/s after warm-up; DDP timed the same way), bytes
per iteration, network wait and hidden fraction, and the ratio Poseidon / DDP. On one machine the
network is loopback and the workers share the cores: this measures overheads, not a cluster
(for that, `poseidon bench cluster`).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from poseidon_cli.launch.hostfile import free_base_port

ROOT = Path(__file__).resolve().parents[2]
#: between one run's end and the next one's start: at least SETTLE_S, then until MemFree holds
#: still (moves less than SETTLE_QUIET_BYTES_PER_S over a second), at most SETTLE_MAX_S. The
#: kernel frees a run's memory and namespaces for seconds after its processes exit (MemFree
#: still rose by 16 MB/s 5 s after a run), and the next run pays: MPI's ranks, which
#: busy-poll, ran at 0.60-0.80 of DDP 0-3 s after a Gloo or SFB run and 0.98 once MemFree
#: held still, 8-19 s after an SFB run (FC-heavy net, 1 Gbit/s). Every run, DDP's too, waits so.
SETTLE_S = 3.0
SETTLE_MAX_S = 30.0
SETTLE_QUIET_BYTES_PER_S = 4 << 20
BATCH = 32
HIDDEN = 1024

_DATA = """name: "BenchNet"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{db}" backend: LMDB batch_size: {batch} }} }}
"""
_LOSS = """layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "{top}" bottom: "label" top: "loss" }}
"""


def _conv(name: str, bottom: str, out: int) -> str:
    return (f'layer {{{{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"\n'
            f'  convolution_param {{{{ num_output: {out} kernel_size: 3 pad: 1 '
            f'weight_filler {{{{ type: "xavier" }}}} }}}} }}}}\n'
            f'layer {{{{ name: "relu_{name}" type: "ReLU" bottom: "{name}" top: "{name}" }}}}\n')


def _ip(name: str, bottom: str, out: int, relu: bool) -> str:
    text = (f'layer {{{{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}"\n'
            f'  inner_product_param {{{{ num_output: {out} weight_filler {{{{ type: "xavier" }}}} '
            f'}}}} }}}}\n')
    if relu:
        text += f'layer {{{{ name: "relu_{name}" type: "ReLU" bottom: "{name}" top: "{name}" }}}}\n'
    return text


#: name -> (the Caffe net as a template of db and batch, the same model in PyTorch)
NETS = {
    "fc": (_DATA + _conv("conv1", "data", 20) + _ip("ip1", "conv1", HIDDEN, True)
           + _ip("ip2", "ip1", 10, False) + _LOSS.replace("{top}", "ip2"),
           f"nn.Sequential(nn.Conv2d(1, 20, 3, padding=1), nn.ReLU(), nn.Flatten(), "
           f"nn.Linear(20 * 8 * 8, {HIDDEN}), nn.ReLU(), nn.Linear({HIDDEN}, 10))"),
    "conv": (_DATA + _conv("conv1", "data", 32) + _conv("conv2", "conv1", 64)
             + 'layer {{ name: "pool" type: "Pooling" bottom: "conv2" top: "pool"\n'
               '  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}\n'
             + _conv("conv3", "pool", 64) + _ip("ip", "conv3", 10, False)
             + _LOSS.replace("{top}", "ip"),
             "nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), "
             "nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2), "
             "nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 4 * 4, 10))"),
}

SOLVER = """net: "net.prototxt"
type: "SGD"
base_lr: 0.01
momentum: 0.9
lr_policy: "fixed"
max_iter: {iters}
display: {display}
random_seed: 1
snapshot_after_train: false
"""

_DDP_CHILD = r"""
import json, os, sys, time
import numpy as np
import torch, torch.distributed as dist
from torch import nn
from engine.data.datum import datum_to_array, parse_datum
from engine.data.lmdb_source import open_db
torch.set_num_threads(1)
rank, world, iters, port, db, master = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                        sys.argv[4], sys.argv[5], sys.argv[6])
import datetime
dist.init_process_group("gloo", init_method=f"tcp://{{master}}:{{port}}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=120))
torch.manual_seed(1)
model = {model}
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
src = open_db(db)
n = len(src)
def batch(it):
    # the records Poseidon's rank-strided data layer gives worker `rank` at iteration `it`
    first = it * world * {batch} + rank * {batch}
    xs, ys = [], []
    for k in range(first, first + {batch}):
        d = parse_datum(src.get(k % n)[1])
        xs.append(datum_to_array(d).astype(np.float32) * 0.00390625)
        ys.append(d.label)
    return torch.from_numpy(np.stack(xs)), torch.tensor(ys)
stamps = []
for it in range(iters):
    x, y = batch(it)
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    stamps.append(time.perf_counter())
warm = len(stamps) // 3
rate = (len(stamps) - 1 - warm) / (stamps[-1] - stamps[warm])
if rank == 0:
    print(json.dumps({{"iter_per_s": rate}}), flush=True)
# every rank done before any leaves, then leave without C++ teardown: gloo's destructors
# sometimes aborted a rank ("terminate called without an active exception"), also after a
# barrier and destroy_process_group (1 run in 20 here), failing a run that had finished
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


def one_thread_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


class Loopback:
    """Where the processes of one run live: this machine, on 127.0.0.1."""

    def __init__(self, workers: int) -> None:
        self.addresses = ["127.0.0.1"] * workers
        self.base = free_base_port(max(workers, 1))

    def port(self, i: int) -> int:
        return self.base + 2 * i

    def hosts_text(self) -> str:
        """One machine running every worker (worker i at base + 2i, as a hosts line's slots)."""
        return f"127.0.0.1:{self.base} slots={len(self.addresses)}\n"

    def start(self, rank: int, argv: list[str], **popen: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, start_new_session=True, **popen)

    def start_mpi(self, mpiexec: str, argv: list[str], **popen: Any) -> subprocess.Popen:
        """Every worker at once, as MPI's ranks: ``mpiexec -n P argv``."""
        return subprocess.Popen([mpiexec, "-n", str(len(self.addresses)), *argv],
                                start_new_session=True, **popen)

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class Emulated:
    """Where the processes of one run live: one network namespace per worker, each link
    shaped to ``bits_per_s`` each way (engine/perf/netns.py; needs root)."""

    def __init__(self, workers: int, bits_per_s: float) -> None:
        from engine.perf.netns import EmulatedCluster

        self.cluster = EmulatedCluster(workers, bits_per_s)
        self.addresses = self.cluster.addresses

    def port(self, i: int) -> int:
        return 29500

    def hosts_text(self) -> str:
        """A machine per worker, each at its namespace's address."""
        return "".join(f"{a}:{self.port(i)}\n" for i, a in enumerate(self.addresses))

    def start(self, rank: int, argv: list[str], **popen: Any) -> subprocess.Popen:
        # gloo listens on the interface it is told (by default the host name's address,
        # which another namespace cannot reach)
        env = {**popen.pop("env", os.environ), "GLOO_SOCKET_IFNAME": f"{self.cluster.tag}n{rank}"}
        return self.cluster.run(rank, argv, env=env, **popen)

    def start_mpi(self, mpiexec: str, argv: list[str], **popen: Any) -> subprocess.Popen:
        """Every worker at once, as MPI's ranks, each in its namespace (an MPMD line per
        rank): MPI's messages go over the shaped links (UCX's TCP on the rank's own end;
        no shared memory between ranks that MPI sees on one machine)."""
        line: list[str] = []
        for rank, ns in enumerate(self.cluster.namespaces):
            line += ([":"] if line else []) + [
                "-n", "1", "-env", "MPIR_CVAR_NOLOCAL", "1", "-env", "UCX_TLS", "tcp,self",
                "-env", "UCX_NET_DEVICES", self.cluster.interface(rank),
                "ip", "netns", "exec", ns, *argv]
        proc = subprocess.Popen([mpiexec, *line], start_new_session=True, **popen)
        self.cluster.procs.append(proc)
        return proc

    def __enter__(self) -> "Emulated":
        self.cluster.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cluster.__exit__(*exc)


def _wait_all(procs: list[subprocess.Popen], what: str) -> list[tuple[str, str]]:
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what}: still running after 600 s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(r, p.returncode, e) for r, (p, (_, e)) in enumerate(zip(procs, outs))
              if p.returncode]
    if failed:
        raise RuntimeError(f"{what} failed: " + " | ".join(
            f"rank {r} exit {rc}: " + " / ".join(e.strip().splitlines()[-3:])
            for r, rc, e in failed) + f" [rank 0 printed: {outs[0][0].strip()[-80:]!r}]")
    return outs


def run_poseidon(work: Path, db: Path, workers: int, variant: str, iters: int,
                 net: str = "fc", bits_per_s: float | None = None,
                 common: tuple[str, ...] = ()) -> dict[str, Any]:
    """One training run; ``variant`` is a scheme and maybe train options ('ring:--fusion-mb=4'),
    ``common`` options every variant takes. Each rank is started on its own (in its namespace
    with ``bits_per_s``) with a fresh key; for the mpi scheme, all by one mpiexec, and so for
    auto on a trusted network where MPI is installed: as a user with MPI starts a job, so
    that auto may choose every engine a scheme of the same run uses."""
    from engine.comm.auth import KEY_ENV, key_hex, new_key

    from .allreduce import mpi_launcher
    from .cluster import split_variant

    comm, extra = split_variant(variant)
    extra = [*common, *extra]
    d = work / f"{net}_p{workers}_{len(list(work.glob('*')))}"
    d.mkdir(parents=True)
    (d / "net.prototxt").write_text(NETS[net][0].format(db=db, batch=BATCH))
    (d / "solver.prototxt").write_text(SOLVER.format(iters=iters, display=max(iters // 6, 1)))
    cmd = [sys.executable, "-m", "poseidon_cli.main", "train", "--solver", str(d / "solver.prototxt")]
    stats = d / "stats.json"
    env = {**one_thread_env(), KEY_ENV: key_hex(new_key())}
    place = Emulated(workers, bits_per_s) if bits_per_s and workers > 1 else Loopback(workers)
    with place:
        if workers > 1:
            (d / "hosts").write_text(place.hosts_text())
            cmd += ["--hosts", str(d / "hosts"), "--comm", comm, *extra]
        io = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        mpiexec = mpi_launcher() if comm in ("mpi", "auto") else None
        mpi = comm == "mpi" or (comm == "auto" and "--trusted-network" in extra
                                and mpiexec is not None)
        if workers > 1 and mpi:  # MPI's launcher starts the ranks (rank 0 the stats)
            if mpiexec is None:
                raise RuntimeError("the mpi scheme needs mpi4py and mpiexec: pip install "
                                   "'poseidon[mpi]'")
            procs = [place.start_mpi(mpiexec, cmd + ["--stats", str(stats)], **io)]
        else:
            procs = [place.start(r, cmd + (["--rank", str(r)] if workers > 1 else [])
                                 + (["--stats", str(stats)] if workers > 1 and r == 0 else []),
                                 **io) for r in range(workers)]
        outs = _wait_all(procs, f"poseidon P={workers} {variant}")
    log = outs[0][1]
    rates = [float(m) for m in re.findall(r"Iteration \d+ \(([\d.e+-]+) iter/s", log)]
    rates = rates[2:] or rates  # skip the start-up windows
    ips = statistics.median(rates) if rates else float("nan")
    out: dict[str, Any] = {"net": net, "workers": workers, "comm": variant if workers > 1 else "-",
                           "iter_per_s": ips, "images_per_s": ips * BATCH * workers}
    if workers > 1:
        s = json.loads(stats.read_text())
        out.update(plan=sorted({p["scheme"] for p in s["plan"]}),
                   wait_ms_per_iter=1e3 * s["wait_s_per_iter"],
                   hidden_fraction=s["hidden_fraction"],
                   worker_bytes_per_iter=sum(r["all_sent_per_iter"] + r["all_recv_per_iter"]
                                             for r in s["layers"]))
    return out


def run_ddp(db: Path, workers: int, iters: int, net: str = "fc",
            bits_per_s: float | None = None) -> dict[str, Any]:
    code = _DDP_CHILD.format(model=NETS[net][1], batch=BATCH)
    place = Emulated(workers, bits_per_s) if bits_per_s and workers > 1 else Loopback(workers)
    with place:
        procs = [place.start(r, [sys.executable, "-c", code, str(r), str(workers), str(iters),
                                 str(place.port(0) + 1), str(db), place.addresses[0]],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=one_thread_env()) for r in range(workers)]
        outs = _wait_all(procs, "DDP")
    ips = json.loads(outs[0][0].strip().splitlines()[-1])["iter_per_s"]
    return {"net": net, "workers": workers, "iter_per_s": ips,
            "images_per_s": ips * BATCH * workers}


def _mem_free() -> int | None:
    """MemFree in bytes (None where there is no /proc/meminfo)."""
    from engine.blob import meminfo_bytes
    return meminfo_bytes("MemFree")


def settle() -> float:
    """Wait for the last run's memory to be freed (``SETTLE_S``); the seconds waited."""
    began = time.monotonic()
    time.sleep(SETTLE_S)
    last, quiet = _mem_free(), 0
    while last is not None and quiet < 2 and time.monotonic() - began < SETTLE_MAX_S:
        time.sleep(0.5)
        now = _mem_free()
        quiet = quiet + 1 if now is not None and abs(now - last) < \
            SETTLE_QUIET_BYTES_PER_S / 2 else 0
        last = now
    return time.monotonic() - began


def _settled(run_once: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run_once(*args)`` once the last run's memory is freed, with the seconds waited."""
    settled = settle()
    return {**run_once(*args), "settled_s": settled}


def run(workers: list[int], comms: list[str], iters: int, work: Path, with_ddp: bool,
        say: Callable[[str], None] = print, nets: tuple[str, ...] = ("fc",),
        repeats: int = 1, bits_per_s: float | None = None,
        common: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every (net, P) runs DDP and each scheme ``repeats`` times, alternating, each repeat in
    an order of its own (``order``); the rates are the medians of the repeats. With
    ``bits_per_s`` every worker of both runs in a network namespace of its own, its link
    shaped to that rate each way."""
    from engine.data.converters import convert_digits

    from .alternation import order

    convert_digits(work / "digits")
    db = work / "digits" / "digits_train_lmdb"
    results: dict[str, Any] = {"batch_per_worker": BATCH, "iters": iters, "repeats": repeats,
                               "link_bits_per_s": bits_per_s, "options": list(common),
                               "cpu_count": os.cpu_count(), "poseidon": [], "ddp": []}
    for net in nets:
        for n in workers:
            runs: dict[str, list[dict[str, Any]]] = {}
            peers = (["ddp"] if with_ddp else []) + (comms if n > 1 else ["-"])
            for k in range(repeats):
                for peer in order(peers, k):
                    runs.setdefault(peer, []).append(
                        _settled(run_ddp, db, n, iters, net, bits_per_s) if peer == "ddp"
                        else _settled(run_poseidon, work / f"r{k}", db, n, peer, iters, net,
                                      bits_per_s, common))
            ddp = _median_run(runs["ddp"]) if with_ddp else None
            if ddp:
                results["ddp"].append(ddp)
            for comm in (comms if n > 1 else ["-"]):
                r = _median_run(runs[comm])
                if ddp:
                    r["ratio_vs_ddp"] = r["images_per_s"] / ddp["images_per_s"]
                results["poseidon"].append(r)
                line = f"{net:>4} P={n} {r['comm']:>6}: poseidon {r['images_per_s']:8.0f} img/s"
                if ddp:
                    line += (f", DDP {ddp['images_per_s']:8.0f} img/s, "
                             f"ratio {r['ratio_vs_ddp']:.2f}")
                    if repeats > 1:  # each repeat against DDP's median: where runs split
                        ratios = [x / ddp["images_per_s"] for x in r["images_per_s_runs"]]
                        line += f" (runs {min(ratios):.2f}-{max(ratios):.2f})"
                if n > 1:
                    line += (f"; wait {r['wait_ms_per_iter']:.1f} ms/iter, "
                             f"{100 * r['hidden_fraction']:.0f}% hidden, "
                             f"{r['worker_bytes_per_iter'] / 1e6:.2f} MB/iter, plan {r['plan']}")
                say(line)
    return results


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat whose rate is the median (its other counters with it), all rates kept."""
    ordered = sorted(runs, key=lambda r: r["images_per_s"])
    out = dict(ordered[len(ordered) // 2])
    out["images_per_s_runs"] = [r["images_per_s"] for r in runs]
    out["settled_s_runs"] = [r.get("settled_s") for r in runs]
    return out
