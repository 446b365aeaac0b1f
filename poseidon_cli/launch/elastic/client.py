"""A worker's control connection to the elastic driver.

One thread owns the DEALER socket: it sends what the training thread hands it (through an
in-process socket that wakes it at once), heartbeats, and takes the driver's messages
(protocol.py): orders (an assignment, write a commit, exit) go to a queue the training thread
waits on, the answers to its questions at commits to a table, and an abort of the running
generation straight to that generation's endpoint, which fails the way a lost peer fails it
(so training stops within a moment, not after --timeout). The launcher's signals come as a
message and are raised on this process, so their handlers run on the training thread as a
signal's do.

The driver is lost when its connection closes (its process ended) or nothing comes from it for
--timeout (its machine went): the job stops, as a torchrun job stops when its rendezvous store
goes; the running generation fails with that reason.
"""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.comm.auth import Signer, Verifier
from engine.comm.errors import CommError

from .protocol import (DRIVER_KINDS, DRIVER_MESSAGE_BYTES, NONCE_CHARS, authenticate, encode,
                       parse)

_SIGNALS = {"stop": signal.SIGINT, "snapshot": getattr(signal, "SIGHUP", signal.SIGINT)}


class DriverClient:
    """The training thread's side: ``join``, ``tell``, ``ask``, ``next_order``, ``watch``."""

    def __init__(self, address: str, key: bytes, timeout: float) -> None:
        self.address, self.timeout = address, timeout
        self.hb = max(0.05, min(1.0, timeout / 5))
        self._signer, self._verifier = Signer(key), Verifier(key)
        #: who this worker is to the driver: its socket's routing id, and the nonce its signed
        #: JOIN carries (the driver checks they are one), the same after a reconnect
        self.nonce = os.urandom(NONCE_CHARS // 2).hex()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, self.nonce.encode())
        self._sock.setsockopt(zmq.LINGER, 2000)  # the last report leaves before we exit
        self._sock.setsockopt(zmq.MAXMSGSIZE, DRIVER_MESSAGE_BYTES)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._wake_in = self._ctx.socket(zmq.PAIR)
        self._wake_in.bind(f"inproc://poseidon-elastic-{id(self)}")
        self._wake_out = self._ctx.socket(zmq.PAIR)
        self._wake_out.connect(f"inproc://poseidon-elastic-{id(self)}")
        self._sock.connect(f"tcp://{address}")
        self._outgoing: queue.Queue = queue.Queue()
        self._orders: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._decisions: dict[tuple[int, int], str] = {}
        self._aborted: dict[int, str] = {}
        self._watched: tuple[int, Any] | None = None
        self._heard = time.monotonic()
        self._welcomed = False
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="poseidon-elastic-control",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the training thread
    def tell(self, kind: str, **fields: Any) -> None:
        """Send a message to the driver (it leaves at once, from the control thread)."""
        self._raise_if_lost()
        self._outgoing.put((kind, fields))
        self._wake()

    def join(self, host: str, port: int, machine: str) -> int:
        """Register with the driver; this worker's id, or CommError with the refusal."""
        nonce = self.nonce
        self.tell("join", nonce=nonce, host=host, port=port, machine=machine, pid=os.getpid())
        deadline = time.monotonic() + 2 * self.timeout
        while True:
            try:
                msg = self._orders.get(timeout=0.2)
            except queue.Empty:
                self._raise_if_lost()
                if time.monotonic() > deadline:
                    raise CommError(f"elastic driver at {self.address}: no answer within "
                                    f"{2 * self.timeout:g} s (is it running, and is this its "
                                    "address? the same job key?)") from None
                continue
            if msg is None:
                self._raise_if_lost()
            if msg["kind"] == "refuse" and msg["nonce"] == nonce:
                raise CommError(msg["reason"])
            if msg["kind"] == "welcome" and msg["nonce"] == nonce:
                self._welcomed = True
                return int(msg["wid"])

    def next_order(self) -> dict[str, Any]:
        """Wait for the driver's next order: assign, write or exit (idle for as long as the
        driver keeps this worker out of a generation: its heartbeats say it is there)."""
        while True:
            try:
                msg = self._orders.get(timeout=0.5)
            except queue.Empty:
                self._raise_if_lost()
                continue
            if msg is None:
                self._raise_if_lost()
                continue
            return msg

    def ask(self, gen: int, iteration: int) -> str:
        """At a commit: does the membership change here? The driver's answer (continue or
        regroup); CommError when the generation was aborted or the driver is lost."""
        self.tell("ask", gen=gen, iter=iteration)
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while (gen, iteration) not in self._decisions:
                if self.error is not None:
                    raise CommError(self.error)
                if gen in self._aborted:
                    raise CommError(self._aborted[gen])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommError(f"elastic driver at {self.address}: no answer within "
                                    f"{self.timeout:g} s at the commit of iteration {iteration}")
                self._lock.wait(min(left, 0.5))
            answer = self._decisions.pop((gen, iteration))
        if answer == "abort":
            raise CommError(self._aborted.get(gen) or f"elastic driver: generation {gen} "
                            "ended without this worker")
        return answer

    def watch(self, gen: int, ep: Any) -> None:
        """Fail ``ep`` (generation ``gen``'s endpoint) when the driver aborts ``gen`` or is
        lost; at once if that already happened."""
        with self._lock:
            self._watched = (gen, ep)
            reason = self.error or self._aborted.get(gen)
        if reason is not None:
            ep.fatal(reason, propagate=False)

    def unwatch(self) -> None:
        with self._lock:
            self._watched = None

    def aborted(self, gen: int) -> str | None:
        with self._lock:
            return self._aborted.get(gen)

    def close(self) -> None:
        """Let the last messages leave, then stop the thread and the sockets."""
        if self.error is None:
            deadline = time.monotonic() + 2.0
            while not self._outgoing.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
        self._stop.set()
        self._wake()
        self._thread.join(5)
        self._wake_out.close(linger=0)
        self._ctx.destroy(linger=1000)

    def _wake(self) -> None:
        """Wake the control thread (never blocks: a thread that has ended needs no waking)."""
        try:
            self._wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _raise_if_lost(self) -> None:
        if self.error is not None:
            raise CommError(self.error)

    # ------------------------------------------------------------------ the control thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in (self._sock, self._monitor, self._wake_in):
            poller.register(s, zmq.POLLIN)
        last_hb = 0.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(self.hb * 500)))
                if self._wake_in in ready:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                while not self._outgoing.empty():
                    kind, fields = self._outgoing.get()
                    self._sock.send_multipart(encode(self._signer, kind, **fields))
                if self._monitor in ready:
                    event = recv_monitor_message(self._monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED and self._welcomed:
                        self._lose("its connection closed (the driver process ended)")
                        return
                while self._sock.poll(0):
                    self._receive(self._sock.recv_multipart())
                now = time.monotonic()
                if now - last_hb >= self.hb:
                    last_hb = now
                    self._sock.send_multipart(encode(self._signer, "heartbeat"))
                if self._welcomed and now - self._heard > self.timeout:
                    self._lose(f"nothing heard from it for {self.timeout:g} s (its machine "
                               "went?)")
                    return
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                self._lose(f"its socket failed: {e}")
        except Exception as e:  # a bug here must stop the worker, not leave it waiting
            self._lose(f"the control thread failed: {type(e).__name__}: {e}")
        finally:
            self._monitor.close(linger=0)
            self._wake_in.close(linger=0)
            self._sock.close(linger=0 if self.error else 2000)

    def _receive(self, frames: list[bytes]) -> None:
        payload = authenticate(self._verifier, frames, "driver")
        if payload is None:
            return  # not this job's driver, or a replay: dropped
        try:
            msg = parse(payload, DRIVER_KINDS, f"elastic driver at {self.address}")
        except CommError as e:
            self._lose(str(e))
            return
        self._heard = time.monotonic()
        kind = msg["kind"]
        if kind == "heartbeat":
            return
        if kind == "decision":
            with self._lock:
                self._decisions[(msg["gen"], msg["iter"])] = msg["answer"]
                self._lock.notify_all()
            return
        if kind == "abort":
            with self._lock:
                self._aborted[msg["gen"]] = msg["reason"]
                watched = self._watched
                self._lock.notify_all()
            if watched is not None and watched[0] == msg["gen"]:
                watched[1].fatal(msg["reason"], propagate=False)
            return
        if kind == "signal":
            os.kill(os.getpid(), _SIGNALS[msg["action"]])
            return
        self._orders.put(msg)

    def _lose(self, why: str) -> None:
        reason = (f"lost the elastic driver at {self.address}: {why}; the job stops, as a "
                  "torchrun job stops when its rendezvous store goes")
        with self._lock:
            if self.error is not None:
                return
            self.error = reason
            watched = self._watched
            self._lock.notify_all()
        self._orders.put(None)
        if watched is not None:
            watched[1].fatal(reason, propagate=False)
