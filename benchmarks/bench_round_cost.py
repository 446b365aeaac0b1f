"""Benchmark: what one layer's round through the mpi scheme costs above MPI's own call, cold.

    python benchmarks/bench_round_cost.py [--workers 2] [--sizes 64K,1M] [--rounds 200]
                                          [--gap-ms 5] [--json FILE]

Under ``mpiexec -n P`` (started here), each rank builds the mpi scheme's syncer for one layer
of each size (``poseidon bench comm --allreduce``'s: the real path, from the layer's release
to its update, and the wait before its next forward) and alternates it with mpi4py's
Allreduce called bare on the same diff, each after a barrier and ``--gap-ms`` of other
Python on the training thread. The gap is what makes the round cold, as in training, where
backward runs between a layer's rounds: on a busy VM a Python path slows several times after
some milliseconds of other work, where MPI's one C call barely does (docs/engines.md). A
round's time is the slowest rank's; printed are the medians, the scheme's over the bare
call's, and the round's cost above it, and everything as JSON. Run it from two checkouts to
compare a change: the syncer it measures is its own checkout's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(args: argparse.Namespace) -> None:
    import numpy as np

    from engine.comm.auth import job_key
    from engine.comm.schemes.mpi import init_mpi
    from poseidon_cli.benches.allreduce import bare_call, layer_syncer
    from poseidon_cli.options import parse_sizes

    MPI = init_mpi()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    key = job_key(None)
    assert key is not None
    gap = args.gap_ms / 1e3

    def spin() -> None:
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass

    rows = []
    for k, nbytes in enumerate(parse_sizes(args.sizes)):
        sync, buf = layer_syncer("mpi", nbytes, rank, world, args.port + 4 * world * k, key)

        def scheme() -> None:
            sync.release(0)
            sync.wait(0)

        peers = {"bare": bare_call("mpi", sync, buf), "scheme": scheme}
        times: dict[str, list[float]] = {p: [] for p in peers}
        for i in range(args.rounds + 5):  # the first five warm up
            for name in (("bare", "scheme") if i % 2 else ("scheme", "bare")):
                comm.Barrier()
                spin()
                t = time.perf_counter()
                peers[name]()
                times[name].append(time.perf_counter() - t)
        sync.close()
        mine = np.array([times[p] for p in peers])  # buffers, not pickles, between the ranks
        every = np.empty((world, *mine.shape)) if rank == 0 else None
        comm.Gather(mine, every, root=0)
        if rank == 0:
            slowest = every.max(axis=0)[:, 5:]  # each round's slowest rank, past the warm-up
            med = {p: float(np.median(slowest[j])) for j, p in enumerate(peers)}
            rows.append({"bytes": nbytes, "bare_us": med["bare"] * 1e6,
                         "scheme_us": med["scheme"] * 1e6,
                         "ratio": med["scheme"] / med["bare"],
                         "above_us": (med["scheme"] - med["bare"]) * 1e6})
    if rank == 0:
        Path(args.json).write_text(json.dumps({"workers": world, "gap_ms": args.gap_ms,
                                               "rounds": args.rounds, "rows": rows}))
    comm.Barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sizes", default="64K,1M")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=47300)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from poseidon_cli.options import parse_sizes
    try:
        parse_sizes(args.sizes)
    except ValueError as e:
        sys.exit(f"bench_round_cost: --sizes: {e}")
    from engine.comm.auth import KEY_ENV, key_hex, new_key
    from poseidon_cli.benches.allreduce import mpi_launcher

    mpiexec = mpi_launcher()
    if mpiexec is None:
        sys.exit("bench_round_cost: needs mpi4py and mpiexec (pip install 'poseidon[mpi]')")
    out = Path(args.json or os.devnull)
    result = Path(f"/tmp/bench_round_cost_{os.getpid()}.json")
    cmd = [mpiexec, "-n", str(args.workers), sys.executable, __file__, "--child",
           "--sizes", args.sizes, "--rounds", str(args.rounds), "--gap-ms", str(args.gap_ms),
           "--port", str(args.port), "--json", str(result)]
    env = {**os.environ, KEY_ENV: key_hex(new_key()), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, env=env, timeout=600, check=False, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode != 0 or not result.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            sys.exit(f"bench_round_cost: {mpiexec} -n {args.workers} failed "
                     f"(exit {done.returncode}): {last}")
        got = json.loads(result.read_text())
    except subprocess.TimeoutExpired:
        sys.exit(f"bench_round_cost: {mpiexec} -n {args.workers} took over 600 s")
    finally:
        result.unlink(missing_ok=True)
    print(f"P={got['workers']}, {got['gap_ms']:g} ms of other Python before each, "
          f"{got['rounds']} rounds each, the slowest rank's medians:")
    for r in got["rows"]:
        print(f"  {r['bytes']:>9} B: bare {r['bare_us']:7.1f} us, scheme {r['scheme_us']:7.1f} us,"
              f" {r['ratio']:.2f}x, {r['above_us']:6.1f} us above")
    if args.json:
        out.write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
