"""Benchmark: what a worker costs while it waits for a peer that never comes.

    python benchmarks/bench_idle.py [--window 20] [--repeats 3] [--out FILE]

Rank 0 of a two-worker job (DigitsLeNet, a hosts file of two loopback workers, rank 1 never
started) builds its net, then waits at the start-up barrier. Once it has said so, its process
and its shard's are sampled over ``--window`` seconds: CPU seconds per process and per thread
(Linux's /proc), as a share of one core. The peer in the same run: torch.distributed's rank 0
waiting in ``init_process_group`` (Gloo, a TCP store) for a rank 1 that never comes, the
wait a DDP user knows. The two alternate, ``--repeats`` times each; medians are printed, with
the ratio, and everything as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine.perf.cpu import children, stat_cpu  # noqa: E402  (the checkout's, run from anywhere)


def threads(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` and of its children, keyed 'process/thread tid'."""
    pids = [pid, *children(pid)]
    out = {}
    for p in pids:
        role = "worker" if p == pid else "shard"
        for tid in os.listdir(f"/proc/{p}/task"):
            got = stat_cpu(f"/proc/{p}/task/{tid}/stat")
            if got is not None:
                out[f"{role}/{got[0]} {tid}"] = got[1]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(proc: subprocess.Popen, window: float) -> dict:
    """Share of a core per thread over ``window`` s, and the total."""
    before, t0 = threads(proc.pid), time.monotonic()
    time.sleep(window)
    after, span = threads(proc.pid), time.monotonic() - t0
    per = {k: (after[k] - before.get(k, 0.0)) / span for k in after}
    return {"total": sum(per.values()), "threads": {k: v for k, v in per.items() if v > 0}}


def wait_for(proc: subprocess.Popen, log: Path, text: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"no {text!r} within {limit:g} s:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


def poseidon_waiting(tmp: Path, window: float) -> dict:
    digits = ROOT / "models" / "data" / "digits"
    if not digits.exists():
        subprocess.run([sys.executable, "-m", "poseidon_cli.main", "data", "digits", "--out",
                        str(digits)], check=True, cwd=ROOT, capture_output=True)
    base = free_port()
    hosts = tmp / "hosts.txt"
    hosts.write_text(f"0 127.0.0.1 {base}\n1 127.0.0.1 {base + 2}\n")
    key = tmp / "job.key"
    if not key.exists():
        subprocess.run([sys.executable, "-m", "poseidon_cli.main", "keygen", str(key)],
                       check=True, cwd=ROOT, capture_output=True)
    log = tmp / "poseidon.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "poseidon_cli.main", "train", "--solver",
             str(ROOT / "models/digits_lenet/solver.prototxt"), "--hosts", str(hosts),
             "--key-file", str(key), "--rank", "0",
             "--startup-timeout", str(int(window) + 120)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(proc, log, "HELLO from worker 1")
        time.sleep(2.0)  # past the first words of waiting
        return sample(proc, window)
    finally:
        proc.kill()
        proc.wait()


TORCH_RANK0 = """
import datetime, sys, torch.distributed as dist
print("waiting", file=sys.stderr, flush=True)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=2, timeout=datetime.timedelta(seconds=float(sys.argv[2])))
"""


def torch_waiting(tmp: Path, window: float) -> dict:
    log = tmp / "torch.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", TORCH_RANK0, str(free_port()),
                                 str(window + 120)], stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(proc, log, "waiting")
        time.sleep(2.0)
        return sample(proc, window)
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"poseidon": [], "torch": []}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeats):
            runs["poseidon"].append(poseidon_waiting(Path(d), args.window))
            runs["torch"].append(torch_waiting(Path(d), args.window))
    med = {k: statistics.median(r["total"] for r in v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k:>9} waiting: {med[k]:.3%} of a core (median of {len(v)}: "
              + ", ".join(f"{r['total']:.3%}" for r in v) + ")")
    print(f"ratio poseidon/torch: {med['poseidon'] / max(med['torch'], 1e-9):.2f}")
    last = runs["poseidon"][-1]["threads"]
    for name, share in sorted(last.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<40} {share:.3%}")
    report = {"window_s": args.window, "median_share": med, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"median_share": med}))


if __name__ == "__main__":
    main()
