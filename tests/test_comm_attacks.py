"""Nobody outside the job can change or stop it: attacks on a real 2-worker run change nothing.

The launcher makes a fresh job key; an attacker on the same machine can reach every worker and
shard port but does not have the key. Each attack runs for the whole training, against all
four ports, and the run must exit 0 with weights byte-identical to an undisturbed run's:
- forged PUSH messages claiming to be worker 1, for every chunk of every parameter a shard
  serves, rounds 0..N, values 1e3 (before authentication they took the slot of the real push,
  poisoning the model while the replica check passed);
- forged ABORT messages (they stopped the job within 0.1 s, printing the attacker's text);
- a HEARTBEAT whose shape multiplies past 2**64 (it wrapped to 0 in int64 and killed the
  receive thread, and the run died blaming a lost worker).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from engine.pb import poseidon_pb2 as pb
from tests.test_comm_train import digits_db, poseidon, weights, write_hosts, write_run  # noqa: F401

pytestmark = pytest.mark.numpy_kernels

ITERS = 30
BATCH = 16


def layout_of(solver: Path) -> list:
    """The chunk table every worker of a 2-worker hybrid run computes (the attacker can too)."""
    from engine.comm.bind import describe_net
    from engine.comm.codecs import Codec
    from engine.comm.planner import PlanOptions, make_plan
    from engine.comm.units import Unit
    from engine.comm.schemes.ps import make_layout, unit_vectors
    from engine.context import RunContext
    from engine.solver import Solver

    s = Solver(solver, context=RunContext(rank=0, world_size=2))
    try:
        slots, infos = describe_net(s.net)
        planned = make_plan(infos, 2, PlanOptions(comm="hybrid"))
        units = [Unit([slots[l] for l in layers], scheme)
                 for layers, scheme in planned.units if scheme == "ps"]
        return make_layout(unit_vectors(units, Codec().vectors, "<f4"), 2)
    finally:
        s.close()


def forged_pushes(layout: list) -> list[tuple[int, list[bytes]]]:
    """(shard, frames) of a push of 1e3 for every chunk and round, claiming to be worker 1."""
    out = []
    for rnd in range(ITERS + 2):
        for c in layout:
            h = pb.Header(kind=pb.DATA, scheme="ps", op=0, sender_role=pb.WORKER, sender=1,
                          round=rnd, layer=c.layer, param=c.param, chunk=c.chunk)
            h.arrays.add(dtype=c.dtype, shape=[c.count])
            out.append((c.shard, [h.SerializeToString(),
                                  np.full(c.count, 1e3, np.dtype(c.dtype)).tobytes()]))
    return out


def attack(kind: str, base: int, layout: list, stop: threading.Event, sent: list[int]) -> None:
    ctx = zmq.Context.instance()
    ports = {"worker": [base, base + 2], "shard": [base + 1, base + 3]}
    socks = {}
    for role, ps in ports.items():
        for i, port in enumerate(ps):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100)
            s.connect(f"tcp://127.0.0.1:{port}")
            socks[(role, i)] = s
    abort = pb.Header(kind=pb.ABORT, sender_role=pb.WORKER, sender=1,
                      reason="worker 1 (127.0.0.1): attacker says stop")
    overflow = pb.Header(kind=pb.HEARTBEAT, sender_role=pb.WORKER, sender=1)
    overflow.arrays.add(dtype="<f4", shape=[2 ** 32, 2 ** 32])
    pushes = forged_pushes(layout) if kind == "push" else []
    try:
        while not stop.is_set():
            if kind == "push":
                for shard, frames in pushes:
                    socks[("shard", shard)].send_multipart(frames, zmq.NOBLOCK)
                    sent[0] += 1
            else:
                frames = ([abort.SerializeToString()] if kind == "abort"
                          else [overflow.SerializeToString(), b""])
                for s in socks.values():
                    s.send_multipart(frames, zmq.NOBLOCK)
                    sent[0] += 1
            time.sleep(0.02)
    except zmq.Again:  # a peer's queue is full: wait and go on
        if not stop.is_set():
            time.sleep(0.05)
            attack(kind, base, layout, stop, sent)
    finally:
        for s in socks.values():
            s.close()


def train(tmp_path: Path, db: Path, kind: str | None) -> tuple[dict, dict, str]:
    d = tmp_path / (kind or "undisturbed")
    solver = write_run(d, db, BATCH, "run", iters=ITERS)
    hosts, base = write_hosts(d, 2)
    stats = d / "stats.json"
    stop, sent = threading.Event(), [0]
    attacker = None
    if kind is not None:
        attacker = threading.Thread(target=attack, args=(kind, base, layout_of(solver), stop, sent),
                                    daemon=True)
        attacker.start()
    try:
        # hybrid: the plan layout_of forges pushes for, whatever the link probe says
        done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--comm",
                        "hybrid", "--stats", str(stats), "--timeout", "20", timeout=150)
    finally:
        stop.set()
        if attacker is not None:
            attacker.join(10)
    assert done.returncode == 0, done.stderr[-3000:]
    if kind is not None:
        assert sent[0] > 0
    return weights(d / f"run_iter_{ITERS}.caffemodel"), json.loads(stats.read_text()), done.stderr


@pytest.fixture(scope="module")
def undisturbed(digits_db, tmp_path_factory):  # noqa: F811
    got, stats, _ = train(tmp_path_factory.mktemp("undisturbed"), digits_db, None)
    assert stats["unauthenticated_messages"] == 0
    return got


@pytest.mark.parametrize("kind", ["push", "abort", "overflow"])
def test_an_attack_during_training_changes_nothing(kind, undisturbed, digits_db,  # noqa: F811
                                                   tmp_path):
    got, stats, err = train(tmp_path, digits_db, kind)
    assert got.keys() == undisturbed.keys()
    for name, want in undisturbed.items():
        assert np.array_equal(got[name], want), name
    assert stats["replicas_identical"] is True
    # rank 0's worker saw the attack and counted it (the shards count theirs too)
    if kind != "push":
        assert stats["unauthenticated_messages"] > 0, stats
    assert "attacker says stop" not in err
    assert "dropped" in err and "failed authentication" in err
