"""DWBP syncer: wait-free backprop — each layer's gradients go on the wire the moment they exist.

``release(layer)`` is called by ``net.backward`` as soon as a layer's parameter gradients are
complete; it queues them and returns, so the backward of the layers below goes on while these
bytes travel. A sender thread pushes PS chunks to their shards or broadcasts an SFB layer's
sufficient factors; a reducer thread, in release order, gathers the global sum, divides by P
(the mean gradient: P workers with batch B compute what one worker with batch P·B computes),
writes it into the parameters' diffs and calls the solver's ``update_layer``. ``wait(layer)``
blocks the next forward of a layer until its update is applied (BSP, per layer).
"""
from __future__ import annotations

import hashlib
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from engine import backend
from engine.pb import poseidon_pb2 as pb
from engine.perf import timeline

from .errors import CommError
from .hosts import HostEntry
from .ps import Chunk, layout_digest
from .stats import CommStats, now
from .transport import (HEADER_BYTES, HEADER_BYTES_PER_CHUNK, SHARD, WORKER, Endpoint, Message,
                        header, message_key)


#: what a signal asks for, as bits on the wire (Header.request)
REQUEST_BITS = {"snapshot": 1, "stop": 2}


@dataclass
class ParamSlot:
    index: int       # learnable-parameter index, the id on the wire
    name: str        # "layer/i"
    blob: Any        # has .diff (numpy or cupy)
    role: str        # "weight" (grad uᵀ·v), "weight_t" (grad vᵀ·u), "bias" (Σ rows of u), "other"


@dataclass
class LayerSlot:
    layer: int
    name: str
    params: list[ParamSlot]
    #: returns the sufficient factors (u, v) of the last backward; None if not an FC layer
    factors: Callable[[], tuple[Any, Any]] | None = None
    #: (K, M, N): u is K x N and v is K x M, the shapes peers' FACTORS are checked against
    factor_shape: tuple[int, int, int] | None = None


def open_worker(rank: int, hosts: Sequence[HostEntry], *, key: bytes, timeout: float = 30.0,
                stats: CommStats | None = None, exit_grace: float | None = None,
                snapshot_hint: Callable[[], str | None] | None = None,
                max_frame_bytes: int | None = None) -> Endpoint:
    """Bind worker ``rank``'s socket and connect to every worker and shard (no traffic yet)."""
    world = len(hosts)
    peers = [(WORKER, r) for r in range(world)] + [(SHARD, s) for s in range(world)]
    return Endpoint((WORKER, rank), hosts, peers, key=key, timeout=timeout, stats=stats,
                    exit_grace=exit_grace, snapshot_hint=snapshot_hint,
                    max_frame_bytes=max_frame_bytes)


def frame_limit(layout: Sequence[Chunk], slots: Mapping[int, LayerSlot]) -> int:
    """The largest frame a process of this job sends: a chunk, a layer's factor (u or v, at
    most 8 bytes a value), or a header (LAYOUT lists every chunk). ZMQ_MAXMSGSIZE."""
    biggest = max((c.count * np.dtype(c.dtype).itemsize for c in layout), default=0)
    for s in slots.values():
        if s.factor_shape is not None:
            k, m, n = s.factor_shape
            biggest = max(biggest, 8 * k * max(m, n))
    return max(biggest, HEADER_BYTES + HEADER_BYTES_PER_CHUNK * len(layout))


def meet(ep: Endpoint, layout: Sequence[Chunk]) -> None:
    """The start-up barrier: every worker and shard is up and agrees on the layout.

    Rank 0 hands the chunk table to the shards. Called once this worker can check data
    messages (a fast peer may send its first gradients the moment the barrier opens).
    """
    world = len(ep.hosts)
    workers = [(WORKER, r) for r in range(world)]
    shards = [(SHARD, s) for s in range(world)]
    digest = layout_digest(layout)
    if ep.me == (WORKER, 0):
        ep.broadcast(shards, header(pb.LAYOUT, layout=[c.to_pb() for c in layout]))
    ep.broadcast(ep.peers, header(pb.HELLO, layout_digest=digest, world_size=world))
    hellos = ep.wait_for([message_key(pb.HELLO, w) for w in workers if w != ep.me],
                         "start-up HELLO")
    for m in hellos:
        if m.header.world_size != world or m.header.layout_digest != digest:
            ep.fatal(f"{ep.name_of(m.sender)} runs a different configuration "
                     "(hosts file, net or --chunk-bytes differ)")
            raise CommError(ep.error)
    ep.wait_for([message_key(pb.READY, s) for s in shards], "shard READY")


class Syncer:
    """The per-layer gradient synchroniser a Solver drives (release / wait / wait_all / close).

    Construction installs the message checker on ``ep`` (from ``open_worker``) and then runs
    the start-up barrier.
    """

    def __init__(self, ep: Endpoint, layers: dict[int, LayerSlot], schemes: dict[int, str],
                 layout: Sequence[Chunk], update_layer: Callable[[int], None],
                 on_round_done: Callable[[int], None] | None = None) -> None:
        self.ep = ep
        self.rank = ep.me[1]
        self.world = len(ep.hosts)
        self.layers = layers
        self.schemes = schemes
        self.update_layer = update_layer
        self.on_round_done = on_round_done
        self._last_layer = min(layers) if layers else -1  # released last in a backward
        self.stats = ep.stats
        for i, slot in layers.items():
            self.stats.layer_names[i] = slot.name
        self._chunks: dict[int, list[Chunk]] = {}
        self._chunk_by_id = {(c.param, c.chunk): c for c in layout}
        for c in layout:
            self._chunks.setdefault(c.param, []).append(c)
        self._factor_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...], str]] = {}
        for i, slot in layers.items():
            if schemes.get(i) == "sfb":
                if slot.factors is None or slot.factor_shape is None:
                    ep.close(say_bye=False)
                    raise CommError(f"layer {slot.name} has no sufficient factors for SFB")
                k, m, n = slot.factor_shape
                dtype = np.dtype(slot.params[0].blob.diff.dtype).str
                self._factor_shapes[i] = ((k, n), (k, m), dtype)
        #: signal bits (SNAPSHOT | STOP) for the messages of the next round this worker sends
        self._request_out = 0
        #: round -> OR of the signal bits in that round's messages, identical on every worker
        self._round_requests: dict[int, int] = {}
        self._requests_taken = 0  # rounds below this one have been handed to the solver
        self._released = {i: 0 for i in layers}
        self._applied = {i: 0 for i in layers}
        self._cond = threading.Condition()
        self._send_q: queue.Queue = queue.Queue()
        self._reduce_q: queue.Queue = queue.Queue()
        ep.checker = self._check
        ep.on_fatal.append(self._wake)
        self._threads = [threading.Thread(target=self._guard, args=(self._send_loop,),
                                          name="poseidon-send", daemon=True),
                         threading.Thread(target=self._guard, args=(self._reduce_loop,),
                                          name="poseidon-reduce", daemon=True)]
        for t in self._threads:
            t.start()
        try:
            meet(ep, layout)
        except BaseException:
            ep.disarm()
            self._shutdown()
            raise

    # ------------------------------------------------------------------ the solver's side
    def release(self, layer: int) -> None:
        """Hand layer ``layer``'s fresh gradients to the communication threads; returns at once."""
        slot = self.layers.get(layer)
        if slot is None:
            return
        self._raise_if_failed()
        t = now()
        factors = None
        if self.schemes[layer] == "sfb":
            # copies: the next forward may overwrite the layer's input before they are sent
            factors = [np.array(backend.to_numpy(a), copy=True) for a in slot.factors()]  # type: ignore[misc]
        with self._cond:
            rnd = self._released[layer]
            self._released[layer] += 1
            request = self._request_out
            if layer == self._last_layer:  # sent with (at least) this round's last layer
                self._request_out &= ~request  # not = 0: a signal may have come meanwhile
        self._send_q.put((layer, rnd, t, factors, request))

    def wait(self, layer: int) -> None:
        """Block until every released round of ``layer`` is applied (call before its forward)."""
        if layer not in self.layers:
            return
        t = now()
        tl = timeline.current
        start = tl.now()
        with self._cond:
            while self._applied[layer] < self._released[layer]:
                self._raise_if_failed()
                self._cond.wait(0.5)
        self._raise_if_failed()
        waited = now() - t
        if waited > 0:
            self.stats.add_wait(layer, waited)
        if tl.active:
            tl.complete(self.layers[layer].name, "wait", start)

    def wait_all(self) -> None:
        for layer in self.layers:
            self.wait(layer)

    def request(self, action: str) -> None:
        """A signal asked this worker for ``action`` ('snapshot' or 'stop'): tell every worker
        through the next round's messages. Called from a signal handler, which runs on the
        training thread: no lock (that thread may hold it), and only that thread touches
        ``_request_out``."""
        self._request_out |= REQUEST_BITS[action]

    def take_request(self) -> str | None:
        """The action every worker agreed on, or None. Called by the solver at an iteration
        boundary, after it released round R-1: rounds before R-1 are complete on every worker
        (each of their layers was waited for in the last forward), so every worker gets the same
        answer at the same iteration."""
        with self._cond:
            complete = min(self._released.values(), default=0) - 1
            bits = 0
            for rnd in range(self._requests_taken, complete):
                bits |= self._round_requests.pop(rnd, 0)
            self._requests_taken = max(self._requests_taken, complete)
        if bits & REQUEST_BITS["stop"]:
            return "stop"
        return "snapshot" if bits & REQUEST_BITS["snapshot"] else None

    def close(self) -> None:
        """Finish outstanding rounds, check the replicas agree, say BYE, release the sockets."""
        try:
            if self.ep.error is None:
                self.wait_all()
                self.check_replicas()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._send_q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self.ep.close(say_bye=self.ep.error is None)

    def check_replicas(self) -> None:
        """Every worker's parameters must be bit-identical (BSP); a difference is fatal."""
        h = hashlib.sha256()
        for li in sorted(self.layers):
            for p in self.layers[li].params:
                h.update(np.ascontiguousarray(backend.to_numpy(p.blob.data)).tobytes())
        mine = h.digest()
        others = [(WORKER, r) for r in range(self.world) if r != self.rank]
        self.ep.broadcast(others, header(pb.CHECK, layout_digest=mine))
        for m in self.ep.wait_for([message_key(pb.CHECK, w) for w in others], "the final check"):
            if m.header.layout_digest != mine:
                self.ep.fatal(f"replicas diverged: the parameters of {self.ep.name_of(m.sender)} "
                              f"differ from those of {self.ep.name}")
                raise CommError(self.ep.error)
        self.stats.extra["replicas_identical"] = True
        self.stats.extra["params_sha256"] = mine.hex()

    # ------------------------------------------------------------------- internals
    def _raise_if_failed(self) -> None:
        """On the training thread: raise the recorded error (the process will exit cleanly)."""
        if self.ep.error is not None:
            self.ep.disarm()
            raise CommError(self.ep.error)

    def _wake(self, _reason: str) -> None:
        with self._cond:
            self._cond.notify_all()

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except CommError:
            pass  # already recorded and broadcast by the endpoint
        except Exception as e:
            self.ep.fatal(f"{self.ep.name}: communication thread failed: {type(e).__name__}: {e}")
        finally:
            self._reduce_q.put(None)
            self._wake("")

    def _check(self, msg: Message) -> str | None:
        h = msg.header
        if h.kind == pb.SUM:
            c = self._chunk_by_id.get((h.param, h.chunk))
            if c is None:
                return f"unknown param {h.param} chunk {h.chunk}"
            if msg.sender != (SHARD, c.shard) or h.layer != c.layer:
                return f"param {h.param} chunk {h.chunk} does not come from {msg.sender} / layer {h.layer}"
            want = [((c.count,), c.dtype)]
        elif h.kind == pb.FACTORS:
            if h.layer not in self._factor_shapes or msg.sender[0] != WORKER:
                return f"layer {h.layer} is not synchronised by SFB"
            us, vs, dt = self._factor_shapes[h.layer]
            want = [(us, dt), (vs, dt)]
        else:
            return f"a worker does not take kind {pb.Kind.Name(h.kind)}"
        applied = self._applied.get(h.layer)
        if applied is None or h.round not in (applied, applied + 1):
            return f"layer {h.layer}: round {h.round}, expected {applied}"
        got = [(a.shape, a.dtype.str) for a in msg.arrays]
        if got != want:
            return f"layer {h.layer}: arrays {got}, expected {want}"
        return None

    def _send_loop(self) -> None:
        ep = self.ep
        while True:
            job = self._send_q.get()
            if job is None or ep.error is not None:
                return
            layer, rnd, _, factors, request = job
            tl = timeline.current
            start = tl.now()
            if factors is not None:
                peers = [(WORKER, r) for r in range(self.world) if r != self.rank]
                ep.broadcast(peers, header(pb.FACTORS, round=rnd, layer=layer, request=request),
                             factors)
            else:
                for p in self.layers[layer].params:
                    flat = backend.to_numpy(p.blob.diff).reshape(-1)
                    for c in self._chunks[p.index]:
                        ep.send((SHARD, c.shard), header(pb.PUSH, round=rnd, layer=layer,
                                                         param=p.index, chunk=c.chunk,
                                                         request=request),
                                [flat[c.offset:c.offset + c.count]])
            if tl.active:
                slot = self.layers[layer]
                nbytes = (sum(f.nbytes for f in factors) * (self.world - 1) if factors is not None
                          else sum(p.blob.diff.nbytes for p in slot.params))
                tl.complete(f"send {slot.name}", "send", start,
                            {"round": rnd, "scheme": self.schemes[layer], "bytes": nbytes})
            self._reduce_q.put(job)

    def _reduce_loop(self) -> None:
        while True:
            job = self._reduce_q.get()
            if job is None or self.ep.error is not None:
                return
            layer, rnd, released, factors, request = job
            slot = self.layers[layer]
            if factors is not None:
                request |= self._reduce_sfb(slot, rnd, factors)
            else:
                request = self._reduce_ps(slot, rnd)
            tl = timeline.current
            start = tl.now()
            self.update_layer(layer)
            if tl.active:
                tl.complete(f"update {slot.name}", "update", start, {"round": rnd})
            with self._cond:
                if request:
                    self._round_requests[rnd] = self._round_requests.get(rnd, 0) | request
                self._applied[layer] += 1
                self._cond.notify_all()
            self.stats.add_round(layer, rnd, released, now())
            if layer == self._last_layer and self.on_round_done is not None:
                self.on_round_done(rnd)

    def _reduce_ps(self, slot: LayerSlot, rnd: int) -> int:
        """Write the mean gradient from the shards' sums; returns their signal bits."""
        keys = [message_key(pb.SUM, (SHARD, c.shard), rnd, slot.layer, p.index, c.chunk)
                for p in slot.params for c in self._chunks[p.index]]
        tl = timeline.current
        start = tl.now()
        sums = self.ep.wait_for(keys, f"the sums of layer {slot.name} round {rnd}")
        if tl.active:
            tl.complete(f"receive {slot.name}", "receive", start, {"round": rnd})
        msgs = iter(sums)
        for p in slot.params:
            total = np.empty(p.blob.diff.size, dtype=p.blob.diff.dtype)
            for c in self._chunks[p.index]:
                total[c.offset:c.offset + c.count] = next(msgs).arrays[0]
            total /= self.world
            _write(p.blob, total)
        return _request_bits(sums)

    def _reduce_sfb(self, slot: LayerSlot, rnd: int, own: list[np.ndarray]) -> int:
        """Rebuild the mean gradient from every worker's factors; returns the peers' bits."""
        others = [r for r in range(self.world) if r != self.rank]
        keys = [message_key(pb.FACTORS, (WORKER, r), rnd, slot.layer) for r in others]
        tl = timeline.current
        start = tl.now()
        msgs = self.ep.wait_for(keys, f"the sufficient factors of layer {slot.name} round {rnd}")
        if tl.active:
            tl.complete(f"receive {slot.name}", "receive", start, {"round": rnd})
            start = tl.now()
        got = {r: m.arrays for r, m in zip(others, msgs)}
        got[self.rank] = own
        # Rank order: every replica forms the very same matrices, so results are bit-identical.
        u = np.concatenate([got[r][0] for r in range(self.world)])
        v = np.concatenate([got[r][1] for r in range(self.world)])
        for p in slot.params:
            if p.role == "weight":
                g = u.T @ v
            elif p.role == "weight_t":
                g = v.T @ u
            elif p.role == "bias":
                g = u.sum(axis=0)
            else:
                raise CommError(f"layer {slot.name}: parameter {p.name} cannot be rebuilt from "
                                "sufficient factors")
            g /= self.world
            _write(p.blob, g)
        if tl.active:
            tl.complete(f"rebuild {slot.name}", "rebuild", start, {"round": rnd})
        return _request_bits(msgs)


def _request_bits(msgs: Sequence[Message]) -> int:
    bits = 0
    for m in msgs:
        bits |= m.header.request
    return bits


def _write(blob: Any, grad: np.ndarray) -> None:
    """Overwrite a parameter's diff with the mean gradient (numpy or cupy)."""
    xp = backend.get_array_module(blob.diff)
    blob.diff[...] = xp.asarray(grad.reshape(blob.diff.shape), dtype=blob.diff.dtype)
