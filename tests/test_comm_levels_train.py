"""Two levels in real training: M machines of k workers with batch B equal one worker with
M·k·B, every layer's scheme present (the conv layer by ring, ip1 by SFB, ip2 by PS).

Machines are hosts-file lines with slots=k on 127.0.0.1; `poseidon train --hosts` starts every
worker and its shard as processes. The bound and why it holds on any BLAS build are those of
tests/test_comm_train.py (the same net, rate and iteration count)."""
from __future__ import annotations

import json

import pytest

from poseidon_cli.launch.hostfile import free_base_port
from tests.test_comm_train import (  # noqa: F401
    BOUND,
    ITERS,
    digits_db,
    digits_net,
    poseidon,
    relative_distance,
    weights,
    write_run,
)

pytestmark = pytest.mark.numpy_kernels

BATCH = 8  # per worker


@pytest.mark.parametrize("m, k", [(2, 2), (2, 3)])
def test_machines_of_several_workers_equal_one_worker(m, k, digits_db, tmp_path):  # noqa: F811
    total = BATCH * m * k
    ref = tmp_path / "ref"
    ref.mkdir()
    solver = write_run(ref, digits_db, total, "ref", net=digits_net)
    done = poseidon("train", "--solver", str(solver), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    want = weights(ref / f"ref_iter_{ITERS}.caffemodel")

    dist = tmp_path / "dist"
    dist.mkdir()
    solver = write_run(dist, digits_db, BATCH, "dist", net=digits_net)
    base = free_base_port(m * k)
    hosts = dist / "hosts.txt"
    hosts.write_text("".join(f"127.0.0.1:{base + 2 * k * i} slots={k}\n" for i in range(m)))
    stats = dist / "stats.json"
    done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts),
                    "--comm", "ps,conv1=ring,ip1=sfb", "--stats", str(stats), "--timeout", "30",
                    timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{m} machines of {k}, reducing inside each machine first" in done.stderr
    got = weights(dist / f"dist_iter_{ITERS}.caffemodel")
    worst = max(relative_distance(got, want).items(), key=lambda kv: kv[1])
    assert worst[1] <= BOUND, worst
    s = json.loads(stats.read_text())
    assert s["replicas_identical"] is True
    assert {p["layer"]: p["scheme"] for p in s["plan"]} == {"conv1": "ring", "ip1": "sfb",
                                                            "ip2": "ps"}
    tags = {row["scheme"] for row in s["layers"]}
    assert {"ring", "ring.local", "sfb", "ps", "ps.local"} <= tags, tags
