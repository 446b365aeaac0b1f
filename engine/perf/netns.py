"""An emulated cluster on one machine: one network namespace per host, shaped links.

Each host is a namespace with a veth pair whose other end sits on one bridge. Each link is
shaped in both directions with ``tbf``: egress on the namespace's end limits what the host
sends, egress on the bridge's end limits what it receives, as a full-duplex NIC on a
switch. This kernel has no ``netem``: no delay or loss is imposed, and the latency the links
have is measured (``measure_latency``) and reported, never assumed. A fast link carries jumbo
frames (``link_mtu``): every packet costs the kernel the same through veth, bridge and tbf
whatever its size, and at 1500 bytes that took half the CPU of a 16-worker run at 100 Mbit/s
(its softirq time), work that a real NIC's segmentation offloads spare the hosts.

Names carry the creating process's pid (``pp<pid>h<i>``, bridge ``pp<pid>br``), so two runs do
not collide, and ``cleanup_stale`` removes what a killed run left behind. Everything is torn
down on every exit path of the ``with`` block: an exception, SIGINT/SIGTERM (turned into
exceptions while the block runs), or a process inside that was killed.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

PREFIX = "pp"
#: jumbo frames, as 10 GbE clusters run them (below tbf's smallest burst), and Ethernet's
JUMBO_MTU, MTU = 9000, 1500
#: jumbo frames only where tbf's queue holds this many: with 16 hosts sending to one through a
#: queue of 115 (41.7 Mbit/s), TCP flows stalled past a 60 s time-out (1500 bytes: 695 packets,
#: and the run was within 5% of the model); at 100 Mbit/s (277) every row was within 10%
JUMBO_QUEUE_PACKETS = 256
_NAME = re.compile(rf"^{PREFIX}(\d+)(h\d+|br)$")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built; the message says why (root, ip, tc)."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def check_root(command: str = "bench cluster") -> None:
    """Root and iproute2 are there, or a ClusterError that names ``command``."""
    if os.geteuid() != 0:
        raise ClusterError(f"{command} needs root (network namespaces); run it with sudo")
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise ClusterError(f"{command} needs the `{tool}` command (iproute2)")


def tbf_args(bits_per_s: float) -> list[str]:
    """tbf's rate, burst and queue for a link of ``bits_per_s``. The burst holds 4 ms of
    traffic (at least 32 KB, more than one 64 KB GSO segment's worth at high rates would let
    bursts through at line rate); the queue holds 200 ms, so TCP meets the rate, not drops."""
    burst, limit = _tbf_bytes(bits_per_s)
    return ["rate", f"{int(bits_per_s)}bit", "burst", str(burst), "limit", str(limit)]


def _tbf_bytes(bits_per_s: float) -> tuple[int, int]:
    bytes_per_s = bits_per_s / 8
    burst = max(int(bytes_per_s * 0.004), 32 << 10)
    return burst, max(int(bytes_per_s * 0.2), 4 * burst)


def link_mtu(bits_per_s: float) -> int:
    """The MTU of a link of ``bits_per_s``: jumbo frames when its queue holds enough of them."""
    return JUMBO_MTU if _tbf_bytes(bits_per_s)[1] >= JUMBO_QUEUE_PACKETS * JUMBO_MTU else MTU


class EmulatedCluster:
    """``n`` hosts at 10.<a>.<b>.1..n on one bridge, each link ``bits_per_s`` each way."""

    def __init__(self, n: int, bits_per_s: float) -> None:
        if n < 1:
            raise ClusterError(f"an emulated cluster needs at least one host, got {n}")
        self.n = n
        self.bits_per_s = bits_per_s
        pid = os.getpid()
        self.tag = f"{PREFIX}{pid}"
        self.bridge = f"{self.tag}br"
        self.namespaces = [f"{self.tag}h{i}" for i in range(n)]
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self._previous: dict[int, Any] = {}

    # -- life cycle ----------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        check_root()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, _raise_interrupt)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        _ip("ip", "link", "add", self.bridge, "type", "bridge")
        _ip("ip", "link", "set", self.bridge, "up")
        mtu, shape = str(link_mtu(self.bits_per_s)), tbf_args(self.bits_per_s)
        for i, ns in enumerate(self.namespaces):
            host_end, ns_end = f"{self.tag}v{i}", f"{self.tag}n{i}"
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", host_end, "mtu", mtu, "type", "veth", "peer", "name",
                ns_end, "mtu", mtu)
            _ip("ip", "link", "set", ns_end, "netns", ns)
            _ip("ip", "link", "set", host_end, "master", self.bridge)
            _ip("ip", "link", "set", host_end, "up")
            _ip("ip", "addr", "add", f"{self.addresses[i]}/16", "dev", ns_end, netns=ns)
            _ip("ip", "link", "set", ns_end, "up", netns=ns)
            _ip("ip", "link", "set", "lo", "up", netns=ns)
            _ip("tc", "qdisc", "add", "dev", ns_end, "root", "tbf", *shape, netns=ns)  # sends
            _ip("tc", "qdisc", "add", "dev", host_end, "root", "tbf", *shape)          # receives

    def close(self) -> None:
        """Stop every process started inside, delete the links, the namespaces and the
        bridge. Safe to call twice."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for i, ns in enumerate(self.namespaces):
            _kill_in_namespace(ns)
            _ip("ip", "link", "del", f"{self.tag}v{i}", check=False)  # and its peer with it
            _ip("ip", "netns", "del", ns, check=False)
        _ip("ip", "link", "del", self.bridge, check=False)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    # -- use -----------------------------------------------------------------------------
    def run(self, host: int, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace, in a process group of its own."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv],
                             start_new_session=True, **popen)
        self.procs.append(p)
        return p

    def interface(self, host: int) -> str:
        """The name of host ``host``'s end of its link, inside its namespace."""
        return f"{self.tag}n{host}"

    def link_bytes(self, host: int) -> tuple[int, int]:
        """(bytes into, bytes out of) host ``host`` so far, as its link's bridge end counts
        them (what crosses the emulated network: headers included, a machine's own traffic
        between its workers not)."""
        stats = Path(f"/sys/class/net/{self.tag}v{host}/statistics")
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    def measure_latency(self, rounds: int = 200) -> float:
        """Median one-way time of a 1-byte TCP ping-pong from host 0 to host 1 (seconds):
        the alpha the links really have (nothing is added to it)."""
        if self.n < 2:
            return 0.0
        port = 29400
        server = self.run(1, ["python3", "-c", _PONG.format(port=port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            done = subprocess.run(["ip", "netns", "exec", self.namespaces[0], "python3", "-c",
                                   _PING.format(addr=self.addresses[1], port=port,
                                                rounds=rounds)],
                                  capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise ClusterError(f"latency probe failed: {done.stderr.strip()[-300:]}")
            return float(done.stdout.strip()) / 2
        finally:
            server.kill()
            server.wait()


    def measure_goodput(self, nbytes: int = 8 << 20) -> float:
        """Bits per second of payload one TCP stream gets from host 0 to host 1: the shaped
        rate less what TCP/IP headers and the shaper take (the beta the links really have)."""
        if self.n < 2:
            return self.bits_per_s
        port = 29401
        sink = self.run(1, ["python3", "-c", _SINK.format(port=port)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            done = subprocess.run(["ip", "netns", "exec", self.namespaces[0], "python3", "-c",
                                   _SEND.format(addr=self.addresses[1], port=port, n=nbytes)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise ClusterError(f"bandwidth probe failed: {done.stderr.strip()[-300:]}")
            return nbytes * 8 / float(done.stdout.strip())
        finally:
            sink.kill()
            sink.wait()


_SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {port})); s.listen(1); c, _ = s.accept()
while c.recv(1 << 20):
    pass
c.sendall(b"!")
"""
_SEND = """
import socket, time
for _ in range(100):
    try:
        c = socket.create_connection(("{addr}", {port}), timeout=30); break
    except OSError:
        time.sleep(0.05)
data = b"x" * {n}
t = time.perf_counter(); c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.perf_counter() - t)
"""
_PONG = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {port})); s.listen(1); c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)):
    c.sendall(b)
"""
_PING = """
import socket, statistics, time
for _ in range(100):
    try:
        c = socket.create_connection(("{addr}", {port}), timeout=5); break
    except OSError:
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range({rounds}):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
print(statistics.median(rtts))
"""


def enter_namespace(ns: str) -> None:
    """Move this process (single-threaded: a fresh child) into network namespace ``ns``;
    every socket it opens afterwards is in there (os.setns only comes with Python 3.12)."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    with open(f"/var/run/netns/{ns}") as f:
        if libc.setns(f.fileno(), clone_newnet) != 0:
            raise ClusterError(f"cannot enter namespace {ns}: {os.strerror(ctypes.get_errno())}")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _kill_in_namespace(ns: str) -> None:
    """SIGKILL whatever still runs in ``ns`` (a worker's shard whose parent died...)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


def leftovers() -> tuple[list[str], list[str]]:
    """(namespaces, links) named like an emulated cluster's, of any run."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in ns.splitlines() if line.strip()]
    links = [p.name for p in Path("/sys/class/net").iterdir()] if Path("/sys/class/net").is_dir() \
        else []
    return ([n for n in names if n.startswith(PREFIX) and _NAME.match(n)],
            [l for l in links if l.startswith(PREFIX)])


def cleanup_stale() -> list[str]:
    """Remove the namespaces and bridges of emulated clusters whose process is gone."""
    removed = []
    namespaces, links = leftovers()
    for name in namespaces + [l for l in links if l.endswith("br")]:
        m = _NAME.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        if name.endswith("br"):
            _ip("ip", "link", "del", name, check=False)
        else:
            _kill_in_namespace(name)
            _ip("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_port(host: str, port: int, timeout: float = 10.0) -> None:
    """Used by tests: block until ``host:port`` accepts a TCP connection."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise ClusterError(f"{host}:{port} did not open within {timeout:g} s")
