"""`poseidon bench comm`: Poseidon's transport against a raw TCP stream, in the same run.

Two processes on loopback. For each message size, alternately:
- Poseidon: a worker endpoint streams ``count`` PUSH messages of one float32 array to a shard
  endpoint (the real transport: ZeroMQ, authentication, header parsing and checks), which
  answers the last one; and a ping-pong of one message and a small answer, for latency;
- the same without authentication (its cost is the ratio of the two);
- raw TCP: one socket, ``sendall`` of the same bytes into the peer's ``recv_into`` of a
  preallocated buffer, which answers with one byte.

It prints medians, the ratio Poseidon / TCP, and fits the link model t = alpha + beta * bytes
to Poseidon's ping-pong times (engine/comm/link.py), which `poseidon simulate --link` reads.
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from engine.comm.hosts import free_base_port, parse_hosts_text
from engine.comm.planner import cost_ps_node, cost_ring
from engine.pb import poseidon_pb2 as pb

from engine.comm.link import Link

SIZES = [1 << k for k in range(10, 29, 2)]  # 1 KB .. 256 MB, x4
SHARD = ("shard", 0)
WORKER = ("worker", 0)


@dataclass
class Row:
    bytes: int
    poseidon_one_way_s: float   # ping-pong / 2
    poseidon_mb_s: float        # streaming
    tcp_mb_s: float
    repeats: int
    unauthenticated_mb_s: float = 0.0  # the same transport without authentication

    @property
    def ratio(self) -> float:
        return self.poseidon_mb_s / self.tcp_mb_s if self.tcp_mb_s else 0.0

    @property
    def auth_cost(self) -> float:
        """Throughput lost to authentication, as a fraction of the unauthenticated one."""
        u = self.unauthenticated_mb_s
        return 1.0 - self.poseidon_mb_s / u if u else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "auth_cost": self.auth_cost}


def _count(nbytes: int) -> int:
    """Messages per streaming measurement: about 64 MB of traffic, at least 4 messages."""
    return max(4, min(1000, (64 << 20) // nbytes))


def _repeats(nbytes: int, budget: int) -> int:
    return max(3, min(budget, (256 << 20) // max(nbytes * _count(nbytes), 1)))


# ------------------------------------------------------------------------- Poseidon's side
def _hosts(base: int) -> list:
    return parse_hosts_text(f"127.0.0.1:{base}\n")


def _zmq_server(base: int, key: bytes | None, ready: Any) -> None:
    """A shard endpoint: answers a PUSH whose chunk field is 1 with an empty SUM."""
    from engine.comm.transport import Endpoint, header

    ep = Endpoint(SHARD, _hosts(base), [WORKER], key=key, timeout=300, local_ipc=False)
    ep.checker = lambda msg: None

    def on_push(msg: Any) -> None:
        if msg.header.chunk == 1:
            ep.send(WORKER, header(pb.DATA, scheme="ps", op=1, round=msg.header.round))
    ep.handler = on_push
    ready.set()
    while not ep.all_gone("worker") and ep.error is None:
        time.sleep(0.05)
    ep.close(say_bye=False)


class _ZmqClient:
    def __init__(self, base: int, key: bytes | None) -> None:
        from engine.comm.transport import Endpoint

        self.ep = Endpoint(WORKER, _hosts(base), [SHARD], key=key, timeout=300,
                           local_ipc=False)
        self.ep.checker = lambda msg: None
        self.round = 0

    def stream(self, payload: np.ndarray, count: int) -> float:
        from engine.comm.transport import header, message_key

        self.round += 1
        t = time.perf_counter()
        for k in range(count):
            self.ep.send(SHARD, header(pb.DATA, scheme="ps", round=self.round,
                                       chunk=int(k == count - 1)), [payload])
        self.ep.wait_for([message_key(pb.DATA, SHARD, self.round)], "the benchmark's answer")
        return time.perf_counter() - t

    def close(self) -> None:
        self.ep.close()


# ------------------------------------------------------------------------- raw TCP's side
def _tcp_server(port: int, ready: Any) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        left = int.from_bytes(head, "little")
        while left:
            n = conn.recv_into(view[:min(left, len(buf))])
            if not n:
                return
            left -= n
        conn.sendall(b"!")


class _TcpClient:
    def __init__(self, port: int) -> None:
        for _ in range(100):
            try:
                self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
                break
            except OSError:
                time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream(self, payload: np.ndarray, count: int) -> float:
        data = memoryview(payload).cast("B")
        t = time.perf_counter()
        self.sock.sendall((data.nbytes * count).to_bytes(8, "little"))
        for _ in range(count):
            self.sock.sendall(data)
        self.sock.recv(1)
        return time.perf_counter() - t

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------------------ the bench
def run(sizes: list[int] | None = None, budget: int = 5,
        say: Callable[[Row], None] | None = None) -> tuple[list[Row], Link]:
    """Measure every size (Poseidon with and without authentication, and TCP, alternating);
    returns the rows and the fitted link."""
    from engine.comm.auth import new_key

    sizes = sizes or SIZES
    ctx = mp.get_context("fork")
    base = free_base_port(3)
    key = new_key()
    ready = [ctx.Event() for _ in range(3)]
    servers = [ctx.Process(target=_zmq_server, args=(base, key, ready[0]), daemon=True),
               ctx.Process(target=_zmq_server, args=(base + 2, None, ready[1]), daemon=True),
               ctx.Process(target=_tcp_server, args=(base + 4, ready[2]), daemon=True)]
    for p in servers:
        p.start()
    try:
        if not all(r.wait(30) for r in ready):
            raise RuntimeError("bench comm: the receiving processes did not start")
        z, plain, tcp = _ZmqClient(base, key), _ZmqClient(base + 2, None), _TcpClient(base + 4)
        rows, pp_points = [], []
        try:
            for nbytes in sizes:
                payload = np.ones(max(nbytes // 4, 1), np.float32)
                count, reps = _count(nbytes), _repeats(nbytes, budget)
                zs, us, ts, pp = [], [], [], []
                for _ in range(reps):  # alternate, so all see the same machine
                    zs.append(z.stream(payload, count))
                    ts.append(tcp.stream(payload, count))
                    us.append(plain.stream(payload, count))
                    pp.append(z.stream(payload, 1))
                total = payload.nbytes * count
                row = Row(payload.nbytes, statistics.median(pp) / 2,
                          total / statistics.median(zs) / 1e6, total / statistics.median(ts) / 1e6,
                          reps, total / statistics.median(us) / 1e6)
                rows.append(row)
                pp_points.append((payload.nbytes, row.poseidon_one_way_s))
                if say is not None:
                    say(row)
        finally:
            z.close()
            plain.close()
            tcp.close()
    finally:
        for p in servers:
            p.join(5)
            if p.is_alive():
                p.kill()
    return rows, fit_link(pp_points)


def auth_bytes_per_s(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """One core's speed at authenticating a message (engine/comm/auth.py), median of
    ``repeats``: each side of a link pays nbytes / this per message."""
    from engine.comm.auth import Signer, new_key

    payload = np.ones(nbytes // 4, np.float32)
    frames = [b"header", memoryview(payload).cast("B")]
    signer = Signer(new_key())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        signer.trailer(frames)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def cpu_name_and_blas() -> str:
    """The CPU model, core count and the BLAS numpy uses (what a speed depends on)."""
    import os
    from pathlib import Path

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blas = "unknown BLAS"
    try:
        from threadpoolctl import threadpool_info
        libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if libs:
            blas = f"{libs[0].get('internal_api')} {libs[0].get('version')}"
    except ImportError:
        pass
    return f"{name}, {os.cpu_count()} cores, {blas}"


def fit_link(points: list[tuple[int, float]]) -> Link:
    """Least squares of t = alpha + beta * bytes, weighting each point by 1/t (relative
    error), so that the small messages set alpha and the large ones beta."""
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    w = 1.0 / np.maximum(y, 1e-9)
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    alpha, beta = np.linalg.lstsq(a, y * w, rcond=None)[0]
    return Link(max(float(alpha), 0.0), max(float(beta), 1e-15),
                "poseidon bench comm: Poseidon's transport, loopback, ping-pong fit")


def scheme_times(link: Link, nbytes: int, workers: list[int]) -> list[dict[str, Any]]:
    """Each scheme's time per node to synchronise one ``nbytes`` tensor, from the fitted link
    and the planner's cost formulas (bytes sent + received; each direction at full speed)."""
    out = []
    for p in workers:
        floats = nbytes / 4
        ps = cost_ps_node(int(floats), p, p) * 4 / 2   # per direction
        ring = cost_ring(int(floats), p) * 4 / 2
        out.append({"workers": p, "bytes": nbytes, "ps_s": 2 * link.alpha_s + link.beta_s_per_byte * ps,
                    "ring_s": 2 * (p - 1) * link.alpha_s + link.beta_s_per_byte * ring})
    return out
