"""`poseidon bench comm`: Poseidon's transport against a raw TCP stream and Gloo, in one run.

Two processes, on loopback or at both ends of one emulated link (a network namespace each,
joined through a bridge by veths shaped with ``tbf``: engine/perf/netns.py). For each message
size, alternately:
- Poseidon: a worker endpoint streams ``count`` PUSH messages of one float32 array to a shard
  endpoint (the real transport: ZeroMQ, authentication in pieces, header parsing and checks),
  which answers the last one; and a ping-pong of one message and a small answer, for latency;
- the same without authentication (its cost is the ratio of the two);
- raw TCP: one socket, ``sendall`` of the same bytes into the peer's ``recv_into`` of a
  preallocated buffer, which answers with one byte;
- Gloo (PyTorch's CPU backend, when PyTorch is installed): ``torch.distributed`` send of the
  same tensor into the peer's recv of a preallocated one, which answers with one float; and
  its ping-pong.

It prints medians, the ratio Poseidon / TCP, and fits the link model t = alpha + beta * bytes
to Poseidon's ping-pong times (engine/comm/link.py), which `poseidon simulate --link` reads.
``stage_breakdown`` times where one ping-pong's microseconds go, stage by stage.
"""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import numpy as np

from engine.comm.cost import cost_ps_node, cost_ring
from engine.comm.link import Link
from engine.comm.pieces import PIECE_BYTES
from engine.pb import poseidon_pb2 as pb
from poseidon_cli.launch.hostfile import free_base_port, parse_hosts_text

SIZES = [1 << k for k in range(10, 29, 2)]  # 1 KB .. 256 MB, x4
CLIENT = ("worker", 0)
SERVER = ("shard", 1)
#: ports from the base: Poseidon authenticated (4), unauthenticated (4), TCP, Gloo's rendezvous
_PORTS = 10
_WAIT_S = 60.0


@dataclass
class Row:
    bytes: int
    poseidon_one_way_s: float   # ping-pong / 2
    poseidon_mb_s: float        # streaming
    tcp_mb_s: float
    repeats: int
    unauthenticated_mb_s: float = 0.0  # the same transport without authentication
    gloo_one_way_s: float | None = None  # None: PyTorch is not installed
    gloo_mb_s: float | None = None

    @property
    def ratio(self) -> float:
        return self.poseidon_mb_s / self.tcp_mb_s if self.tcp_mb_s else 0.0

    @property
    def auth_cost(self) -> float:
        """Throughput lost to authentication, as a fraction of the unauthenticated one."""
        u = self.unauthenticated_mb_s
        return 1.0 - self.poseidon_mb_s / u if u else 0.0

    @property
    def gloo_ratio(self) -> float | None:
        """Poseidon / Gloo, streaming."""
        return self.poseidon_mb_s / self.gloo_mb_s if self.gloo_mb_s else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "auth_cost": self.auth_cost,
                "gloo_ratio": self.gloo_ratio}


@dataclass(frozen=True)
class Place:
    """Where the two ends run: addresses, and the namespaces to enter (None: this one)."""
    client_addr: str = "127.0.0.1"
    server_addr: str = "127.0.0.1"
    client_ns: str | None = None
    server_ns: str | None = None
    client_ifname: str = "lo"
    server_ifname: str = "lo"


def gloo_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _count(nbytes: int) -> int:
    """Messages per streaming measurement: about 64 MB of traffic, at least 4 messages."""
    return max(4, min(1000, (64 << 20) // nbytes))


def _repeats(nbytes: int, budget: int) -> int:
    return max(3, min(budget, (256 << 20) // max(nbytes * _count(nbytes), 1)))


def _enter(ns: str | None) -> None:
    if ns is not None:
        from engine.perf.netns import enter_namespace
        enter_namespace(ns)


# ------------------------------------------------------------------------- Poseidon's side
def _hosts(place: Place, base: int) -> list:
    """The client is worker 0 at ``base``; the server shard 1 at ``base + 3``."""
    return parse_hosts_text(f"{place.client_addr}:{base}\n{place.server_addr}:{base + 2}\n")


def _zmq_server(place: Place, base: int, key: bytes | None, piece_bytes: int, ready: Any,
                marks: Any = None) -> None:
    """A shard endpoint: answers a PUSH whose chunk field is 1 with an empty SUM. ``marks``:
    a pipe to send its stage clock's marks back through at the end."""
    _enter(place.server_ns)
    from engine.comm.stages import StageClock
    from engine.comm.transport import Endpoint, header

    ep = Endpoint(SERVER, _hosts(place, base), [CLIENT], key=key, timeout=300, local_ipc=False,
                  piece_bytes=piece_bytes)
    ep.checker = lambda msg: None
    if marks is not None:
        ep.clock = StageClock()

    def on_push(msg: Any) -> None:
        if msg.header.chunk == 1:
            ep.send(CLIENT, header(pb.DATA, scheme="ps", op=1, round=msg.header.round))
    ep.handler = on_push
    ready.set()
    while not ep.all_gone("worker") and ep.error is None:
        time.sleep(0.05)
    ep.close(say_bye=False)
    if marks is not None:
        marks.send(ep.clock.marks)


class _ZmqClient:
    def __init__(self, place: Place, base: int, key: bytes | None, piece_bytes: int) -> None:
        from engine.comm.transport import Endpoint

        self.ep = Endpoint(CLIENT, _hosts(place, base), [SERVER], key=key, timeout=300,
                           local_ipc=False, piece_bytes=piece_bytes)
        self.ep.checker = lambda msg: None
        self.round = 0

    def stream(self, payload: np.ndarray, count: int) -> float:
        from engine.comm.transport import header, message_key

        self.round += 1
        t = time.perf_counter()
        for k in range(count):
            self.ep.send(SERVER, header(pb.DATA, scheme="ps", round=self.round,
                                        chunk=int(k == count - 1)), [payload])
        self.ep.wait_for([message_key(pb.DATA, SERVER, self.round)], "the benchmark's answer")
        return time.perf_counter() - t

    def close(self) -> None:
        self.ep.close()


# ------------------------------------------------------------------------- raw TCP's side
def _tcp_server(place: Place, port: int, ready: Any) -> None:
    _enter(place.server_ns)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((place.server_addr, port))
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
    def __init__(self, place: Place, port: int) -> None:
        self.sock = _connect(place.server_addr, port)
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


def _connect(addr: str, port: int) -> socket.socket:
    deadline = time.monotonic() + _WAIT_S
    while True:
        try:
            return socket.create_connection((addr, port), timeout=_WAIT_S)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---------------------------------------------------------------------------- Gloo's side
def _gloo_init(place: Place, port: int, rank: int) -> Any:
    """torch.distributed over Gloo, rank 0 (the receiver) hosting the rendezvous."""
    os.environ["GLOO_SOCKET_IFNAME"] = place.server_ifname if rank == 0 else place.client_ifname
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # not c10d's notes about hostnames
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # point-to-point needs none; the two cores are the transfer's
    dist.init_process_group("gloo", init_method=f"tcp://{place.server_addr}:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=_WAIT_S))
    return torch, dist


def _gloo_server(place: Place, port: int, ready: Any) -> None:
    """Per size, told (bytes, count, repeats): each repeat takes ``count`` messages then one,
    answering each batch's last with one float, as the client's streams expect."""
    _enter(place.server_ns)
    ready.set()  # the rendezvous below waits for the client
    torch, dist = _gloo_init(place, port, 0)
    control = torch.zeros(3, dtype=torch.int64)
    answer = torch.ones(1)
    try:
        while True:
            dist.recv(control, src=1)
            nbytes, count, reps = (int(v) for v in control)
            if nbytes == 0:
                return
            buf = torch.empty(nbytes // 4)
            for _ in range(reps):
                for n in (count, 1):
                    for _ in range(n):
                        dist.recv(buf, src=1)
                    dist.send(answer, dst=1)
    finally:
        dist.destroy_process_group()


class _GlooClient:
    def __init__(self, place: Place, port: int) -> None:
        self.torch, self.dist = _gloo_init(place, port, 1)
        self.answer = self.torch.zeros(1)

    def begin(self, nbytes: int, count: int, reps: int) -> None:
        """Tell the server what follows: ``reps`` times a stream of ``count``, then of 1."""
        self.dist.send(self.torch.tensor([nbytes, count, reps], dtype=self.torch.int64), dst=0)

    def stream(self, payload: np.ndarray, count: int) -> float:
        tensor = self.torch.from_numpy(payload)
        t = time.perf_counter()
        for _ in range(count):
            self.dist.send(tensor, dst=0)
        self.dist.recv(self.answer, src=0)
        return time.perf_counter() - t

    def close(self) -> None:
        self.begin(0, 0, 0)
        self.dist.destroy_process_group()


# ------------------------------------------------------------------------------ the bench
def run(sizes: list[int] | None = None, budget: int = 5,
        say: Callable[[Row], None] | None = None, piece_bytes: int = PIECE_BYTES,
        bits_per_s: float | None = None, gloo: bool = True) -> tuple[list[Row], Link]:
    """Measure every size (Poseidon with and without authentication, TCP, and Gloo when
    PyTorch is installed and ``gloo``, alternating); returns the rows and the fitted link.
    ``bits_per_s``: through one emulated link of that rate (root), else on loopback."""
    sizes = sizes or SIZES
    gloo = gloo and gloo_available()
    if bits_per_s is None:
        rows = list(_served(Place(), sizes, budget, piece_bytes, gloo, say))
    else:
        rows = _through_link(bits_per_s, sizes, budget, piece_bytes, gloo, say)
    return rows, fit_link([(r.bytes, r.poseidon_one_way_s) for r in rows])


def _through_link(bits_per_s: float, sizes: list[int], budget: int, piece_bytes: int,
                  gloo: bool, say: Callable[[Row], None] | None) -> list[Row]:
    """The bench with each end in a namespace of its own: the measuring end is a child
    process in host 0's namespace, which sends each row back as it is measured."""
    from engine.perf.netns import EmulatedCluster

    ctx = mp.get_context("fork")
    with EmulatedCluster(2, bits_per_s) as cluster:
        place = Place(cluster.addresses[0], cluster.addresses[1], cluster.namespaces[0],
                      cluster.namespaces[1], cluster.interface(0), cluster.interface(1))
        mine, theirs = ctx.Pipe(duplex=False)

        def measure() -> None:
            _enter(place.client_ns)
            try:
                for row in _served(place, sizes, budget, piece_bytes, gloo, None):
                    theirs.send(asdict(row))
            except Exception as e:
                theirs.send(f"{type(e).__name__}: {e}")
            theirs.send(None)

        child = ctx.Process(target=measure)  # not a daemon: it starts the receiving ends
        child.start()
        rows = []
        try:
            while True:
                if not mine.poll(600):
                    raise RuntimeError("the measuring process went silent for 600 s")
                got = mine.recv()
                if got is None:
                    break
                if isinstance(got, str):
                    raise RuntimeError(got)
                rows.append(Row(**got))
                if say is not None:
                    say(rows[-1])
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
    return rows


def _served(place: Place, sizes: list[int], budget: int, piece_bytes: int, gloo: bool,
            say: Callable[[Row], None] | None) -> Iterator[Row]:
    """Start the receiving processes, then measure each size against them."""
    from engine.comm.auth import new_key

    ctx = mp.get_context("fork")
    base = free_base_port(_PORTS // 2)
    key = new_key()
    targets: list[tuple[Callable[..., None], tuple]] = [
        (_zmq_server, (place, base, key, piece_bytes)),
        (_zmq_server, (place, base + 4, None, piece_bytes)),
        (_tcp_server, (place, base + 8))]
    if gloo:
        targets.append((_gloo_server, (place, base + 9)))
    ready = [ctx.Event() for _ in targets]
    servers = [ctx.Process(target=f, args=(*args, r), daemon=True)
               for (f, args), r in zip(targets, ready)]
    for p in servers:
        p.start()
    clients: list[Any] = []
    try:
        if not all(r.wait(30) for r in ready):
            raise RuntimeError("bench comm: the receiving processes did not start")
        z = _ZmqClient(place, base, key, piece_bytes)
        clients.append(z)
        plain = _ZmqClient(place, base + 4, None, piece_bytes)
        clients.append(plain)
        tcp = _TcpClient(place, base + 8)
        clients.append(tcp)
        g = _GlooClient(place, base + 9) if gloo else None
        if g is not None:
            clients.append(g)
        for nbytes in sizes:
            payload = np.ones(max(nbytes // 4, 1), np.float32)
            count, reps = _count(nbytes), _repeats(nbytes, budget)
            zs, us, ts, pp, gs, gpp = [], [], [], [], [], []
            if g is not None:
                g.begin(payload.nbytes, count, reps)
            for _ in range(reps):  # alternate, so all see the same machine
                zs.append(z.stream(payload, count))
                ts.append(tcp.stream(payload, count))
                us.append(plain.stream(payload, count))
                pp.append(z.stream(payload, 1))
                if g is not None:
                    gs.append(g.stream(payload, count))
                    gpp.append(g.stream(payload, 1))
            total = payload.nbytes * count
            row = Row(payload.nbytes, statistics.median(pp) / 2,
                      total / statistics.median(zs) / 1e6, total / statistics.median(ts) / 1e6,
                      reps, total / statistics.median(us) / 1e6,
                      statistics.median(gpp) / 2 if gpp else None,
                      total / statistics.median(gs) / 1e6 if gs else None)
            if say is not None:
                say(row)
            yield row
    finally:
        for c in clients:
            c.close()
        for p in servers:
            p.join(5)
            if p.is_alive():
                p.kill()


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
