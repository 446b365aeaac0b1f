"""Host tables with several workers per machine: `slots=N` lines, `-H host:N`, `--gpus`, and the
JSON a table travels in (checked field by field, as anything received)."""
from __future__ import annotations

import json

import pytest

from engine.comm.hosts import HostsError, machines, table_from_json, table_json
from engine.comm.transport import WORKER, peer_name
from poseidon_cli.job_config import JobConfig
from poseidon_cli.launch.hostfile import DEFAULT_PORT, parse_hosts_text
from poseidon_cli.launch.tables import from_host_list, gpus_of, resolve


def layout(entries):
    return [(e.rank, e.host, e.port, e.machine, e.local_rank, e.local_size) for e in entries]


def test_slots_lines_give_each_machine_consecutive_ranks_and_ports():
    entries = parse_hosts_text("# two boxes of 2, one of 1\n"
                               "10.0.0.1:7000 slots=2\n"
                               "10.0.0.2 slots=2\n"
                               "10.0.0.3\n")
    assert layout(entries) == [
        (0, "10.0.0.1", 7000, 0, 0, 2), (1, "10.0.0.1", 7002, 0, 1, 2),
        (2, "10.0.0.2", DEFAULT_PORT + 4, 1, 0, 2), (3, "10.0.0.2", DEFAULT_PORT + 6, 1, 1, 2),
        (4, "10.0.0.3", DEFAULT_PORT + 8, 2, 0, 1)]
    assert [[e.rank for e in m] for m in machines(entries)] == [[0, 1], [2, 3], [4]]
    # an error names the machine and the local worker where a machine runs several
    assert peer_name((WORKER, 3), entries) == "worker 3 (10.0.0.2:10005, machine 1 local rank 1)"
    assert peer_name((WORKER, 4), entries) == "worker 4 (10.0.0.3:10007)"


def test_the_old_formats_are_one_worker_per_machine():
    entries = parse_hosts_text("1 127.0.0.1 9002\n0 127.0.0.1 9000\n")
    assert layout(entries) == [(0, "127.0.0.1", 9000, 0, 0, 1), (1, "127.0.0.1", 9002, 1, 0, 1)]
    # --gpus 0,1: a line without slots runs one worker per GPU
    entries = parse_hosts_text("127.0.0.1:9000\n127.0.0.1:9100\n", default_slots=2)
    assert [(e.port, e.machine, e.local_rank) for e in entries] == [
        (9000, 0, 0), (9002, 0, 1), (9100, 1, 0), (9102, 1, 1)]


@pytest.mark.parametrize("text, needle", [
    ("127.0.0.1:9000 slots=2\n127.0.0.1:9002\n", "h.txt:2: worker 2 at 127.0.0.1:9002 collides"),
    ("a slots=0", "h.txt:1: slots=0 out of range 1..256"),
    ("a slots=x", "h.txt:1: slots 'x' is not a number"),
    ("a max_slots=2", "h.txt:1: expected"),
    ("a:65530 slots=4", "h.txt:1: 4 workers from port 65530 run past 65535"),
    ("1 a 9000\nb slots=2\n", "h.txt:2: id 1 appears twice (also h.txt:1)"),
])
def test_bad_slots_lines_name_the_line(text, needle):
    with pytest.raises(HostsError) as e:
        parse_hosts_text(text, "h.txt")
    assert needle in str(e.value)


def test_host_list_as_horovodrun_spells_it():
    entries = from_host_list("192.0.2.1:2,192.0.2.2")
    assert layout(entries) == [(0, "192.0.2.1", DEFAULT_PORT, 0, 0, 2),
                               (1, "192.0.2.1", DEFAULT_PORT + 2, 0, 1, 2),
                               (2, "192.0.2.2", DEFAULT_PORT + 4, 1, 0, 1)]
    # every machine here: each one's base port is probed free, and none overlap
    local = from_host_list("localhost:2,127.0.0.1:3")
    assert [len(m) for m in machines(local)] == [2, 3]
    ports = [p for e in local for p in (e.port, e.shard_port)]
    assert len(set(ports)) == 10 and 20000 <= min(ports) and max(ports) < 32000
    for bad, needle in (("a:x", "slots 'x' is not a number"), (":2", r"expected host\[:slots\]"),
                        ("localhsot:2", "host 'localhsot' does not resolve")):
        with pytest.raises(HostsError, match=needle):
            from_host_list(bad)


def test_gpus_pin_one_worker_per_gpu_on_every_machine(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("192.0.2.1\n192.0.2.2 slots=2\n")
    entries = resolve(str(hosts), None, None, (4, 5))
    config = JobConfig("s", str(hosts), gpus=(4, 5), pin_gpus=True)
    assert gpus_of(entries, config) == {0: 4, 1: 5, 2: 4, 3: 5}
    # --gpu deals round robin per address instead
    assert gpus_of(entries, JobConfig("s", "h", gpus=(4, 5))) == {0: 4, 1: 5, 2: 4, 3: 5}
    assert [len(m) for m in machines(resolve(None, None, 3, (0, 1, 2)))] == [3]
    hosts.write_text("192.0.2.1 slots=3\n")
    with pytest.raises(HostsError, match=r"hosts.txt:1: machine 0 \(192.0.2.1\) runs 3 workers, "
                                         r"but --gpus 4,5 pins one worker to each of 2 GPUs"):
        resolve(str(hosts), None, None, (4, 5))


def test_a_table_round_trips_as_json_and_a_bad_one_is_named():
    entries = parse_hosts_text("127.0.0.1:9000 slots=2\n127.0.0.1:9100\n")
    assert table_from_json(table_json(entries), "t") == entries
    good = json.loads(table_json(entries))
    for change, needle in (
            (lambda d: d.update(extra=1), "not a host table"),
            (lambda d: d["hosts"][0].update(port="9000"), "field 'port' has the wrong type"),
            (lambda d: d["hosts"][0].update(port=True), "field 'port' has the wrong type"),
            (lambda d: d["hosts"][1].update(local_rank=0), "local ranks [0, 0]"),
            (lambda d: d["hosts"][2].update(machine=5), "rank 2 is on machine 5 before machine 1"),
            (lambda d: d["hosts"][1].update(host="10.0.0.9"), "one machine, one address"),
            (lambda d: d["hosts"][0].update(host="a b"), "is not a host name"),
            (lambda d: d["hosts"][2].update(port=9002), "collides"),
            (lambda d: d["hosts"][0].pop("machine"), "fields ['host', 'local_rank', 'port']"),
            (lambda d: d.update(hosts=[]), "not a host table")):
        d = json.loads(json.dumps(good))
        change(d)
        with pytest.raises(HostsError) as e:
            table_from_json(json.dumps(d), "the table")
        assert needle in str(e.value) and str(e.value).startswith("the table"), (needle, e.value)
    with pytest.raises(HostsError, match="not JSON"):
        table_from_json(b"\xff{", "t")


def test_the_example_of_two_machines_with_four_gpus():
    from poseidon_cli.launch.hostfile import parse_hosts
    from tests.test_comm_train import ROOT

    entries = parse_hosts(ROOT / "models" / "hosts" / "two_machines_4gpus.txt")
    assert [[(e.host, e.port) for e in m] for m in machines(entries)] == [
        [(host, 9000 + 2 * i) for i in range(4)] for host in ("192.0.2.10", "192.0.2.11")]


def test_ports_probed_free_come_from_poseidon_ports(monkeypatch):
    from poseidon_cli.launch.hostfile import PORTS, port_range, reserve_ports
    monkeypatch.delenv("POSEIDON_PORTS", raising=False)
    assert port_range() == PORTS
    monkeypatch.setenv("POSEIDON_PORTS", "25000-25040")
    for _ in range(5):
        base, held = reserve_ports(4)
        for s in held:
            s.close()
        assert 25000 <= base and base + 8 <= 25040
    with pytest.raises(HostsError, match="holds fewer than the 44 ports 22 workers need"):
        reserve_ports(22)
    for bad in ("25000", "30000-20000", "80-90", "a-b"):
        monkeypatch.setenv("POSEIDON_PORTS", bad)
        with pytest.raises(HostsError, match=f"POSEIDON_PORTS='{bad}': expected LOW-HIGH"):
            port_range()


@pytest.mark.parametrize("how", ["-n", "-H"])
def test_a_launchers_probed_ports_stay_its_own_until_the_job_ends(how, monkeypatch):
    """-n / -H probe their ports free and hold them while the job runs: another job's probe
    cannot draw them (two jobs started at once once drew the same ones, and one job's shard
    could not bind: "cannot bind port 22645"), while the job's own workers bind and listen."""
    import contextlib

    import zmq

    from poseidon_cli.launch.hostfile import reserve_ports
    base, held = reserve_ports(2)  # 4 ports free now: the only ones the range below holds
    for s in held:
        s.close()
    monkeypatch.setenv("POSEIDON_PORTS", f"{base}-{base + 4}")
    with contextlib.ExitStack() as ports:
        if how == "-n":
            entries = resolve(None, None, 2, None, ports)
        else:
            entries = resolve(None, "127.0.0.1:2", None, None, ports)
        assert [(e.port, e.shard_port) for e in entries] == [(base, base + 1), (base + 2, base + 3)]
        with pytest.raises(HostsError, match="no 4 consecutive free ports"):
            reserve_ports(2)  # another job probing now
        ctx = zmq.Context()
        try:
            listeners = []
            for port in range(base, base + 4):  # the job's own workers and shards
                sock = ctx.socket(zmq.ROUTER)
                sock.linger = 0
                sock.bind(f"tcp://127.0.0.1:{port}")
                listeners.append(sock)
            for sock in listeners:
                sock.close()
        finally:
            ctx.term()
    again, held = reserve_ports(2)  # the job over: free again
    for s in held:
        s.close()
    assert again == base
    # without a hold they are released on return, as before
    assert resolve(None, None, 2, None)[0].port == base
    again, held = reserve_ports(2)
    for s in held:
        s.close()
    assert again == base
