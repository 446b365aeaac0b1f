"""The emulated cluster's namespaces: shaped links, and nothing left behind on any exit path.

Needs root and iproute2 (`ip`, `tc` with tbf); skipped, saying so, without them.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from engine.perf.netns import EmulatedCluster, cleanup_stale, leftovers, link_mtu

#: what every test of the emulated cluster needs (this file's, and those that import it)
needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2 (ip, tc)")
pytestmark = needs_namespaces

SINK = """
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 29411)); s.listen(1); c, _ = s.accept()
n = 0
while (b := c.recv(1 << 20)):
    n += len(b)
print(n)
"""
SEND = """
import socket, time
for _ in range(100):
    try:
        c = socket.create_connection(("{addr}", 29411), timeout=5); break
    except OSError:
        time.sleep(0.05)
t = time.perf_counter(); c.sendall(b"x" * {n}); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.perf_counter() - t)
"""


def mine(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(f"pp{os.getpid()}")]


def gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_links_are_shaped_and_everything_is_removed():
    with EmulatedCluster(2, 40e6) as c:
        before = [c.link_bytes(h) for h in range(2)]
        sink = c.run(1, ["python3", "-c", SINK], stdout=subprocess.PIPE, text=True)
        n = 4_000_000  # 32 Mbit: 0.8 s at 40 Mbit/s
        done = subprocess.run(["ip", "netns", "exec", c.namespaces[0], "python3", "-c",
                               SEND.format(addr=c.addresses[1], n=n)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        got = int(sink.communicate(timeout=30)[0])
        seconds = float(done.stdout)
        assert got == n
        # each host's link counts the payload, in the direction it went, plus TCP/IP's
        # headers (~5%) and little else; the acknowledgements go the other way
        (in0, out0), (in1, out1) = [(a - x, b - y) for (a, b), (x, y) in
                                    zip([c.link_bytes(h) for h in range(2)], before)]
        assert n <= out0 <= 1.1 * n and n <= in1 <= 1.1 * n, (out0, in1)
        assert in0 < 0.1 * n and out1 < 0.1 * n, (in0, out1)
        rate = n * 8 / seconds
        # at most the shaped rate, whatever the load (TCP/IP headers take ~5%); the lower bound
        # only catches a unit error (bits for bytes is 8x), as other work may slow the sender
        assert 0.25 * 40e6 <= rate <= 1.05 * 40e6, rate
        assert c.measure_latency(50) < 0.05  # nothing is added: veth + a bridge
        # a slow link keeps Ethernet's frames (jumbo ones stalled many flows in its queue)
        for dev in (f"{c.tag}v0", c.bridge):
            assert Path(f"/sys/class/net/{dev}/mtu").read_text().strip() == "1500"
        pids = [p.pid for p in c.procs]
    assert mine(leftovers()[0]) == [] and mine(leftovers()[1]) == []
    assert gone(pids)


def test_fast_links_carry_jumbo_frames():
    assert [link_mtu(r) for r in (40e6, 41.7e6, 100e6, 200e6)] == [1500, 1500, 9000, 9000]
    with EmulatedCluster(1, 100e6) as c:
        for dev in (f"{c.tag}v0", c.bridge):
            assert Path(f"/sys/class/net/{dev}/mtu").read_text().strip() == "9000"


def test_teardown_after_an_exception_and_a_killed_process():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, 100e6) as c:
            p = c.run(0, ["sleep", "60"])
            q = c.run(1, ["sleep", "60"])
            os.kill(p.pid, signal.SIGKILL)
            raise RuntimeError("boom")
    assert mine(leftovers()[0]) == [] and mine(leftovers()[1]) == []
    time.sleep(0.1)
    assert gone([q.pid])


def test_teardown_on_sigterm():
    with pytest.raises(KeyboardInterrupt):
        with EmulatedCluster(2, 100e6) as c:
            c.run(0, ["sleep", "60"])
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert mine(leftovers()[0]) == [] and mine(leftovers()[1]) == []


def test_stale_clusters_of_dead_runs_are_removed():
    dead = subprocess.run(["python3", "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    subprocess.run(["ip", "netns", "add", f"pp{dead}h0"], check=True)
    subprocess.run(["ip", "link", "add", f"pp{dead}br", "type", "bridge"], check=True)
    try:
        assert set(cleanup_stale()) >= {f"pp{dead}h0", f"pp{dead}br"}
        ns, links = leftovers()
        assert f"pp{dead}h0" not in ns and f"pp{dead}br" not in links
    finally:
        subprocess.run(["ip", "netns", "del", f"pp{dead}h0"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"pp{dead}br"], capture_output=True)
