"""Large messages in authenticated pieces: released whole or not at all.

A receiving endpoint (worker 0) gets pieces as a sender of the job would put them on the wire
(engine/comm/pieces.py: ``signed``), through a plain PUSH socket, so that a test can alter,
reorder, repeat or splice them as someone on the path could. Each case ends with an authentic
message; the mailbox must then hold exactly the authentic messages, byte for byte, and the
counters must say what was dropped.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from engine.comm.auth import Signer
from engine.comm.pieces import split, signed
from engine.comm.transport import WORKER, Endpoint, header, message_key, wire_frames
from engine.pb import poseidon_pb2 as pb
from tests.test_comm_transport import KEY, local_hosts

PIECE = 1024
LAYER = 5


def payload(rnd: int) -> list[np.ndarray]:
    """Two arrays: 3600 bytes (pieces of 1024, 1024, 1024 and 528) and 512 (one piece)."""
    rng = np.random.default_rng(rnd)
    return [rng.standard_normal((3, 300)).astype(np.float32), rng.standard_normal(64)]


def wire(signer: Signer, sender: int, rnd: int) -> list[list[bytes]]:
    """Message ``rnd`` of worker ``sender`` as the wire carries it: its signed pieces."""
    h = header(pb.DATA, scheme="sfb", layer=LAYER, round=rnd, sender_role=pb.WORKER,
               sender=sender)
    return [[bytes(memoryview(f)) for f in piece]
            for piece in signed(wire_frames(h, payload(rnd)), signer, PIECE)]


@pytest.fixture
def receiver():
    """Worker 0, which hears workers 1 and 2; and a raw socket into it."""
    hosts = local_hosts(3)
    ep = Endpoint((WORKER, 0), hosts, [(WORKER, 1), (WORKER, 2)], key=KEY, timeout=10,
                  piece_bytes=PIECE)
    ep.checker = lambda msg: None
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(hosts[0].worker_addr())
    try:
        yield ep, raw
    finally:
        raw.close()
        ep.close(say_bye=False)


def send(raw: zmq.Socket, pieces: list[list[bytes]]) -> None:
    for piece in pieces:
        raw.send_multipart(piece)


def settle(ep: Endpoint, sender: int, rnd: int, dropped: int) -> list[tuple[int, int]]:
    """Wait for the authentic message ``rnd`` (it came last) and ``dropped`` drops; return
    the (sender, round) of everything in the mailbox, checking each against its payload."""
    last = message_key(pb.DATA, (WORKER, sender), rnd, LAYER)
    deadline = time.monotonic() + 10  # a liveness bound only
    while ((last not in ep._mailbox or ep.dropped < dropped)
           and time.monotonic() < deadline):
        time.sleep(0.01)
    return sorted(k[2:4] for k in ep._mailbox)


def got(ep: Endpoint, sender: int, rnd: int) -> list[np.ndarray]:
    [msg] = ep.wait_for([message_key(pb.DATA, (WORKER, sender), rnd, LAYER)], "it", timeout=5)
    return msg.arrays


def assert_authentic(arrays: list[np.ndarray], rnd: int) -> None:
    for a, b in zip(arrays, payload(rnd), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_split_cuts_each_array_and_keeps_small_messages_whole():
    h, a, b = b"h", memoryview(bytes(2500)), memoryview(bytes(10))
    assert [[len(f) for f in p] for p in split([h, a, b], 1024)] == [[1], [1024], [1024], [452],
                                                                     [10]]
    assert split([h, b, b], 1024) == [[h, b, b]]


def test_a_large_message_arrives_whole_and_equal():
    hosts = local_hosts(2)
    a = Endpoint((WORKER, 0), hosts, [(WORKER, 1)], key=KEY, timeout=10, piece_bytes=PIECE)
    b = Endpoint((WORKER, 1), hosts, [(WORKER, 0)], key=KEY, timeout=10, piece_bytes=PIECE)
    a.checker = lambda msg: None
    try:
        arrays = [*payload(7), np.zeros((0, 4), np.float32), np.full((1, 1), 2.5)]
        b.send((WORKER, 0), header(pb.DATA, scheme="sfb", layer=LAYER, round=7), arrays)
        b.send((WORKER, 0), header(pb.DATA, scheme="sfb", layer=LAYER, round=8), payload(8))
        first = got(a, 1, 7)
        for x, y in zip(first, arrays, strict=True):
            assert x.shape == np.shape(y)
            np.testing.assert_array_equal(x, y)
        assert_authentic(got(a, 1, 8), 8)
        assert (a.dropped, a.incomplete) == (0, 0)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("altered, dropped, incomplete", [
    (0, 6, 0),  # the header piece: it fails, then each of its 5 data pieces belongs to nothing
    (1, 5, 1),  # the first data piece fails, the next finds it missing, 3 belong to nothing
    (3, 3, 1),  # a middle one
    (5, 2, 1),  # the last one: its message waits in vain, until the sender's next one starts
])
def test_one_altered_piece_drops_the_whole_message(receiver, altered, dropped, incomplete):
    ep, raw = receiver
    me = Signer(KEY)
    bad, good = wire(me, 1, 3), wire(me, 1, 4)
    assert len(bad) == 6  # a header, then 4 + 1 pieces of array bytes
    bad[altered][0] = bytes([bad[altered][0][0] ^ 1]) + bad[altered][0][1:]
    send(raw, bad + good)
    assert settle(ep, 1, 4, dropped) == [(1, 4)]  # the altered one never: not even a part
    assert_authentic(got(ep, 1, 4), 4)
    assert (ep.dropped, ep.unauthenticated, ep.incomplete) == (dropped, 1, incomplete)


def test_reordered_pieces_drop_the_message(receiver):
    ep, raw = receiver
    me = Signer(KEY)
    m, after = wire(me, 1, 3), wire(me, 1, 4)
    # piece 2 before 1: 2 is new but not next (the message is dropped whole); 1, then older
    # than the sender's newest, is a replay; 3, 4 and 5 belong to no message
    send(raw, [m[0], m[2], m[1], *m[3:]] + after)
    assert settle(ep, 1, 4, 5) == [(1, 4)]
    assert (ep.dropped, ep.unauthenticated, ep.incomplete) == (5, 0, 1)


def test_a_repeated_piece_is_dropped_alone_and_never_counts_twice(receiver):
    """A replayed piece (someone recorded the traffic) is dropped by itself: it cannot break
    the message in flight, and it is not taken in a second time."""
    ep, raw = receiver
    me = Signer(KEY)
    m, after = wire(me, 1, 3), wire(me, 1, 4)
    send(raw, [m[0], m[1], m[1], m[2], m[2], m[3], m[4], m[5], m[5], m[0]] + after)
    assert settle(ep, 1, 4, 4) == [(1, 3), (1, 4)]
    assert_authentic(got(ep, 1, 3), 3)
    assert (ep.dropped, ep.unauthenticated, ep.incomplete) == (4, 0, 0)


def test_pieces_of_another_message_never_join_one(receiver):
    ep, raw = receiver
    me = Signer(KEY)
    old, cur, nxt, fresh, last = (wire(me, 1, r) for r in (3, 4, 5, 99, 6))
    send(raw, old)  # accepted
    # an older message's piece in the middle of the current one: a replay, dropped alone
    send(raw, cur[:2] + [old[2]] + cur[2:])
    # the current message's tail swapped for a later message's (same layout, fresh counters,
    # never sent): every index fits, the counters do not, so the current one is dropped whole
    # and the swapped-in pieces belong to no message
    send(raw, nxt[:2] + fresh[2:])
    send(raw, last)
    # dropped: old[2]; nxt whole; fresh[3:] (3 pieces of no message)
    assert settle(ep, 1, 6, 5) == [(1, 3), (1, 4), (1, 6)]
    for rnd in (3, 4, 6):
        assert_authentic(got(ep, 1, rnd), rnd)
    assert (ep.dropped, ep.unauthenticated, ep.incomplete) == (5, 0, 1)


def test_pieces_of_another_sender_never_join_one(receiver):
    ep, raw = receiver
    one, two = Signer(KEY), Signer(KEY)
    a, b = wire(one, 1, 3), wire(two, 2, 3)
    # worker 2's data piece amid worker 1's message: it is checked against worker 2's
    # session, which has no message in pieces, and dropped; worker 1's goes on
    send(raw, a[:2] + [b[1]] + a[2:])
    # worker 2's piece relabelled as worker 1's (its trailer names worker 1's session):
    # it fails authentication
    relabelled = [b[2][0], a[0][-1][:16] + b[2][1][16:]]
    send(raw, b[:2] + [relabelled] + b[2:])
    c = wire(one, 1, 4)
    send(raw, c)
    # dropped: b[1] alone; the relabelled piece; worker 2's message goes on unharmed
    assert settle(ep, 1, 4, 2) == [(1, 3), (1, 4), (2, 3)]
    assert_authentic(got(ep, 1, 3), 3)
    assert_authentic(got(ep, 2, 3), 3)
    assert (ep.dropped, ep.unauthenticated, ep.incomplete) == (2, 1, 0)
