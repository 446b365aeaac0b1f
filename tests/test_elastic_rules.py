"""The elastic driver's rules and wire, without processes: messages checked field by field and
authenticated (a generation's key is its own), back-off and exclusion, the batch rule, the
commit a generation starts from, and a listing read again when it changes."""
from __future__ import annotations

import os
import time

import pytest

from engine.comm.auth import Signer, Verifier
from engine.comm.errors import CommError
from poseidon_cli.launch.elastic.boundary import Commits
from poseidon_cli.launch.elastic.membership import Seat, common_commit, table_of
from poseidon_cli.launch.elastic.policy import Admission, iter_size_for, lr_scale, usable
from poseidon_cli.launch.elastic.protocol import (DRIVER_KINDS, WORKER_KINDS, authenticate,
                                                  encode, generation_key, parse)
from poseidon_cli.launch.elastic.sources import Discovery, HostsFile
from poseidon_cli.launch.hostfile import free_base_port

KEY = bytes(range(32))


def frames(kind: str, key: bytes = KEY, **fields: object) -> list[bytes]:
    return encode(Signer(key), kind, **fields)


def test_a_message_is_taken_once_and_only_with_the_job_key():
    v = Verifier(KEY)
    msg = frames("ask", gen=3, iter=40)
    assert parse(authenticate(v, msg, "w"), WORKER_KINDS, "w") == {"kind": "ask", "gen": 3,
                                                                     "iter": 40}
    assert authenticate(v, msg, "w") is None  # a replay
    assert authenticate(Verifier(KEY), frames("ask", key=bytes(32), gen=3, iter=40), "w") is None
    tampered = [msg[0].replace(b"40", b"41"), msg[1]]
    assert authenticate(Verifier(KEY), tampered, "w") is None


def test_each_generation_has_a_key_of_its_own():
    keys = {generation_key(KEY, g) for g in range(1, 50)}
    assert len(keys) == 49 and KEY not in keys
    old, new = generation_key(KEY, 4), generation_key(KEY, 5)
    payload = [b"gradient"]
    assert isinstance(Verifier(new).verify(payload, Signer(old).trailer(payload)), str)


@pytest.mark.parametrize("payload, kinds, needle", [
    (b"\xff", WORKER_KINDS, "not JSON"),
    (b'{"kind": "assign"}', WORKER_KINDS, "unexpected control message 'assign'"),
    (b'{"kind": "ask", "gen": 1}', WORKER_KINDS, "fields"),
    (b'{"kind": "ask", "gen": -1, "iter": 2}', WORKER_KINDS, "'gen' is '-1'"),
    (b'{"kind": "ask", "gen": true, "iter": 2}', WORKER_KINDS, "'gen' is 'True'"),
    (b'{"kind": "report", "gen": 1, "status": "won", "commits": [], "iter": 0, "reason": ""}',
     WORKER_KINDS, "'status' is 'won'"),
    (b'{"kind": "report", "gen": 1, "status": "ended", "commits": [1, 2, 3], "iter": 0, '
     b'"reason": ""}', WORKER_KINDS, "at most 2 iterations"),
    (b'{"kind": "join", "nonce": "00", "host": "h", "port": 9000, "machine": "m", "pid": 1}',
     WORKER_KINDS, "'nonce' has 2 characters"),
    (b'{"kind": "join", "nonce": "' + b"0" * 32 + b'", "host": "h;rm", "port": 9000, '
     b'"machine": "m", "pid": 1}', WORKER_KINDS, "not a host name"),
    (b'{"kind": "decision", "gen": 1, "iter": 5, "answer": "maybe"}', DRIVER_KINDS,
     "'answer' is 'maybe'"),
    (b'{"kind": "assign", "gen": 1, "rank": 2, "hosts": [{"host": "127.0.0.1", "port": 9000, '
     b'"machine": 0, "local_rank": 0}], "commit": 0, "source": "peer", "joiners": [], '
     b'"iter_size": 1, "lr_scale": 1.0, "commit_every": 5}', DRIVER_KINDS, "rank 2 of 1"),
    (b'{"kind": "assign", "gen": 1, "rank": 0, "hosts": [{"host": "127.0.0.1", "port": 9000, '
     b'"machine": 0, "local_rank": 0}], "commit": 0, "source": "peer", "joiners": [], '
     b'"iter_size": 1, "lr_scale": NaN, "commit_every": 5}', DRIVER_KINDS,
     "'lr_scale' is 'nan'"),
])
def test_a_bad_field_is_named(payload, kinds, needle):
    with pytest.raises(CommError, match=needle):
        parse(payload, kinds, "worker at 10.0.0.2:9000")


def test_a_failing_slot_backs_off_doubling_then_is_excluded():
    a = Admission(backoff_s=2.0, max_failures=3)
    key = ("10.0.0.5", 9000)
    a.joined(key)
    assert a.failed(key, 100.0) == (1, 2.0)
    assert not a.eligible(key, 101.9) and a.eligible(key, 102.0)
    a.joined(key)
    assert a.failed(key, 110.0) == (2, 4.0)  # again before any commit with it
    a.joined(key)
    a.progressed(key)  # this time the job committed with it: the count starts again
    assert a.failed(key, 120.0) == (1, 2.0)
    for t, want in ((130.0, (2, 4.0)), (140.0, (3, None))):
        a.joined(key)
        assert a.failed(key, t) == want
    assert a.excluded(key) and not a.eligible(key, 10 ** 6)
    a.left(("10.0.0.6", 9000), 0.0)  # a leave is no failure, but the machine is going
    assert not a.eligible(("10.0.0.6", 9000), 1.0) and not a.excluded(("10.0.0.6", 9000))


def test_the_global_batch_takes_the_largest_membership_that_keeps_it():
    assert iter_size_for(4, 8, None, 3) == 3
    assert iter_size_for(2, 8, 32, 1) == 2
    why = iter_size_for(3, 8, 32, 1)
    assert why == ("--global-batch 32 with a batch of 8 per worker needs 32 / (3 x 8) to be "
                   "whole (it is for 1, 2, 4 workers)")
    assert usable(3, 2, 8, 32, 1) == (2, 2)  # of 3 available, 2 keep 32 with iter_size 2
    assert usable(5, 1, 8, None, 1) == (5, 1)
    assert usable(1, 2, 8, None, 1) == "1 worker can train, fewer than --min-workers 2"
    assert usable(3, 3, 8, 32, 1) == why
    assert lr_scale("linear", 24, 32) == 0.75 and lr_scale("none", 24, 32) == 1.0


def test_the_survivors_go_on_from_the_newest_commit_they_all_hold():
    seats = [Seat(0, "127.0.0.1", 9000, "a", (40, 50)), Seat(1, "127.0.0.1", 9002, "b", (30, 40)),
             Seat(2, "127.0.0.1", 9004, "c", (40, 50))]
    assert common_commit(seats) == 40
    with pytest.raises(CommError, match="no commit in common"):
        common_commit([seats[0], Seat(3, "127.0.0.1", 9006, "d", (10, 20))])
    # the losses that left such survivors are the cause, and the error says them
    lost = "lost worker 1 (127.0.0.1:9002): nothing heard for 30 s"
    with pytest.raises(CommError) as e:
        common_commit([seats[0], Seat(3, "127.0.0.1", 9006, "d")], [lost])
    assert str(e.value) == ("elastic: the survivors hold no commit in common (127.0.0.1:9000 "
                            f"holds [40, 50]; 127.0.0.1:9006 holds []); {lost}")
    assert common_commit([]) is None
    table = table_of([seats[2], Seat(4, "127.0.0.1", 9008, "c"), seats[0]])
    assert [(e.rank, e.port, e.machine, e.local_rank) for e in table] == [
        (0, 9004, 0, 0), (1, 9008, 0, 1), (2, 9000, 1, 0)]


def test_a_worker_keeps_its_two_newest_commits_of_one_timeline():
    from engine.snapshots import Commit
    held = Commits()
    assert held.spare() is None
    for it in (0, 5, 10, 10):
        held.add(Commit(it, 0, [], b"", [], 0))
    assert held.iterations() == [5, 10] and held.newest().iter == 10
    spare = held.spare()
    assert spare is not None and spare.iter == 5
    spare.iter = 15  # overwritten by the next commit
    held.add(spare)
    assert held.iterations() == [10, 15] and held.get(15) is spare
    held.restart(held.get(10))  # a generation goes on from 10: 15 was another timeline's
    assert held.iterations() == [10]


def test_the_hosts_file_is_read_again_when_it_changes(tmp_path):
    base = free_base_port(3)
    path = tmp_path / "hosts.txt"
    path.write_text(f"0 127.0.0.1 {base}\n")
    source, warned = HostsFile(str(path)), []
    assert [s.port for s in source.poll(warned.append)] == [base]
    assert source.poll(warned.append) is None  # unchanged
    path.write_text(f"0 127.0.0.1 {base}\n1 127.0.0.1 {base + 2}\nbad line here\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10 ** 9))
    assert source.poll(warned.append) is None
    assert warned == [f"{path}:3: id 'bad' is not a number (expected '<id> <ip> <port>' or "
                      "'<ip>[:<port>] [slots=N]'): keeping the workers listed before"]
    path.write_text(f"127.0.0.1:{base} slots=2\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10 ** 9))
    slots = source.poll(warned.append)
    assert [(s.port, s.machine, s.local) for s in slots] == [
        (base, f"127.0.0.1:{base}", 0), (base + 2, f"127.0.0.1:{base}", 1)]


def test_a_discovery_command_is_run_again_and_its_failure_said_once(tmp_path):
    out = tmp_path / "now.txt"
    out.write_text("127.0.0.1:9100\n")
    source = Discovery(f"cat {out}", 0.1)
    warned: list[str] = []
    try:
        deadline = time.monotonic() + 30
        first = None
        while first is None and time.monotonic() < deadline:
            first = source.poll(warned.append)
            time.sleep(0.05)
        assert [s.port for s in first] == [9100]
        out.unlink()
        while not warned and time.monotonic() < deadline:
            source.poll(warned.append)
            time.sleep(0.05)
        time.sleep(0.5)
        source.poll(warned.append)
        assert len(warned) == 1 and "exited with code 1" in warned[0], warned
    finally:
        source.close()
