"""The collective engines as schemes (engine/comm/schemes/collective.py; gloo.py, mpi.py).

End to end on loopback, real processes: `poseidon train -n 3 --comm gloo` and `mpiexec -n 3
poseidon train --comm mpi` on LeNet equal one worker with 3·B (the bound and why it holds:
tests/test_comm_train.py), with identical replicas; a resumed and a pinned gloo run reproduce
the bits; a signal sent to one worker reaches every worker through the unit that carries the
signals; a plan recorded on another engine version is refused in one line. Without a unit per
layer (``--fusion-mb 0``) the engine issues several units per round, in the one order every
worker shares. The engine-free parts (the planner's pricing, the trust rule, the engine
thread's order) are checked in-process. A test that needs an engine skips, saying which,
where its extra is not installed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.comm.auth import KEY_ENV, key_hex, new_key
from engine.comm.cost import LayerInfo
from engine.comm.link import Link
from engine.comm.planner import EngineMismatch, PlanMismatch, PlanOptions, make_plan, pin_plan
from engine.comm.engines import Backend, Collective, EngineCost, EngineError, ring_link, ring_time
from engine.comm.errors import CommError
from engine.comm.schemes.base import Finished
from engine.comm.schemes.collective import SIGNAL_BITS, CollectiveScheme
from engine.comm.schemes.gloo import GlooBackend
from engine.comm.schemes.mpi import MpiBackend
from poseidon_cli.job_config import JobConfig
from tests.test_comm_resume import same_bits
from tests.test_comm_train import (BOUND, ITERS, ROOT, digits_db, lenet_net,  # noqa: F401
                                   relative_distance, weights, write_hosts, write_run)
from tests.test_elastic_train import LOST, K, Job, jobs, resumed_reference, tree  # noqa: F401
from tests.conftest import shared_path

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.numpy_kernels]

WORKERS = 3
BATCH = 10  # per worker; one worker trains with 30
GLOO = GlooBackend.missing(False)
needs_gloo = pytest.mark.skipif(bool(GLOO), reason=f"gloo: {GLOO}")
MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
_mpi_missing = "mpi4py is not installed" if MpiBackend.missing(False).startswith("mpi4py is") \
    else "" if MPIEXEC else "no mpiexec on PATH"
needs_mpi = pytest.mark.skipif(bool(_mpi_missing), reason=f"mpi: {_mpi_missing}")


# ------------------------------------------------------------------------- in-process
CONV = LayerInfo(1, "conv1", [(8, 1, 3, 3), (8,)])
IP1 = LayerInfo(3, "ip1", [(256, 512), (256,)], factors=(16, 512, 256))
IP2 = LayerInfo(5, "ip2", [(10, 256), (10,)], factors=(16, 256, 10))
LAYERS = [CONV, IP1, IP2]
SLOW = Link(5e-3, 8e-8, "given: 100mbit@5ms")


def engine(alpha: float = 1e-5, beta: float = 1e-10, version: str = "torch 9") -> EngineCost:
    return EngineCost("gloo", version, "ring", Link(alpha, beta, "a probe"))


def test_the_probe_fits_a_ring_that_takes_the_measured_times():
    link = ring_link(4, 4 << 10, 300e-6, 4 << 20, 5e-3, "probe")
    assert ring_time(link, 4, 4 << 10) == pytest.approx(300e-6)
    assert ring_time(link, 4, 4 << 20) == pytest.approx(5e-3)


def test_an_engine_is_planned_only_where_every_worker_joined_it():
    assert all(s != "gloo" for _, s in make_plan(LAYERS, 2, PlanOptions(link=SLOW)).units)
    with pytest.raises(ValueError, match="--comm gloo: the workers did not join it"):
        make_plan(LAYERS, 2, PlanOptions(comm="gloo"))
    forced = make_plan(LAYERS, 2, PlanOptions(comm="gloo", engines=(engine(),)))
    assert {s for _, s in forced.units} == {"gloo"}
    assert [(e.name, e.version, e.algorithm) for e in forced.to_pb().engines] == \
        [("gloo", "torch 9", "ring")]


def test_auto_prices_an_engine_by_its_probe():
    """A fast engine takes every layer on a slow link; a slow engine takes none."""
    fast = make_plan(LAYERS, 2, PlanOptions(link=SLOW, engines=(engine(),)))
    assert {s for _, s in fast.units} == {"gloo"}
    slow = make_plan(LAYERS, 2, PlanOptions(link=SLOW, engines=(engine(alpha=1.0),)))
    assert "gloo" not in {s for _, s in slow.units} and not slow.to_pb().engines


def test_shm_probed_beside_the_engines_is_priced_as_they_are():
    """On one machine, shm priced by its cost model takes a layer that its probe shows
    slower than other schemes; priced from that probe, no layer; a probed round is timed
    crowded, so nothing is added to it on a crowded machine, as to an engine's."""
    from engine.comm.cost import Device
    from engine.comm.engines import probed_timing
    from engine.comm.planner import plan_layers

    device = Device("cpu", update_bytes_per_s=8e9, gemm_flops_per_s=50e9, add_bytes_per_s=8e9,
                    update_on_device=False)
    gloo = (engine(alpha=1e-3, beta=1e-8),)
    link = Link(150e-6, 1e-9, "probed", overhead_s=80e-6)
    modelled = plan_layers(LAYERS, 2, "auto", link=link, device=device, machines=1,
                           engines=gloo, crowding=2.0)
    assert modelled[0].info.name == "conv1" and modelled[0].scheme == "shm"
    slow = ring_link(2, 4 << 10, 2e-3, 4 << 20, 30e-3, "shm probe")
    probed = plan_layers(LAYERS, 2, "auto", link=link, device=device, machines=1,
                         engines=gloo, crowding=2.0, probed={"shm": slow})
    assert "shm" not in {p.scheme for p in probed}
    for p in probed:
        assert p.timings["shm"] == probed_timing("shm", p.info, 2, slow, device)
        assert p.timings["shm"].cpu_s == 0 and p.timings["gloo"].cpu_s == 0
        assert p.timings["shm"].total_s > 1.5e-3  # its 4 KB round took 2 ms


def test_a_recorded_engine_plan_is_followed_refused_or_replaced_saying_why():
    recorded = make_plan(LAYERS, 2, PlanOptions(comm="gloo", engines=(engine(),))).to_pb()
    here = PlanOptions(trusted_engines=("gloo",),
                       engine_versions=(("gloo", "torch 9", "ring"),))
    pinned = pin_plan(recorded, LAYERS, 2, here)
    assert {s for _, s in pinned.units} == {"gloo"} and pinned.used_engines[0].version == "torch 9"
    with pytest.raises(EngineMismatch, match=r"it sums on gloo torch 9 \(ring\), this run has "
                                             r"torch 10 \(ring\)"):
        pin_plan(recorded, LAYERS, 2, PlanOptions(trusted_engines=("gloo",), engine_versions=(
            ("gloo", "torch 10", "ring"),)))
    # the same version summing in another order (a user's MPIR_CVAR_... or NCCL_ALGO)
    with pytest.raises(EngineMismatch, match=r"it sums on gloo torch 9 \(ring\), this run has "
                                             r"torch 9 \(tree\): another version or algorithm"):
        pin_plan(recorded, LAYERS, 2, PlanOptions(trusted_engines=("gloo",), engine_versions=(
            ("gloo", "torch 9", "tree"),)))
    with pytest.raises(EngineMismatch, match="this run cannot run gloo"):
        pin_plan(recorded, LAYERS, 2, PlanOptions(trusted_engines=("gloo",)))
    with pytest.raises(PlanMismatch, match="authenticates nothing, and this run does not allow "
                                           r"it \(give --comm gloo or --trusted-network\)"):
        pin_plan(recorded, LAYERS, 2, PlanOptions(engine_versions=(("gloo", "torch 9", "ring"),)))


@pytest.mark.parametrize("comm, trusted, wire, allowed, required", [
    ("auto", False, "fp32", (), ()),
    ("auto", True, "fp32", ("gloo", "mpi", "nccl"), ()),
    ("auto", True, "fp16", (), ()),
    ("gloo", False, "fp32", ("gloo",), ("gloo",)),
    ("ring,ip1=mpi", False, "fp32", ("mpi",), ("mpi",)),
    ("hybrid", True, "fp32", (), ()),
])
def test_engines_are_planned_only_where_the_user_trusts_the_network(comm, trusted, wire, allowed,
                                                                    required):
    config = JobConfig(solver="s", comm=comm, trusted_network=trusted, wire=wire)
    assert config.engines == (allowed, required)


def test_an_engine_with_a_compressing_wire_is_refused_in_one_line():
    with pytest.raises(CommError, match="--comm gloo sums float32 gradients on the engine: give "
                                        "it without --wire fp16"):
        JobConfig(solver="s", comm="gloo", wire="fp16")


class _Recorder(Backend):
    """A backend that sums nothing and records the order it is asked to, on which thread."""
    name = "recorder"
    install = ""

    @classmethod
    def missing(cls, on_gpu: bool) -> str:
        return ""

    @classmethod
    def version(cls) -> str:
        return "1"

    @classmethod
    def algorithm(cls) -> str:
        return "none"

    def __init__(self, setup, rank, world, address, timeout) -> None:
        self.order: list[int] = []
        self.threads: set[str] = {threading.current_thread().name}
        self.ran_on: dict[int, str] = {}

    def start(self, vec):
        self.threads.add(threading.current_thread().name)
        self.order.append(int(vec[0]))
        self.ran_on[int(vec[0])] = threading.current_thread().name
        return None

    def then(self, handle, done) -> bool:
        return False  # the wait thread's path

    def finish(self, handle) -> None:
        pass  # complete when started


class _BlockingRecorder(_Recorder):
    blocking = True


@pytest.mark.parametrize("backend", [_Recorder, _BlockingRecorder], ids=["issued in turn",
                                                                        "blocking"])
def test_ops_are_issued_in_the_one_order_whatever_order_they_come_in(backend):
    c = Collective(backend, b"", 0, 2, "127.0.0.1", 5.0, lambda why: None)
    try:
        done = threading.Semaphore(0)
        for seq in (2, 0, 3, 1, 5, 4):
            c.submit(seq, np.array([seq]), done.release, f"op {seq}")
        for _ in range(6):
            assert done.acquire(timeout=5)
        assert c.backend.order == [0, 1, 2, 3, 4, 5]
        # a blocking engine's ops are issued by its engine thread, which also joined it
        assert (c.backend.threads == {"poseidon-recorder"}) == backend.blocking
    finally:
        c.close()


class _InlineRecorder(_BlockingRecorder):
    inline_bytes = 64

    def then(self, handle, done) -> bool:
        done(None)  # as MPI's: complete when start returns
        return True


def test_a_blocking_engines_small_op_in_its_turn_is_summed_by_the_thread_that_submits_it():
    """MPI's small layers are summed at release, on the training thread (no hand-off to the
    engine thread and back); a large op, or one that comes before its turn, goes to the
    engine thread; the one order holds either way."""
    c = Collective(_InlineRecorder, b"", 0, 2, "127.0.0.1", 5.0, lambda why: None)
    me = threading.current_thread().name
    try:
        done = threading.Semaphore(0)
        c.submit(0, np.array([0]), done.release, "small, in turn")
        assert done.acquire(timeout=0)  # complete when submit returns
        c.submit(1, np.full(100, 1), done.release, "large")
        assert done.acquire(timeout=5)
        c.submit(3, np.array([3]), done.release, "small, before its turn")
        deadline = time.monotonic() + 5  # the engine thread holds it until its turn
        while 3 not in c._early:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        c.submit(2, np.array([2]), done.release, "small, in turn")
        assert done.acquire(timeout=0) and done.acquire(timeout=0)  # both, on this thread
        assert c.backend.order == [0, 1, 2, 3]
        assert [c.backend.ran_on[k] for k in range(4)] == [me, "poseidon-recorder", me, me]
    finally:
        c.close()


class _SlowRecorder(_InlineRecorder):
    def start(self, vec):
        if int(vec[0]) < 2:
            time.sleep(0.2)  # the engine thread is still busy when the last op comes
        return super().start(vec)


def test_a_blocking_engines_last_op_waits_here_for_its_turn_and_is_summed_here():
    """The round's last op (``sum_here``), whatever its size: it waits for the ops before it,
    which the engine thread sums, and is then summed on the thread that submitted it."""
    c = Collective(_SlowRecorder, b"", 0, 2, "127.0.0.1", 5.0, lambda why: None)
    me = threading.current_thread().name
    try:
        done = threading.Semaphore(0)
        for seq in (0, 1):
            c.submit(seq, np.full(100, seq), done.release, f"large {seq}")
        c.sum_here(2, np.full(100, 2), "the last, large")
        assert done.acquire(timeout=0) and done.acquire(timeout=0)
        assert c.backend.order == [0, 1, 2]
        assert [c.backend.ran_on[k] for k in range(3)] == ["poseidon-recorder"] * 2 + [me]
    finally:
        c.close()


class _ReportingRecorder(_Recorder):
    """An engine that reports on a thread of its own (Gloo's future), and can be waited for."""
    fail_finish = False

    def __init__(self, setup, rank, world, address, timeout) -> None:
        super().__init__(setup, rank, world, address, timeout)
        self.reported: list[int] = []
        self.finished_on: dict[int, str] = {}

    def start(self, vec):
        super().start(vec)
        return int(vec[0])

    def then(self, handle, done) -> bool:
        self.reported.append(handle)
        threading.Thread(target=done, args=(None,)).start()
        return True

    def finish(self, handle) -> None:
        self.finished_on[handle] = threading.current_thread().name
        if self.fail_finish:
            raise RuntimeError("Connection reset by peer")


def test_a_reporting_engines_last_op_is_waited_for_on_the_thread_that_submits_it():
    """The round's last op (``sum_here``) of an engine that reports on its own thread is waited
    for where it was submitted, as a bare call's: its completion runs there, with no report
    from the engine's thread. One that comes before its turn waits for it (issued by another
    thread: a GPU's staged units are issued from the progress thread) and is then issued and
    waited for where it was submitted. A failed wait raises the engine's failure there, which
    is also the job's error, and nothing is applied."""
    errors: list[str] = []
    c = Collective(_ReportingRecorder, b"", 0, 2, "127.0.0.1", 5.0, errors.append)
    me = threading.current_thread().name
    try:
        done = threading.Semaphore(0)
        ran: list[str] = []
        c.submit(0, np.array([0]), done.release, "op 0")
        c.sum_here(1, np.array([1]), "the last")
        ran.append(threading.current_thread().name)
        assert ran == [me]  # complete when sum_here returns, on this thread
        assert c.backend.reported == [0] and c.backend.finished_on == {1: me}
        assert done.acquire(timeout=5)
        early = threading.Thread(target=c.sum_here, name="early", args=(
            3, np.array([3]), "the last, early"))
        early.start()
        time.sleep(0.2)  # waiting for its turn
        assert c.backend.order == [0, 1] and early.is_alive()
        c.submit(2, np.array([2]), done.release, "op 2")
        early.join(timeout=5)
        assert done.acquire(timeout=5)
        assert c.backend.order == [0, 1, 2, 3] and c.backend.reported == [0, 2]
        assert c.backend.finished_on[3] == "early"
        c.backend.fail_finish = True
        applied: list[int] = []
        with pytest.raises(CommError, match="Connection reset by peer"):
            c.sum_here(4, np.array([4]), "the last of round 2")
            applied.append(4)
        assert not applied
        assert errors == [c.failed] and c.failed == (
            "the recorder allreduce of the last of round 2 failed: Connection reset by peer")
    finally:
        c.close(clean=False)


class _StuckRecorder(_InlineRecorder):
    release = threading.Event()

    def start(self, vec):
        if int(vec[0]) == 0:
            if not self.release.wait(10):  # a peer that never comes
                raise RuntimeError("peer gone")
            raise RuntimeError("the allreduce of op 0 failed: peer gone")
        return super().start(vec)


def test_a_last_op_waiting_for_its_turn_gives_up_with_the_cause():
    """Waiting here for the ops before it is bounded: by the job's error (a peer the
    watchdog found gone), by the job's timeout when one of them hangs (the error says so),
    at once when one of them fails (the engine's error)."""
    c = Collective(_StuckRecorder, b"", 0, 2, "127.0.0.1", 1.0, lambda why: None)

    def gone() -> None:
        raise CommError("worker 1 stopped answering")
    try:
        c.submit(0, np.full(100, 0), lambda: None, "large 0")
        t = time.monotonic()
        with pytest.raises(CommError, match="worker 1 stopped answering"):
            c.sum_here(1, np.full(100, 1), "the last", abort=gone)
        assert time.monotonic() - t < 0.9  # before the timeout
        t = time.monotonic()
        with pytest.raises(EngineError, match="the last waited 1 s for the allreduces before it"):
            c.sum_here(1, np.full(100, 1), "the last")
        assert time.monotonic() - t < 5
        _StuckRecorder.release.set()  # op 0 now fails: the next waiter returns at once
        deadline = time.monotonic() + 5
        while c.failed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "op 0 failed" in (c.failed or "")
        t = time.monotonic()
        with pytest.raises(CommError, match="op 0 failed"):
            c.sum_here(1, np.full(100, 1), "the last")
        assert time.monotonic() - t < 0.9
        assert c.backend.order == []  # nothing issued after the failure
    finally:
        _StuckRecorder.release.clear()
        c.close(clean=False)


class _Hub:
    """Two in-process ranks' engine: op k of each rank is summed in rank order when both came."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: dict[int, dict[int, tuple[np.ndarray, threading.Event]]] = {}
        self.count = [0, 0]


HUB = _Hub()


class _HubBackend(Backend):
    name = "hub"
    install = ""

    @classmethod
    def missing(cls, on_gpu: bool) -> str:
        return ""

    @classmethod
    def version(cls) -> str:
        return "1"

    @classmethod
    def algorithm(cls) -> str:
        return "rank order"

    def __init__(self, setup, rank, world, address, timeout) -> None:
        self.rank = rank

    def start(self, vec):
        done = threading.Event()
        with HUB.lock:
            k = HUB.count[self.rank]
            HUB.count[self.rank] += 1
            got = HUB.ops.setdefault(k, {})
            got[self.rank] = (vec, done)
            if len(got) == 2:
                total = got[0][0] + got[1][0]
                for v, e in HUB.ops.pop(k).values():
                    v[...] = total
                    e.set()
        return done

    def then(self, handle, done) -> bool:
        return False

    def finish(self, handle) -> None:
        assert handle.wait(10)


class _HubScheme(CollectiveScheme):
    name = "hub"
    backend = _HubBackend


class _Host:
    """What the syncer offers the scheme: ``done`` records each applied round."""

    def __init__(self, rank: int) -> None:
        from engine.comm.codecs import Codec
        from engine.comm.stats import CommStats
        self.rank, self.world, self.codec = rank, 2, Codec()
        self.ep = type("Ep", (), {"stats": CommStats()})()
        self.signal_unit = 1
        self.events: list = []
        self.applied: list = []
        self.lock = threading.Condition()
        self.collectives = {"hub": Collective(_HubBackend, b"", rank, 2, "", 5.0,
                                              lambda why: None)}

    def call_soon(self, fn) -> None:
        with self.lock:
            self.events.append(fn)
            self.lock.notify_all()

    def done(self, unit, rnd: int, bits: int) -> None:
        self.applied.append((rnd, unit.id, float(unit.params[0].blob.diff[0]), bits))
        for p in unit.params:  # the next backward's gradients: this rank's again
            p.blob.diff[...] = self.rank + unit.id

    def raise_if_failed(self) -> None:
        pass

    def run_until(self, done: list, n: int) -> None:
        """The progress loop: run posted completions until ``done`` holds ``n``."""
        deadline = time.monotonic() + 10
        while len(done) < n:
            with self.lock:
                while not self.events:
                    assert self.lock.wait(max(deadline - time.monotonic(), 0.01))
                fn = self.events.pop(0)
            fn()


@pytest.mark.parametrize("path", ["at release", "from the progress thread"])
@pytest.mark.parametrize("signal_params, held, apart", [
    ((3,), False, False), (((256 << 10) // 4,), True, True),
    (((256 << 10) // 4,), False, False), (((128 << 10) // 4,) * 2, False, False)],
    ids=["signals behind the gradients", "signals apart", "signals behind a large diff placed",
         "signals behind a large gathered unit"])
@pytest.mark.parametrize("replaced", [False, True], ids=["diffs kept", "diffs replaced"])
def test_two_ranks_sum_in_one_order_and_agree_on_every_signal(signal_params, held, apart, path,
                                                             replaced):
    """The engine layer's multi-rank logic with an in-process engine: three units a round, the
    progress threads of the two ranks start them in other orders, and each is summed in the
    one order; the signal one rank raised reaches both, whether it rides behind the signal
    unit or in an op of its own (a large diff that something else holds, which cannot move
    into the vector with room for them; a large diff that can, or one of two parameters
    gathered into a vector anyway, carries them behind). Host gradients are issued at
    release, and the round's last unit is summed and applied on the training thread; a GPU's
    (staged) and NCCL's from the progress thread. A unit whose blobs get new diffs after the
    scheme placed them (a reshape) is summed into the new ones, not the vector they left."""
    from engine.comm.units import LayerSlot, ParamSlot, Unit, gather

    class Blob:
        def __init__(self, n: int, v: float) -> None:
            self.data = np.zeros(n, np.float32)
            self.diff = np.full(n, v, np.float32)

    hosts, schemes = [], []
    for rank in range(2):
        host = _Host(rank)
        units = [Unit([LayerSlot(i, f"l{i}", [ParamSlot(i, f"l{i}/{k}", Blob(n, rank + i))
                                              for k, n in enumerate(sizes)])], "hub")
                 for i, sizes in ((1, signal_params), (2, (5,)), (3, (7,)))]
        hosts.append(host)
        views = [p.blob.diff[:1] for p in units[0].params] if held else []
        schemes.append((_HubScheme(host, units, 1 << 20), units))
        if not apart:  # its diffs live in the vector that is summed, the signals behind them
            vec = schemes[-1][0]._buffers[1]
            assert vec.size == units[0].count + len(SIGNAL_BITS)
            assert all(np.shares_memory(p.blob.diff, vec) for p in units[0].params)
        assert all(v.base is p.blob.diff for v, p in zip(views, units[0].params))
    ops_before = HUB.count[0]
    def backward(rank: int, rnd: int, bits: int, released: dict) -> None:
        """A rank's training thread: each unit released, the highest first; the last one
        (the signal unit) is summed and applied on this thread, as the syncer does."""
        scheme, units = schemes[rank]
        for u in units[::-1]:
            got = scheme.capture(u, rnd, bits)
            if isinstance(got, Finished):
                hosts[rank].done(u, rnd, got)
            else:
                released[u.id] = got

    try:
        for rnd in range(2):
            if replaced and rnd == 1:
                for rank, (_, units) in enumerate(schemes):
                    for u in units:
                        for p in u.params:
                            p.blob.diff = np.full(p.blob.diff.shape, rank + u.id, np.float32)
            released: list[dict] = [{}, {}]
            bits = [0, 2 if rnd == 1 else 0]  # rank 1 raises STOP in round 1
            if path == "at release":  # the two ranks' backwards at once
                threads = [threading.Thread(target=backward, args=(r, rnd, bits[r], released[r]))
                           for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(10)
                assert not any(t.is_alive() for t in threads)
                assert all(set(got) == {2, 3} for got in released)  # the signal unit applied
            for rank, (scheme, units) in enumerate(schemes):
                # rank 0's progress thread starts them in another order
                order = units[::-1] if rank == 1 else [units[1], units[0], units[2]]
                for u in order:
                    if path == "at release":
                        if u.id in released[rank]:
                            scheme.start(u, rnd, bits[rank], released[rank][u.id])
                    else:
                        diff = u.params[0].blob.diff

                        def finish(total, agreed, u=u, rnd=rnd, diff=diff, host=hosts[rank]):
                            diff[...] = total[:diff.size]  # the sum, as start's finish
                            host.done(u, rnd, agreed)
                        scheme.sum_vector(u, rnd, 0, gather(u), bits[rank], finish)
            for host in hosts:
                host.run_until(host.applied, 3 * (rnd + 1))
        for host in hosts:
            got = {(rnd, uid): (value, agreed) for rnd, uid, value, agreed in host.applied}
            for uid in (1, 2, 3):  # ranks 0 and 1 start with uid and uid + 1: their sum
                assert got[(0, uid)] == (2 * uid + 1, 0)
                assert got[(1, uid)] == (2 * uid + 1, 2 if uid == 1 else 0)
        assert HUB.count[0] - ops_before == 2 * (3 + apart)  # two rounds
    finally:
        for host in hosts:
            host.collectives["hub"].close()


def test_a_closed_schemes_placements_leave_the_diffs_to_the_next_generation():
    """A scheme's placements hold its units' diffs; once it is closed, the next generation's
    scheme, with another plan (the two layers in one bucket), moves them into its vector, as
    it moves diffs nothing else holds, rather than copy them in every round."""
    from engine.comm.units import LayerSlot, ParamSlot, Unit, placed_vector

    class Blob:
        def __init__(self, n: int) -> None:
            self.data = np.zeros(n, np.float32)
            self.diff = np.zeros(n, np.float32)

    blobs = {i: Blob(n) for i, n in ((1, 3), (2, 5), (3, 7))}

    def slot(i: int) -> LayerSlot:
        return LayerSlot(i, f"l{i}", [ParamSlot(i, f"l{i}/0", blobs[i])])
    host = _Host(0)
    try:
        scheme = _HubScheme(host, [Unit([slot(i)], "hub") for i in (1, 2, 3)], 1 << 20)
        assert scheme._placed_vector(Unit([slot(2)], "hub")) is not None  # lone diffs: placed
        scheme.close()
        bucket = Unit([slot(2), slot(3)], "hub")  # the next plan fuses them
        vec = placed_vector(bucket)
        assert all(np.shares_memory(blobs[i].diff, vec) for i in (2, 3))
    finally:
        host.collectives["hub"].close()


def test_signal_bits_are_every_request_bit():
    from engine.comm.syncer import REQUEST_BITS
    assert set(REQUEST_BITS.values()) <= set(SIGNAL_BITS)


# ------------------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def lenet_db(tmp_path_factory) -> Path:
    from engine.data.converters import convert_mnist
    src = shared_path("data", "mnist")
    out = tmp_path_factory.mktemp("mnist3")
    convert_mnist(src, out, limit=WORKERS * BATCH * ITERS)
    return out / "mnist_train_lmdb"


@pytest.fixture(scope="module")
def lenet_reference(lenet_db, tmp_path_factory) -> dict[str, np.ndarray]:
    d = tmp_path_factory.mktemp("ref3")
    solver = write_run(d, lenet_db, WORKERS * BATCH, "ref", net=lenet_net)
    done = run(["train", "--solver", str(solver)])
    assert done.returncode == 0, done.stderr[-2000:]
    return weights(d / f"ref_iter_{ITERS}.caffemodel")


def run(args: list[str], launcher: list[str] = (), timeout: float = 240,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, sys.executable, "-m", "poseidon_cli.main", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def said(done: subprocess.CompletedProcess) -> str:
    """A run's output for a failure's message: its log, then the launcher's own lines
    (mpiexec names a rank that died on its standard output)."""
    return done.stderr[-3000:] + done.stdout[-2000:]


def check_equals_reference(d: Path, reference: dict[str, np.ndarray], engine_name: str,
                           done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, said(done)
    got = weights(d / f"dist_iter_{ITERS}.caffemodel")
    worst = max(relative_distance(got, reference).items(), key=lambda kv: kv[1])
    assert worst[1] <= BOUND, worst
    s = json.loads((d / "stats.json").read_text())
    assert s["replicas_identical"] is True and s["world_size"] == WORKERS
    assert {u["scheme"] for u in s["units"]} == {engine_name}
    if engine_name == "gloo":
        # the round's last unit (its id is the lowest layer) is waited for in its release,
        # and that time counts as waiting: Gloo's ring over TCP takes 2(P-1) steps, each
        # more than 20 us / 4 on any machine (a wait that found it applied counts nothing)
        last = min(layer for u in s["units"] for layer in u["layers"])
        assert s["wait_s_by_layer"][str(last)] > 20e-6, s["wait_s_by_layer"]
    assert f"travel on {engine_name} (" in done.stderr and "authenticates nothing" in done.stderr


@needs_gloo
def test_three_gloo_workers_equal_one_worker_with_three_times_the_batch(lenet_db, lenet_reference,
                                                                       tmp_path):
    solver = write_run(tmp_path, lenet_db, BATCH, "dist", net=lenet_net)
    done = run(["train", "--solver", str(solver), "-n", str(WORKERS), "--comm", "gloo",
                "--fusion-mb", "0", "--timeout", "60", "--stats", str(tmp_path / "stats.json")])
    check_equals_reference(tmp_path, lenet_reference, "gloo", done)
    s = json.loads((tmp_path / "stats.json").read_text())
    assert len(s["units"]) == 4  # one per layer: the engine orders four units per round


@needs_mpi
def test_three_mpi_workers_equal_one_worker_with_three_times_the_batch(lenet_db, lenet_reference,
                                                                      tmp_path):
    solver = write_run(tmp_path, lenet_db, BATCH, "dist", net=lenet_net)
    key = {KEY_ENV: key_hex(new_key())}
    args = ["train", "--solver", str(solver), "--comm", "mpi", "--fusion-mb", "0", "--timeout",
            "60"]
    done = run([*args, "--stats", str(tmp_path / "stats.json")],
               [MPIEXEC, "-n", str(WORKERS)], env=key)
    check_equals_reference(tmp_path, lenet_reference, "mpi", done)
    assert "Rendezvous (MPICH / Intel MPI)" in done.stderr
    first = weights(tmp_path / f"dist_iter_{ITERS}.caffemodel")
    # a rerun on the plan the first run wrote gives the same bits (the algorithm is pinned)
    again = run([*args, "--plan", str(tmp_path / "dist_plan.prototxt")],
                [MPIEXEC, "-n", str(WORKERS)], env=key)
    assert again.returncode == 0, said(again)
    assert "(pinned by --plan" in again.stderr
    second = weights(tmp_path / f"dist_iter_{ITERS}.caffemodel")
    assert all(np.array_equal(first[k], second[k]) for k in first)


RANK_THAT_ENDS = """
import subprocess, sys
from engine.comm.schemes.mpi import init_mpi
from poseidon_cli.console import run_process

def main():
    init_mpi().COMM_WORLD.Barrier()
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # as a worker's shard
    return 0

run_process(main)
"""


@needs_mpi
def test_mpi_ranks_end_without_mpiexec_killing_any(tmp_path):
    """A worker process ends through ``run_process``: MPI_Finalize (atexit), then the exit.
    By ``os._exit`` MPICH's launcher took a rank ending so for a failed one and killed the
    others with signal 9 (10 of 15 runs with a child process, as a worker's shard); five
    runs in a row fail that way with a chance of 1 in 240."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_THAT_ENDS)
    for _ in range(5):
        done = subprocess.run([MPIEXEC, "-n", "4", sys.executable, str(script)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, said(done)


def train(*args: str) -> str:
    done = run(["train", *args, "--timeout", "30"])
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


@needs_gloo
def test_a_resumed_and_a_pinned_gloo_run_reproduce_the_bits(digits_db, tmp_path):  # noqa: F811
    hosts, _ = write_hosts(tmp_path, 2)
    solvers = {}
    for name in ("straight", "resumed", "pinned"):
        solvers[name] = write_run(tmp_path, digits_db, 16, name, iters=10)
        solvers[name].write_text(solvers[name].read_text() + "snapshot: 5\n")
    gloo = ["--hosts", str(hosts), "--comm", "gloo", "--fusion-mb", "0"]
    train("--solver", str(solvers["straight"]), *gloo)
    state = tmp_path / "straight_iter_5.solverstate"
    log = train("--solver", str(solvers["resumed"]), *gloo, "--snapshot", str(state))
    assert f"(recorded in {state}: the resumed run sums as the run that wrote it)" in log
    plan = tmp_path / "straight_plan.prototxt"
    assert 'version: "torch ' in plan.read_text() and 'algorithm: "ring"' in plan.read_text()
    log = train("--solver", str(solvers["pinned"]), "--hosts", str(hosts), "--trusted-network",
                "--plan", str(plan))
    assert f"(pinned by --plan {plan})" in log
    for name in ("resumed", "pinned"):
        same_bits(tmp_path / "straight_iter_10.caffemodel", tmp_path / f"{name}_iter_10.caffemodel")

    # a plan made on another version of the engine, or with another algorithm pinned, is
    # refused, naming both
    here = f"this run has {GlooBackend.version()} ({GlooBackend.algorithm()}): another " \
        "version or algorithm may sum in another order"
    for name, edit, says in [
            ("other_version", ('version: "torch ', 'version: "torch 0.'), "gloo torch 0."),
            ("other_algorithm", ('algorithm: "ring"', 'algorithm: "tree"'), "(tree)")]:
        edited = tmp_path / f"{name}.prototxt"
        edited.write_text(plan.read_text().replace(*edit))
        done = run(["train", "--solver", str(solvers["pinned"]), *gloo, "--plan", str(edited),
                    "--timeout", "30"])
        errors = [l for l in done.stderr.splitlines() if l.startswith("poseidon: error:")]
        assert done.returncode != 0 and len(errors) == 1, done.stderr[-2000:]
        assert f"--plan {edited}: it sums on gloo " in errors[0] and says in errors[0]
        assert here in errors[0], errors[0]


@needs_gloo
def test_auto_on_a_trusted_network_probes_shm_beside_the_engines(digits_db, tmp_path):  # noqa: F811
    """Two workers of one machine: every worker runs shm's probe after the engines' (its
    rounds through the progress thread), and rank 0 logs its times and plans on them."""
    hosts, _ = write_hosts(tmp_path, 2, one_machine=True)
    solver = write_run(tmp_path, digits_db, 8, "auto", iters=4)
    log = train("--solver", str(solver), "--hosts", str(hosts), "--comm", "auto",
                "--trusted-network")
    probe = re.search(r"Shared memory \(shm\) probed beside them: shm probe: 4 KB in (\d+) us, "
                      r"4 MB in ([\d.]+) ms, 2 workers", log)
    assert probe is not None, log[-3000:]
    assert 0 < int(probe[1]) and 0 < float(probe[2]) < 30 * 1e3
    assert "Collective engine gloo joined" in log and "Communication plan for 2 workers" in log


@needs_gloo
def test_a_signal_to_one_gloo_worker_reaches_every_worker(digits_db, tmp_path):  # noqa: F811
    """SIGHUP (snapshot) to worker 1 alone: its request rides the unit that ends its backward,
    and rank 0, which no signal reached, writes the snapshot at the iteration all agreed."""
    from engine.comm.hosts import port_owner
    from tests.test_comm_signals import FAR, start_in_background, wait_for_line

    hosts, base = write_hosts(tmp_path, 2)
    solver = write_run(tmp_path, digits_db, 16, "sig", iters=FAR, display=1)
    shell, launcher = start_in_background(
        ["train", "--solver", str(solver), "--hosts", str(hosts), "--comm", "gloo",
         "--fusion-mb", "0", "--timeout", "30"], tmp_path)
    try:
        wait_for_line(shell.stderr, r"Iteration 3\b", timeout=120)
        owner = port_owner(base + 2)
        assert owner is not None
        os.kill(int(owner.split()[1]), signal.SIGHUP)
        deadline = time.monotonic() + 60  # liveness
        while not list(tmp_path.glob("sig_iter_*.solverstate")):
            assert time.monotonic() < deadline, "rank 0 wrote no snapshot"
            time.sleep(0.1)
        os.kill(launcher, signal.SIGINT)
        shell.wait(timeout=60)
    finally:
        if shell.poll() is None:  # the launcher shares this process group: kill its tree
            for pid in tree(launcher):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shell.kill()
    assert shell.returncode == 0


@needs_gloo
def test_kill_9_of_a_gloo_worker_leaves_three_that_go_on_from_the_commit(jobs, digits_db,  # noqa: F811
                                                                        tmp_path):
    """The elastic job rebuilds the Gloo group for each generation; from the commit on it
    equals a 3-worker gloo run resumed from it, bit for bit."""
    # the kill lands at iteration 2K+2: 60 leaves it 48 iterations to land mid-run (with 20,
    # under stress-ng, the run had ended before the test had found the victim)
    job = Job(tmp_path, digits_db, 4, iters=60)
    jobs.append(job.start("--min-workers", "3", "--backoff", "600", "--comm", "gloo"))
    job.wait_for(r"Elastic generation 1: 4 workers")
    victim = job.member(1)
    job.wait_for(rf"Iteration {2 * K + 2} ")
    os.kill(victim, signal.SIGKILL)
    m = job.wait_for(LOST.format(rank=1, port=job.port(1)))
    commit = int(m.group(1))
    assert job.finish() == 0, job.tail()
    assert not job.errors()
    # the second generation joined a Gloo group of its own three workers
    assert re.search(r"Collective engine gloo joined \(.*, 3 workers$", job.text(), re.M)
    reference = resumed_reference(job, digits_db, 3, commit, "--comm", "gloo")
    same_bits(reference, tmp_path / f"el_iter_{job.iters}.caffemodel")
