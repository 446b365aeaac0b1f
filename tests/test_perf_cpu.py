"""engine/perf/cpu.py: a worker's CPU taken apart by kind of thread. Each thread below burns
a fixed amount of its own CPU time (``time.thread_time``), so the amounts do not depend on how
busy the machine is; the meter must put each where its thread's name says."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from engine.perf.cpu import CpuMeter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BURN_S = 0.3
#: the readings at each end, and a busy machine's preemptions inside ``burn``'s checks
SLACK_S = 0.08


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_threads_cpu_goes_where_its_name_says():
    meter = CpuMeter()  # made on this thread: it is the training thread
    meter.begin()
    burn(BURN_S)
    for name in ("poseidon-recv", "ZMQbg/IO/0", "OpenBLAS-pool"):
        t = threading.Thread(target=burn, args=(BURN_S,), name=name)
        t.start()
        t.join()
    # the threads ended: their CPU is the process's, no longer any live thread's, so only the
    # training thread is told apart here; a live communicator thread is below
    got = meter.end(iterations=2)
    assert got["iterations"] == 2
    assert abs(got["training"] * 2 - BURN_S) < SLACK_S, got
    assert abs(got["other"] * 2 - 3 * BURN_S) < 3 * SLACK_S, got


@pytest.mark.parametrize("name, kind", [("poseidon-progress", "progress"),
                                        ("poseidon-recv", "transport"),
                                        ("ZMQbg/IO/0", "transport")])
def test_a_live_communicator_thread_is_told_apart(name, kind):
    go, done = threading.Event(), threading.Event()

    def comm() -> None:
        go.wait()
        burn(BURN_S)
        done.set()
        time.sleep(60)  # alive while the meter reads it

    t = threading.Thread(target=comm, name=name, daemon=True)
    t.start()
    meter = CpuMeter()
    meter.begin()
    go.set()
    assert done.wait(30)
    got = meter.end(iterations=1)
    assert abs(got[kind] - BURN_S) < SLACK_S, got
    assert got["threads"][name] == pytest.approx(got[kind])
    assert got["training"] < SLACK_S and "shard" not in got


def test_a_stretch_shorter_than_a_clock_tick_is_counted():
    """A few iterations of a small net on a busy machine can take less CPU than /proc's 10 ms
    tick, which read them as none (or as a whole tick): the kernel's own clock counts them."""
    meter = CpuMeter()
    meter.begin()
    burn(0.003)
    got = meter.end(iterations=1)
    assert 0.003 <= got["training"] < 0.008, got
