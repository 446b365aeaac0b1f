"""Where the transport's time goes (`poseidon bench comm --stages`, and its authentication
line): one ping-pong timed stage by stage through every step of the authenticated transport
(engine/comm/stages.py), and one core's speed at authenticating a message in its pieces."""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from engine.comm.pieces import PIECE_BYTES
from poseidon_cli.launch.hostfile import free_base_port

from .comm import Place, _ZmqClient, _zmq_server


def stage_breakdown(nbytes: int = 64 << 10, rounds: int = 400,
                    piece_bytes: int = PIECE_BYTES) -> dict[str, Any]:
    """Where a ping-pong's time goes: a message of ``nbytes`` from the worker to the shard
    and its empty answer back, each through every stage of the authenticated transport
    (engine/comm/stages.py), median microseconds per stage over ``rounds`` ping-pongs (the
    first tenth left out as warm-up). The stages of both legs add up to the round trip."""
    from engine.comm.auth import new_key
    from engine.comm.stages import StageClock

    ctx = mp.get_context("fork")
    base = free_base_port(2)
    key = new_key()
    place = Place()
    ready = ctx.Event()
    mine, theirs = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_zmq_server, args=(place, base, key, piece_bytes, ready,
                                                   theirs), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("bench comm: the receiving process did not start")
        client = _ZmqClient(place, base, key, piece_bytes)
        client.ep.clock = StageClock()
        payload = np.ones(max(nbytes // 4, 1), np.float32)
        try:
            for _ in range(rounds):
                client.stream(payload, 1)
        finally:
            client.close()
        if not mine.poll(30):
            raise RuntimeError("bench comm: the receiving process sent no timings")
        theirs_marks = mine.recv()
    finally:
        server.join(5)
        if server.is_alive():
            server.kill()
    return _legs(client.ep.clock.marks, theirs_marks, range(rounds // 10 + 1, rounds + 1))


def _legs(client: list, server: list, rounds: range) -> dict[str, Any]:
    """Per-stage medians (us) of both legs from the two processes' marks."""
    def by_round(marks: list) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for rnd, stage, t in marks:
            out.setdefault(rnd, {}).setdefault(stage, t)
        return out

    c, s = by_round(client), by_round(server)
    # (leg, stage name, from (process, stage), to (process, stage))
    steps = [("there", "serialise", ("c", "call"), ("c", "serialised")),
             ("there", "tag", ("c", "serialised"), ("c", "tagged")),
             ("there", "ZeroMQ: I/O threads, kernel", ("c", "tagged"), ("s", "received")),
             ("there", "verify", ("s", "received"), ("s", "verified")),
             ("there", "parse + check", ("s", "verified"), ("s", "checked")),
             ("there", "dispatch to the handler", ("s", "checked"), ("s", "handed")),
             ("back", "the handler, until it answers", ("s", "handed"), ("s", "call")),
             ("back", "serialise", ("s", "call"), ("s", "serialised")),
             ("back", "tag", ("s", "serialised"), ("s", "tagged")),
             ("back", "ZeroMQ: I/O threads, kernel", ("s", "tagged"), ("c", "received")),
             ("back", "verify", ("c", "received"), ("c", "verified")),
             ("back", "parse + check", ("c", "verified"), ("c", "checked")),
             ("back", "mailbox", ("c", "checked"), ("c", "handed")),
             ("back", "waiting thread wakes", ("c", "handed"), ("c", "woken"))]
    table = []
    for leg, name, (pa, sa), (pb_, sb) in steps:
        ds = [((s if pb_ == "s" else c)[r][sb] - (s if pa == "s" else c)[r][sa]) / 1e3
              for r in rounds if r in c and r in s]
        table.append({"leg": leg, "stage": name, "us": statistics.median(ds) if ds else None})
    rtts = [(c[r]["woken"] - c[r]["call"]) / 1e3 for r in rounds if r in c and "woken" in c[r]]
    return {"stages": table, "round_trip_us": statistics.median(rtts) if rtts else None}


def auth_bytes_per_s(nbytes: int = 64 << 20, repeats: int = 5,
                     piece_bytes: int = PIECE_BYTES) -> float:
    """One core's speed at authenticating a message in its pieces (engine/comm/auth.py),
    median of ``repeats``: each side of a link pays nbytes / this per message."""
    from engine.comm.auth import Signer, new_key
    from engine.comm.pieces import split

    payload = np.ones(nbytes // 4, np.float32)
    pieces = split([b"header", memoryview(payload).cast("B")], piece_bytes)
    signer = Signer(new_key())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for k, piece in enumerate(pieces):
            signer.trailer(piece, k, len(pieces))
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)
