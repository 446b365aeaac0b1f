"""`poseidon bench shard`: PHub's fast shard server (threads=N) against today's (threads=0),
in the same run.

For each layout, one cluster per thread count, all started before the first measurement: a
real shard process (engine/comm/shard.py: its Endpoint, authenticated messages, loopback) and
P synthetic worker processes, each a real worker Endpoint. A measurement runs ``rounds`` BSP
rounds on one cluster: every worker pushes every chunk of the layout, then waits for every
chunk's sum (checked, authenticated) before the next round. The clusters take turns,
``repeats`` times, so all see the same machine; each row is the median.

- aggregation throughput = bytes summed per second = P x the layout's bytes / round time;
- rounds/s = 1 / round time (a round ends when the slowest worker has every sum);
- the shard process's CPU time per round (user + system, all its threads, from /proc), and
  the bytes it sums per CPU-second: what a shard would do with cores of its own.

What this measures: the round trip through one shard that holds the whole layout, with the P
workers on the same machine. The workers' own costs (authenticating P x the layout's bytes
each way, ZeroMQ's copies into and out of the kernel) share the machine's cores with the
shard, so the ratios are this machine's, not those of a shard with cores of its own; the
shard's CPU per round is its own cost either way.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from engine.comm.hosts import HostEntry
from engine.comm.chunks import (
    DEFAULT_CHUNK_BYTES,
    PUSH,
    SUM,
    Chunk,
    PSParam,
    layout_digest,
    make_layout,
)
from engine.pb import poseidon_pb2 as pb
from poseidon_cli.launch.hostfile import free_base_port, parse_hosts_text

SHARD0 = ("shard", 0)
#: seconds any wait of the benchmark may take before it stops naming what did not come
TIMEOUT_S = 120.0


def vgg16_counts() -> list[int]:
    """Values per learnable layer (weights and bias) of VGG-16 without fc6, the layer
    Poseidon's planner sends by SFB (it alone is 411 MB): 142 MB of PS traffic in 15 vectors."""
    convs = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 256),
             (256, 512), (512, 512), (512, 512), (512, 512), (512, 512), (512, 512)]
    counts = [cin * cout * 9 + cout for cin, cout in convs]
    return counts + [4096 * 4096 + 4096, 1000 * 4096 + 1000]


def resnet50_counts() -> list[int]:
    """Values per learnable layer of Caffe's ResNet-50: the convolutions (no bias), each
    followed by a Scale layer (gamma and beta), and fc1000: 102 MB in 107 vectors, half of
    them a few KB (many small chunks)."""
    counts = [3 * 64 * 49, 2 * 64]
    cin = 64
    for mid, out, blocks in ((64, 256, 3), (128, 512, 4), (256, 1024, 6), (512, 2048, 3)):
        for b in range(blocks):
            if b == 0:  # the projection shortcut
                counts += [cin * out, 2 * out]
            counts += [cin * mid, 2 * mid, mid * mid * 9, 2 * mid, mid * out, 2 * out]
            cin = out
    return counts + [2048 * 1000 + 1000]


LAYOUTS: dict[str, Callable[[], list[int]]] = {"vgg": vgg16_counts, "resnet": resnet50_counts}


def layout(name: str, wire: str, chunk_bytes: int) -> list[Chunk]:
    """The chunk table of ``name`` for one shard that holds all of it."""
    if name not in LAYOUTS:
        raise ValueError(f"layout {name!r}: expected one of {', '.join(LAYOUTS)}")
    params = [PSParam(i, i, n, np.dtype(wire).str) for i, n in enumerate(LAYOUTS[name]())]
    return make_layout(params, 1, chunk_bytes)


def layout_bytes(chunks: Sequence[Chunk]) -> int:
    return sum(c.count * np.dtype(c.dtype).itemsize for c in chunks)


@dataclass
class Row:
    layout: str
    threads: int
    workers: int
    chunks: int
    bytes: int                # of the layout (one worker's push of every chunk)
    round_s: float            # median
    shard_cpu_s: float        # the shard process's CPU seconds per round, median
    samples_s: list[float] = field(default_factory=list)
    baseline_round_s: float = 0.0  # threads=0's median, measured in the same run

    @property
    def summed_gb_s(self) -> float:
        return self.workers * self.bytes / self.round_s / 1e9

    @property
    def rounds_per_s(self) -> float:
        return 1.0 / self.round_s

    @property
    def ratio(self) -> float:
        """Throughput against threads=0's."""
        return self.baseline_round_s / self.round_s if self.round_s else 0.0

    @property
    def gb_per_cpu_s(self) -> float:
        """Bytes summed per CPU-second of the shard process."""
        return self.workers * self.bytes / self.shard_cpu_s / 1e9 if self.shard_cpu_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summed_gb_s": self.summed_gb_s,
                "rounds_per_s": self.rounds_per_s, "ratio": self.ratio,
                "gb_per_cpu_s": self.gb_per_cpu_s}


# --------------------------------------------------------------------------- the processes
def _shard_main(hosts: list[HostEntry], key: bytes, threads: int) -> None:
    from engine.comm.errors import CommError
    from engine.comm.shard import ShardServer

    srv = ShardServer(0, hosts, key=key, timeout=TIMEOUT_S, threads=threads)
    try:
        srv.start()
        srv.serve()
    except CommError:
        pass  # the workers see the same error (ABORT) and report it
    finally:
        srv.close()


def check_sum(msg: Any, by_id: dict[tuple[int, int], Chunk]) -> str | None:
    """A synthetic worker's check of a received message: a PS sum of a known chunk."""
    h = msg.header
    c = by_id.get((h.param, h.chunk))
    if h.scheme != "ps" or h.op != SUM or c is None:
        return f"not a PS sum of a known chunk (param {h.param} chunk {h.chunk} op {h.op})"
    if [(a.shape, a.dtype.str) for a in msg.arrays] != [((c.count,), c.dtype)]:
        return f"param {h.param} chunk {h.chunk}: wrong arrays"
    return None


def synthetic_worker(rank: int, hosts: Sequence[HostEntry], key: bytes, chunks: list[Chunk],
                     timeout: float = TIMEOUT_S) -> Any:
    """Worker ``rank``'s Endpoint, connected to shard 0 alone, which it has sent the layout
    (rank 0) and its READY; the caller waits for the shard's READY (once every worker is up)."""
    from engine.comm.transport import Endpoint, header

    ep = Endpoint(("worker", rank), hosts, [SHARD0], key=key, timeout=timeout)
    by_id = {(c.param, c.chunk): c for c in chunks}
    ep.checker = lambda msg: check_sum(msg, by_id)
    if rank == 0:
        ep.send(SHARD0, header(pb.LAYOUT, layout=[c.to_pb() for c in chunks]))
    ep.send(SHARD0, header(pb.READY, layout_digest=layout_digest(chunks)))
    return ep


def push(ep: Any, c: Chunk, rnd: int, values: np.ndarray, request: int = 0) -> None:
    """Push ``values`` (the chunk's part of a gradient, zero-copy) as round ``rnd``."""
    from engine.comm.transport import header

    ep.send(SHARD0, header(pb.DATA, scheme="ps", op=PUSH, round=rnd, layer=c.layer,
                           param=c.param, chunk=c.chunk, phase=c.phase, request=request),
            [values])


def take_sums(ep: Any, chunks: Sequence[Chunk], rnd: int) -> list[Any]:
    """The shard's sum messages of ``chunks`` in round ``rnd``, in the order of ``chunks``."""
    from engine.comm.transport import message_key

    return ep.wait_for([message_key(pb.DATA, SHARD0, rnd, c.layer, c.param, c.chunk)
                        for c in chunks], f"the sums of round {rnd}")


def _worker_main(rank: int, world: int, hosts: list[HostEntry], key: bytes,
                 chunks: list[Chunk], grads: dict[int, np.ndarray], conn: Any) -> None:
    """One synthetic worker: on ``n`` from the driver, run n rounds, answer the seconds."""
    from engine.comm.transport import message_key

    ep = synthetic_worker(rank, hosts, key, chunks)
    try:
        ep.wait_for([message_key(pb.READY, SHARD0)], "the shard's READY")
        expected = world * (world + 1) / 2  # worker r pushes r + 1 everywhere
        rnd = 0
        conn.send(("ready", None))
        while (n := conn.recv()) is not None:
            t = time.perf_counter()
            for _ in range(n):
                for c in chunks:  # zero-copy pushes: the gradients never change
                    push(ep, c, rnd, grads[c.param][c.offset:c.offset + c.count])
                sums = take_sums(ep, chunks, rnd)
                if rnd == 0 and not all((m.arrays[0] == expected).all() for m in sums):
                    raise RuntimeError(f"worker {rank}: a sum of round 0 is not {expected}")
                rnd += 1
            conn.send(("seconds", time.perf_counter() - t))
        ep.close()
    except Exception as e:  # the driver reports it
        conn.send(("error", f"worker {rank}: {type(e).__name__}: {e}"))
        ep.close(say_bye=False)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cluster:
    """A shard with ``threads`` and P workers, started and waiting for rounds to run."""

    def __init__(self, ctx: Any, chunks: list[Chunk], grads: list[dict[int, np.ndarray]],
                 threads: int, key: bytes) -> None:
        world = len(grads)
        base = free_base_port(world)
        hosts = parse_hosts_text("\n".join(f"127.0.0.1:{base + 2 * i}" for i in range(world)))
        self.threads = threads
        self.shard = ctx.Process(target=_shard_main, args=(hosts, key, threads), daemon=True)
        self.shard.start()
        self.conns, self.workers = [], []
        for r in range(world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main,
                            args=(r, world, hosts, key, chunks, grads[r], theirs), daemon=True)
            p.start()
            self.conns.append(mine)
            self.workers.append(p)
        self._answers("ready")

    def _answers(self, kind: str) -> list[Any]:
        out = []
        for r, conn in enumerate(self.conns):
            if not conn.poll(TIMEOUT_S):
                raise RuntimeError(f"bench shard (threads={self.threads}): worker {r} did not "
                                   f"answer within {TIMEOUT_S:g} s")
            got, value = conn.recv()
            if got == "error":
                raise RuntimeError(f"bench shard (threads={self.threads}): {value}")
            if got != kind:
                raise RuntimeError(f"bench shard: worker {r} answered {got!r}, not {kind!r}")
            out.append(value)
        return out

    def rounds(self, n: int) -> tuple[float, float]:
        """Seconds per round over ``n`` rounds (the slowest worker's), and the shard process's
        CPU seconds per round."""
        cpu = cpu_seconds(self.shard.pid)
        for conn in self.conns:
            conn.send(n)
        wall = max(self._answers("seconds")) / n
        return wall, (cpu_seconds(self.shard.pid) - cpu) / n

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.workers + [self.shard]:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def add_bytes_per_s(chunk_bytes: int = DEFAULT_CHUNK_BYTES, total: int = 256 << 20,
                    repeats: int = 5) -> float:
    """One thread's speed at adding pushes in place into a float32 buffer (the fast server's
    summing alone, no network), in bytes of pushes per second, median of ``repeats``."""
    n = max(chunk_bytes // 4, 1)
    count = max(total // (4 * n), 1)
    acc = np.zeros(n, np.float32)
    pushes = np.ones(count * n, np.float32)  # distinct memory, as received pushes are
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for k in range(count):
            np.add(acc, pushes[k * n:(k + 1) * n], out=acc)
        times.append(time.perf_counter() - t)
    return count * 4 * n / statistics.median(times)


# ------------------------------------------------------------------------------ the bench
def run(layouts: Sequence[str], threads: Sequence[int], workers: int = 4, repeats: int = 5,
        rounds: int = 3, wire: str = "<f4", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        say: Callable[[Row], None] | None = None) -> list[Row]:
    """Measure every layout with every thread count (threads=0, the peer, first), the
    clusters taking turns; one warm-up round each first. Returns one row per pair."""
    from engine.comm.auth import new_key

    if 0 not in threads:
        threads = [0, *threads]
    threads = sorted(set(threads))
    ctx = mp.get_context("fork")  # before this process has any socket or thread of its own
    key = new_key()
    rows = []
    for name in layouts:
        chunks = layout(name, wire, chunk_bytes)
        counts = {c.param: 0 for c in chunks}
        for c in chunks:
            counts[c.param] += c.count
        # made before the fork: every cluster's worker r shares (reads) the same pages
        grads = [{p: np.full(n, r + 1, wire) for p, n in counts.items()} for r in range(workers)]
        clusters: list[Cluster] = []
        try:
            for t in threads:
                clusters.append(Cluster(ctx, chunks, grads, t, key))
            for c in clusters:
                c.rounds(1)  # warm-up: first-touch pages, connections, the sums checked
            samples: dict[int, list[float]] = {t: [] for t in threads}
            cpu: dict[int, list[float]] = {t: [] for t in threads}
            for _ in range(repeats):
                for c in clusters:
                    wall, used = c.rounds(rounds)
                    samples[c.threads].append(wall)
                    cpu[c.threads].append(used)
        finally:
            for c in clusters:
                c.close()
        base = statistics.median(samples[0])
        for t in threads:
            row = Row(name, t, workers, len(chunks), layout_bytes(chunks),
                      statistics.median(samples[t]), statistics.median(cpu[t]), samples[t], base)
            rows.append(row)
            if say is not None:
                say(row)
    return rows
