"""The elastic driver knows each worker by who it is, not by its connection's file descriptor.

A real Driver (poseidon_cli/launch/elastic/driver.py) on loopback, its loop run on a thread,
and workers played by real ZeroMQ DEALER sockets speaking the signed protocol. The race the
old driver lost (it mapped the monitor's ACCEPTED and DISCONNECTED events to workers by file
descriptor and an accept count, and assumed every JOIN came after its ACCEPTED): many workers
join at once, some close while others connect, closed descriptors are reused by the next
connections. Every closed worker must be found lost by its connection, within the heartbeat
bound (``MISSED_BEATS`` beats, with a wide margin for a loaded machine), never by silence
after --timeout (60 s here, longer than the test), and no worker still connected may be
lost. A JOIN whose signed nonce is not its socket's routing id is dropped.
"""
from __future__ import annotations

import os
import threading
import time

import zmq

from engine.comm.auth import Signer, new_key
from poseidon_cli.job_config import JobConfig
from poseidon_cli.launch.elastic.driver import MISSED_BEATS, BatchFacts, Driver
from poseidon_cli.launch.elastic.policy import ElasticSettings
from poseidon_cli.launch.elastic.protocol import NONCE_CHARS, encode

TIMEOUT = 60.0
#: beats are at most a second apart; the bound leaves a wide margin for a busy machine
BOUND_S = MISSED_BEATS * 1.0 + 8.0


class _NoListing:
    name = "no listing"

    def poll(self, warn):  # workers come by hand only
        return None


class Harness:
    """A driver whose loop runs on a thread; the time each loss was recorded, by worker."""

    def __init__(self) -> None:
        self.key = new_key()
        settings = ElasticSettings(min_workers=1000, max_workers=None, commit_every=5,
                                   lr="none", global_batch=None, backoff_s=600.0,
                                   max_failures=3)
        self.lines: list[str] = []
        self.driver = Driver(JobConfig(solver="unused", timeout=TIMEOUT), settings,
                             _NoListing(), self.key, BatchFacts(8, 1), 0,
                             say=self.lines.append)
        self.lost: dict[str, tuple[float, str]] = {}
        lost = self.driver.events.lost

        def record(who: str, why: str, now: float, consequence: bool = False) -> None:
            self.lost[who] = (time.monotonic(), why)
            lost(who, why, now, consequence=consequence)
        self.driver.events.lost = record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        self.ctx = zmq.Context()
        self.signer = Signer(self.key)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.driver._tick()

    def worker(self, port: int, nonce: str | None = None) -> tuple[zmq.Socket, str]:
        """A worker's socket that joins as 127.0.0.1:``port``; its routing id is its nonce
        unless ``nonce`` says the JOIN claims another."""
        ident = os.urandom(NONCE_CHARS // 2).hex()
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, ident.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.driver.port}")
        s.send_multipart(encode(self.signer, "join", nonce=nonce or ident, host="127.0.0.1",
                                port=port, machine="m", pid=os.getpid()))
        return s, ident

    def welcomed(self, sock: zmq.Socket, limit: float = 20.0) -> bool:
        if not sock.poll(int(limit * 1000)):
            return False
        return b"welcome" in sock.recv_multipart()[0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.driver._close_sockets()
        self.ctx.destroy(linger=0)


def name(port: int) -> str:
    return f"worker at 127.0.0.1:{port}"


def test_joins_and_closes_interleaved_are_each_found_by_the_heartbeats():
    h = Harness()
    try:
        open_: dict[int, zmq.Socket] = {}
        closed: dict[int, float] = {}
        port = 40000
        for wave in range(6):  # joins racing closes: the next wave reuses the descriptors
            joined = []
            for _ in range(6):
                port += 2
                sock, _ = h.worker(port)
                joined.append((port, sock))
            for p, sock in joined[::2]:  # half close before the driver even answered
                sock.close(linger=2000)  # (their JOIN leaves first: the driver reads it late)
                closed[p] = time.monotonic()
            for p, sock in joined[1::2]:
                assert h.welcomed(sock), f"{name(p)} was not welcomed"
                open_[p] = sock
            for p in list(open_)[:2]:  # and two that joined earlier go
                open_.pop(p).close(linger=0)
                closed[p] = time.monotonic()
        deadline = time.monotonic() + BOUND_S + 5
        while time.monotonic() < deadline and not all(name(p) in h.lost for p in closed):
            time.sleep(0.1)
        for p, at in closed.items():
            assert name(p) in h.lost, f"{name(p)} closed and was never found lost"
            seen, why = h.lost[name(p)]
            assert "connection to the driver closed" in why, why
            assert seen - at <= BOUND_S, f"{name(p)} found after {seen - at:.1f} s"
        still = [p for p in open_ if name(p) in h.lost]
        assert not still, f"connected workers lost: {still} ({h.lost})"
    finally:
        h.close()


def test_a_join_whose_nonce_is_not_its_routing_id_is_dropped():
    h = Harness()
    try:
        sock, _ = h.worker(40100, nonce="0" * NONCE_CHARS)
        assert not h.welcomed(sock, limit=2.0)
        assert not h.driver.state.workers
    finally:
        h.close()


def test_the_driver_draws_its_port_clear_of_the_listed_workers(monkeypatch):
    """A worker listed on the driver's machine binds its port and the next: the driver's own
    port is drawn from the range without them (it once drew a worker's, and every generation
    of that job failed to bind it)."""
    from poseidon_cli.launch.hostfile import free_base_port

    base = free_base_port(3)  # six free ports: the range the driver draws a free pair from
    monkeypatch.setenv("POSEIDON_PORTS", f"{base}-{base + 5}")  # the high end is not drawn
    settings = ElasticSettings(min_workers=1000, max_workers=None, commit_every=5, lr="none",
                               global_batch=None, backoff_s=600.0, max_failures=3)
    for _ in range(5):
        driver = Driver(JobConfig(solver="unused", timeout=TIMEOUT), settings, _NoListing(),
                        new_key(), BatchFacts(8, 1), 0, say=lambda line: None,
                        avoid=frozenset({base, base + 1, base + 2}))
        try:
            assert driver.port == base + 3
        finally:
            driver._close_sockets()
