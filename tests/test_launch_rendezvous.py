"""The rendezvous over loopback, its ranks as threads: the table every rank gets, who is named
when a rank does not come, and what is dropped (no key, a replay) or stops the job (a rank
claimed twice, another world size)."""
from __future__ import annotations

import json
import os
import threading

import pytest
import zmq

from engine.comm.auth import Signer
from engine.comm.errors import CommError
from engine.comm.hosts import machines
from poseidon_cli.launch.hostfile import free_base_port
from poseidon_cli.launch.managers import Placement
from poseidon_cli.launch.rendezvous import meet

KEY = bytes(range(32))


def run_ranks(placements: list[Placement], timeout: float = 5.0,
              keys: list[bytes] | None = None) -> list[object]:
    """meet() for each placement on its own thread; each one's table, or its error."""
    out: list[object] = [None] * len(placements)

    def one(i: int) -> None:
        try:
            out[i] = meet(placements[i], (keys or [KEY] * len(placements))[i], timeout)
        except CommError as e:
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(placements))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * timeout + 15)
        assert not t.is_alive()
    return out


def place(rank: int, world: int, machine: str, port: int, local: tuple | None = None) -> Placement:
    lr, ls = local or (None, None)
    return Placement("test", rank, world, lr, ls, machine, ("127.0.0.1", port))


def test_every_rank_gets_one_table_with_its_machines():
    port = free_base_port(1)
    # machine "b" has the lowest rank after 0, so it is machine 1; "a" says its local ranks
    # (as SLURM_LOCALID does), "b" does not (they follow rank order)
    ps = [place(0, 4, "a", port, (1, 2)), place(1, 4, "b", port), place(2, 4, "a", port, (0, 2)),
          place(3, 4, "b", port)]
    tables = run_ranks(ps)
    assert all(t == tables[0] for t in tables), tables
    layout = [[(e.rank, e.local_rank) for e in m] for m in machines(tables[0])]
    assert layout == [[(2, 0), (0, 1)], [(1, 0), (3, 1)]]
    assert all(e.host == "127.0.0.1" and e.local_size == 2 for e in tables[0])
    assert len({e.port for e in tables[0]}) == 4


def test_a_rank_that_does_not_come_is_named_to_everyone_who_did():
    port = free_base_port(1)
    out = run_ranks([place(0, 4, "a", port), place(1, 4, "a", port), place(3, 4, "a", port)],
                    timeout=1.0)
    for e in out:
        assert isinstance(e, CommError) and str(e).startswith(
            f"rendezvous at 127.0.0.1:{port}: rank 2 of 4 did not come within 1 s"), e


def test_no_rank_0_is_named_after_twice_the_timeout():
    out = run_ranks([place(1, 2, "a", free_base_port(1))], timeout=0.5)
    assert "no answer from rank 0 within 2.05 s (rank 1 of 2" in str(out[0])


def test_a_rank_without_the_key_is_not_heard_and_named_missing():
    port = free_base_port(1)
    out = run_ranks([place(0, 2, "a", port), place(1, 2, "a", port)], timeout=1.0,
                    keys=[KEY, bytes(32)])
    assert "rank 1 of 2 did not come within 1 s" in str(out[0])


def test_two_processes_that_claim_one_rank_stop_the_job():
    port = free_base_port(1)
    out = run_ranks([place(0, 3, "a", port), place(1, 3, "a", port), place(1, 3, "b", port)],
                    timeout=2.0)
    for e in out:
        assert "rank 1 came twice (from 127.0.0.1 and 127.0.0.1): two processes claim one " \
            "rank" in str(e), e


@pytest.mark.parametrize("second, needle", [
    (dict(rank=1, world=3), "rank 1 says the job has 3 workers, rank 0 says 2"),
    (dict(rank=1, world=2, local=(0, 3)), "rank 1 says its machine runs 3 workers, but ranks "
                                          "[0, 1] came from 'a'"),
])
def test_a_join_of_this_job_that_does_not_fit_stops_it(second, needle):
    """Each JOIN authenticates, so each comes from a process of this job: a misconfigured one."""
    port = free_base_port(1)
    ps = [place(0, 2, "a", port), place(second["rank"], second["world"], "a", port,
                                        second.get("local"))]
    for e in run_ranks(ps, timeout=2.0):
        assert isinstance(e, CommError) and needle in str(e), e


def test_forged_and_replayed_joins_are_dropped():
    """Rank 1 speaks the wire by hand: garbage, a JOIN under another key, then its JOIN twice
    (a replay). The rendezvous goes on, and rank 1 gets exactly one table."""
    port = free_base_port(1)
    result: list[object] = []
    rank0 = threading.Thread(target=lambda: result.append(meet(place(0, 2, "a", port), KEY, 5.0)))
    rank0.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        nonce = os.urandom(16).hex()
        join = json.dumps({"kind": "join", "rank": 1, "world": 2, "local_rank": None,
                           "local_size": None, "machine": "a", "host": "127.0.0.1",
                           "port": free_base_port(1), "nonce": nonce}).encode()
        sock.send_multipart([b"garbage"])
        sock.send_multipart([join, Signer(bytes(32)).trailer([join])])
        signed = [join, Signer(KEY).trailer([join])]
        sock.send_multipart(signed)
        sock.send_multipart(signed)
        assert sock.poll(10000), "no table"
        answer = json.loads(sock.recv_multipart()[0])
        assert answer["kind"] == "table" and answer["nonce"] == nonce
        assert len(answer["hosts"]) == 2
        rank0.join(10)
        assert len(result) == 1 and len(result[0]) == 2
        assert not sock.poll(300)  # one answer: the replay was dropped, not answered
    finally:
        sock.close()
        ctx.term()
        rank0.join(10)
