"""The PS shard server's two ways to sum (engine/comm/shard.py, engine/comm/aggregate.py):
on the receive thread (threads=0, the reference) and PHub's fast server (threads=N, chunks
pinned to threads, summed in place, answered zero-copy). Real endpoints over loopback: the
shard on a thread of this process, the workers as endpoints of this process (or, for the slow
worker, a process of its own that is stopped while a sum is on its way)."""
from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from engine.comm.aggregate import ChunkSum, pin, sum_in_rank_order
from engine.comm.errors import CommError
from engine.comm.chunks import PSParam, make_layout
from engine.comm.shard import DEFAULT_THREADS, ShardServer
from engine.comm.transport import Message, header, message_key
from engine.pb import poseidon_pb2 as pb
from poseidon_cli.benches.shard import SHARD0, push, synthetic_worker, take_sums
from poseidon_cli.job_config import JobConfig
from poseidon_cli.launch.hostfile import parse_hosts_text
from poseidon_cli.launch.shard import ShardSettings, read_settings
from tests.test_comm_train import digits_db, poseidon, weights, write_hosts, write_run  # noqa: F401
from tests.test_comm_transport import KEY, local_hosts

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.numpy_kernels]


def _layout(counts, dtype="<f4", chunk_bytes=4096):
    return make_layout([PSParam(i, 10 + i, n, dtype) for i, n in enumerate(counts)], 1,
                       chunk_bytes)


class Rig:
    """Shard 0 (``threads``) serving on a thread of this process, and P worker endpoints
    that have passed the start-up barrier; ``absent`` ranks are left to a process of their
    own (the test starts it)."""

    def __init__(self, world, chunks, threads, timeout=10.0, absent=(), hosts=None):
        self.hosts = hosts or local_hosts(world)
        self.chunks = chunks
        self.srv = ShardServer(0, self.hosts, key=KEY, timeout=timeout, threads=threads)
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.eps = {r: synthetic_worker(r, self.hosts, KEY, chunks, timeout)
                    for r in range(world) if r not in absent}

    def _serve(self):
        try:
            self.srv.start()
            self.srv.serve()
        except Exception as e:
            self.error = e

    def ready(self):
        for ep in self.eps.values():
            ep.wait_for([message_key(pb.READY, SHARD0)], "the shard's READY")

    def close(self):
        for ep in self.eps.values():
            ep.close(say_bye=ep.error is None)
        self.thread.join(15)
        self.srv.close()


def _pushes(world, chunks, rounds, dtype, seed):
    """{(round, rank): {param: vector}}: values over six decades, so that the order of a
    float32 sum shows in its bits."""
    rng = np.random.default_rng(seed)
    sizes = {}
    for c in chunks:
        sizes[c.param] = sizes.get(c.param, 0) + c.count
    return {(t, r): {p: (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(dtype)
                     for p, n in sizes.items()}
            for t in range(rounds) for r in range(world)}


def _run(threads, world, chunks, grads, rounds, seed):
    """Every round's pushes in a random order of (rank, chunk); every worker's sums."""
    rig = Rig(world, chunks, threads)
    rng = np.random.default_rng(seed)
    got = {}
    try:
        rig.ready()
        for t in range(rounds):
            order = [(r, c) for r in range(world) for c in chunks]
            for i in rng.permutation(len(order)):
                r, c = order[i]
                push(rig.eps[r], c, t, grads[(t, r)][c.param][c.offset:c.offset + c.count])
            for r, ep in rig.eps.items():
                got[(t, r)] = [m.arrays[0].copy() for m in take_sums(ep, chunks, t)]
    finally:
        rig.close()
    assert rig.error is None, rig.error
    return got


@pytest.mark.parametrize("dtype", ["<f4", "<f2"])
def test_threaded_sums_are_exact_and_bit_identical_to_the_reference(dtype):
    world, rounds = 4, 3
    chunks = _layout([3000, 700, 5, 2500], dtype, chunk_bytes=2048)
    grads = _pushes(world, chunks, rounds, dtype, seed=7)
    ref = _run(0, world, chunks, grads, rounds, seed=1)
    for threads in (1, 3):
        got = _run(threads, world, chunks, grads, rounds, seed=threads + 1)
        for key, sums in ref.items():
            for a, b in zip(sums, got[key]):
                assert a.tobytes() == b.tobytes()
    for t in range(rounds):
        for i, c in enumerate(chunks):
            parts = [grads[(t, r)][c.param][c.offset:c.offset + c.count] for r in range(world)]
            exact = np.sum([p.astype(np.float64) for p in parts], axis=0)
            scale = np.sum([np.abs(p.astype(np.float64)) for p in parts], axis=0)
            err = np.abs(ref[(t, 0)][i].astype(np.float64) - exact)
            tol = 1e-6 if dtype == "<f4" else 2e-3  # fp16: one rounding of the sum
            assert (err <= tol * scale + 1e-30).all()
            for r in range(1, world):  # every worker has the same bits
                assert ref[(t, r)][i].tobytes() == ref[(t, 0)][i].tobytes()
    # the data would show a different order of addition
    parts = [grads[(0, r)][0].astype(np.float32) for r in range(world)]
    assert not np.array_equal(sum(parts), sum(parts[::-1]))


def _msg(rank, rnd, values, request=0):
    return Message(header(pb.DATA, scheme="ps", op=0, round=rnd, sender=rank, request=request),
                   [values])


@pytest.mark.parametrize("dtype", ["<f4", "<f2"])
def test_a_chunk_sum_holds_back_early_ranks_and_rounds(dtype):
    """Every arrival order of two rounds' pushes that BSP allows (a worker pushes round 1 of a
    chunk only once it has the sum of round 0, so after every round-0 push arrived): the
    reference's bits, each round completed once, in order. The next round's number is taken
    from its first push (a chunk need not take part in every round)."""
    world = 3
    chunk = _layout([64], dtype)[0]
    rng = np.random.default_rng(3)
    pushes = {(t, r): (rng.standard_normal(64) * 10.0 ** rng.uniform(-3, 3, 64)).astype(dtype)
              for t in range(2) for r in range(world)}
    refs = [sum_in_rank_order([_msg(r, t, pushes[(t, r)], request=r) for r in range(world)],
                              np.dtype(dtype)) for t in range(2)]
    for order in itertools.permutations(sorted(pushes)):
        if max(i for i, (t, _) in enumerate(order) if t == 0) > \
                min(i for i, (t, _) in enumerate(order) if t == 1):
            continue
        s = ChunkSum(chunk, range(world))
        done = []
        for t, r in order:
            done += [(rnd, total.copy(), bits)
                     for rnd, total, bits in s.add(_msg(r, t, pushes[(t, r)], request=r))]
        assert [d[0] for d in done] == [0, 1]
        for (rnd, total, bits), (ref, ref_bits) in zip(done, refs):
            assert total.tobytes() == ref.tobytes() and bits == ref_bits == 3


@pytest.mark.parametrize("threads", [0, 2])
def test_an_fp16_sum_that_overflows_raises_the_bit(threads):
    world = 2
    chunks = _layout([8, 8], "<f2")
    rig = Rig(world, chunks, threads)
    try:
        rig.ready()
        big, small = np.full(8, 40000, np.float16), np.full(8, 1.5, np.float16)
        for r, ep in rig.eps.items():
            push(ep, chunks[0], 0, big)
            push(ep, chunks[1], 0, small, request=pb.REQUEST_SNAPSHOT if r == 1 else 0)
        overflowed, fine = take_sums(rig.eps[0], chunks, 0)
        assert overflowed.header.request & pb.REQUEST_OVERFLOW and np.isinf(overflowed.arrays[0]).all()
        assert fine.header.request == pb.REQUEST_SNAPSHOT and (fine.arrays[0] == 3.0).all()
    finally:
        rig.close()
    assert rig.error is None, rig.error


@pytest.mark.parametrize("threads", [0, 2])
def test_a_worker_that_never_pushes_is_named(threads):
    chunks = _layout([100])
    rig = Rig(3, chunks, threads, timeout=1.5)
    try:
        rig.ready()
        for r in (0, 2):
            push(rig.eps[r], chunks[0], 0, np.ones(100, np.float32))
        rig.thread.join(10)
        assert isinstance(rig.error, CommError)
        assert "waiting for the push of vector 0 chunk 0 round 0 from worker 1 " in str(rig.error)
    finally:
        rig.close()


# ------------------------------------------------------------------ a slow worker's sum
BIG = 8 << 20  # values per chunk: 32 MB, more than loopback's socket buffers hold


def _slow_worker(hosts, chunks, out):
    """Worker 2: pushes round 0, says so, is stopped (SIGSTOP) before its sum can arrive,
    then pushes round 1 once it has sum 0, and reports both sums' checks."""
    ep = synthetic_worker(2, hosts, KEY, chunks, timeout=10)
    try:
        ep.wait_for([message_key(pb.READY, SHARD0)], "the shard's READY")
        for t in (0, 1):
            push(ep, chunks[0], t, np.full(BIG, 3.0 + t, np.float32))
            if t == 0:
                out.put("pushed")
            total = take_sums(ep, chunks, t)[0].arrays[0]
            out.put(bool((total == 6.0 + 3 * t).all()))
        ep.close()
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")
        ep.close(say_bye=False)


@pytest.mark.parametrize("threads", [0, 2])
def test_a_slow_worker_gets_its_sum_unchanged(threads):
    """While sum 0 is stuck on its way to a stopped worker, the others push round 1: the
    buffer sum 0 is sent from must not change (the slow worker would drop it as failed
    authentication, then time out)."""
    chunks = _layout([BIG], chunk_bytes=BIG * 4)
    hosts = local_hosts(3)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    slow = ctx.Process(target=_slow_worker, args=(hosts, chunks, out), daemon=True)
    slow.start()
    rig = Rig(3, chunks, threads, timeout=20, absent=(2,), hosts=hosts)
    try:
        rig.ready()
        assert out.get(timeout=30) == "pushed"
        deadline = time.monotonic() + 60  # its push is in once the shard lists it (liveness)
        while not any(2 in got for _, got in rig.srv._pending.values()):
            assert time.monotonic() < deadline, "the slow worker's push did not arrive"
            time.sleep(0.01)
        os.kill(slow.pid, signal.SIGSTOP)
        try:
            for r in (0, 1):
                push(rig.eps[r], chunks[0], 0, np.full(BIG, 1.0 + r, np.float32))
            for r in (0, 1):
                assert (take_sums(rig.eps[r], chunks, 0)[0].arrays[0] == 6.0).all()
            for r in (0, 1):  # round 1 starts while sum 0 still waits for worker 2
                push(rig.eps[r], chunks[0], 1, np.full(BIG, 2.0 + r, np.float32))
            time.sleep(0.5)
        finally:
            os.kill(slow.pid, signal.SIGCONT)
        assert out.get(timeout=30) is True  # sum 0, as sent
        assert out.get(timeout=30) is True  # sum 1
        for r in (0, 1):
            assert (take_sums(rig.eps[r], chunks, 1)[0].arrays[0] == 9.0).all()
        assert rig.srv.ep.dropped == 0
    finally:
        rig.close()
        slow.join(10)
        if slow.is_alive():
            slow.kill()
    assert rig.error is None, rig.error


def test_chunks_are_pinned_to_threads_by_bytes():
    chunks = _layout([800, 700, 600, 500, 400, 300, 200, 100], chunk_bytes=1 << 20)
    groups = pin(chunks, 2)
    loads = sorted(sum(c.count for c in g) for g in groups)
    assert loads == [1800, 1800]
    assert sorted((c.param, c.chunk) for g in groups for c in g) == \
        sorted((c.param, c.chunk) for c in chunks)
    assert len(pin(chunks[:1], 4)) == 1  # no idle thread for want of chunks


def test_training_sums_the_same_bits_with_any_number_of_shard_threads(digits_db, tmp_path):  # noqa: F811
    """`poseidon train --comm ps` with the reference server and with 3 summing threads: the
    same weights, bit for bit."""
    got = {}
    for threads in (0, 3):
        d = tmp_path / f"t{threads}"
        solver = write_run(d, digits_db, 8, "run", iters=6)
        hosts, _ = write_hosts(d, 3)
        done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--comm", "ps",
                        "--chunk-bytes", "2048", "--shard-threads", str(threads), timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        got[threads] = weights(d / "run_iter_6.caffemodel")
    assert got[0].keys() == got[3].keys()
    for name, w in got[0].items():
        assert w.tobytes() == got[3][name].tobytes(), name


def test_the_shard_threads_travel_from_the_command_line_to_the_shard():
    hosts = parse_hosts_text("127.0.0.1:9000 slots=2")
    config = JobConfig("s.prototxt", "h.txt", shard_threads=3)
    assert JobConfig.from_json(config.to_json()).shard_threads == 3
    assert JobConfig("s", "h").shard_threads == DEFAULT_THREADS
    line = ShardSettings(1, 30.0, 1 << 20, config.shard_threads).line(b"k" * 32, hosts)
    settings, key, entries = read_settings(line.decode())
    assert settings.threads == 3 and key == b"k" * 32 and entries == hosts
    with pytest.raises(CommError, match="--shard-threads must be >= 0, got -1"):
        JobConfig("s", "h", shard_threads=-1)
    with pytest.raises(CommError, match="'shard_threads' has the wrong type"):
        JobConfig.from_json('{"solver": "s", "hosts": "h", "shard_threads": 1.5}')


def test_bench_shard_measures_every_thread_count_against_threads_0(tmp_path):
    out = tmp_path / "shard.json"
    done = poseidon("bench", "shard", "--layouts", "resnet", "--threads", "2", "--workers", "2",
               "--repeats", "1", "--rounds", "1", "--json", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["layout"], r["threads"]) for r in rows] == [("resnet", 0), ("resnet", 2)]
    for r in rows:
        assert r["summed_gb_s"] == pytest.approx(2 * r["bytes"] / r["round_s"] / 1e9)
        assert r["ratio"] == pytest.approx(rows[0]["round_s"] / r["round_s"])
        assert r["shard_cpu_s"] > 0
        assert r["gb_per_cpu_s"] == pytest.approx(2 * r["bytes"] / r["shard_cpu_s"] / 1e9)
    assert rows[0]["ratio"] == 1.0 and report["add_bytes_per_s_one_thread"] > 0
    assert "summed GB/s" in done.stdout
