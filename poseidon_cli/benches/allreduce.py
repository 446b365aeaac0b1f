"""`poseidon bench comm --allreduce`: Poseidon's allreduce schemes beside the engines called
bare, in the same processes, alternating.

P processes on loopback, a set of them for each engine (``groups``): Gloo's, plain processes
that run Poseidon's ring and hd too, and MPI's, started by mpiexec (when mpi4py and mpiexec
are there); a job runs one engine, and another's threads in the process slow this one. For
each size, every process builds one Syncer per scheme of its set (the real path, from the
release of a layer of that size to its sum in the diffs: for ring and hd through the
progress thread; an engine's, the round's last unit, summed on the releasing thread; the
mean is the solver update's, folded into the pass it makes anyway), and, beside them, its
engine called bare: torch.distributed's all_reduce on a Gloo process group, mpi4py's
Allreduce, as a user's script would, on the engine scheme's own group (communicator) and
vector (``bare_call``).
Each repeat runs every peer once, each after a barrier, in an order of its own
(``alternation.order``: a peer runs slower after one whose threads are still winding down,
gloo's say, and so each follows every other one alike). A repeat is a batch of rounds back to back (``rounds_per_repeat``), as a
training step releases its layers; its time per round runs from the start of its last rank
to the end of its last (``collective_time``), after a warm-up (``warm_up_alternations``),
and the row gives the median over the repeats. A scheme is timed twice over:
from the release of its layer to the sum in its diffs (what training waits for before the
update), and its sum alone ("<scheme>: sum": from the gathered vector to the summed one, in
a batch of its own after each repeat: the clock reads that take it are not in the timed
rounds). Every process runs with one BLAS thread.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
#: Poseidon's schemes, then the engines bare
SCHEMES = ("ring", "hd", "gloo", "mpi")
BARE = ("torch.distributed gloo", "mpi4py Allreduce")
#: the scheme each bare call is the engine of
ENGINE_OF = {"gloo": "torch.distributed gloo", "mpi": "mpi4py Allreduce"}
SIZES = (64 << 10, 1 << 20, 64 << 20)


@dataclass
class Row:
    workers: int
    bytes: int
    #: peer -> median seconds a round (over the repeats; a repeat is ``rounds`` back to back)
    seconds: dict[str, float]
    repeats: int
    rounds: int

    def ratio(self, scheme: str, part: str = "") -> float | None:
        """An engine scheme's time (``part`` ': sum': its sum alone) over its engine's bare
        call."""
        bare = self.seconds.get(ENGINE_OF.get(scheme, ""))
        mine = self.seconds.get(scheme + part)
        return mine / bare if mine and bare else None

    def as_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "bytes": self.bytes, "seconds": self.seconds,
                "repeats": self.repeats, "rounds_per_repeat": self.rounds,
                "engine_over_bare": {s: self.ratio(s) for s in ENGINE_OF if self.ratio(s)},
                "engine_sum_over_bare": {s: self.ratio(s, ": sum") for s in ENGINE_OF
                                         if self.ratio(s, ": sum")}}


def mpi_launcher() -> str | None:
    """mpiexec, when mpi4py is installed and an mpiexec is on PATH (or beside Python)."""
    from engine.comm.schemes.mpi import MpiBackend
    if MpiBackend.missing(False).startswith(("mpi4py is not", "mpi4py finds no")):
        return None
    return shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def repeats_for(nbytes: int, budget: int) -> int:
    """Timed repeats of a size: ``budget`` (4x --repeats), or as many as move 1 GB a peer,
    at least 5. A 64 MB repeat is one round, and 8 of them left a row's median moving by a
    tenth between runs (Gloo, four ranks: 0.93x to 1.13x of the bare call)."""
    return max(5, min(budget, (1 << 30) // max(nbytes, 1)))


def rounds_per_repeat(nbytes: int) -> int:
    """Rounds a repeat runs back to back: 32 MB a peer, at most 64 rounds. One round a
    repeat gave medians that were a coin's toss on Gloo here, where a fifth to a half of the
    calls wait a scheduler tick (two ranks, 64 KB, 200 single rounds: the scheme 0.33x to
    3.95x of the bare call in four runs; 40 repeats of 64 rounds: 0.94x-1.04x in three)."""
    return max(1, min(64, (32 << 20) // max(nbytes, 1)))


def warm_up_alternations(nbytes: int, repeats: int) -> int:
    """Untimed alternations before the timed ones: until each peer has run 500 rounds or
    moved 64 MB, and at least two (each peer follows another), or as many as are timed where
    a repeat is one round. Connections and first-touch pages want a round or two, the cores'
    and caches' idle states many more: measured here, two ranks, 64 KB, mpi4py's bare
    Allreduce took 50-70 us (median of 40) after 40 warm-up rounds and 22.7 after 300 or
    1,000; 1 MB 640-650 us after 40 and 198-200 after 300."""
    batch = rounds_per_repeat(nbytes)
    rounds = min(500, (64 << 20) // max(nbytes, 1))
    return max(2, -(-rounds // batch), repeats if batch == 1 else 0)


def groups(gloo: bool, mpi: bool) -> list[tuple[list[str], bool]]:
    """The peers each set of processes runs, and whether mpiexec starts them: each engine
    beside its own bare call, and Poseidon's ring and hd beside Gloo (else MPI). A job runs
    one engine, and another engine's threads in the process slow this one: measured here,
    two ranks, 64 KB, mpi4py's bare Allreduce took 22.4 us beside the mpi scheme alone and
    38.2 with Gloo's process group and Poseidon's other syncers in the process too."""
    out = []
    if gloo:
        out.append((["ring", "hd", "gloo", BARE[0]], False))
    if mpi:
        out.append((["mpi", BARE[1]] + ([] if gloo else ["ring", "hd"]), True))
    return out


def run(workers: list[int], sizes: list[int], budget: int,
        say: Callable[[Row], None] | None = None) -> tuple[list[Row], dict[str, Any]]:
    """Every worker count and size; (the rows, what ran: the peers and why some did not)."""
    from engine.comm.auth import KEY_ENV, key_hex, new_key
    from engine.comm.schemes.gloo import GlooBackend

    gloo = not GlooBackend.missing(False)
    mpiexec = mpi_launcher()
    sets = groups(gloo, mpiexec is not None)
    notes = {"peers": [peer for peers, _ in sets for peer in peers],
             "processes": [peers for peers, _ in sets],
             "gloo": "" if gloo else GlooBackend.missing(False),
             "mpi": mpiexec or "mpi4py or mpiexec is missing: pip install 'poseidon[mpi]'"}
    if not sets:
        raise RuntimeError("bench comm --allreduce needs PyTorch or MPI for its barrier: "
                           "pip install 'poseidon[gloo]' or 'poseidon[mpi]'")
    rows = []
    with tempfile.TemporaryDirectory(prefix="poseidon-bench-allreduce-") as d:
        for p in workers:
            seconds: dict[int, dict[str, float]] = {n: {} for n in sizes}
            reps: dict[int, int] = {}  # repeats (alike for every set)
            for g, (peers, by_mpi) in enumerate(sets):
                env = {**os.environ, KEY_ENV: key_hex(new_key()), "OPENBLAS_NUM_THREADS": "1",
                       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
                times = _processes(Path(d), f"p{p}g{g}", p, sizes, peers, budget,
                                   mpiexec if by_mpi else None, env)
                for nbytes in sizes:
                    got = [t[str(nbytes)] for t in times]
                    reps[nbytes] = len(got[0][peers[0]])
                    batch = rounds_per_repeat(nbytes)
                    for peer in got[0]:  # a peer's span is a batch; a sum's, one round of it
                        spans = [t[peer] for t in got]
                        seconds[nbytes][peer] = (
                            collective_time(spans, spans=batch) if peer.endswith(": sum")
                            else collective_time(spans, rounds=batch))
            for nbytes in sizes:
                row = Row(p, nbytes, seconds[nbytes], reps[nbytes], rounds_per_repeat(nbytes))
                rows.append(row)
                if say is not None:
                    say(row)
    return rows, notes


def collective_time(ranks: list[list[tuple[float, float]]], rounds: int = 1,
                    spans: int = 1) -> float:
    """The median over the repeats of a collective's time a round: each span's time from
    the start of its last rank to the end of its last (every rank's (start, end) on the
    machine's one monotonic clock); a repeat is ``spans`` consecutive spans (a scheme's sums
    each of a round) of ``rounds`` rounds each (a peer's batch).
    A collective can start no earlier, and a barrier lets its ranks go at times of their
    own: Gloo's, whose waiting threads sleep, by milliseconds on two busy cores (measured:
    half of torch.distributed's 64 KB allreduces took 2-8 ms from their own rank's start,
    the rest 0.2-0.6)."""
    each = [max(r[i][1] for r in ranks) - max(r[i][0] for r in ranks)
            for i in range(len(ranks[0]))]
    return statistics.median(sum(each[i:i + spans]) for i in range(0, len(each), spans)) \
        / (rounds * spans)


def _processes(d: Path, name: str, p: int, sizes: list[int], peers: list[str], budget: int,
               mpiexec: str | None, env: dict[str, str]) -> list[dict[str, Any]]:
    """P processes (by ``mpiexec``, else plain ones) that run ``peers`` for every size: each
    rank's times."""
    from poseidon_cli.launch.hostfile import free_base_port

    # the bare group's store, then each (size, scheme)'s endpoints
    base = free_base_port((2 + len(sizes) * len(SCHEMES) * (2 * p + 2)) // 2 + 1)
    config = d / f"{name}.json"
    config.write_text(json.dumps({
        "world": p, "sizes": sizes, "peers": peers, "base": base, "name": name,
        "repeats": [repeats_for(n, budget) for n in sizes], "out": str(d)}))
    cmd = [sys.executable, "-m", "poseidon_cli.benches.allreduce", str(config)]
    if mpiexec:
        procs = [subprocess.Popen([mpiexec, "-n", str(p), *cmd], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    else:
        procs = [subprocess.Popen([*cmd, str(r)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(p)]
    try:
        outs = [q.communicate(timeout=1800) for q in procs]
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    failed = [e for q, (_, e) in zip(procs, outs) if q.returncode]
    if failed:
        raise RuntimeError(f"bench comm --allreduce, {p} workers ({', '.join(peers)}): " +
                           " | ".join(" / ".join(e.strip().splitlines()[-4:]) for e in failed))
    return [json.loads((d / f"{name}_rank{r}.json").read_text()) for r in range(p)]


# ------------------------------------------------------------------------- one process
class _Blob:
    def __init__(self, n: int) -> None:
        self.data = np.zeros(n, np.float32)
        self.diff = np.zeros(n, np.float32)  # summed every round: ones would overflow


def layer_syncer(scheme: str, nbytes: int, rank: int, world: int, base: int,
                 key: bytes) -> tuple[Any, np.ndarray]:
    """One layer of ``nbytes`` synchronised by ``scheme`` among ``world`` local workers:
    (its Syncer, its diff)."""
    from engine.comm.cost import LayerInfo
    from engine.comm.planner import PlanOptions, make_plan
    from engine.comm.syncer import Syncer, open_worker
    from engine.comm.wire import frame_limit
    from engine.comm.units import LayerSlot, ParamSlot
    from poseidon_cli.launch.hostfile import parse_hosts_text

    n = nbytes // 4
    blob = _Blob(n)
    slots = {0: LayerSlot(0, "grad", [ParamSlot(0, "grad/0", blob)])}
    infos = [LayerInfo(0, "grad", [(n,)])]
    hosts = parse_hosts_text("".join(f"{i} 127.0.0.1 {base + 2 * i}\n" for i in range(world)))
    ep = open_worker(rank, hosts, key=key, timeout=120, shards=False,
                     max_frame_bytes=frame_limit(slots, world))
    engines = (scheme,) if scheme in ENGINE_OF else ()

    def planner(link: Any, local: Any, joined: Any, crowding: float, shm: Any) -> Any:
        return make_plan(infos, world, PlanOptions(comm=scheme, link=link, engines=joined))

    return Syncer(ep, slots, lambda layer: None, planner=planner, levels=False,
                  engines=engines, required_engines=engines), blob.diff


def child(config_path: str, rank_arg: str | None) -> None:
    from engine.comm.auth import job_key

    from .alternation import order

    cfg = json.loads(Path(config_path).read_text())
    world, peers = cfg["world"], cfg["peers"]
    rank = int(os.environ["PMI_RANK"]) if rank_arg is None else int(rank_arg)
    key = job_key(None)
    assert key is not None
    barrier = _barrier(peers, rank, world, cfg["base"])
    times: dict[str, dict[str, list[float]]] = {}
    per_size = 2 * world + 2
    for k, nbytes in enumerate(cfg["sizes"]):
        syncers, diffs = {}, {}
        for j, scheme in enumerate(s for s in SCHEMES if s in peers):
            base = cfg["base"] + 2 + (k * len(SCHEMES) + j) * per_size
            syncers[scheme], diffs[scheme] = layer_syncer(scheme, nbytes, rank, world, base,
                                                          key)
        bare = {ENGINE_OF[s]: bare_call(s, syncers[s], diffs[s]) for s in ENGINE_OF
                if s in syncers}
        row: dict[str, list[tuple[float, float]]] = {peer: [] for peer in peers}
        row.update({f"{s}: sum": [] for s in syncers})
        schemes = {s: next(iter(sync._schemes.values())) for s, sync in syncers.items()}

        batch = rounds_per_repeat(nbytes)

        def once(peer: str) -> tuple[float, float]:
            barrier()
            t = time.perf_counter()
            for _ in range(batch):
                if peer in syncers:
                    syncers[peer].release(0)
                    syncers[peer].wait(0)
                else:
                    bare[peer]()
            return t, time.perf_counter()

        for i in range(warm_up_alternations(nbytes, cfg["repeats"][k])):
            for peer in order(peers, i):
                once(peer)
        for i in range(cfg["repeats"][k]):
            for peer in order(peers, i):
                row[peer].append(once(peer))
            # each scheme's sums in a batch of their own, after the timed ones: the two
            # clock reads that take a sum's span cost a 64 KB round a percent or two
            for s, scheme in schemes.items():
                scheme.spans = row[f"{s}: sum"]
                once(s)
                scheme.spans = None
        for s in syncers.values():
            s.close()
        times[str(nbytes)] = row
    Path(cfg["out"], f"{cfg['name']}_rank{rank}.json").write_text(json.dumps(times))
    barrier()  # every rank wrote its times before any leaves (the launcher ends at the first)


def _barrier(peers: list[str], rank: int, world: int, port: int) -> Callable[[], None]:
    """The barrier between measurements: MPI's, else torch.distributed's default group's."""
    if BARE[1] in peers:
        from engine.comm.schemes.mpi import init_mpi
        return init_mpi().COMM_WORLD.Barrier
    if BARE[0] in peers:
        import datetime

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        return dist.barrier
    raise RuntimeError("bench comm --allreduce needs PyTorch or MPI for its barrier")


def bare_call(scheme: str, syncer: Any, diff: np.ndarray) -> Callable[[], None]:
    """The engine under ``scheme`` called bare, as a user's script calls it (torch.distributed's
    all_reduce on a Gloo process group, mpi4py's Allreduce), on the scheme's own group or
    communicator and its own diff: the same connections and the same buffer, so that a ratio
    is Poseidon's path alone. (On another vector allocated alike, mpi4py's 64 MB Allreduce
    took 1.2-1.5x as long here, two ranks; torch.distributed's default group, with a device
    of its own, took 2.2-2.5 ms for 1 MB where the scheme's own group took 1.4-1.9.)"""
    [scheme_obj] = syncer._schemes.values()
    backend = scheme_obj.collective.backend
    if scheme == "gloo":
        import torch
        group, tensors = backend.group, [torch.from_numpy(diff)]
        return lambda: group.allreduce(tensors).wait()
    from engine.comm.schemes.mpi import init_mpi
    MPI = init_mpi()
    comm = backend.comm
    return lambda: comm.Allreduce(MPI.IN_PLACE, diff, op=MPI.SUM)


if __name__ == "__main__":
    from poseidon_cli.console import run_process

    # without the interpreter's teardown, but through MPI_Finalize (atexit): each os._exit
    # left MPICH's shared-memory segment in /dev/shm
    run_process(lambda: child(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
