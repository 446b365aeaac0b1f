"""Hosts files, the wire header, and validation: forged messages are dropped, the receiver lives."""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from engine.comm.auth import Signer
from engine.comm.errors import CommError
from engine.comm.hosts import HostsError
from engine.comm.transport import SHARD, WORKER, Endpoint, header, message_key
from engine.pb import poseidon_pb2 as pb
from poseidon_cli.launch.hostfile import (
    DEFAULT_PORT,
    free_base_port,
    parse_hosts,
    parse_hosts_text,
)
from tests.conftest import shared_path

KEY = bytes(range(32))


def local_hosts(n: int):
    base = free_base_port(n)
    return parse_hosts_text("\n".join(f"127.0.0.1:{base + 2 * i}" for i in range(n)))


def test_poseidon_hostfile_fixture():
    entries = parse_hosts(shared_path("fixtures", "prototxt", "poseidon_v1__hostfile_localserver"))
    assert [(e.rank, e.host, e.port, e.shard_port) for e in entries] == [(0, "127.0.0.1", 9999, 10000)]


def test_ip_port_format_and_defaults():
    entries = parse_hosts_text("# cluster\n10.0.0.1:7000\n10.0.0.2\n\n")
    assert [(e.rank, e.host, e.port) for e in entries] == [(0, "10.0.0.1", 7000),
                                                          (1, "10.0.0.2", DEFAULT_PORT + 2)]


@pytest.mark.parametrize("text, needle", [
    ("0 127.0.0.1 9000\n0 127.0.0.1 9002", "id 0 appears twice"),
    ("1 127.0.0.1 9000", "ids must be 0..0"),
    ("127.0.0.1:9000\n127.0.0.1:9001", "collides"),
    ("127.0.0.1:http", "not a number"),
    ("a b", "expected"),
    ("", "no hosts"),
])
def test_bad_hosts_files_name_the_line(text, needle):
    with pytest.raises(HostsError, match=needle):
        parse_hosts_text(text, "h.txt")


def signed(frames: list[bytes], signer: Signer) -> list[bytes]:
    return [*frames, signer.trailer(frames)]


def test_forged_messages_are_dropped_and_receiver_keeps_working():
    hosts = local_hosts(3)
    recv = Endpoint((WORKER, 0), hosts, [(WORKER, 1), (WORKER, 2)], key=KEY, timeout=10)
    shape = (3, 4)

    def check(msg):
        h = msg.header
        if h.layer != 5:
            return f"unknown layer {h.layer}"
        if [a.shape for a in msg.arrays] != [shape]:
            return "wrong shape"
        return None

    recv.checker = check
    sender = Endpoint((WORKER, 1), hosts, [(WORKER, 0)], key=KEY, timeout=10)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(hosts[0].worker_addr())
    insider = Signer(KEY)  # worker 2, a process of the job that sends nonsense (a bug)
    try:
        good = np.arange(12, dtype=np.float32).reshape(shape)

        def claim(rnd: int, dtype: str = "<f4", dims=(3, 4), role=pb.WORKER, who=2) -> list[bytes]:
            h = header(pb.DATA, scheme="sfb", layer=5, sender_role=role, sender=who, round=rnd)
            h.arrays.add(dtype=dtype, shape=list(dims))
            return [h.SerializeToString(), good.tobytes()]

        # without the key: garbage, an empty message, a well-formed claim to be worker 1
        # (unsigned, signed with another job's key, or an authentic message altered), and the
        # overflowing shape of finding 1
        raw.send_multipart([b"\xff\x00garbage\x13"])
        raw.send_multipart([b""])
        raw.send_multipart(claim(0))
        raw.send_multipart(signed(claim(0), Signer(bytes(32))))
        altered = signed(claim(0), Signer(KEY))
        altered[1] = (good + 1).tobytes()
        raw.send_multipart(altered)
        raw.send_multipart(signed(claim(0, dims=(2**32, 2**32)), Signer(bytes(32)))[:1] + [b""])
        unauthenticated = 6
        # with the key, but wrong: a shape whose product wraps int64, a lying array count, an
        # unknown sender, pickle's dtype, and a wrong shape and layer from worker 1
        raw.send_multipart(signed([claim(1, dims=(2**32, 2**32))[0], b""], insider))
        raw.send_multipart(signed(claim(2, dims=(100,)), insider))
        raw.send_multipart(signed(claim(3, role=pb.SHARD, who=7), insider))
        raw.send_multipart(signed(claim(4, dtype="|O"), insider))
        sender.send((WORKER, 0), header(pb.DATA, scheme="sfb", layer=5), [np.zeros((4, 3), np.float32)])
        sender.send((WORKER, 0), header(pb.DATA, scheme="sfb", layer=9, round=1), [good])
        # then the real one, and a replay of an authentic message
        sender.send((WORKER, 0), header(pb.DATA, scheme="sfb", layer=5, round=0), [good])
        replayed = signed(claim(5), insider)
        raw.send_multipart(replayed)
        raw.send_multipart(replayed)
        [msg] = recv.wait_for([message_key(pb.DATA, (WORKER, 1), 0, 5)], "factors", timeout=5)
        np.testing.assert_array_equal(msg.arrays[0], good)
        expected = unauthenticated + 6 + 1
        deadline = time.monotonic() + 5
        while recv.dropped < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (recv.dropped, recv.unauthenticated) == (expected, unauthenticated)
        assert recv.error is None
    finally:
        raw.close()
        sender.close()
        recv.close()


def test_a_frame_over_the_limit_disconnects_its_sender_and_nothing_else():
    hosts = local_hosts(2)
    recv = Endpoint((WORKER, 0), hosts, [(WORKER, 1)], key=KEY, timeout=10, max_frame_bytes=1024)
    recv.checker = lambda msg: None
    sender = Endpoint((WORKER, 1), hosts, [(WORKER, 0)], key=KEY, timeout=10)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(hosts[0].worker_addr())
    try:
        raw.send_multipart([b"x" * 4096])
        small = np.ones(16, np.float32)
        sender.send((WORKER, 0), header(pb.DATA, scheme="sfb", layer=5), [small])
        [msg] = recv.wait_for([message_key(pb.DATA, (WORKER, 1), 0, 5)], "factors", timeout=5)
        np.testing.assert_array_equal(msg.arrays[0], small)
        assert recv.dropped == 0 and recv.error is None  # the big one never reached Python
    finally:
        raw.close()
        sender.close()
        recv.close()


def test_receive_timeout_names_who_is_missing():
    # The wait (0.05 s) ends long before the peers count as silent (3 heartbeats: 3 s with a
    # 30 s timeout), else the error rightly names the silent peer's start-up instead; with a
    # 0.6 s timeout a loaded machine (stress-ng) once took more than the 0.36 s between.
    hosts = local_hosts(3)
    ep = Endpoint((WORKER, 0), hosts, [(WORKER, 1), (SHARD, 2)], key=KEY, timeout=30)
    try:
        with pytest.raises(CommError, match=r"waiting for sums from shard 2 \(127\.0\.0\.1:\d+\), worker 1"):
            ep.wait_for([message_key(pb.DATA, (WORKER, 1)), message_key(pb.DATA, (SHARD, 2))], "sums",
                        timeout=0.05)
    finally:
        ep.close(say_bye=False)


def test_silent_peer_is_named_by_the_heartbeat_watchdog():
    hosts = local_hosts(2)
    ep = Endpoint((WORKER, 0), hosts, [(WORKER, 1)], key=KEY, timeout=0.5)
    try:
        deadline = time.monotonic() + 5
        while ep.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ep.error is not None and "worker 1 (127.0.0.1:" in ep.error
        assert "did not come within 0.5 s" in ep.error
    finally:
        ep.close(say_bye=False)


def test_machine_mates_talk_through_a_unix_socket():
    """Two workers of one hosts line reach each other over ipc:// (their Unix socket exists
    while they run, the message arrives); workers of two lines at the same address use TCP."""
    from pathlib import Path

    from engine.comm.transport import ipc_address

    base = free_base_port(4)
    one = parse_hosts_text(f"127.0.0.1:{base} slots=2\n")
    two = parse_hosts_text(f"127.0.0.1:{base + 4}\n127.0.0.1:{base + 6}\n")
    for port in (base + 4, base + 6):  # what a killed process of another run left there
        Path(ipc_address("127.0.0.1", port)[len("ipc://"):]).unlink(missing_ok=True)
    for hosts, local in ((one, True), (two, False)):
        a = Endpoint((WORKER, 0), hosts, [(WORKER, 1)], key=KEY, timeout=10)
        b = Endpoint((WORKER, 1), hosts, [(WORKER, 0)], key=KEY, timeout=10)
        a.checker = b.checker = lambda msg: None
        try:
            path = Path(ipc_address(hosts[0].host, hosts[0].port)[len("ipc://"):])
            assert path.exists() == local
            b.send((WORKER, 0), header(pb.DATA, scheme="sfb", layer=5), [np.ones(3, np.float32)])
            [msg] = a.wait_for([message_key(pb.DATA, (WORKER, 1), 0, 5)], "a", timeout=5)
            np.testing.assert_array_equal(msg.arrays[0], np.ones(3, np.float32))
        finally:
            a.close()
            b.close()
        assert not path.exists()  # a closed endpoint leaves no socket file behind
